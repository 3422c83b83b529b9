// kimik3 serve: the K3 API contract. A chat request's messages, tools, tool choice, response format and
// thinking options checked and turned into chapter 15b's ChatRequest; the model's tool calls read back
// by token id into OpenAI's tool_calls. The contract is the one Moonshot's vendor verifier checks
// (github.com/MoonshotAI/Kimi-Vendor-Verifier, tests/k3_features and tests/prompt_tokens) and the one
// the release's encoder renders (encoding_k3.py; chapter 15b). Included at the end of serve_reply.hpp,
// whose parse_request calls chat_prompt for /v1/chat/completions.
//
// What the verifier asks, and what this file does:
//   tools          request-level `tools` and a system message's own `tools` (dynamic tools), each
//                  {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}};
//                  names 1-256 characters of letters, digits, _ and -, not starting with a digit or -,
//                  unique over the whole request. A user or assistant message with tools, a system
//                  message with both tools and content, is refused.
//   tool_choice    "auto" (nothing rendered), "none", "required" (an internal message each); "required"
//                  needs a declared tool. The named form {"type": "function", ...} is refused: K3's
//                  encoder has no rendering for it, and the verifier marks it unsupported.
//   tool results   role "tool" needs tool_call_id; runs of results are put in the order of the
//                  assistant's calls (matched by id) and take the call's function name, as the encoder's
//                  normalize_xtml_tool_result_messages does; index counts 1, 2, ... after each assistant.
//   thinking       on unless turned off (K3's default). thinking {type: enabled|disabled, keep: all,
//                  effort: low|high|max}, reasoning_effort low|high|max, chat_template_kwargs {thinking,
//                  enable_thinking, thinking_effort, preserve_thinking: true}. The effort is thinking.effort,
//                  else chat_template_kwargs.thinking_effort, else reasoning_effort, else max (the verifier:
//                  thinking.effort wins over reasoning_effort). keep other than "all" and preserve_thinking
//                  false are refused: the encoder always keeps every turn's reasoning.
//   response_format text, json_object, json_schema {name, schema, strict?}: rendered, NOT enforced
//                  (no constrained decoding: the model is told to answer in JSON and may not).
//   usage          prompt_tokens = the rendered prompt less the stub that opens the reply's channel,
//                  <|open|>think<|sep|> (or response; 3 ids in K3's vocabulary): Moonshot counts the prompt
//                  without it (the verifier's prompt_token_cases README; its published counts 36, 119 and 99
//                  are reproduced exactly, test 15.9 with K3's vocabulary).
#pragma once

#include <random>
#include <set>
#include <string>
#include <vector>

#include "../../chapters/15b_tools.hpp"
#include "serve_reply.hpp"

namespace kimik3::cli {

// ---------------------------------------------------------------------------------------------------
// Tool declarations
// ---------------------------------------------------------------------------------------------------
// A function name as the verifier's tests draw the line: "1bad_name", "bad@name", "" and 257 characters
// are refused.
inline bool valid_tool_name(const std::string& n) {
    if (n.empty() || n.size() > 256 || std::isdigit(static_cast<unsigned char>(n[0])) || n[0] == '-') return false;
    return std::all_of(n.begin(), n.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; });
}

