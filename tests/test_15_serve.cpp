// Tests for kimik3 serve's request checks and reply reading (examples/cli/serve_reply.hpp, the appendix
// to chapter 15) and the K3 API contract (examples/cli/serve_api.hpp: tools, tool choice, response
// formats, thinking options, usage, tool calls). The HTTP side is tested end to end by tests/serve.sh.
#include "../examples/cli/serve_reply.hpp"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "check.hpp"

#include <set>

using namespace kimik3;
using namespace kimik3::cli;

namespace {

const Tokenizer& tok() {
    static const Tokenizer t = Tokenizer::load(test::source_path("fixtures/tiny-k3"));
    return t;
}
const ServeLimits kLimits{"tiny-k3", 256, 512};

ApiError refusal(const std::string& body, bool chat = true, const ServeLimits& lim = kLimits) {
    try {
        parse_request(body, chat, tok(), lim);
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
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}], "seed": 7, "thinking": {"type": "disabled"}})",
                                       true, tok(), kLimits);
    const std::vector<ChatMessage> m = {{"system", "Be brief."}, {.role = "user", .parts = {"Hel", "lo"}}};  // each part its own segment
    ChatOptions co;
    co.thinking = false;
    const std::vector<std::uint32_t> want = render_chat(tok(), m, co);
    CHECK(r.prompt == std::vector<std::int64_t>(want.begin(), want.end()));
    CHECK(r.sampling.temperature == 1.0f);  // OpenAI's default, not run's greedy
    CHECK(r.seed == 7);
    CHECK(r.max_tokens == 256 - want.size() + 1);  // up to the context
    CHECK_FALSE(r.stream);
    CHECK_FALSE(r.ignore_eos);
    CHECK(parse_request(R"({"messages": [{"role": "user", "content": "x"}], "ignore_eos": true, "thinking": false})", true, tok(), kLimits).ignore_eos);
    // thinking is on unless turned off (K3's default), with the effort message: too long for this 256-position test context
    const ServeLimits wide{"tiny-k3", 4096, 512};
    const GenRequest t = parse_request(R"({"messages": [{"role": "user", "content": "x"}]})", true, tok(), wide);
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
        {R"({"messages": [{"role": "tool", "content": "x"}]})", 400, "messages[0].tool_call_id", "missing_required_parameter"},
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

namespace {

nlohmann::ordered_json encoder_cases() {  // ordered: an object of arguments renders in its own order
    std::ifstream f(test::source_path("fixtures/chat/k3_encoder_cases.json"));
    std::stringstream ss;
    ss << f.rdbuf();
    return nlohmann::ordered_json::parse(ss.str())["cases"];
}

ChatRequest request_of(const nlohmann::ordered_json& c) {
    const std::string text = c["request"].dump();
    ChatRequest cr = chat_request(text, nlohmann::json::parse(text));
    if (!c["effort_message"].get<bool>()) cr.options.thinking_effort = "";  // build_chat_segments without an effort
    return cr;
}

const char* body_of(const char* extra) {  // a valid request plus `extra` fields
    static std::string s;
    s = std::string(R"({"messages": [{"role": "user", "content": "hi"}], "thinking": false)") + (*extra ? ", " : "") + extra + "}";
    return s.c_str();
}

}  // namespace

TEST_CASE("15.9 K3 API: every request renders segment for segment as Moonshot's encoder does (fixtures/chat/k3_encoder_cases.json)") {
    const nlohmann::ordered_json cases = encoder_cases();
    REQUIRE(cases.size() >= 12);
    const std::set<std::string> markers = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
    for (const nlohmann::ordered_json& c : cases) {
        CAPTURE(c["name"].get<std::string>());
        const ChatWriter w = render_request(tok(), request_of(c));
        std::vector<std::pair<std::string, bool>> want;
        for (const nlohmann::ordered_json& seg : c["segments"]) want.emplace_back(seg.get<std::string>(), markers.count(seg.get<std::string>()) > 0);
        CHECK(w.segments() == want);
    }
}

