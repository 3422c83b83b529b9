// kimik3 chapter 15: generation -- chats rendered to token ids, and the next token drawn from logits.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Chapter 14 turns text into ids; this chapter turns a *conversation* into ids, in the exact layout
//   Kimi K3 was trained on, and turns the model's logits back into a chosen id. New: K3's "XTML" chat
//   format (structural special tokens wrapping ordinary-text tags), segment-wise tokenization, stop
//   tokens, and sampling (greedy, temperature, top-k, top-p) from a seeded generator whose every
//   rounding step is pinned, so a seed gives the same tokens on every machine and thread count.
//   Then the model-driven half: a session continued token by token (15.6: chapter 13's decode loop with
//   this chapter's sampler), one chat turn that feeds only the new tokens, stops on either stop token and
//   shows only the reply's text, never its markup (15.7; the reader is chapters/15a_reply.hpp), and
//   sessions saved to and loaded from a versioned file, so a conversation resumes in a fresh process
//   with bit-identical logits (15.8).
//
// WHERE THIS SITS IN KIMI K3
//   The checkpoint renders chats in Python (encoding_k3.py). A user turn is
//     <|open|>message role="user"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>
//   where <|open|> 163587, <|sep|> 163589, <|close|> 163588 and <|end_of_msg|> 163586 are special ids
//   and `message role="user"`, `Hello`, `message` are BPE-encoded text. The model's logits have
//   V = 163,840 entries; generation stops at <|end_of_msg|> (config.json's eos_token_id) or at [EOS]
//   163585 (tokenizer_config.json's eos_token): docs/kimi-k3.md trap 5.1.12.
//
// CONCEPTS
//   segment     a run of the rendered chat that is either one structural special or one text string.
//   tag         the text between <|open|> (or <|close|>) and <|sep|>: a name plus attributes k="v".
//   logits      the model's unnormalised scores, one per id (V).
//   temperature logits are divided by T before the softmax; T <= 0 means greedy (the argmax, no draw),
//               the limit of T -> 0.
//   top-k/top-p keep the k most likely ids / the smallest most-likely prefix with probability >= p.
//
// THE XTML LAYOUT (the release's encoding_k3.py; "[x]" is a special id, everything else BPE-encoded text)
//   message     [<|open|>]message role="R"( type="T")( name="N")( tool="F" index="I")[<|sep|>]
//                 BODY [<|close|>]message[<|sep|>][<|end_of_msg|>]
//   assistant   BODY = ([<|open|>]think[<|sep|>]REASONING[<|close|>]think[<|sep|>])    when thinking is on
//                      [<|open|>]response[<|sep|>]TEXT[<|close|>]response[<|sep|>]   (then tool calls: 15b)
//   prompt      [<|open|>]message role="assistant"[<|sep|>][<|open|>]think[<|sep|>]   (thinking off:
//               the last part is [<|open|>]response[<|sep|>])
//   Attribute values escape & -> &amp; and " -> &quot;. No BOS is prepended. Text is encoded with
//   specials NOT recognised, so a user who types "<|open|>" gets plain text ids.
//
// CONTRACT
//   1. Rendering is the encoder's, segment for segment (test 15.2 compares the segments the release
//      produced, google-deepmind/simply's kimi_k3_chat_goldens.json): attributes in the order role,
//      type, name, tool, index, each as four segments; with thinking on every assistant message gets a
//      think block (empty when its reasoning is only whitespace), with it off none does; with thinking
//      on the chat opens with the thinking-effort message (effort max unless low, high or none). Tools,
//      tool choice and response formats: chapter 15b.
//   2. Sampling order of operations, all in f32: greedy (T below kGreedyBelow = 1e-10, 0 included) is
//      the argmax, ties to the lower id, and draws nothing; so is any T for which some logit / T
//      overflows f32 (the limit T -> 0, instead of a draw among infinities). Otherwise z_i = logit_i / T (one IEEE division); ids sorted by z descending,
//      ties lower id first; keep the first top_k (0 = all); e_j = exp(z_j - z_0); S = the 16-lane sum
//      of e_j in sorted order (lane j % 16, then hsum16: chapter 00's rule); p_j = e_j / S; if top_p
//      < 1, keep through the first j whose running sum c_j = c_{j-1} + p_j (sequential, f32) reaches
//      top_p; then one draw u in [0, 1), r = u * c_last, and the first j with r < c_j wins (the last
//      kept one if rounding leaves none). A NaN logit is an Error.
//   3. The generator is splitmix64 (state += 0x9E3779B97F4A7C15, then the finaliser); a draw is
//      u = (next() >> 40) * 2^-24, a multiple of 2^-24 in [0, 1), exact in f32. Nothing here uses
//      threads or std:: distributions (whose algorithms are implementation-defined).
//      The token at position p of a sequence (p tokens before it) is drawn with output p of the seed's
//      stream, computed directly: splitmix64 is a counter (output n = finaliser(seed + (n + 1) x gamma)),
//      so a draw depends on (seed, position) alone, never on how many draws came before it. Hence a
//      resumed session draws what the first process would have, and chapter 16's speculation, which
//      chooses several positions in one step, samples exactly what one-token steps sample.
//
//   4. A chat turn feeds exactly the tokens the session has not seen (what closes the previous reply,
//      the new message, the generation prompt) and carries every layer's state forward: no history is
//      recomputed. A reply cut by max_new or stopped by [EOS] is closed before the next message (its
//      open tags, then <|end_of_msg|>), so past turns are always closed messages, as the template
//      renders them. A saved session holds the token history, every KDA state and every MLA cache; a
//      file made for another model (config fingerprint) or another format version is refused, and so
//      is any count that does not fit the model, the context or the file's length (checked before
//      anything is allocated), an id outside the vocabulary, a non-finite state, or trailing bytes.
//
// USES     chapter 14 (Tokenizer), chapter 13 (Model, Session, decode), chapter 00 (hsum16, Error);
//          its appendix chapters/15a_reply.hpp (ReplyReader: a reply's text by token id).
// RUN      make run-15    (renders a short chat; the little K3 in a conversation, then one question
//                         answered greedily and sampled at two temperatures, 0.7 and 1.0)
// TEST     make test-15   (hand-written XTML token sequences; a hand-worked sampling case; sessions)
//
// SECTIONS
//   15.1 messages       15.2 rendering       15.3 stop tokens       15.4 the generator
//   15.5 sampling       15.6 continuing a session    15.7 a chat turn
//   15.8 sessions on disk: APPENDIX 15c (chapters/15c_session_file.hpp), the file format and its checks
// ====================================================================================================
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <streambuf>
#include <string>
#include <tuple>
#include <utility>
#include <string_view>
#include <vector>

