// Fuzz target: the chat renderer (chapter 15) with the tiny K3's tokenizer, and close_reply on what it
// rendered. Input: byte 0 picks the options (thinking, generation prompt, effort), the rest is messages
// separated by 0x1E, each "role 0x1F content 0x1F reasoning 0x1F type 0x1F name 0x1F tool".
#include "../../chapters/15_generate.hpp"
#include "fuzz.hpp"

namespace {
const kimik3::Tokenizer& tok() {
    static const kimik3::Tokenizer t = kimik3::Tokenizer::from_strings(kimik3::fuzz::source_file("fixtures/tiny-k3/tiktoken.model"), "tiktoken.model",
                                                                       kimik3::fuzz::source_file("fixtures/tiny-k3/tokenizer_config.json"),
                                                                       "tokenizer_config.json");
    return t;
}
std::vector<std::string_view> split(std::string_view s, char sep) {
    std::vector<std::string_view> out;
    for (std::size_t p = 0;;) {
        const std::size_t q = s.find(sep, p);
        out.push_back(s.substr(p, q == std::string_view::npos ? s.npos : q - p));
        if (q == std::string_view::npos) return out;
        p = q + 1;
    }
}
}  // namespace

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3;
    if (input.empty()) return;
    const std::uint8_t flags = std::uint8_t(input[0]);
    ChatOptions opt;
    opt.thinking = flags & 1;
    opt.add_generation_prompt = flags & 2;
    const char* efforts[] = {"", "low", "medium", "high", "max", "bogus"};
    opt.thinking_effort = efforts[(flags >> 2) % 6];
    std::vector<ChatMessage> messages;
    for (std::string_view m : split(input.substr(1), '\x1e')) {
        const std::vector<std::string_view> f = split(m, '\x1f');
        ChatMessage msg;
        std::string* fields[] = {&msg.role, &msg.content, &msg.reasoning, &msg.type, &msg.name, &msg.tool};
        for (std::size_t i = 0; i < f.size() && i < 6; ++i) *fields[i] = std::string(f[i]);
        msg.index = int(m.size() % 4);
        if (msg.role == "assistant" && msg.tool.size() > 0) msg.tool_calls.push_back({.tool = msg.tool, .arguments = {{.key = msg.name, .value = msg.content}}});
        messages.push_back(std::move(msg));
    }
    const std::vector<std::uint32_t> ids = render_chat(tok(), messages, opt);
    for (std::uint32_t id : ids)
        if (id >= tok().vocab_size()) std::abort();
    // the rendered ids read as a reply: close_reply must always end the message
    const std::vector<std::int64_t> reply(ids.begin(), ids.end());
    const std::vector<std::int64_t> closed = close_reply(tok(), reply, opt.thinking);
    if (closed.empty() || closed.back() != std::int64_t(tok().special_id("<|end_of_msg|>"))) std::abort();
}

std::vector<std::string> kimik3_fuzz_seeds() {
    auto msg = [](std::initializer_list<std::string> fields) {
        std::string out;
        for (const std::string& f : fields) out += (out.empty() ? "" : "\x1f") + f;
        return out;
    };
    return {std::string("\x13") + msg({"system", "You are Kimi."}) + "\x1e" + msg({"user", "Hi! <|open|>"}) + "\x1e" +
                msg({"assistant", "Hello.", "Let me think.", "", "", ""}) + "\x1e" + msg({"user", "Weather?"}),
            std::string("\x02") + msg({"user", "Paris?"}) + "\x1e" + msg({"assistant", "", " ", "", "city", "get_weather"}) + "\x1e" +
                msg({"tool", "18 C", "", "", "", "get_weather"})};
}