// Checks one `tools` array (the request's or a message's), adds its names to `seen`; returns it as the
// encoder writes it (python_json_sorted).
inline std::string checked_tools(const nlohmann::json& tools, const std::string& at, std::set<std::string>& seen) {
    if (!tools.is_array()) refuse(at, "'" + at + "' must be an array of tools, not " + type_name(tools), "invalid_type");
    for (std::size_t i = 0; i < tools.size(); ++i) {
        const nlohmann::json& t = tools[i];
        const std::string ti = at + "[" + std::to_string(i) + "]";
        if (!t.is_object()) refuse(ti, "'" + ti + "' must be an object, not " + type_name(t), "invalid_type");
        const nlohmann::json* type = field(t, "type");
        if (!type) refuse(ti + ".type", "'" + ti + ".type' is required (\"function\")", "missing_required_parameter");
        if (*type != "function") refuse(ti + ".type", "'" + ti + ".type' is " + type->dump() + "; only \"function\" is supported", "invalid_value");
        const nlohmann::json* fn = field(t, "function");
        if (!fn) refuse(ti + ".function", "'" + ti + ".function' is required", "missing_required_parameter");
        if (!fn->is_object()) refuse(ti + ".function", "'" + ti + ".function' must be an object, not " + type_name(*fn), "invalid_type");
        const nlohmann::json* name = field(*fn, "name");
        if (!name) refuse(ti + ".function.name", "'" + ti + ".function.name' is required", "missing_required_parameter");
        if (!name->is_string()) refuse(ti + ".function.name", "'" + ti + ".function.name' must be a string", "invalid_type");
        const std::string n = name->get<std::string>();
        if (!valid_tool_name(n))
            refuse(ti + ".function.name", "'" + ti + ".function.name' is \"" + n.substr(0, 64) + (n.size() > 64 ? "...\"" : "\"") +
                                              ": a name is 1 to 256 letters, digits, _ or -, not starting with a digit or -", "invalid_value");
        if (!seen.insert(n).second) refuse(ti + ".function.name", "'" + ti + ".function.name': the tool name '" + n + "' is declared twice", "duplicate_tool_name");
        if (const nlohmann::json* p = field(*fn, "parameters"); p && !p->is_object())
            refuse(ti + ".function.parameters", "'" + ti + ".function.parameters' must be a JSON Schema object", "invalid_type");
        if (const nlohmann::json* d = field(*fn, "description"); d && !d->is_string())
            refuse(ti + ".function.description", "'" + ti + ".function.description' must be a string", "invalid_type");
        if (const nlohmann::json* s = field(*fn, "strict"); s && !s->is_boolean())
            refuse(ti + ".function.strict", "'" + ti + ".function.strict' must be a boolean", "invalid_type");
    }
    return python_json_sorted(tools);
}

// ---------------------------------------------------------------------------------------------------
// Thinking options
// ---------------------------------------------------------------------------------------------------
inline std::string checked_effort(const nlohmann::json& v, const std::string& at) {
    if (!v.is_string() || (v != "low" && v != "high" && v != "max"))
        refuse(at, "'" + at + "' is " + v.dump() + "; K3's thinking effort is \"low\", \"high\" or \"max\"", "invalid_value");
    return v.get<std::string>();
}

inline ChatOptions thinking_options(const nlohmann::json& body) {
    ChatOptions co;  // thinking on, effort max
    std::optional<bool> on;
    std::string effort, kw_effort;
    if (const nlohmann::json* t = field(body, "thinking")) {
        if (t->is_boolean()) on = t->get<bool>();
        else if (!t->is_object()) refuse("thinking", "'thinking' must be an object {\"type\": \"enabled\" | \"disabled\", ...} or a boolean", "invalid_type");
        else {
            if (const nlohmann::json* ty = field(*t, "type")) {
                if (*ty != "enabled" && *ty != "disabled") refuse("thinking.type", "'thinking.type' must be \"enabled\" or \"disabled\"", "invalid_value");
                on = *ty == "enabled";
            }
            if (const nlohmann::json* k = field(*t, "keep"); k && on.value_or(true) && *k != "all")
                refuse("thinking.keep", "'thinking.keep' is " + k->dump() + "; K3 keeps every turn's reasoning: only \"all\"", "invalid_value");
            if (const nlohmann::json* e = field(*t, "effort")) effort = checked_effort(*e, "thinking.effort");
        }
    }
    if (const nlohmann::json* k = field(body, "chat_template_kwargs")) {
        if (!k->is_object()) refuse("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type");
        for (const char* name : {"thinking", "enable_thinking"})
            if (field(*k, name)) {
                const bool v = get_bool(*k, name, true);
                if (on && *on != v) refuse(std::string("chat_template_kwargs.") + name, "'chat_template_kwargs." + std::string(name) +
                                                                                       "' contradicts the request's other thinking switch", "invalid_value");
                on = v;
            }
        if (const nlohmann::json* e = field(*k, "thinking_effort")) kw_effort = checked_effort(*e, "chat_template_kwargs.thinking_effort");
        if (!get_bool(*k, "preserve_thinking", true))
            refuse("chat_template_kwargs.preserve_thinking", "'chat_template_kwargs.preserve_thinking' false is not supported: K3's encoder keeps every turn's reasoning", "unsupported_value");
    }
    std::string reasoning_effort;
    if (const nlohmann::json* e = field(body, "reasoning_effort")) reasoning_effort = checked_effort(*e, "reasoning_effort");
    co.thinking = on.value_or(true);
    co.thinking_effort = !effort.empty() ? effort : !kw_effort.empty() ? kw_effort : !reasoning_effort.empty() ? reasoning_effort : "max";
    return co;
}