#include "00_numerics.hpp"
#include "13_model.hpp"
#include "14_tokenizer.hpp"
#include "15a_reply.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 15.1 Messages
// ---------------------------------------------------------------------------------------------------
struct ToolArgument {
    std::string key{};
    std::string type = "string";             // the value's JSON type: string, number, boolean, null, object, array
    std::string value{};                     // strings as they are, other types as JSON text (chapter 15b)
};

struct ToolCall {  // arguments in order, or (text that is not a JSON object) one json block instead
    std::string tool{};
    std::vector<ToolArgument> arguments{};
    std::optional<std::string> json_block{};
};

struct ChatMessage {
    std::string role{};                      // "system", "user", "assistant" or "tool"
    std::string content{};                   // the body; for an assistant, the response text
    std::string type{};                      // internal system messages: "tool-declare", "thinking-effort", ...
    std::string name{};                      // optional name="..." attribute
    std::string tool{};                      // tool messages: tool="..."
    int index = 0;                           // tool messages: index="..." (written when tool is set)
    std::string reasoning{};                 // assistant: the think block's text
    std::vector<ToolCall> tool_calls{};      // assistant: index="1", "2", ... in this order
    std::vector<std::string> parts{};        // when not empty, the body instead of content: one text segment each
};

struct ChatOptions {
    bool thinking = true;                // K3's default
    bool add_generation_prompt = true;   // end with the opening of the assistant's reply
    std::string thinking_effort = "max";  // with thinking on: low, high, max (apply_chat_template's default) or "" (none)
};

// The thinking-effort message's body, word for word as K3's encoder writes it (encoding_k3.py,
// build_chat_segments). Its text names `medium`, but the encoder accepts only low, high and max.
inline std::string thinking_effort_text(std::string_view effort) {
    if (effort != "low" && effort != "high" && effort != "max")
        fail(ErrorKind::usage, "thinking effort '" + std::string(effort) + "' is not one of low, high, max");
    return "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
           "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=" +
           std::string(effort) + "`.";
}

