// kimik3 chapter 15b, APPENDIX to chapter 15: tools, tool choice and response formats, rendered as K3's
// encoder renders them.
// ====================================================================================================
//
// WHAT THIS APPENDIX ADDS
//   Chapter 15 renders messages; an OpenAI-style request carries more: tool declarations (for the whole
//   request, or inside a system message), a tool choice, a response format, and assistant turns whose
//   tool calls carry JSON arguments. K3's release renders all of them as internal system messages and
//   XTML tags (encoding_k3.py, build_chat_segments, in the Hugging Face repository moonshotai/Kimi-K3; the same code
//   that vLLM's Kimi K3 renderer calls through the tokenizer's apply_chat_template). This appendix is that
//   code's rendering, plus the one thing C++ has to add: JSON written byte for byte as Python's json
//   module writes it, because the JSON is part of the prompt.
//
// THE LAYOUT (in this order; "[x]" a special id, each internal message role="system" type="T")
//   tool-declare     request-level tools: "# Tools\nHere are the available tools, described in
//                    JSONSchema.\n\n```json\n" TOOLS "\n```"   (TOOLS: compact JSON, keys sorted)
//   thinking-effort  chapter 15 (thinking on and an effort given)
//   messages         in order; a system message that carries tools renders as a tool-declare message
//                    with the "## New Tools Available ..." header instead (its content is not rendered)
//   tool-choice      after the messages, for "required" and "none" only ("auto" adds nothing)
//   response-format  after that, for json_object and json_schema (the schema as compact sorted JSON)
//   prompt           chapter 15
//   An assistant's tool call:
//     [<|open|>]tools[<|sep|>] ( [<|open|>]call tool="F" index="I"[<|sep|>] ARGS [<|close|>]call[<|sep|>] )...
//     [<|close|>]tools[<|sep|>]
//   ARGS, from the OpenAI arguments: a JSON object gives one block per key, in the object's own order,
//     [<|open|>]argument key="K" type="T"[<|sep|>]V[<|close|>]argument[<|sep|>]
//   with T the value's JSON type (string, number, boolean, null, object, array) and V the string itself
//   or, for any other type, Python's json.dumps of the value (separators ", " and ": "); text that is not
//   JSON at all gives one [<|open|>]json type="object"[<|sep|>]TEXT[<|close|>]json[<|sep|>] block; JSON
//   that is not an object is refused (the encoder raises).
//
// CONTRACT
//   1. JSON is written as Python's json.dumps(ensure_ascii=False) writes it: object keys in their order
//      (or sorted by code point where the encoder sorts: tools and schemas), "\"" "\\" "\b" "\f" "\n"
//      "\r" "\t" escaped and other controls as \u00xx, everything else as UTF-8; integers as digits;
//      floats as Python's repr (the shortest text that reads back, fixed from 1e-4 to below 1e16,
//      exponent e-05 / e+16 outside). Known difference: an integer beyond 64 bits, which nlohmann reads as
//      a double, is written as a float (Python keeps every digit).
//   2. Every fixed text is the encoder's, word for word (test 15.2 compares them).
//
// USES     chapter 15 (ChatWriter, ChatMessage, render_message), chapter 14 (Tokenizer), nlohmann::json.
// TEST     make test-15  (15.2: the encoder's own segments for tools, tool calls and tool results; the
//          internal messages; JSON as Python writes it)
//
// SECTIONS
//   15b.1 JSON as Python writes it     15b.2 the internal messages     15b.3 tool calls
//   15b.4 a whole request
// ====================================================================================================
#pragma once

#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "15_generate.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 15b.1 JSON as Python writes it
// ---------------------------------------------------------------------------------------------------
// A float as Python's repr: the shortest digits that read back (std::to_chars gives them), then Python's
// layout. With the decimal point after d digits' position `point` (1.5 -> "15", point 1): fixed when
// -4 < point <= 16 (so 1e-4 is 0.0001 and 1e16 is 1e+16), always with a fraction ("2.0"); otherwise
// d[.ddd]e+XX with at least two exponent digits.
inline std::string python_float(double v) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
    std::string s(buf, r.ptr), sign;
    if (s[0] == '-') sign = "-", s.erase(0, 1);
    const std::size_t e = s.find('e');
    std::string digits = s.substr(0, 1) + (e > 2 ? s.substr(2, e - 2) : "");
    const int point = std::stoi(s.substr(e + 1)) + 1;
    if (point > -4 && point <= 16) {
        if (point <= 0) return sign + "0." + std::string(std::size_t(-point), '0') + digits;
        if (std::size_t(point) >= digits.size()) return sign + digits + std::string(std::size_t(point) - digits.size(), '0') + ".0";
        return sign + digits.substr(0, std::size_t(point)) + "." + digits.substr(std::size_t(point));
    }
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", point - 1 < 0 ? '-' : '+', std::abs(point - 1));
    return sign + digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + ex;
}

// json.dumps(value, ensure_ascii=False, separators=(item, key)): the encoder's compact form is (",", ":")
// and the default (", ", ": "). Works for nlohmann::json (keys sorted) and ordered_json (keys as given).
template <class Json>
std::string python_json(const Json& v, std::string_view item = ", ", std::string_view key = ": ") {
    if (v.is_object()) {
        std::string out = "{";
        bool first = true;
        for (auto it = v.begin(); it != v.end(); ++it, first = false)
            out += std::string(first ? "" : item) + Json(it.key()).dump(-1, ' ', false) + std::string(key) + python_json(it.value(), item, key);
        return out + "}";
    }
    if (v.is_array()) {
        std::string out = "[";
        for (std::size_t i = 0; i < v.size(); ++i) out += std::string(i ? item : "") + python_json(v[i], item, key);
        return out + "]";
    }
    if (v.is_number_float()) return python_float(v.template get<double>());
    return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // strings, integers, true/false/null
}