// ---------------------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------------------
// A content: a string, or text parts (each its own segment, as the encoder renders a list).
inline void content_of(const nlohmann::json* content, const std::string& at, ChatMessage& m) {
    if (!content) return;
    if (content->is_array()) {
        for (std::size_t i = 0; i < content->size(); ++i) m.parts.push_back(text_of(nlohmann::json::array({(*content)[i]}), at));
        if (m.parts.empty()) m.parts.push_back("");
    } else {
        m.content = text_of(*content, at);
    }
}

// The runs of tool results after an assistant's calls, put in the calls' order by tool_call_id and named
// after the matched call (normalize_xtml_tool_result_messages; a run with an unknown id stays as it is).
inline std::string role_of(const nlohmann::json& m) { return m.is_object() && m.contains("role") && m["role"].is_string() ? m["role"].get<std::string>() : ""; }
inline std::string call_name(const nlohmann::json& c) {
    const nlohmann::json* fn = c.is_object() ? field(c, "function") : nullptr;
    return fn && fn->is_object() && fn->contains("name") && (*fn)["name"].is_string() ? (*fn)["name"].get<std::string>() : "";
}
inline void order_tool_results(nlohmann::json& ms) {
    nlohmann::json calls = nlohmann::json::array();
    for (std::size_t i = 0; i < ms.size();) {
        if (role_of(ms[i]) == "assistant") calls = ms[i].contains("tool_calls") && ms[i]["tool_calls"].is_array() ? ms[i]["tool_calls"] : nlohmann::json::array();
        if (role_of(ms[i]) != "tool") {
            ++i;
            continue;
        }
        std::size_t end = i;
        std::vector<std::tuple<std::size_t, std::size_t, std::string>> run;  // (call position, offset, name)
        bool resolved = true;
        for (; end < ms.size() && role_of(ms[end]) == "tool"; ++end) {
            const nlohmann::json id = ms[end].contains("tool_call_id") ? ms[end]["tool_call_id"] : nlohmann::json();
            std::size_t pos = 0;
            for (; pos < calls.size(); ++pos)
                if (calls[pos].is_object() && calls[pos].contains("id") && !id.is_null() && calls[pos]["id"] == id) break;
            if (pos == calls.size()) resolved = false;
            else run.emplace_back(pos, end - i, call_name(calls[pos]));
        }
        if (resolved) {
            std::stable_sort(run.begin(), run.end());
            std::vector<nlohmann::json> sorted;
            for (const auto& [pos, off, name] : run) {
                nlohmann::json m = ms[i + off];
                m["tool"] = name;
                if (m.contains("name")) m["name"] = name;
                sorted.push_back(std::move(m));
            }
            for (std::size_t k = 0; k < sorted.size(); ++k) ms[i + k] = std::move(sorted[k]);
        }
        i = end;
    }
}