// ---------------------------------------------------------------------------------------------------
// 15.2 Rendering: segment by segment, straight to ids
// ---------------------------------------------------------------------------------------------------
// & first, so the & of &quot; is not escaped again.
inline std::string escape_attribute(std::string_view v) {
    std::string out;
    for (char c : v) {
        if (c == '&') out += "&amp;";
        else if (c == '"') out += "&quot;";
        else out += c;
    }
    return out;
}

// Appends segments (text through Tokenizer::encode, specials never recognised; markers by name) to an id
// list. An attribute is four segments, ` key` `="` value `"`, each encoded alone as the encoder's _attr does.
using Attributes = std::vector<std::pair<std::string, std::string>>;
class ChatWriter {
  public:
    explicit ChatWriter(const Tokenizer& tok) : tok_(tok) {}
    void special(std::string_view name) { ids_.push_back(tok_.special_id(name)), segments_.emplace_back(name, true); }
    void text(std::string_view s) {
        if (s.empty()) return;  // the encoder drops empty segments
        const std::vector<std::uint32_t> t = tok_.encode(s);
        ids_.insert(ids_.end(), t.begin(), t.end()), segments_.emplace_back(s, false);
    }
    void open(std::string_view tag, const Attributes& attrs = {}) {  // [<|open|>]tag key="v"...[<|sep|>]
        special("<|open|>"), text(tag);
        for (const auto& [k, v] : attrs) text(" " + k), text("=\""), text(escape_attribute(v)), text("\"");
        special("<|sep|>");
    }
    void close(std::string_view tag) { special("<|close|>"), text(tag), special("<|sep|>"); }   // [<|close|>]tag[<|sep|>]
    const std::vector<std::uint32_t>& ids() const { return ids_; }
    const std::vector<std::pair<std::string, bool>>& segments() const { return segments_; }  // (text, is a marker)

  private:
    const Tokenizer& tok_;
    std::vector<std::uint32_t> ids_;
    std::vector<std::pair<std::string, bool>> segments_;
};

// Whether a reasoning text is only whitespace (Python's str.isspace, as the template's `trim` filter sees
// it): such reasoning renders as an empty think block, as both of K3's renderers do.
inline bool is_blank(std::string_view s) {
    for (std::size_t i = 0; i < s.size();) {
        const Utf8Char c = utf8_next(s, i);
        if (!c.valid || !python_isspace(c.cp)) return false;
        i += c.len;
    }
    return true;
}

inline void render_message(ChatWriter& w, const ChatMessage& m, const ChatOptions& opt) {
    Attributes attrs = {{"role", m.role}};
    if (!m.type.empty()) attrs.emplace_back("type", m.type);
    if (!m.name.empty()) attrs.emplace_back("name", m.name);
    if (!m.tool.empty()) attrs.emplace_back("tool", m.tool), attrs.emplace_back("index", std::to_string(m.index));
    w.open("message", attrs);
    auto body = [&] { for (const std::string& p : m.parts.empty() ? std::vector<std::string>{m.content} : m.parts) w.text(p); };
    if (m.role == "assistant") {
        if (opt.thinking) w.open("think"), w.text(is_blank(m.reasoning) ? "" : m.reasoning), w.close("think");
        w.open("response"), body(), w.close("response");
        if (!m.tool_calls.empty()) {
            w.open("tools");
            for (std::size_t k = 0; k < m.tool_calls.size(); ++k) {
                const ToolCall& c = m.tool_calls[k];
                w.open("call", {{"tool", c.tool}, {"index", std::to_string(k + 1)}});
                if (c.json_block) w.open("json", {{"type", "object"}}), w.text(*c.json_block), w.close("json");
                else
                    for (const ToolArgument& a : c.arguments)
                        w.open("argument", {{"key", a.key}, {"type", a.type}}), w.text(a.value), w.close("argument");
                w.close("call");
            }
            w.close("tools");
        }
    } else {
        body();
    }
    w.close("message");
    w.special("<|end_of_msg|>");
}

// What opens every chat before its messages: with thinking on and an effort given, the thinking-effort
// message (after the tool declaration of chapter 15b, when a request has one).
inline void render_chat_start(ChatWriter& w, const ChatOptions& opt) {
    if (opt.thinking && !opt.thinking_effort.empty())
        render_message(w, ChatMessage{.role = "system", .content = thinking_effort_text(opt.thinking_effort), .type = "thinking-effort"}, opt);
}

