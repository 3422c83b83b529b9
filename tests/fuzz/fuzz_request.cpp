// Fuzz target: a request body to kimik3 serve (examples/cli/serve_reply.hpp's parse_request, the chat and
// the completions forms) with the tiny K3's tokenizer. Byte 0 picks the endpoint; the rest is the body.
// Contract: a hostile body ends in an ApiError (a 400/404 the server sends back) or is accepted; any other
// exception (the JSON library's type errors among them), a crash or a stack overflow is a bug.
#include "../../examples/cli/serve_reply.hpp"
#include "fuzz.hpp"

namespace {
const kimik3::Tokenizer& tok() {
    static const kimik3::Tokenizer t = kimik3::Tokenizer::from_strings(kimik3::fuzz::source_file("fixtures/tiny-k3/tiktoken.model"), "tiktoken.model",
                                                                       kimik3::fuzz::source_file("fixtures/tiny-k3/tokenizer_config.json"),
                                                                       "tokenizer_config.json");
    return t;
}
}  // namespace

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3::cli;
    if (input.empty()) return;
    const bool chat = input[0] & 1;
    const std::string body(input.substr(1));
    // the nesting scan never says "shallow" of a text the parser finds deeper
    if (json_nesting(body, kMaxJsonNesting) <= kMaxJsonNesting) {
        try {
            std::size_t deepest = 0;
            (void)nlohmann::json::parse(body, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
                deepest = std::max(deepest, std::size_t(depth));
                return true;
            });
            if (deepest > kMaxJsonNesting + 1) std::abort();
        } catch (const nlohmann::json::exception&) {
        }
    }
    try {
        const GenRequest r = parse_request(body, chat, tok(), ServeLimits{"tiny-k3", 256, tok().vocab_size()});
        if (r.prompt.empty() || r.max_tokens == 0 || r.prompt.size() + r.max_tokens > 256 + 1) std::abort();
        for (std::int64_t id : r.prompt)
            if (id < 0 || std::uint64_t(id) >= tok().vocab_size()) std::abort();
    } catch (const ApiError& e) {
        if (e.status < 400 || e.status > 499 || e.message.empty() || e.message.size() > 1000) std::abort();  // a client error, short
    }
}

std::vector<std::string> kimik3_fuzz_seeds() {
    return {
        "\x01{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":4,\"temperature\":0.7,\"seed\":1}",
        "\x01{\"model\":\"tiny-k3\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
        "\"text\":\"Hi\"}]},{\"role\":\"assistant\",\"content\":\"Yes\",\"reasoning_content\":\"r\"}],\"stream\":true,\"stream_options\":"
        "{\"include_usage\":true},\"stop\":[\"a\",\"b\"],\"thinking\":{\"type\":\"enabled\"},\"kimik3\":{\"trace\":true},\"top_p\":0.9,\"top_k\":5}",
        "\x00{\"prompt\":\"Once upon a time\",\"max_tokens\":3,\"stop\":\"x\",\"response_format\":{\"type\":\"text\"}}",
        "\x00{\"prompt\":[1,2,3,18446744073709551615],\"seed\":18446744073709551615,\"max_completion_tokens\":2}",
    };
}