TEST_CASE("15.9 K3 API: with K3's own vocabulary the ids and usage.prompt_tokens are Moonshot's (runs where KIMIK3_K3_TOKENIZER names it)") {
    // tiktoken.model is not in this repository (docs/kimi-k3.md section 4); point KIMIK3_K3_TOKENIZER at a folder holding it and
    // fixtures/tokenizer/k3_tokenizer_config.json as tokenizer_config.json to run this check.
    const char* dir = std::getenv("KIMIK3_K3_TOKENIZER");
    if (!dir) return;
    const Tokenizer k3 = Tokenizer::load(dir);
    for (const nlohmann::ordered_json& c : encoder_cases()) {
        CAPTURE(c["name"].get<std::string>());
        const ChatWriter w = render_request(k3, request_of(c));
        CHECK(w.ids() == c["k3_ids"].get<std::vector<std::uint32_t>>());
        if (c.contains("prompt_tokens")) {
            const GenRequest r = parse_request(c["request"].dump(), true, k3, ServeLimits{"k3", 8192, k3.vocab_size()});
            CHECK(r.prompt_tokens == c["prompt_tokens"].get<std::size_t>());
        }
    }
}

TEST_CASE("15.9 K3 API: usage.prompt_tokens is the rendered prompt less its stub (3 ids in K3's vocabulary); completions count every id") {
    const GenRequest off = parse_request(body_of(""), true, tok(), kLimits);
    const std::size_t stub = 2 + tok().encode("response").size();  // <|open|>response<|sep|>: 3 ids under K3's vocabulary, more under the tiny one
    CHECK(off.prompt_tokens == off.prompt.size() - stub);
    CHECK(tok().decode(std::vector<std::uint32_t>(off.prompt.end() - long(stub), off.prompt.end())) == "<|open|>response<|sep|>");
    const GenRequest on = parse_request(R"({"messages": [{"role": "user", "content": "hi"}]})", true, tok(), ServeLimits{"tiny-k3", 4096, 512});
    CHECK(on.prompt_tokens == on.prompt.size() - 2 - tok().encode("think").size());
    const GenRequest raw = parse_request(R"({"prompt": "hello there"})", false, tok(), kLimits);
    CHECK(raw.prompt_tokens == raw.prompt.size());
}

