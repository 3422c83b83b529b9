// kimik3 serve, the part without HTTP: a request body checked and rendered to ids (OpenAI's fields and
// error objects), and the reply read back from the token stream (the chat format's reasoning and content
// channels, stop sequences). Separate from serve.hpp so that tests/test_15_serve.cpp can test it without
// a server.
#pragma once

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../chapters/15_generate.hpp"
#include <nlohmann/json.hpp>

namespace kimik3::cli {

// ---------------------------------------------------------------------------------------------------
// Errors in OpenAI's shape
// ---------------------------------------------------------------------------------------------------
struct ApiError {
    int status = 400;
    std::string message, param, code, type = "invalid_request_error";
};

inline nlohmann::ordered_json error_json(const ApiError& e) {
    nlohmann::ordered_json err = {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
    if (!e.param.empty()) err["param"] = e.param;
    if (!e.code.empty()) err["code"] = e.code;
    return {{"error", err}};
}

// Invalid UTF-8 (a client's bytes, a model's half character) becomes U+FFFD instead of an exception.
inline std::string dump(const nlohmann::ordered_json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

[[noreturn]] inline void refuse(const std::string& param, const std::string& message, const std::string& code = "invalid_value",
                                int status = 400) {
    throw ApiError{status, message, param, code};
}

// A client's text inside our messages and log lines: at most `n` bytes (a 4 MB body is not echoed).
inline std::string clip(const std::string& s, std::size_t n = 200) {
    return s.size() <= n ? s : s.substr(0, n) + "... (" + std::to_string(s.size()) + " bytes)";
}

// How deep a JSON text nests arrays and objects, found without parsing it (strings and their escapes
// skipped), stopping as soon as it passes `limit`. The parser, the copies and the dumps of a document are
// recursive: a request nested 100,000 levels deep would overflow the stack in any of them, so the
// nesting is bounded before anything recursive sees the text.
inline std::size_t json_nesting(std::string_view text, std::size_t limit) {
    std::size_t depth = 0, deepest = 0;
    bool in_string = false;
    for (std::size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') ++i;
            else if (c == '"') in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
            if (deepest > limit) return deepest;
        } else if ((c == ']' || c == '}') && depth > 0) {
            --depth;
        }
    }
    return deepest;
}
inline constexpr std::size_t kMaxJsonNesting = 32;  // an OpenAI request nests 6 levels at most (tools' schemas: a few more)

// ---------------------------------------------------------------------------------------------------
// One request, checked
// ---------------------------------------------------------------------------------------------------
struct GenRequest {
    bool chat = true;                  // chat format (reasoning/content channels) or raw text
    bool stream = false, include_usage = false, thinking = false, extension = false, trace = false;
    bool ignore_eos = false;           // end-of-turn tokens do not stop the reply (they are generated like any token)
    std::vector<std::int64_t> prompt;  // rendered ids
    std::size_t max_tokens = 0;
    SamplingParams sampling;
    std::uint64_t seed = 0;
    std::vector<std::string> stop;
    std::size_t prompt_tokens = 0;     // usage.prompt_tokens: chat prompts without the last 3 ids (serve_api.hpp)
    std::string tool_choice;           // chat: "", auto, none or required (serve_api.hpp)
};

// Typed field access: absent -> nullptr; present with another type -> 400 naming the field.
inline const nlohmann::json* field(const nlohmann::json& body, const char* name) {
    auto it = body.find(name);
    return it == body.end() || it->is_null() ? nullptr : &*it;
}
inline std::string type_name(const nlohmann::json& j) {
    if (j.is_boolean()) return "a boolean";
    if (j.is_number()) return "a number";
    if (j.is_string()) return "a string";
    if (j.is_array()) return "an array";
    if (j.is_object()) return "an object";
    return "null";
}
inline bool get_bool(const nlohmann::json& body, const char* name, bool dflt) {
    const nlohmann::json* v = field(body, name);
    if (!v) return dflt;
    if (!v->is_boolean()) refuse(name, std::string("'") + name + "' must be a boolean, not " + type_name(*v), "invalid_type");
    return v->get<bool>();
}
inline std::optional<double> get_number(const nlohmann::json& body, const char* name, double lo, double hi) {
    const nlohmann::json* v = field(body, name);
    if (!v) return std::nullopt;
    if (!v->is_number()) refuse(name, std::string("'") + name + "' must be a number, not " + type_name(*v), "invalid_type");
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) {
        char m[160];
        std::snprintf(m, sizeof m, "'%s' is %g; it must be from %g to %g", name, x, lo, hi);
        refuse(name, m, x < lo ? "decimal_below_min_value" : "decimal_above_max_value");
    }
    return x;
}
inline std::optional<std::int64_t> get_integer(const nlohmann::json& body, const char* name) {
    const nlohmann::json* v = field(body, name);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) refuse(name, std::string("'") + name + "' must be an integer, not " + type_name(*v), "invalid_type");
    if (v->is_number_unsigned() && v->get<std::uint64_t>() > std::uint64_t(INT64_MAX)) return INT64_MAX;
    return v->get<std::int64_t>();
}
inline std::optional<std::string> get_string(const nlohmann::json& body, const char* name, const std::string& at = "") {
    const nlohmann::json* v = field(body, name);
    if (!v) return std::nullopt;
    const std::string p = at.empty() ? name : at + "." + name;
    if (!v->is_string()) refuse(p, "'" + p + "' must be a string, not " + type_name(*v), "invalid_type");
    return v->get<std::string>();
}
inline std::string text_of(const nlohmann::json& content, const std::string& param) {  // a string, or [{type: text, text}]
    if (content.is_string()) return content.get<std::string>();
    if (!content.is_array()) refuse(param, "'" + param + "' must be a string or an array of text parts, not " + type_name(content), "invalid_type");
    std::string out;
    for (std::size_t i = 0; i < content.size(); ++i) {
        const nlohmann::json& part = content[i];
        const std::string at = param + "[" + std::to_string(i) + "]";
        if (!part.is_object() || get_string(part, "type", at).value_or("") != "text" || !get_string(part, "text", at))
            refuse(at, "'" + at + "' must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)", "invalid_type");
        out += part["text"].get<std::string>();
    }
    return out;
}