// The whole prompt: every message, then (by default) the opening of the assistant's reply.
inline std::vector<std::uint32_t> render_chat(const Tokenizer& tok, std::span<const ChatMessage> messages, const ChatOptions& opt = {}) {
    ChatWriter w(tok);
    render_chat_start(w, opt);
    for (const ChatMessage& m : messages) render_message(w, m, opt);
    if (opt.add_generation_prompt) w.open("message", {{"role", "assistant"}}), w.open(opt.thinking ? "think" : "response");
    return w.ids();
}

// ---------------------------------------------------------------------------------------------------
// 15.3 Stop tokens
// ---------------------------------------------------------------------------------------------------
// Both ends count (trap 5.1.12 of docs/kimi-k3.md): <|end_of_msg|> ends a turn (config.json's eos_token_id), [EOS] is the
// tokenizer's eos_token. A vocabulary that lacks either is refused here, before any generation.
struct StopTokens {
    std::uint32_t end_of_msg = 0, eos = 0;
    bool contains(std::uint32_t id) const { return id == end_of_msg || id == eos; }
};

inline StopTokens stop_tokens(const Tokenizer& tok) { return {tok.special_id("<|end_of_msg|>"), tok.special_id("[EOS]")}; }

// ---------------------------------------------------------------------------------------------------
// 15.4 The generator: splitmix64
// ---------------------------------------------------------------------------------------------------
// Why splitmix64: six lines, 64-bit state, passes BigCrush, and its first output for seed 0 is the
// well-known 0xE220A8397B1DCDAF (test 15.4), so anyone can check an implementation by hand.
class SplitMix64 {
  public:
    static constexpr std::uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd
    explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
    std::uint64_t next() { return finalise(state_ += kGamma); }
    // The top 24 bits as a multiple of 2^-24: every value is exact in f32 and below 1.
    float uniform() { return to_uniform(next()); }
    // Output n (from 0) of the stream seeded with `seed`, without drawing the n before it: the state
    // after n + 1 steps is seed + (n + 1) x gamma (mod 2^64).
    static std::uint64_t at(std::uint64_t seed, std::uint64_t n) { return finalise(seed + (n + 1) * kGamma); }
    static float uniform_at(std::uint64_t seed, std::uint64_t n) { return to_uniform(at(seed, n)); }