// deep_sort_dict then the compact form: what the encoder writes for tools and schemas.
template <class Json>
std::string python_json_sorted(const Json& v) {
    return python_json(nlohmann::json::parse(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)), ",", ":");
}

// ---------------------------------------------------------------------------------------------------
// 15b.2 The internal messages
// ---------------------------------------------------------------------------------------------------
// Bodies word for word as encoding_k3.py writes them; `tools_json` is python_json_sorted of the list.
inline std::string tool_declare_text(std::string_view tools_json, bool dynamic) {
    const std::string head = dynamic ? "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                                       "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                                     : "# Tools\nHere are the available tools, described in JSONSchema.\n\n";
    return head + "```json\n" + std::string(tools_json) + "\n```";
}

// "required" or "none"; any other choice adds no message.
inline std::string tool_choice_text(std::string_view choice) {
    return choice == "required" ? "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
                                : "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.";
}

// "json_object", or "json_schema" with the schema as python_json_sorted.
inline std::string response_format_text(std::string_view type, std::string_view schema_json) {
    std::string t = "The system is invoked with `response_format=" + std::string(type) +
                    "`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    if (type == "json_schema") t += "\nThe JSON data must match the following schema:\n```json\n" + std::string(schema_json) + "\n```";
    return t;
}

inline ChatMessage internal_message(std::string type, std::string body) {
    return ChatMessage{.role = "system", .content = std::move(body), .type = std::move(type)};
}

// ---------------------------------------------------------------------------------------------------
// 15b.3 Tool calls
// ---------------------------------------------------------------------------------------------------
// The XTML type of a JSON value (_xtml_type) and its text (_xtml_value).
inline std::string xtml_type(const nlohmann::ordered_json& v) {
    if (v.is_boolean()) return "boolean";
    if (v.is_null()) return "null";
    if (v.is_number()) return "number";
    if (v.is_string()) return "string";
    return v.is_object() ? "object" : "array";
}
inline std::string xtml_value(const nlohmann::ordered_json& v) { return v.is_string() ? v.get<std::string>() : python_json(v); }

// An assistant's call from OpenAI's function.arguments (normalize_tool_arguments): absent, or text that is
// only whitespace, is no arguments; an object gives one argument per key; text that is not JSON is kept
// whole as a json block. JSON text that is not an object, or a value that is neither text nor an object,
// is refused with the reason (the caller names the field).
inline ToolCall tool_call_from(const std::string& name, const nlohmann::ordered_json& arguments) {
    ToolCall c{.tool = name};
    nlohmann::ordered_json args = arguments;
    if (arguments.is_string()) {
        const std::string& s = arguments.get_ref<const std::string&>();
        if (is_blank(s)) return c;
        try {
            args = nlohmann::ordered_json::parse(s);
        } catch (const nlohmann::json::exception&) {
            c.json_block = s;
            return c;
        }
        if (!args.is_object()) fail(ErrorKind::usage, "the arguments are JSON but not a JSON object");
    } else if (!arguments.is_null() && !arguments.is_object()) {
        fail(ErrorKind::usage, "the arguments must be a JSON object or a string holding one");
    }
    if (args.is_object())
        for (auto it = args.begin(); it != args.end(); ++it) c.arguments.push_back({it.key(), xtml_type(it.value()), xtml_value(it.value())});
    return c;
}

// ---------------------------------------------------------------------------------------------------
// 15b.4 A whole request
// ---------------------------------------------------------------------------------------------------
// A system message that declares tools is in `messages` already as internal_message("tool-declare",
// tool_declare_text(..., true)); tool results carry their tool name and 1-based index.
struct ChatRequest {
    std::vector<ChatMessage> messages;
    std::string tools_json;            // request-level tools (python_json_sorted), "" for none
    std::string tool_choice;           // "", "auto", "required" or "none"
    std::string response_format;       // "", "text", "json_object" or "json_schema"
    std::string response_schema_json;  // json_schema: python_json_sorted of the schema
    ChatOptions options;
};

// build_chat_segments, section for section (the layout above).
inline ChatWriter render_request(const Tokenizer& tok, const ChatRequest& r) {
    ChatWriter w(tok);
    if (!r.tools_json.empty()) render_message(w, internal_message("tool-declare", tool_declare_text(r.tools_json, false)), r.options);
    render_chat_start(w, r.options);
    for (const ChatMessage& m : r.messages) render_message(w, m, r.options);
    if (r.tool_choice == "required" || r.tool_choice == "none")
        render_message(w, internal_message("tool-choice", tool_choice_text(r.tool_choice)), r.options);
    if (r.response_format == "json_object" || r.response_format == "json_schema")
        render_message(w, internal_message("response-format", response_format_text(r.response_format, r.response_schema_json)), r.options);
    if (r.options.add_generation_prompt) w.open("message", {{"role", "assistant"}}), w.open(r.options.thinking ? "think" : "response");
    return w;
}

}  // namespace kimik3