struct ServeLimits {
    std::string model_name;
    std::size_t context = 0, vocab = 0;
};

// Fields that change what is generated and that this server does not implement: refused, never ignored.
inline void refuse_unsupported(const nlohmann::json& body) {
    if (const auto n = get_integer(body, "n"); n && *n != 1) refuse("n", "only n = 1 is supported", "unsupported_value");
    if (const auto b = get_integer(body, "best_of"); b && *b != 1) refuse("best_of", "only best_of = 1 is supported", "unsupported_value");
    for (const char* p : {"presence_penalty", "frequency_penalty"})
        if (const auto v = get_number(body, p, -2.0, 2.0); v && *v != 0.0)
            refuse(p, std::string("'") + p + "' is not supported (only 0)", "unsupported_value");
    if (const nlohmann::json* lp = field(body, "logprobs"); lp && !(lp->is_boolean() && !lp->get<bool>()))
        refuse("logprobs", "'logprobs' is not supported", "unsupported_value");
    for (const char* p : {"functions", "function_call", "logit_bias", "suffix"})
        if (const nlohmann::json* v = field(body, p); v && !(v->is_array() && v->empty()) && !(v->is_object() && v->empty()) &&
                                                      !(v->is_string() && (v->get<std::string>() == "none" || v->get<std::string>().empty())))
            refuse(p, std::string("'") + p + "' is not supported by this server", "unsupported_parameter");
    if (get_bool(body, "echo", false)) refuse("echo", "'echo' is not supported", "unsupported_value");
}

// The chat fields of the K3 API contract (tools, tool choice, response format, thinking): serve_api.hpp,
// included at the end of this file. Renders the prompt; sets r.thinking, r.tool_choice, r.prompt_tokens.
inline std::vector<std::uint32_t> chat_prompt(const std::string& text, const nlohmann::json& body, const Tokenizer& tok, GenRequest& r);

// The body as JSON, nested at most kMaxJsonNesting deep. Throws ApiError.
inline nlohmann::json parse_body(const std::string& text) {
    if (const std::size_t d = json_nesting(text, kMaxJsonNesting); d > kMaxJsonNesting)
        refuse("", "the request body nests arrays and objects more than " + std::to_string(kMaxJsonNesting) + " levels deep", "invalid_json");
    nlohmann::json body;
    try {
        body = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
        refuse("", "the request body is not valid JSON: " + clip(e.what()), "invalid_json");
    }
    if (!body.is_object()) refuse("", "the request body must be a JSON object, not " + type_name(body), "invalid_type");
    return body;
}

inline GenRequest parse_fields(const std::string& text, const nlohmann::json& body, bool chat, const Tokenizer& tok, const ServeLimits& lim);