TEST_CASE("15.9 K3 API: malformed tools, tool choices, formats, thinking options and messages are refused with 400 naming the field") {
    const std::string weather = R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}})";
    struct Case {
        std::string extra;
        const char* param;
        const char* code;
    };
    const Case cases[] = {
        // tools (Kimi-Vendor-Verifier tests/k3_features/test_dynamic_tools.py and test_tool_choice.py)
        {R"("tools": {"type": "function"})", "tools", "invalid_type"},
        {R"("tools": [null])", "tools[0]", "invalid_type"},
        {R"("tools": [{"function": {"name": "a"}}])", "tools[0].type", "missing_required_parameter"},
        {R"("tools": [{"type": "bogus", "function": {"name": "x"}}])", "tools[0].type", "invalid_value"},
        {R"("tools": [{"type": "function"}])", "tools[0].function", "missing_required_parameter"},
        {R"("tools": [{"type": "function", "function": {"description": "d"}}])", "tools[0].function.name", "missing_required_parameter"},
        {R"("tools": [{"type": "function", "function": {"name": "1bad_name"}}])", "tools[0].function.name", "invalid_value"},
        {R"("tools": [{"type": "function", "function": {"name": "bad@name"}}])", "tools[0].function.name", "invalid_value"},
        {R"("tools": [{"type": "function", "function": {"name": ""}}])", "tools[0].function.name", "invalid_value"},
        {R"("tools": [{"type": "function", "function": {"name": ")" + std::string(257, 'a') + R"("}}])", "tools[0].function.name", "invalid_value"},
        {R"("tools": [{"type": "function", "function": {"name": "dup"}}, {"type": "function", "function": {"name": "dup"}}])", "tools[1].function.name", "duplicate_tool_name"},
        {R"("tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}])", "tools[0].function.parameters", "invalid_type"},
        {R"("tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}])", "tools[0].function.strict", "invalid_type"},
        {R"("tool_choice": "required")", "tool_choice", "invalid_value"},
        {R"("tools": [], "tool_choice": "required")", "tool_choice", "invalid_value"},
        {R"("tools": [)" + weather + R"(], "tool_choice": "bogus")", "tool_choice", "invalid_value"},
        {R"("tools": [)" + weather + R"(], "tool_choice": {"type": "function", "function": {"name": "get_weather"}})", "tool_choice", "unsupported_value"},
        // response_format (test_response_format.py)
        {R"("response_format": {"type": "bogus"})", "response_format.type", "invalid_value"},
        {R"("response_format": {"type": "json_schema"})", "response_format.json_schema", "missing_required_parameter"},
        {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}})", "response_format.json_schema.name", "missing_required_parameter"},
        {R"("response_format": {"type": "json_schema", "json_schema": {"name": "w"}})", "response_format.json_schema.schema", "missing_required_parameter"},
        {R"("response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": "x"}})", "response_format.json_schema.schema", "missing_required_parameter"},
        {R"("response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": "yes", "schema": {"type": "object"}}})", "response_format.json_schema.strict", "invalid_type"},
        // thinking (test_thinking_effort.py): efforts low, high, max; keep all
        {R"("reasoning_effort": "medium")", "reasoning_effort", "invalid_value"},
        {R"("chat_template_kwargs": {"thinking_effort": "extreme"})", "chat_template_kwargs.thinking_effort", "invalid_value"},
        {R"("chat_template_kwargs": {"preserve_thinking": false})", "chat_template_kwargs.preserve_thinking", "unsupported_value"},
        {R"("chat_template_kwargs": {"thinking": true})", "chat_template_kwargs.thinking", "invalid_value"},  // contradicts "thinking": false
    };
    for (const Case& c : cases) {
        CAPTURE(c.extra);
        const ApiError e = refusal(body_of(c.extra.c_str()));
        CHECK(e.status == 400);
        CHECK(e.param == c.param);
        CHECK(e.code == c.code);
        CHECK(e.message.find(c.param) != std::string::npos);  // the message names the field too
    }
    const ApiError keep = refusal(R"({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "keep": "none"}})");
    CHECK(keep.param == "thinking.keep");
    CHECK(refusal(R"({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled", "keep": "none"}})").status == 0);  // ignored when off
    // messages: dynamic tools only on a system message with empty content; unique across the request; tool results need their call
    const std::string W = weather;
    const std::pair<std::string, const char*> messages[] = {
        {R"([{"role": "user", "content": "hi", "tools": [)" + W + "]}]", "messages[0].tools"},
        {R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tools": [)" + W + "]}]", "messages[1].tools"},
        {R"([{"role": "system", "content": "not empty", "tools": [)" + W + R"(]}, {"role": "user", "content": "hi"}])", "messages[0].content"},
        {R"([{"role": "system", "content": "", "tools": [)" + W + R"(]}, {"role": "system", "content": "", "tools": [)" + W + R"(]}, {"role": "user", "content": "x"}])", "messages[1].tools[0].function.name"},
        {R"([{"role": "system", "content": "", "tools": [{"type": "bogus", "function": {"name": "x"}}]}, {"role": "user", "content": "x"}])", "messages[0].tools[0].type"},
        {R"([{"role": "tool", "content": "some tool result"}, {"role": "user", "content": "hello"}])", "messages[0].tool_call_id"},
        {R"([{"role": "tool", "tool_call_id": "nope", "content": "r"}])", "messages[0]"},
        {R"([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])", "messages[0].tool_calls[0].function.arguments"},
        {R"([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}])", "messages[0].tool_calls[0].function.name"},
    };
    for (const auto& m : messages) {  // (no structured binding: CAPTURE's lambda cannot capture one under clang)
        CAPTURE(m.first);
        const ApiError e = refusal(R"({"thinking": false, "messages": )" + m.first + "}");
        CHECK(e.status == 400);
        CHECK(e.param == m.second);
    }
    CHECK(refusal(R"({"thinking": false, "tools": [)" + W + R"(], "messages": [{"role": "system", "content": "", "tools": [)" + W +
                  R"(]}, {"role": "user", "content": "x"}]})").code == "duplicate_tool_name");  // global and dynamic share a name
    // accepted: none/auto without tools; required with only dynamic tools; strict false; text format
    for (const char* ok : {R"("tool_choice": "none")", R"("tool_choice": "auto")", R"("response_format": {"type": "text"})"})
        CHECK(refusal(body_of(ok)).status == 0);
    CHECK(refusal(R"({"thinking": false, "tool_choice": "required", "messages": [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f", "strict": false}}]}, {"role": "user", "content": "x"}]})",
                  true, ServeLimits{"tiny-k3", 4096, 512}).status == 0);
    CHECK(refusal(R"({"prompt": "x", "tools": []})", false).param == "tools");  // completions take no tools
}

TEST_CASE("15.9 K3 API: the effort is thinking.effort, else chat_template_kwargs.thinking_effort, else reasoning_effort, else max") {
    auto effort = [](const char* extra) { return thinking_options(nlohmann::json::parse(std::string("{") + extra + "}")); };
    CHECK(effort("").thinking);
    CHECK(effort("").thinking_effort == "max");
    CHECK(effort(R"("thinking": {"keep": "all"})").thinking);  // type omitted: enabled
    CHECK(effort(R"("thinking": {"type": "enabled", "effort": "low"}, "reasoning_effort": "max")").thinking_effort == "low");  // the verifier's rule
    CHECK(effort(R"("reasoning_effort": "high")").thinking_effort == "high");
    CHECK(effort(R"("reasoning_effort": "high", "chat_template_kwargs": {"thinking_effort": "low"})").thinking_effort == "low");
    CHECK_FALSE(effort(R"("chat_template_kwargs": {"enable_thinking": false})").thinking);
    CHECK_FALSE(effort(R"("thinking": {"type": "disabled", "effort": "high"})").thinking);
}

