// Tests for kimik3 serve's request checks and reply reading (examples/cli/serve_reply.hpp, the appendix
// to chapter 15). The HTTP side is tested end to end by tests/serve.sh.
#include "../examples/cli/serve_reply.hpp"

#include "check.hpp"

using namespace kimik3;
using namespace kimik3::cli;

namespace {

const Tokenizer& tok() {
    static const Tokenizer t = Tokenizer::load(test::source_path("fixtures/tiny-k3"));
    return t;
}
const ServeLimits kLimits{"tiny-k3", 256, 512};

ApiError refusal(const std::string& body, bool chat = true) {
    try {
        parse_request(body, chat, tok(), kLimits);
    } catch (const ApiError& e) {
        return e;
    }
    return ApiError{0, "accepted", "", "", ""};
}

// Feeds text through a StopMatcher in the given pieces; returns what it showed, joined.
std::string through(StopMatcher& m, const std::vector<std::string>& pieces) {
    std::string out;
    for (const std::string& p : pieces) out += m.push(p);
    return out + m.finish();
}

std::vector<std::uint32_t> ids_of(std::initializer_list<std::string_view> parts) {  // "<|x|>" = the special, else text
    std::vector<std::uint32_t> out;
    for (std::string_view p : parts) {
        if (p.size() > 2 && p.substr(0, 2) == "<|") out.push_back(tok().special_id(p));
        else for (std::uint32_t id : tok().encode(p)) out.push_back(id);
    }
    return out;
}

}  // namespace

TEST_CASE("15.9 a chat request renders exactly as render_chat does; defaults follow the OpenAI API") {
    const GenRequest r = parse_request(R"({"model": "tiny-k3", "messages": [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}], "seed": 7})", true, tok(), kLimits);
    const std::vector<ChatMessage> m = {{"system", "Be brief."}, {"user", "Hello"}};
    ChatOptions co;
    co.thinking = false;
    const std::vector<std::uint32_t> want = render_chat(tok(), m, co);
    CHECK(r.prompt == std::vector<std::int64_t>(want.begin(), want.end()));
    CHECK(r.sampling.temperature == 1.0f);  // OpenAI's default, not run's greedy
    CHECK(r.seed == 7);
    CHECK(r.max_tokens == 256 - want.size() + 1);  // up to the context
    CHECK_FALSE(r.stream);
    CHECK_FALSE(r.ignore_eos);
    CHECK(parse_request(R"({"messages": [{"role": "user", "content": "x"}], "ignore_eos": true})", true, tok(), kLimits).ignore_eos);
    const GenRequest t = parse_request(R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}})", true, tok(), kLimits);
    co.thinking = true;
    const std::vector<std::uint32_t> want_t = render_chat(tok(), std::vector<ChatMessage>{{"user", "x"}}, co);
    CHECK(t.thinking);
    CHECK(t.prompt == std::vector<std::int64_t>(want_t.begin(), want_t.end()));
}

TEST_CASE("15.9 every bad request is refused with a status, the field and a code") {
    struct Case {
        const char* body;
        int status;
        const char* param;
        const char* code;
    };
    const Case cases[] = {
        {"{", 400, "", "invalid_json"},
        {"[]", 400, "", "invalid_type"},
        {R"({"messages": {}})", 400, "messages", "invalid_type"},
        {R"({"messages": []})", 400, "messages", "empty_array"},
        {R"({"model": "other", "messages": [{"role": "user", "content": "x"}]})", 404, "model", "model_not_found"},
        {R"({"model": 3, "messages": [{"role": "user", "content": "x"}]})", 400, "model", "invalid_type"},
        {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content", "missing_required_parameter"},
        {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "messages[0].content[0]", "invalid_type"},
        {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})", 400, "max_tokens", "invalid_type"},
        {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", 400, "max_tokens", "integer_below_min_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000})", 400, "max_tokens", "context_length_exceeded"},
        {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1})", 400, "max_completion_tokens", "integer_below_min_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})", 400, "top_p", "decimal_below_min_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]})", 400, "stop", "invalid_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "stop": ""})", 400, "stop", "invalid_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "thinking": "yes"})", 400, "thinking", "invalid_type"},
        {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5})", 400, "presence_penalty", "unsupported_value"},
        {R"({"messages": [{"role": "user", "content": "x"}], "kimik3": true})", 400, "kimik3", "invalid_type"},
        {R"({"messages": [{"role": "user", "content": "x"}], "ignore_eos": 1})", 400, "ignore_eos", "invalid_type"},
        {R"({"messages": [{"role": "tool", "content": "x"}]})", 400, "messages[0]", "unsupported_value"},
        {R"({"prompt": "x"})", 400, "prompt", "unsupported_parameter"},
    };
    for (const Case& c : cases) {
        CAPTURE(c.body);
        const ApiError e = refusal(c.body);
        CHECK(e.status == c.status);
        CHECK(e.param == c.param);
        CHECK(e.code == c.code);
        CHECK_FALSE(e.message.empty());
    }
    std::string long_prompt = R"({"messages": [{"role": "user", "content": ")";
    for (int i = 0; i < 300; ++i) long_prompt += "word ";
    CHECK(refusal(long_prompt + "\"}]}").code == "context_length_exceeded");
    CHECK(refusal(R"({"prompt": [1, 512]})", false).code == "invalid_value");
    CHECK(refusal(R"({"prompt": [1, 2], "echo": true})", false).code == "unsupported_value");
    CHECK(refusal(R"({"prompt": [1, 2]})", false).status == 0);  // token ids are a prompt
}