// Parses and checks a request body; renders the prompt. Throws ApiError (every type error is a 400 that
// names its field; one the checks below missed is still a 400, never the library's exception as a 500).
inline GenRequest parse_request(const std::string& text, bool chat, const Tokenizer& tok, const ServeLimits& lim) {
    const nlohmann::json body = parse_body(text);
    try {
        return parse_fields(text, body, chat, tok, lim);
    } catch (const nlohmann::json::exception& e) {
        refuse("", "a field of the request has the wrong type: " + clip(e.what()), "invalid_type");
    }
}

inline GenRequest parse_fields(const std::string& text, const nlohmann::json& body, bool chat, const Tokenizer& tok, const ServeLimits& lim) {
    if (const nlohmann::json* m = field(body, "model")) {
        if (!m->is_string()) refuse("model", "'model' must be a string, not " + type_name(*m), "invalid_type");
        if (m->get<std::string>() != lim.model_name)
            refuse("model", "the model '" + clip(m->get<std::string>(), 100) + "' does not exist: this server has '" + lim.model_name + "'",
                   "model_not_found", 404);
    }
    refuse_unsupported(body);
    GenRequest r;
    r.chat = chat;
    r.stream = get_bool(body, "stream", false);
    if (const nlohmann::json* so = field(body, "stream_options")) {
        if (!so->is_object()) refuse("stream_options", "'stream_options' must be an object", "invalid_type");
        r.include_usage = get_bool(*so, "include_usage", false);
    }
    if (const nlohmann::json* k = field(body, "kimik3")) {
        if (!k->is_object()) refuse("kimik3", "'kimik3' must be an object, e.g. {\"trace\": true}", "invalid_type");
        r.extension = true;
        r.trace = get_bool(*k, "trace", false);
    }
    r.sampling.temperature = float(get_number(body, "temperature", 0.0, 2.0).value_or(1.0));
    r.sampling.top_p = float(get_number(body, "top_p", 0.0, 1.0).value_or(1.0));
    if (r.sampling.top_p <= 0.0f) refuse("top_p", "'top_p' must be more than 0", "decimal_below_min_value");
    const std::int64_t top_k = get_integer(body, "top_k").value_or(0);
    if (top_k < 0 || top_k > (1 << 30)) refuse("top_k", "'top_k' must be from 0 (no limit) to 2^30", "invalid_value");
    r.sampling.top_k = int(top_k);
    r.ignore_eos = get_bool(body, "ignore_eos", false);
    if (const nlohmann::json* s = field(body, "seed")) {  // any 64-bit integer; negative ones wrap (as in C)
        if (!s->is_number_integer()) refuse("seed", "'seed' must be an integer, not " + type_name(*s), "invalid_type");
        r.seed = s->is_number_unsigned() ? s->get<std::uint64_t>() : std::uint64_t(s->get<std::int64_t>());
    } else r.seed = (std::uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    if (const nlohmann::json* st = field(body, "stop")) {
        std::vector<const nlohmann::json*> items;  // pointers: a client's value is never copied
        if (st->is_array())
            for (const nlohmann::json& s : *st) items.push_back(&s);
        else items.push_back(st);
        if (items.size() > 4) refuse("stop", "'stop' holds at most 4 sequences", "invalid_value");
        for (const nlohmann::json* s : items) {
            if (!s->is_string()) refuse("stop", "'stop' must be a string or an array of strings, not " + type_name(*s), "invalid_type");
            if (s->get<std::string>().empty()) refuse("stop", "a stop sequence must not be empty", "invalid_value");
            r.stop.push_back(s->get<std::string>());
        }
    }
    // the prompt
    std::vector<std::uint32_t> ids;
    if (chat) {
        if (field(body, "prompt")) refuse("prompt", "/v1/chat/completions takes 'messages', not 'prompt' (that is /v1/completions)", "unsupported_parameter");
        const nlohmann::json* ms = field(body, "messages");
        if (!ms) refuse("messages", "'messages' is required", "missing_required_parameter");
        if (!ms->is_array()) refuse("messages", "'messages' must be an array, not " + type_name(*ms), "invalid_type");
        if (ms->empty()) refuse("messages", "'messages' must not be empty", "empty_array");
        ids = chat_prompt(text, body, tok, r);
    } else {
        if (field(body, "messages")) refuse("messages", "/v1/completions takes 'prompt', not 'messages' (that is /v1/chat/completions)", "unsupported_parameter");
        for (const char* p : {"tools", "tool_choice", "response_format"})
            if (field(body, p)) refuse(p, std::string("'") + p + "' belongs to /v1/chat/completions", "unsupported_parameter");
        const nlohmann::json* p = field(body, "prompt");
        if (!p) refuse("prompt", "'prompt' is required", "missing_required_parameter");
        if (p->is_string()) ids = tok.encode(p->get<std::string>());
        else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) ids = tok.encode((*p)[0].get<std::string>());
        else if (p->is_array() && !p->empty() && std::all_of(p->begin(), p->end(), [](const nlohmann::json& x) { return x.is_number_integer(); })) {
            for (const nlohmann::json& x : *p) {  // 2^64 - 1 is 18446744073709551615, not -1
                const std::string id = x.is_number_unsigned() ? std::to_string(x.get<std::uint64_t>()) : std::to_string(x.get<std::int64_t>());
                if (!x.is_number_unsigned() || x.get<std::uint64_t>() >= lim.vocab)
                    refuse("prompt", "token id " + id + " is outside the vocabulary (" + std::to_string(lim.vocab) + ")", "invalid_value");
                ids.push_back(std::uint32_t(x.get<std::uint64_t>()));
            }
        } else refuse("prompt", "'prompt' must be a string, an array of one string, or an array of token ids", "invalid_type");
    }
    r.prompt.assign(ids.begin(), ids.end());
    if (!chat) r.prompt_tokens = r.prompt.size();
    if (r.prompt.empty()) refuse(chat ? "messages" : "prompt", "the prompt is empty", "empty_prompt");
    for (std::int64_t id : r.prompt)
        if (std::uint64_t(id) >= lim.vocab)
            refuse(chat ? "messages" : "prompt", "the prompt has token id " + std::to_string(id) + ", outside the model's vocabulary (" +
                                                     std::to_string(lim.vocab) + ")", "invalid_value");
    // the context: the prompt and every drawn token but the last take a position
    const std::size_t P = r.prompt.size();
    if (P >= lim.context)
        refuse(chat ? "messages" : "prompt", "the prompt is " + std::to_string(P) + " tokens; this server's context holds " +
                                                 std::to_string(lim.context) + " (and at least one more is needed to answer)", "context_length_exceeded");
    const std::size_t room = lim.context - P + 1;
    std::optional<std::int64_t> mt = get_integer(body, "max_completion_tokens");
    const char* mt_name = "max_completion_tokens";
    if (!mt) mt = get_integer(body, "max_tokens"), mt_name = "max_tokens";
    if (mt) {
        if (*mt < 1) refuse(mt_name, std::string("'") + mt_name + "' is " + std::to_string(*mt) + "; it must be at least 1", "integer_below_min_value");
        if (std::uint64_t(*mt) > room)
            refuse(mt_name, "the context holds " + std::to_string(lim.context) + " positions; the prompt takes " + std::to_string(P) +
                                ", so at most " + std::to_string(room) + " tokens can be generated, not " + std::to_string(*mt),
                   "context_length_exceeded");
        r.max_tokens = std::size_t(*mt);
    } else {
        r.max_tokens = room;
    }
    return r;
}