TEST_CASE("15.9 K3 API: tool calls are read back by token id into OpenAI tool_calls; unreadable values are kept") {
    // what K3 writes after its response when it calls tools (the layout of chapter 15b)
    const std::vector<std::uint32_t> reply = ids_of({"plan", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Checking.", "<|close|>", "response", "<|sep|>",
        "<|open|>", "tools", "<|sep|>",
        "<|open|>", "call tool=\"get_weather\" index=\"1\"", "<|sep|>",
        "<|open|>", "argument key=\"city\" type=\"string\"", "<|sep|>", "Paris \"17e\"", "<|close|>", "argument", "<|sep|>",
        "<|open|>", "argument key=\"days\" type=\"number\"", "<|sep|>", "3", "<|close|>", "argument", "<|sep|>",
        "<|open|>", "argument key=\"opts\" type=\"object\"", "<|sep|>", "{\"unit\": \"C\"}", "<|close|>", "argument", "<|sep|>",
        "<|open|>", "argument key=\"bad\" type=\"number\"", "<|sep|>", "three", "<|close|>", "argument", "<|sep|>",
        "<|close|>", "call", "<|sep|>",
        "<|open|>", "call tool=\"a&amp;b\" index=\"2\"", "<|sep|>", "<|open|>", "json type=\"object\"", "<|sep|>", "{oops", "<|close|>", "json", "<|sep|>",
        "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>"});
    ReplyReader r(tok(), true, true);
    ToolCallReader calls(tok());
    std::string content, reasoning;
    std::vector<ToolCallOut> got;
    std::vector<std::size_t> at;  // the token index that completed each call
    for (std::size_t i = 0; i < reply.size(); ++i) {
        const ReplyReader::Delta d = r.push(reply[i]);
        content += d.content, reasoning += d.reasoning;
        for (ToolCallOut& c : calls.push(reply[i])) got.push_back(std::move(c)), at.push_back(i);
    }
    const ReplyReader::Delta d = r.finish();
    content += d.content, reasoning += d.reasoning;
    CHECK(calls.finish().empty());
    CHECK(reasoning == "plan");
    CHECK(content == "Checking.");  // the arguments are not content
    REQUIRE(got.size() == 2);
    CHECK(got[0].name == "get_weather");
    // as vLLM's Kimi K3 parser: strings raw, other types read as JSON, an unreadable one kept as text; json.dumps's layout
    CHECK(got[0].arguments == R"({"city": "Paris \"17e\"", "days": 3, "opts": {"unit": "C"}, "bad": "three"})");
    CHECK(got[1].name == "a&b");                 // attribute values unescaped
    CHECK(got[1].arguments == "{oops");          // a json block is the arguments text, kept even when it does not parse
    CHECK(got[0].id != got[1].id);
    CHECK(got[0].id.rfind("call_", 0) == 0);
    const std::string upto = tok().decode(std::vector<std::uint32_t>(reply.begin(), reply.begin() + long(at[0]) + 1));
    CHECK(upto.substr(upto.size() - 20) == "<|close|>call<|sep|>");  // reported as its closing tag ends
    // streamed: one delta per call, with its index; whole: the list
    const nlohmann::ordered_json delta = tool_calls_json({got[1]}, 1, true);
    CHECK(delta[0]["index"] == 1);
    CHECK(delta[0]["function"]["name"] == "a&b");
    CHECK_FALSE(tool_calls_json(got, 0, false)[0].contains("index"));
    // a call cut short (max_tokens) is reported as it stands when the reply ends
    ToolCallReader cut(tok());
    for (std::uint32_t id : ids_of({"<|open|>", "tools", "<|sep|>", "<|open|>", "call tool=\"f\" index=\"1\"", "<|sep|>", "<|open|>", "argument key=\"q\" type=\"string\"", "<|sep|>", "par"}))
        CHECK(cut.push(id).empty());
    const std::vector<ToolCallOut> rest = cut.finish();
    REQUIRE(rest.size() == 1);
    CHECK(rest[0].arguments == R"({"q": "par"})");
}