TEST_CASE("15.9 a hostile body is a 400 naming its field, never a crash or the library's text") {
    // nesting: counted without parsing (strings and escapes skipped), refused past 32 levels
    CHECK(json_nesting(R"({"a": [1, {"b": "[[[[\"]]"}]})", 100) == 3);
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    CHECK(json_nesting(deep, kMaxJsonNesting) == kMaxJsonNesting + 1);  // stops as soon as it knows
    const ApiError d = refusal(R"({"messages":[{"role":"user","content":"hi"}],"stop":)" + deep + "}");
    CHECK(d.status == 400);
    CHECK(d.code == "invalid_json");
    CHECK(d.message.find("more than 32 levels deep") != std::string::npos);
    // a wrong type in a nested field: 400 with the field's path (was: 500, "[json.exception.type_error.302] ...")
    const ApiError rf = refusal(R"({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":5}})");
    CHECK(rf.status == 400);
    CHECK(rf.param == "response_format.type");
    const ApiError part = refusal(R"({"messages":[{"role":"user","content":[{"type":5}]}]})");
    CHECK(part.status == 400);
    CHECK(part.param == "messages[0].content[0].type");
    // an invalid body is not echoed whole
    const ApiError big = refusal("{\"messages\": \"" + std::string(1000000, 'x'));
    CHECK(big.code == "invalid_json");
    CHECK(big.message.size() < 400);
    // 2^64 - 1 is named as such; a seed takes the whole 64-bit range
    const ApiError id = refusal(R"({"prompt":[1,18446744073709551615]})", false);
    CHECK(id.message.find("token id 18446744073709551615") != std::string::npos);
    CHECK(parse_request(R"({"prompt":[1,2],"seed":18446744073709551615})", false, tok(), kLimits).seed == ~0ull);
    CHECK(parse_request(R"({"prompt":[1,2],"seed":-1})", false, tok(), kLimits).seed == ~0ull);
}

TEST_CASE("15.9 stop sequences: held back while they might start, cut at the first, across pieces") {
    StopMatcher none({});
    CHECK(through(none, {"ab", "cd"}) == "abcd");
    StopMatcher one({"END"});
    CHECK(one.push("abc E") == "abc ");  // "E" might start END: held back
    CHECK(one.push("N") == "");
    CHECK(one.push("D and more") == "");
    CHECK(one.stopped);
    StopMatcher false_start({"END"});
    CHECK(through(false_start, {"abc E", "ngland"}) == "abc England");
    CHECK_FALSE(false_start.stopped);
    StopMatcher two({"xyz", "b"});
    CHECK(through(two, {"a", "xy", "zb"}) == "a");  // the earliest of several
    StopMatcher inside({"needle"});
    CHECK(through(inside, {"hay needle hay"}) == "hay ");
}

TEST_CASE("15.9 the reply's channels: think-block text is reasoning, other body text content, tags are structure") {
    ReplyReader r(tok(), true, /*thinking=*/true);
    std::string content, reasoning;
    for (std::uint32_t id : ids_of({"Let me see", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Hello", "<|close|>",
                                    "response", "<|sep|>"})) {
        const ReplyReader::Delta d = r.push(id);
        content += d.content, reasoning += d.reasoning;
    }
    const ReplyReader::Delta d = r.finish();
    content += d.content, reasoning += d.reasoning;
    CHECK(reasoning == "Let me see");
    CHECK(content == "Hello");
    ReplyReader plain(tok(), true, /*thinking=*/false);
    std::string c2;
    for (std::uint32_t id : ids_of({"Hi there", "<|close|>", "response", "<|sep|>"})) c2 += plain.push(id).content;
    CHECK(c2 + plain.finish().content == "Hi there");
    ReplyReader raw(tok(), false, false);  // completions: every token is text, specials by name
    std::string c3;
    for (std::uint32_t id : ids_of({"a", "<|sep|>", "b"})) c3 += raw.push(id).content;
    CHECK(c3 == "a<|sep|>b");
}