// ---------------------------------------------------------------------------------------------------
// Reading the reply: the chat format's channels, and stop sequences
// ---------------------------------------------------------------------------------------------------
// The chat format's channels (reasoning, content, markup by token id) are chapter 15's ReplyReader
// (chapters/15a_reply.hpp), which chat and run show replies with too.
// Holds back content that may be the start of a stop sequence; cuts at the first complete one.
class StopMatcher {
  public:
    explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
    // Adds text; returns what may be shown now. `stopped` turns true at a stop sequence (not shown).
    std::string push(const std::string& s) {
        if (stopped) return "";
        text_ += s;
        std::size_t cut = std::string::npos;
        for (const std::string& st : stops_) {
            const std::size_t from = shown_ > st.size() ? shown_ - st.size() : 0;
            const std::size_t at = text_.find(st, from);
            if (at != std::string::npos) cut = std::min(cut, at);
        }
        if (cut != std::string::npos) {
            stopped = true;
            return take(std::max(cut, shown_));
        }
        std::size_t hold = 0;
        for (const std::string& st : stops_)
            for (std::size_t k = std::min(st.size() - 1, text_.size()); k > hold; --k)
                if (text_.compare(text_.size() - k, k, st, 0, k) == 0) {
                    hold = k;
                    break;
                }
        return take(std::max(text_.size() - hold, shown_));
    }
    std::string finish() { return stopped ? "" : take(text_.size()); }
    bool stopped = false;

  private:
    std::string take(std::size_t upto) {
        std::string out = text_.substr(shown_, upto - shown_);
        shown_ = upto;
        return out;
    }
    std::vector<std::string> stops_;
    std::string text_;
    std::size_t shown_ = 0;
};

}  // namespace kimik3::cli

#include "serve_api.hpp"