// The request's messages, checked, as chapter 15's messages. `ordered` is the same body read with its
// key order kept: an object of arguments renders in the order the client wrote it.
inline std::vector<ChatMessage> chat_messages(nlohmann::json ms, const nlohmann::ordered_json& ordered, std::set<std::string>& tool_names,
                                              bool& declares) {
    std::vector<ChatMessage> out;
    for (std::size_t i = 0; i < ms.size(); ++i) {
        const nlohmann::json& m = ms[i];
        const std::string at = "messages[" + std::to_string(i) + "]";
        if (!m.is_object()) refuse(at, "'" + at + "' must be an object, not " + type_name(m), "invalid_type");
        const nlohmann::json* role = field(m, "role");
        if (!role || !role->is_string()) refuse(at + ".role", "'" + at + ".role' must be a string", "invalid_type");
        ChatMessage cm;
        cm.role = role->get<std::string>() == "developer" ? "system" : role->get<std::string>();
        if (cm.role != "system" && cm.role != "user" && cm.role != "assistant" && cm.role != "tool")
            refuse(at + ".role", "'" + at + ".role' is '" + cm.role + "'; it must be system, developer, user, assistant or tool", "invalid_value");
        if (const nlohmann::json* nm = field(m, "name")) {
            if (!nm->is_string()) refuse(at + ".name", "'" + at + ".name' must be a string", "invalid_type");
            if (cm.role != "tool") cm.name = nm->get<std::string>();
        }
        const nlohmann::json* content = field(m, "content");
        if (const nlohmann::json* tools = field(m, "tools")) {  // dynamic tools: a system message's own
            if (cm.role != "system") refuse(at + ".tools", "only a system message may declare tools, not a " + cm.role + " message", "invalid_value");
            if (content && !(content->is_string() && content->get<std::string>().empty()))
                refuse(at + ".content", "a system message that declares tools must have empty content", "invalid_value");
            const std::string json = checked_tools(*tools, at + ".tools", tool_names);
            if (!tools->empty()) {
                declares = true;
                out.push_back(internal_message("tool-declare", tool_declare_text(json, true)));
                continue;
            }
        }
        if (!content && cm.role != "assistant") refuse(at + ".content", "'" + at + ".content' is required", "missing_required_parameter");
        content_of(content, at + ".content", cm);
        if (cm.role == "tool") {
            const nlohmann::json* id = field(m, "tool_call_id");
            if (!id) refuse(at + ".tool_call_id", "a tool message needs 'tool_call_id', the id of the call it answers", "missing_required_parameter");
            if (!id->is_string()) refuse(at + ".tool_call_id", "'" + at + ".tool_call_id' must be a string", "invalid_type");
            for (const char* k : {"name", "tool"})  // `tool` first, then `name`, as the encoder looks
                if (const nlohmann::json* t = field(m, k)) {
                    if (!t->is_string()) refuse(at + "." + k, "'" + at + "." + k + "' must be a string", "invalid_type");
                    cm.tool = t->get<std::string>();
                }
        }
        if (const nlohmann::json* rc = field(m, "reasoning_content"); rc && cm.role == "assistant") {
            if (!rc->is_string()) refuse(at + ".reasoning_content", "'" + at + ".reasoning_content' must be a string", "invalid_type");
            cm.reasoning = rc->get<std::string>();
        }
        if (const nlohmann::json* calls = field(m, "tool_calls")) {
            if (cm.role != "assistant") refuse(at + ".tool_calls", "only an assistant message has tool_calls", "invalid_value");
            if (!calls->is_array()) refuse(at + ".tool_calls", "'" + at + ".tool_calls' must be an array", "invalid_type");
            for (std::size_t k = 0; k < calls->size(); ++k) {
                const std::string ck = at + ".tool_calls[" + std::to_string(k) + "]";
                const nlohmann::json& c = (*calls)[k];
                const nlohmann::json* fn = c.is_object() ? field(c, "function") : nullptr;
                if (!fn || !fn->is_object()) refuse(ck + ".function", "'" + ck + ".function' must be an object {\"name\", \"arguments\"}", "invalid_type");
                const nlohmann::json* name = field(*fn, "name");
                if (!name || !name->is_string()) refuse(ck + ".function.name", "'" + ck + ".function.name' must be a string", "invalid_type");
                // the arguments as the client wrote them: from the ordered reading of the same body
                const nlohmann::ordered_json& oc = ordered["messages"][i]["tool_calls"][k]["function"];
                try {
                    cm.tool_calls.push_back(tool_call_from(name->get<std::string>(), oc.contains("arguments") ? oc["arguments"] : nlohmann::ordered_json()));
                } catch (const Error& e) {
                    refuse(ck + ".function.arguments", "'" + ck + ".function.arguments': " + e.what(), "invalid_value");
                }
            }
        }
        out.push_back(std::move(cm));
    }
    // tool results: a name from the matched call, else the i-th call of the assistant before; index 1, 2, ...
    const ChatMessage* assistant = nullptr;
    int index = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {  // out[i] is messages[i]
        ChatMessage& cm = out[i];
        if (cm.role == "assistant") assistant = &cm, index = 0;
        if (cm.role != "tool") continue;
        ++index;
        cm.index = index;
        if (cm.tool.empty() && assistant && std::size_t(index) <= assistant->tool_calls.size()) cm.tool = assistant->tool_calls[std::size_t(index) - 1].tool;
        const std::string at = "messages[" + std::to_string(i) + "]";
        if (cm.tool.empty()) refuse(at, "'" + at + "' answers no call: give 'tool_call_id' of an earlier assistant tool call, or 'name'", "invalid_value");
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------
// The whole chat request (the hook parse_request calls)
// ---------------------------------------------------------------------------------------------------
// The request as chapter 15b's ChatRequest, every field checked (ApiError naming the field).
inline ChatRequest chat_request(const std::string& text, const nlohmann::json& body) {
    ChatRequest cr;
    cr.options = thinking_options(body);
    std::set<std::string> names;
    bool declares = false;
    if (const nlohmann::json* tools = field(body, "tools")) {
        cr.tools_json = checked_tools(*tools, "tools", names);
        declares = !tools->empty();
        if (!declares) cr.tools_json.clear();
    }
    nlohmann::json ms = body["messages"];
    order_tool_results(ms);
    cr.messages = chat_messages(ms, nlohmann::ordered_json::parse(text), names, declares);
    if (const nlohmann::json* tc = field(body, "tool_choice")) {
        if (tc->is_object())
            refuse("tool_choice", "a named tool_choice is not supported by K3 (its encoder has no rendering for it): use \"auto\", \"none\" or \"required\"",
                   "unsupported_value");
        if (!tc->is_string() || (*tc != "auto" && *tc != "none" && *tc != "required"))
            refuse("tool_choice", "'tool_choice' is " + tc->dump() + "; it must be \"auto\", \"none\" or \"required\"", "invalid_value");
        cr.tool_choice = tc->get<std::string>();
        if (cr.tool_choice == "required" && !declares)
            refuse("tool_choice", "tool_choice \"required\" needs at least one tool in 'tools' or in a system message's 'tools'", "invalid_value");
    }
    if (const nlohmann::json* rf = field(body, "response_format")) {
        if (!rf->is_object() || !field(*rf, "type"))
            refuse("response_format", "'response_format' must be an object with a 'type'", "invalid_type");
        if (!(*rf)["type"].is_string())
            refuse("response_format.type", "'response_format.type' must be a string, not " + type_name((*rf)["type"]), "invalid_type");
        cr.response_format = (*rf)["type"].get<std::string>();
        if (cr.response_format != "text" && cr.response_format != "json_object" && cr.response_format != "json_schema")
            refuse("response_format.type", "'response_format.type' is \"" + cr.response_format + "\"; it must be text, json_object or json_schema", "invalid_value");
        if (cr.response_format == "json_schema") {
            const nlohmann::json* js = field(*rf, "json_schema");
            if (!js || !js->is_object()) refuse("response_format.json_schema", "'response_format.json_schema' must be an object {\"name\", \"schema\"}", "missing_required_parameter");
            if (!field(*js, "name") || !(*js)["name"].is_string())
                refuse("response_format.json_schema.name", "'response_format.json_schema.name' is required (a string)", "missing_required_parameter");
            if (!field(*js, "schema") || !(*js)["schema"].is_object())
                refuse("response_format.json_schema.schema", "'response_format.json_schema.schema' is required (a JSON Schema object)", "missing_required_parameter");
            if (const nlohmann::json* s = field(*js, "strict"); s && !s->is_boolean())
                refuse("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean", "invalid_type");
            cr.response_schema_json = python_json_sorted((*js)["schema"]);
        }
    }
    return cr;
}

inline std::vector<std::uint32_t> chat_prompt(const std::string& text, const nlohmann::json& body, const Tokenizer& tok, GenRequest& r) {
    const ChatRequest cr = chat_request(text, body);
    r.thinking = cr.options.thinking;
    r.tool_choice = cr.tool_choice;
    const ChatWriter w = render_request(tok, cr);
    // without the stub that opens the reply's channel, <|open|>think<|sep|> (or response): 3 ids in K3's vocabulary
    r.prompt_tokens = w.ids().size() - (2 + tok.encode(cr.options.thinking ? "think" : "response").size());
    return w.ids();
}

// ---------------------------------------------------------------------------------------------------
// Tool calls in the reply, read by token id
// ---------------------------------------------------------------------------------------------------
// Follows the reply's XTML tags by their marker ids (<|open|> TAG <|sep|>, <|close|> TAG <|sep|>): inside
// [<|open|>]tools[<|sep|>], each call's name is its tool="..." attribute and its arguments are the argument
// blocks, turned back into OpenAI's JSON text: a type="string" value as it is, any other type read as
// JSON, and kept as a string when it does not read (vLLM's Kimi K3 parser does the same); a json block
// is the arguments text itself. Attribute values are unescaped (&quot; then &amp;). A call is reported
// when its <|close|>call<|sep|> arrives; one still open when the reply ends is reported as it stands.
struct ToolCallOut {
    std::string id, name, arguments;
};

class ToolCallReader {
  public:
    explicit ToolCallReader(const Tokenizer& tok) : tok_(tok) {
        open_ = tok.special_id("<|open|>"), close_ = tok.special_id("<|close|>"), sep_ = tok.special_id("<|sep|>");
        std::random_device rd;
        char b[24];
        std::snprintf(b, sizeof b, "call_%08x%08x", rd(), rd());
        prefix_ = b;
    }
    // Feeds one generated id; returns the calls completed by it.
    std::vector<ToolCallOut> push(std::uint32_t id) {
        std::vector<ToolCallOut> done;
        if (id == open_ || id == close_) {
            mode_ = id == open_ ? Open : Close, tag_.clear();
        } else if (id == sep_ && mode_ != Body) {
            tag(done);
        } else if (id < tok_.vocab_size() && (mode_ != Body || in_value_)) {  // other body text (between tags) is not kept
            (mode_ != Body ? tag_ : value_) += tok_.token_bytes(id);
        }
        return done;
    }
    std::vector<ToolCallOut> finish() {
        std::vector<ToolCallOut> done;
        if (in_value_) end_value();
        if (in_call_) emit(done);
        return done;
    }
    std::size_t count() const { return count_; }

  private:
    enum Mode { Body, Open, Close };
    static std::string unescape(std::string v) {
        for (auto [from, to] : {std::pair<const char*, const char*>{"&quot;", "\""}, {"&amp;", "&"}})
            for (std::size_t p = 0; (p = v.find(from, p)) != std::string::npos; p += std::strlen(to)) v.replace(p, std::strlen(from), to);
        return v;
    }
    static std::string attribute(const std::string& tag, const std::string& key) {
        const std::size_t p = tag.find(" " + key + "=\"");
        if (p == std::string::npos) return "";
        const std::size_t b = p + key.size() + 3, e = tag.find('"', b);
        return unescape(tag.substr(b, e == std::string::npos ? std::string::npos : e - b));
    }
    void tag(std::vector<ToolCallOut>& done) {
        const std::string name = tag_.substr(0, tag_.find(' '));
        const bool opening = mode_ == Open;
        mode_ = Body;
        if (name == "tools") in_tools_ = opening;
        if (!in_tools_) return;
        if (name == "call" && opening) in_call_ = true, name_ = attribute(tag_, "tool"), args_ = nlohmann::ordered_json::object(), json_.reset();
        else if (name == "call" && in_call_) emit(done);
        else if ((name == "argument" || name == "json") && opening && in_call_) in_value_ = true, json_block_ = name == "json", key_ = attribute(tag_, "key"), type_ = attribute(tag_, "type"), value_.clear();
        else if ((name == "argument" || name == "json") && in_value_) end_value();
    }
    void end_value() {
        in_value_ = false;
        if (json_block_) return void(json_ = value_);
        nlohmann::ordered_json v = value_;
        if (type_ != "string") try {
                v = nlohmann::ordered_json::parse(value_);
            } catch (const nlohmann::json::exception&) {  // kept as the text it is
            }
        args_[key_] = std::move(v);
    }
    void emit(std::vector<ToolCallOut>& done) {
        in_call_ = false;
        done.push_back({prefix_ + "_" + std::to_string(count_++), name_, json_ ? *json_ : python_json(args_)});
    }
    const Tokenizer& tok_;
    std::uint32_t open_ = 0, close_ = 0, sep_ = 0;
    Mode mode_ = Body;
    bool in_tools_ = false, in_call_ = false, in_value_ = false, json_block_ = false;
    std::string tag_, value_, name_, key_, type_, prefix_;
    nlohmann::ordered_json args_;
    std::optional<std::string> json_;
    std::size_t count_ = 0;
};

// OpenAI's tool_calls entries: the whole list for a reply, or one streamed delta per call.
inline nlohmann::ordered_json tool_calls_json(const std::vector<ToolCallOut>& calls, std::size_t first_index, bool delta) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (std::size_t i = 0; i < calls.size(); ++i) {
        nlohmann::ordered_json c = nlohmann::ordered_json::object();
        if (delta) c["index"] = first_index + i;
        c["id"] = calls[i].id, c["type"] = "function", c["function"] = {{"name", calls[i].name}, {"arguments", calls[i].arguments}};
        out.push_back(std::move(c));
    }
    return out;
}

}  // namespace kimik3::cli