  private:
    static std::uint64_t finalise(std::uint64_t z) {
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    static float to_uniform(std::uint64_t x) { return float(x >> 40) * 0x1p-24f; }
    std::uint64_t state_;
};

// ---------------------------------------------------------------------------------------------------
// 15.5 Sampling
// ---------------------------------------------------------------------------------------------------
struct SamplingParams {
    float temperature = 1.0f;  // below kGreedyBelow (0 included): greedy
    int top_k = 0;             // 0: no limit
    float top_p = 1.0f;        // >= 1: no limit
    std::uint64_t seed = 0;    // the draw for position p is SplitMix64::uniform_at(seed, p) (contract 3)
};

// Temperatures below this are the greedy limit. logit / T overflows f32 once |logit| > 3.4e38 x T: at
// T = 2e-38 every logit above 6.8 becomes +inf and the draw is garbage (the least likely id won, in a
// test). Above the threshold an overflow needs |logit| > 3.4e28, and sampling_candidates still catches it.
inline constexpr float kGreedyBelow = 1e-10f;

struct TokenCandidate {
    std::uint32_t id;
    float z;           // logit / T
    float p;           // probability after the top-k cut (before the top-p cut)
    float cumulative;  // running sum of p in sorted order
};

inline std::uint32_t greedy(std::span<const float> logits) {  // logits (V)
    std::uint32_t best = 0;
    for (std::uint32_t i = 0; i < logits.size(); ++i) {
        if (std::isnan(logits[i])) fail(ErrorKind::runtime, "sample: logit " + std::to_string(i) + " is NaN");
        if (logits[i] > logits[best]) best = i;  // strict >: the lower id keeps a tie
    }
    return best;
}

// Steps 2-6 of contract 2: the candidates that survive top-k and top-p, most likely first.
inline std::vector<TokenCandidate> sampling_candidates(std::span<const float> logits, const SamplingParams& sp) {  // logits (V)
    if (logits.empty()) fail(ErrorKind::usage, "sample: no logits");
    std::vector<TokenCandidate> c(logits.size());
    bool overflow = false;  // a finite logit whose z is not: T is too small for these logits
    for (std::uint32_t i = 0; i < logits.size(); ++i) {
        if (std::isnan(logits[i])) fail(ErrorKind::runtime, "sample: logit " + std::to_string(i) + " is NaN");
        c[i] = {i, logits[i] / sp.temperature, 0.0f, 0.0f};
        overflow = overflow || (std::isinf(c[i].z) && std::isfinite(logits[i]));
    }
    if (overflow) return {TokenCandidate{greedy(logits), 0.0f, 1.0f, 1.0f}};  // the limit T -> 0: the greedy id alone
    std::sort(c.begin(), c.end(), [](const TokenCandidate& a, const TokenCandidate& b) { return a.z != b.z ? a.z > b.z : a.id < b.id; });
    if (sp.top_k > 0 && std::size_t(sp.top_k) < c.size()) c.resize(std::size_t(sp.top_k));
    if (std::isinf(c[0].z) && c[0].z < 0) fail(ErrorKind::runtime, "sample: every logit is -inf");
    float lanes[kLanes] = {};
    for (std::size_t j = 0; j < c.size(); ++j) {
        c[j].p = exp_f32(c[j].z - c[0].z);  // e_j, in (0, 1]; exactly 1 for the first
        lanes[j % kLanes] = lanes[j % kLanes] + c[j].p;
    }
    const float sum = hsum16(lanes);
    float running = 0.0f;
    for (std::size_t j = 0; j < c.size(); ++j) {
        c[j].p = c[j].p / sum;
        c[j].cumulative = running = running + c[j].p;
        if (sp.top_p < 1.0f && running >= sp.top_p) {
            c.resize(j + 1);
            break;
        }
    }
    return c;
}

// Step 7: the draw, with u given (tests pick u by hand).
inline std::uint32_t sample_from(std::span<const TokenCandidate> kept, float u) {
    const float r = u * kept.back().cumulative;
    for (const TokenCandidate& c : kept)
        if (r < c.cumulative) return c.id;
    return kept.back().id;
}

// The token at `position` (the number of tokens before it in the sequence). Greedy uses no draw; every
// other setting uses u = uniform_at(seed, position), the same whatever was drawn before.
inline std::uint32_t sample(std::span<const float> logits, const SamplingParams& sp, std::uint64_t position) {  // logits (V)
    if (!(sp.temperature >= kGreedyBelow)) return greedy(logits);  // 0, tiny, or NaN
    const std::vector<TokenCandidate> kept = sampling_candidates(logits, sp);
    return sample_from(kept, SplitMix64::uniform_at(sp.seed, position));
}

// ---------------------------------------------------------------------------------------------------
// 15.6 Continuing a session
// ---------------------------------------------------------------------------------------------------
// chapter 13's decode with this chapter's sampler: the token at position p is drawn with u(seed, p).
inline Chooser sampler(const SamplingParams& sp) {
    return [sp](std::span<const float> l, std::uint64_t position) { return std::int64_t(sample(l, sp, position)); };
}

// Feeds `fresh` (forward steps of at most `chunk` tokens), then draws up to `max_new` tokens, one forward
// step each, until `on_token(id)` returns false (a stop token: it is NOT fed; the caller keeps it for the
// next turn). Returns the drawn ids, stop token included when there was one.
template <class OnToken>
std::vector<std::int64_t> continue_session(Model& model, Session& s, const std::vector<std::int64_t>& fresh, std::size_t max_new,
                                           const SamplingParams& sp, std::size_t chunk, OnToken&& on_token,
                                           std::vector<float>* logits_out = nullptr) {  // logits_out (drawn, V)
    if (fresh.empty()) fail(ErrorKind::usage, "continue_session: nothing to feed");
    return decode(model, s, fresh, {.max_new = max_new, .chunk = chunk}, sampler(sp), {.token = on_token, .logits = logits_out});
}

// ---------------------------------------------------------------------------------------------------
// 15.7 A chat turn
// ---------------------------------------------------------------------------------------------------
// A conversation carried across turns: the session (every layer's state) and the stop token that ended
// the previous reply, which the next turn feeds first (so the history is exactly what the model saw).
struct Chat {
    std::size_t context;                 // positions each MLA cache holds
    Session session;
    std::vector<std::int64_t> pending;   // tokens drawn but not yet fed (the last stop token)
    ChatOptions options;
    Chat(const Config& c, std::size_t ctx) : context(ctx), session(c, ctx) {}
};

// What the next turn feeds after a reply, so that the conversation the model sees always holds the
// reply as a closed message, as K3's renderers write every past turn. A reply that ended with
// <|end_of_msg|> after closing its message is already closed: the stop token alone. Otherwise its last
// drawn token when max_new cut it (not fed yet; a stop token is never fed), then ReplyReader::close.
// `reply` is what continue_session drew after the generation prompt, stop token included.
inline std::vector<std::int64_t> close_reply(const Tokenizer& tok, std::span<const std::int64_t> reply, bool thinking) {
    const StopTokens stops = stop_tokens(tok);
    const bool stopped = !reply.empty() && stops.contains(std::uint32_t(reply.back()));
    const std::size_t n = reply.size() - (stopped ? 1 : 0);
    ReplyReader r(tok, true, thinking);
    for (std::size_t k = 0; k < n; ++k) r.push(std::uint32_t(reply[k]));
    if (r.closed() && stopped && std::uint32_t(reply.back()) == stops.end_of_msg) return {reply.back()};
    std::vector<std::int64_t> out;
    if (n > 0 && !stopped) out.push_back(reply[n - 1]);  // cut by max_new: the last drawn token was not fed yet
    for (std::uint32_t id : r.close()) out.push_back(id);
    return out;
}

// One user message in, the assistant's reply out (its text, reasoning included, streamed through
// on_text as complete UTF-8; markup is never shown). The first
// turn of a conversation begins with render_chat_start's messages (Chat::pending holds them).
// `cont(fresh, on_token)` feeds the fresh tokens and draws the reply with continue_session's contract
// (chat_turn passes continue_session itself; chapter 16 passes its speculative form).
template <class OnText, class Continue>
std::vector<std::int64_t> chat_turn_with(Chat& chat, const Tokenizer& tok, const std::string& user, std::size_t max_new, OnText&& on_text,
                                         Continue&& cont) {
    ChatWriter w(tok);
    const ChatMessage m{"user", user};
    render_message(w, m, chat.options);
    w.open("message", {{"role", "assistant"}}), w.open(chat.options.thinking ? "think" : "response");
    std::vector<std::int64_t> fresh = chat.pending;
    fresh.insert(fresh.end(), w.ids().begin(), w.ids().end());
    // Refused before anything is fed, so a refused turn leaves the conversation as it was: the message,
    // and every drawn token but the last, take a position in each MLA cache.
    if (max_new == 0) fail(ErrorKind::usage, "chat_turn: max_new must be at least 1");
    const std::size_t used = chat.session.position(), need = fresh.size() + max_new - 1;
    if (used + need > chat.context)
        fail(ErrorKind::usage, "the conversation holds " + std::to_string(used) + " of " + std::to_string(chat.context) +
                                   " positions, and this turn needs up to " + std::to_string(need) +
                                   " more: /reset, or start with a larger --context");
    const StopTokens stops = stop_tokens(tok);
    ReplyReader reader(tok, true, chat.options.thinking);  // the reply's text, never its markup
    auto show = [&](const ReplyReader::Delta& d) { on_text(d.reasoning + d.content); };
    const std::vector<std::int64_t> reply = cont(fresh, [&](std::int64_t id) {
        if (stops.contains(std::uint32_t(id))) return false;
        show(reader.push(std::uint32_t(id)));
        return true;
    });
    show(reader.finish());
    chat.pending = close_reply(tok, reply, chat.options.thinking);  // fed first by the next turn
    return reply;
}

template <class OnText>
std::vector<std::int64_t> chat_turn(Model& model, Chat& chat, const Tokenizer& tok, const std::string& user, std::size_t max_new,
                                    const SamplingParams& sp, OnText&& on_text) {
    return chat_turn_with(chat, tok, user, max_new, on_text, [&](const std::vector<std::int64_t>& fresh, auto&& on_token) {
        return continue_session(model, chat.session, fresh, max_new, sp, kPrefillChunk, on_token);
    });
}

// 15.8 Sessions on disk: appendix 15c (chapters/15c_session_file.hpp).

// The tokenizer and the model must agree on the id space: a tokenizer with fewer ids than the model's
// vocabulary fails the first time the model draws one it lacks (mid-generation); one with more can
// produce ids the model has no embedding for.
inline void require_same_vocabulary(const Tokenizer& tok, const Config& c, const std::string& dir) {
    if (tok.vocab_size() != std::uint32_t(c.vocab_size))
        fail(ErrorKind::format, dir + ": the tokenizer has " + std::to_string(tok.vocab_size()) + " ids (" + std::to_string(tok.bpe_size()) +
                                    " BPE ranks + " + std::to_string(tok.vocab_size() - tok.bpe_size()) +
                                    " special tokens), the model's vocab_size is " + std::to_string(c.vocab_size));
}

}  // namespace kimik3
