// Tests for chapter 15 (first half): XTML chat rendering and sampling. The expected chats are written
// out by hand, segment by segment, from the layout of docs/kimi-k3.md section 4; the text segments' ids come from
// chapter 14 (itself checked against tiktoken), so these tests pin the structure: which markers, which
// tag text, in which order. The sampling case is worked by hand in exact binary fractions.
#include "../chapters/15_generate.hpp"
#include "../chapters/15b_tools.hpp"
#include "../chapters/15c_session_file.hpp"

#include <cstring>
#include <limits>

#include "check.hpp"

using namespace kimik3;

namespace {

const Tokenizer& tiny() {
    static const Tokenizer t = Tokenizer::load(test::source_path("fixtures/tiny-k3"));
    return t;
}

// A hand-written expected chat: "[name]" is a special marker, anything else a text segment.
std::vector<std::uint32_t> segments(std::initializer_list<std::string> segs) {
    std::vector<std::uint32_t> ids;
    for (const std::string& s : segs) {
        if (s.size() > 2 && ((s.front() == '<' && s.substr(0, 2) == "<|" && s.substr(s.size() - 2) == "|>") || s.front() == '[')) {
            ids.push_back(tiny().special_id(s));
        } else {
            const std::vector<std::uint32_t> t = tiny().encode(s);
            ids.insert(ids.end(), t.begin(), t.end());
        }
    }
    return ids;
}

std::size_t count(const std::vector<std::uint32_t>& ids, std::uint32_t id) { return std::size_t(std::count(ids.begin(), ids.end(), id)); }

}  // namespace

TEST_CASE("15.2 system + user, thinking on: the exact XTML and its segments") {
    const ChatMessage chat[] = {{.role = "system", .content = "You are Kimi."}, {.role = "user", .content = "Hi!"}};
    const std::vector<std::uint32_t> ids = render_chat(tiny(), chat, {.thinking_effort = ""});  // the effort message: test below
    CHECK(tiny().decode(ids) ==
          "<|open|>message role=\"system\"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"user\"<|sep|>Hi!<|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
    CHECK(ids == segments({"<|open|>", "message role=\"system\"", "<|sep|>", "You are Kimi.", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"user\"", "<|sep|>", "Hi!", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"assistant\"", "<|sep|>", "<|open|>", "think", "<|sep|>"}));
    CHECK(ids.front() == 483);             // no BOS: the first id is <|open|>
    CHECK(count(ids, 480) == 0);
}

TEST_CASE("15.2 multi-turn with thinking: past assistant turns carry think and response blocks") {
    const ChatMessage chat[] = {{.role = "user", .content = "2+2?"},
                                {.role = "assistant", .content = "4", .reasoning = "Add them."},
                                {.role = "user", .content = "And 3+3?"}};
    const std::vector<std::uint32_t> ids = render_chat(tiny(), chat, {.thinking_effort = ""});
    CHECK(ids == segments({"<|open|>", "message role=\"user\"", "<|sep|>", "2+2?", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"assistant\"", "<|sep|>",
                           "<|open|>", "think", "<|sep|>", "Add them.", "<|close|>", "think", "<|sep|>",
                           "<|open|>", "response", "<|sep|>", "4", "<|close|>", "response", "<|sep|>",
                           "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"user\"", "<|sep|>", "And 3+3?", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"assistant\"", "<|sep|>", "<|open|>", "think", "<|sep|>"}));
    CHECK(count(ids, tiny().special_id("<|end_of_msg|>")) == 3);
}

TEST_CASE("15.2 thinking off: no think blocks, and the prompt opens the response") {
    const ChatMessage chat[] = {{.role = "user", .content = "Hi"}, {.role = "assistant", .content = "Hello", .reasoning = "ignored"},
                                {.role = "user", .content = "Bye"}};
    const std::vector<std::uint32_t> ids = render_chat(tiny(), chat, {.thinking = false});
    CHECK(tiny().decode(ids) ==
          "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"user\"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
    const std::vector<std::uint32_t> no_prompt = render_chat(tiny(), chat, {.thinking = false, .add_generation_prompt = false});
    CHECK(no_prompt.back() == tiny().special_id("<|end_of_msg|>"));
}

TEST_CASE("15.2 a tool call and the tool's answer") {
    const ChatMessage chat[] = {
        {.role = "user", .content = "Weather in Paris?"},
        {.role = "assistant", .content = "", .tool_calls = {{.tool = "get_weather", .arguments = {{.key = "city", .value = "Paris"}}}}},
        {.role = "tool", .content = "18 C", .tool = "get_weather", .index = 1}};
    const std::vector<std::uint32_t> ids = render_chat(tiny(), chat, {.thinking = false});
    CHECK(ids == segments({"<|open|>", "message role=\"user\"", "<|sep|>", "Weather in Paris?", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"assistant\"", "<|sep|>",
                           "<|open|>", "response", "<|sep|>", "<|close|>", "response", "<|sep|>",
                           "<|open|>", "tools", "<|sep|>",
                           "<|open|>", "call tool=\"get_weather\" index=\"1\"", "<|sep|>",
                           "<|open|>", "argument key=\"city\" type=\"string\"", "<|sep|>", "Paris", "<|close|>", "argument", "<|sep|>",
                           "<|close|>", "call", "<|sep|>",
                           "<|close|>", "tools", "<|sep|>",
                           "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"tool\" tool=\"get_weather\" index=\"1\"", "<|sep|>", "18 C", "<|close|>", "message",
                           "<|sep|>", "<|end_of_msg|>",
                           "<|open|>", "message role=\"assistant\"", "<|sep|>", "<|open|>", "response", "<|sep|>"}));
    // With thinking on, the same assistant turn gets an empty think block before its response.
    const std::string on = tiny().decode(render_chat(tiny(), chat));
    CHECK(on.find("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>") !=
          std::string::npos);
}

TEST_CASE("15.2 attributes are escaped; typed markers stay text; internal system messages take the caller's body") {
    CHECK(escape_attribute("a&b \"q\" &amp;") == "a&amp;b &quot;q&quot; &amp;amp;");
    const ChatMessage chat[] = {{.role = "system", .content = "EFFORT TEXT", .type = "thinking-effort"},
                                {.role = "user", .content = "<|open|>hi<|sep|>", .name = "Tom \"T&J\""}};
    const std::vector<std::uint32_t> ids = render_chat(tiny(), chat, {.add_generation_prompt = false, .thinking_effort = ""});
    CHECK(tiny().decode(ids) ==
          "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>EFFORT TEXT<|close|>message<|sep|><|end_of_msg|>"
          "<|open|>message role=\"user\" name=\"Tom &quot;T&amp;J&quot;\"<|sep|><|open|>hi<|sep|><|close|>message<|sep|><|end_of_msg|>");
    CHECK(count(ids, tiny().special_id("<|open|>")) == 2);  // the user's typed "<|open|>" is plain text
    CHECK(count(ids, tiny().special_id("<|sep|>")) == 4);
}

TEST_CASE("15.2 thinking on opens with the template's thinking-effort message (max by default); whitespace-only reasoning is dropped") {
    const ChatMessage user[] = {{.role = "user", .content = "Hi"}};
    // word for word as the release's encoding_k3.py writes it, before every message
    const std::string effort_max =
        "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to think in your thinking "
        "channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is "
        "invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>";
    CHECK(tiny().decode(render_chat(tiny(), user)) ==
          effort_max + "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
    // its body is one text segment, as the template's internal_system_message renders it
    CHECK(render_chat(tiny(), user, {.add_generation_prompt = false}) ==
          segments({"<|open|>", "message role=\"system\" type=\"thinking-effort\"", "<|sep|>", thinking_effort_text("max"), "<|close|>", "message",
                    "<|sep|>", "<|end_of_msg|>", "<|open|>", "message role=\"user\"", "<|sep|>", "Hi", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"}));
    for (const char* e : {"low", "high"})
        CHECK(tiny().decode(render_chat(tiny(), user, {.thinking_effort = e})).find(std::string("invoked with `thinking_effort=") + e + "`.<|close|>") !=
              std::string::npos);
    CHECK(tiny().decode(render_chat(tiny(), user, {.thinking = false})).find("thinking-effort") == std::string::npos);  // thinking off: none
    test::expect_error([&] { render_chat(tiny(), user, {.thinking_effort = "extreme"}); }, ErrorKind::usage,
                       {"thinking effort 'extreme' is not one of low, high, max"});
    // the encoder's text names `medium`, but it accepts only low, high and max (encoding_k3.py _VALID_THINKING_EFFORTS)
    test::expect_error([&] { render_chat(tiny(), user, {.thinking_effort = "medium"}); }, ErrorKind::usage, {"'medium' is not one of low, high, max"});
    // reasoning that is only whitespace (Python's isspace, as the template's trim) renders an empty think block
    const ChatMessage blank[] = {{.role = "assistant", .content = "ok", .reasoning = " \n\t\u3000"}};
    CHECK(tiny().decode(render_chat(tiny(), blank, {.add_generation_prompt = false, .thinking_effort = ""})) ==
          "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>"
          "<|close|>message<|sep|><|end_of_msg|>");
    const ChatMessage kept[] = {{.role = "assistant", .content = "ok", .reasoning = " a "}};  // otherwise kept as given, spaces and all
    CHECK(tiny().decode(render_chat(tiny(), kept, {.add_generation_prompt = false, .thinking_effort = ""})).find("<|sep|> a <|close|>think") !=
          std::string::npos);
}

TEST_CASE("15.7 close_reply: a reply cut short or stopped by [EOS] is closed before the next turn") {
    const Tokenizer& t = tiny();
    auto ids = [&](std::initializer_list<std::string> segs) {
        const std::vector<std::uint32_t> u = segments(segs);
        return std::vector<std::int64_t>(u.begin(), u.end());
    };
    auto text = [&](const std::vector<std::int64_t>& v) {
        const std::vector<std::uint32_t> u(v.begin(), v.end());
        return t.decode(u);
    };
    // ended properly: the stop token alone
    CHECK(close_reply(t, ids({"hmm", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Hi", "<|close|>", "response", "<|sep|>",
                              "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"}), true) == ids({"<|end_of_msg|>"}));
    // cut inside the think block (max_new): its last token, the think block closed, an empty response, the message closed
    const std::vector<std::int64_t> cut_think = ids({"let me see"});
    CHECK(text(close_reply(t, cut_think, true)) ==
          text({cut_think.back()}) + "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    // cut inside the response
    const std::vector<std::int64_t> cut_response = ids({"x", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Hel"});
    CHECK(text(close_reply(t, cut_response, true)) == text({cut_response.back()}) + "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    // stopped by [EOS] (never fed into the history; the tokens before it were), thinking off
    CHECK(text(close_reply(t, ids({"Hi", "[EOS]"}), false)) == "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    // cut inside a tag: the tag is ended first, then closed with the rest
    const std::vector<std::int64_t> in_tag = ids({"Hi", "<|close|>", "response", "<|sep|>", "<|open|>", "tools"});
    CHECK(text(close_reply(t, in_tag, false)) == text({in_tag.back()}) + "<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>");
    // <|end_of_msg|> with the message still open: closed first
    CHECK(text(close_reply(t, ids({"Hi", "<|end_of_msg|>"}), false)) == "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    // stopped by <|end_of_msg|> as the only token: nothing to repeat, the message is closed
    CHECK(text(close_reply(t, ids({"<|end_of_msg|>"}), false)) == "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
}

TEST_CASE("15.7 a reply shows its text, never the chat format's markup: markup is decided by token id") {
    auto shown = [&](std::initializer_list<std::string> segs, bool thinking) {
        ReplyReader r(tiny(), true, thinking);
        std::string out;
        for (std::uint32_t id : segments(segs)) {
            const ReplyReader::Delta d = r.push(id);
            out += d.reasoning + d.content;
        }
        const ReplyReader::Delta d = r.finish();
        return out + d.reasoning + d.content;
    };
    // the reply closes its response and its message: none of that is text
    CHECK(shown({"Hi there", "<|close|>", "response", "<|sep|>", "<|close|>", "message", "<|sep|>"}, false) == "Hi there");
    // thinking on: the think body and the response body, not the tags between them
    CHECK(shown({"hmm", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Hi", "<|close|>", "response", "<|sep|>"}, true) ==
          "hmmHi");
    // the characters of a marker, written as text (ordinary BPE ids), are text
    CHECK(shown({"a <|close|>response<|sep|> b"}, false) == "a <|close|>response<|sep|> b");
    // after the response is closed, stray text (a tool block, or a model's noise) is not the reply
    CHECK(shown({"ok", "<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>", "x", "<|close|>", "tools", "<|sep|>"}, false) == "ok");
    // end to end on the little K3, whose greedy reply closes its own message: chat_turn's text is the
    // decoded reply up to its first markup id
    const std::string dir = test::source_path("fixtures/little-k3");
    Model m(dir, ModelOptions{});
    const Tokenizer tok = Tokenizer::load(dir);
    Chat c(m.config, 256);
    c.options.thinking = false;
    std::string text;
    const std::vector<std::int64_t> reply = chat_turn(m, c, tok, "What time is it?", 24, {.temperature = 0}, [&](const std::string& t) { text += t; });
    const std::uint32_t close = tok.special_id("<|close|>");
    const auto first_markup = std::find(reply.begin(), reply.end(), std::int64_t(close));
    REQUIRE(first_markup != reply.end());  // the reply does close itself (so the check below means something)
    CHECK(text == tok.decode(std::vector<std::uint32_t>(reply.begin(), first_markup)));
    CHECK(text.find("<|") == std::string::npos);
    CHECK(!text.empty());
}

TEST_CASE("15.3 stop tokens: <|end_of_msg|> and [EOS], both") {
    const StopTokens s = stop_tokens(tiny());
    CHECK(s.end_of_msg == 482);
    CHECK(s.eos == 481);
    CHECK(s.contains(482));
    CHECK(s.contains(481));
    CHECK(!s.contains(480));
}

TEST_CASE("15.4 splitmix64: the published first outputs for seed 0; draws are multiples of 2^-24 below 1") {
    SplitMix64 g(0);
    CHECK(g.next() == 0xE220A8397B1DCDAFull);
    CHECK(g.next() == 0x6E789E6AA1B965F4ull);
    CHECK(g.next() == 0x06C45D188009454Full);
    SplitMix64 h(0);
    CHECK(h.uniform() == float(0xE220A8397B1DCDAFull >> 40) * 0x1p-24f);
    SplitMix64 r(7);
    for (int i = 0; i < 100000; ++i) {
        const float u = r.uniform();
        REQUIRE((u >= 0.0f && u < 1.0f));
        REQUIRE(u * 0x1p24f == std::floor(u * 0x1p24f));
    }
}

TEST_CASE("15.4 the stream is a counter: output n computed directly equals the n-th draw, for any seed") {
    // seed 0: outputs 0, 1, 2 are the published values above
    CHECK(SplitMix64::at(0, 0) == 0xE220A8397B1DCDAFull);
    CHECK(SplitMix64::at(0, 2) == 0x06C45D188009454Full);
    for (std::uint64_t seed : {0ull, 1ull, 2026ull, 0xFFFFFFFFFFFFFFFFull}) {  // the last wraps the state at once
        SplitMix64 g(seed);
        for (std::uint64_t n = 0; n < 1000; ++n) {
            const std::uint64_t x = g.next();
            REQUIRE(SplitMix64::at(seed, n) == x);
            REQUIRE(SplitMix64::uniform_at(seed, n) == float(x >> 40) * 0x1p-24f);
        }
    }
}

TEST_CASE("15.5 sampling worked by hand: sort with ties to the lower id, top-k, top-p, the draw") {
    // logits (V = 6): id 0: 0.5, ids 1 2 4 5: 2.0, id 3: -1. T = 1, top_k = 4, top_p = 0.5.
    //   sorted by z, ties lower id first:  1, 2, 4, 5, 0, 3      top-k keeps 1, 2, 4, 5
    //   e = exp(z - 2) = 1, 1, 1, 1 (exact);  S = 4;  p = 0.25 each (exact)
    //   running sum 0.25, 0.5 >= top_p  ->  keep 1, 2;  c_last = 0.5
    //   u = 0.375: r = 0.1875 < 0.25 -> id 1;   u = 0.625: r = 0.3125 -> id 2
    const float logits[] = {0.5f, 2.0f, 2.0f, -1.0f, 2.0f, 2.0f};
    const std::vector<TokenCandidate> kept = sampling_candidates(logits, {.temperature = 1.0f, .top_k = 4, .top_p = 0.5f});
    REQUIRE(kept.size() == 2);
    CHECK(kept[0].id == 1);
    CHECK(kept[1].id == 2);
    CHECK(kept[0].p == 0.25f);
    CHECK(kept[1].cumulative == 0.5f);
    CHECK(sample_from(kept, 0.375f) == 1);
    CHECK(sample_from(kept, 0.625f) == 2);
    CHECK(sample_from(kept, 0.9999999f) == 2);
    CHECK(greedy(logits) == 1);  // a four-way tie: the lowest id
    // Without cuts all six survive, in the tie order.
    const std::vector<TokenCandidate> all = sampling_candidates(logits, {});
    REQUIRE(all.size() == 6);
    CHECK((all[2].id == 4 && all[3].id == 5 && all[4].id == 0 && all[5].id == 3));
}

TEST_CASE("15.5 temperature agrees with hand arithmetic within 1e-6 (exp is not exact)") {
    // logits {2, 0}, T = 2: z = {1, 0}; p = e/(1+e) = 0.7310586, 1/(1+e) = 0.2689414.
    const float logits[] = {2.0f, 0.0f};
    const std::vector<TokenCandidate> c = sampling_candidates(logits, {.temperature = 2.0f});
    REQUIRE(c.size() == 2);
    CHECK(std::fabs(c[0].p - 0.7310586f) < 1e-6f);
    CHECK(std::fabs(c[1].p - 0.2689414f) < 1e-6f);
    const float nan_logits[] = {0.0f, NAN};
    CHECK_THROWS_AS(sampling_candidates(nan_logits, {}), Error);
    CHECK_THROWS_AS(greedy(nan_logits), Error);
}

TEST_CASE("15.5 a temperature at the numeric edge is the greedy limit: 1e-45, 1e-38, 2e-38, 1e-6; an overflowing division too") {
    test::Rng rng(155);
    std::vector<float> logits = rng.floats(512, -20.0f, 20.0f);
    logits[137] = 21.0f;  // one clear winner: the least likely id must never come out
    for (const float t : {1e-45f, 1e-38f, 2e-38f, 1e-6f}) {
        CAPTURE(t);
        for (std::uint64_t p = 0; p < 64; ++p) REQUIRE(sample(logits, {.temperature = t, .seed = 7}, p) == 137);
    }
    // above the threshold, logits large enough to overflow logit / T: the greedy id, one candidate
    std::vector<float> big = logits;
    for (float& x : big) x *= 1e29f;
    const std::vector<TokenCandidate> c = sampling_candidates(big, {.temperature = 1e-10f});
    REQUIRE(c.size() == 1);
    CHECK(c[0].id == 137);
    CHECK(sample(big, {.temperature = 1e-10f, .seed = 3}, 5) == 137);
    // and an ordinary temperature is untouched: the same ids as the contract's arithmetic
    CHECK(sampling_candidates(logits, {.temperature = 0.5f}).size() == logits.size());
}

TEST_CASE("15.5 sampling is reproducible: the same (seed, position), the same id, in any order; greedy uses no draw") {
    test::Rng rng(15);
    const std::vector<float> logits = rng.floats(512, -4.0f, 4.0f);
    const SamplingParams sp{.temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .seed = 2026};
    std::vector<std::uint32_t> a, b(200);
    for (std::uint64_t p = 0; p < 200; ++p) a.push_back(sample(logits, sp, p));
    for (std::uint64_t p = 200; p-- > 0;) b[p] = sample(logits, sp, p);  // backwards: each draw stands alone
    CHECK(a == b);
    // position p uses output p of the seed's stream: drawing the stream in order gives the same ids
    SplitMix64 g(2026);
    for (std::uint64_t p = 0; p < 200; ++p) REQUIRE(a[p] == sample_from(sampling_candidates(logits, sp), g.uniform()));
    CHECK(sample(logits, {.temperature = 0.0f}, 17) == greedy(logits));
    SamplingParams other = sp;
    other.seed = 2027;
    std::size_t same = 0;
    for (std::uint64_t p = 0; p < 200; ++p) same += sample(logits, other, p) == a[p];
    CHECK(same < 100);  // another seed, other draws (a few ids coincide: 40 candidates)
    // Regression pin (made by this code, not evidence of correctness): the first ids for seed 2026.
    const std::vector<std::uint32_t> first(a.begin(), a.begin() + 8);
    INFO("first ids: " << first[0] << " " << first[1] << " " << first[2] << " " << first[3]);
    CHECK(first == std::vector<std::uint32_t>{488, 322, 47, 425, 315, 185, 331, 279});
}

// ---- the model-driven half (15.6-15.8): the tiny K3 in chat -----------------------------------------
namespace {

struct TinyChat {
    ModelOptions o;
    Model model{test::source_path("fixtures/tiny-k3"), o};
};

std::vector<std::int64_t> turn(Model& m, Chat& c, const std::string& text, std::vector<float>* logits = nullptr,
                               SamplingParams sp = {.temperature = 0}) {
    ChatWriter w(tiny());
    render_message(w, ChatMessage{"user", text}, c.options);
    w.open("message", {{"role", "assistant"}}), w.open(c.options.thinking ? "think" : "response");
    std::vector<std::int64_t> fresh = c.pending;
    fresh.insert(fresh.end(), w.ids().begin(), w.ids().end());
    const StopTokens stops = stop_tokens(tiny());
    const auto reply = continue_session(m, c.session, fresh, 6, sp, 32, [&](std::int64_t id) { return !stops.contains(std::uint32_t(id)); }, logits);
    c.pending.assign(reply.end() - 1, reply.end());
    return reply;
}

std::string error_of_load(const Model& m, const std::string& path) {
    try {
        Chat d(m.config, 64);
        load_chat(path, m, d);
    } catch (const Error& e) {
        return e.what();
    }
    return "(no error)";
}

struct TempFile {
    std::string path = "/tmp/kimik3-test15-" + std::to_string(::getpid()) + ".session";
    ~TempFile() { std::remove(path.c_str()); }
};

}  // namespace

TEST_CASE("15.7 a chat turn feeds only the new tokens, and equals recomputing the whole conversation") {
    TinyChat t;
    Chat c(t.model.config, 256);
    c.options.thinking = false;
    turn(t.model, c, "Hello there.");
    const std::size_t after_one = c.session.tokens.size();
    std::vector<float> carried;
    turn(t.model, c, "And now?", &carried);
    // the second turn fed: the pending token, the user message, the assistant prompt, then one per draw
    CHECK(c.session.tokens.size() > after_one);
    // recompute: a fresh session teacher-forced over the whole history gives the same first logits
    Session fresh(t.model.config, 256);
    std::vector<std::int64_t> history(c.session.tokens.begin(), c.session.tokens.end());
    const std::size_t V = 512;
    const std::size_t second_turn_first = after_one + (c.session.tokens.size() - after_one) - (carried.size() / V - 1);
    history.resize(second_turn_first);
    std::vector<float> last(V);
    for (std::size_t t0 = 0; t0 < history.size(); t0 += 32) forward(last.data(), t.model, fresh, {&history[t0], std::min<std::size_t>(32, history.size() - t0)});
    CHECK_BITS_EQ(last, std::span<const float>(carried.data(), V));
}

TEST_CASE("15.8 a session saved after two turns and loaded into a fresh model continues with bit-identical logits") {
    TempFile f;
    std::vector<float> a_logits, b_logits;
    std::vector<std::int64_t> a_ids, b_ids;
    {
        TinyChat t;
        Chat c(t.model.config, 256);
        turn(t.model, c, "First question.");
        turn(t.model, c, "Second question.");
        save_chat(f.path, t.model, c);
        a_ids = turn(t.model, c, "Third.", &a_logits);
    }
    {
        TinyChat t;  // a new model object: nothing shared with the first but the files
        Chat c(t.model.config, 256);
        load_chat(f.path, t.model, c);
        b_ids = turn(t.model, c, "Third.", &b_logits);
    }
    CHECK(a_ids == b_ids);
    CHECK_BITS_EQ(a_logits, b_logits);
}

TEST_CASE("15.8 a sampled conversation resumed from a file draws what the process that saved it draws") {
    // Each token is drawn at its position in the conversation (contract 3), so the resumed process, which
    // has drawn nothing yet, continues exactly as the first one does.
    TempFile f;
    const SamplingParams sp{.temperature = 1.0f, .top_k = 50, .seed = 99};
    std::vector<std::int64_t> a_ids, b_ids;
    {
        TinyChat t;
        Chat c(t.model.config, 256);
        turn(t.model, c, "First question.", nullptr, sp);
        save_chat(f.path, t.model, c);
        a_ids = turn(t.model, c, "Second.", nullptr, sp);
    }
    {
        TinyChat t;
        Chat c(t.model.config, 256);
        load_chat(f.path, t.model, c);
        b_ids = turn(t.model, c, "Second.", nullptr, sp);
    }
    CHECK(a_ids == b_ids);
    CHECK(!a_ids.empty());
}

TEST_CASE("15.8 session files for another model, another version, or truncated are refused") {
    TempFile f;
    TinyChat t;
    Chat c(t.model.config, 64);
    turn(t.model, c, "Hi.");
    save_chat(f.path, t.model, c);
    std::string bytes;
    {
        std::ifstream in(f.path, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    auto write = [&](const std::string& b) { std::ofstream(f.path, std::ios::binary | std::ios::trunc) << b; };
    auto error = [&] {
        try {
            Chat d(t.model.config, 64);
            load_chat(f.path, t.model, d);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string("(no error)");
    };
    std::string other = bytes;
    other[12] ^= 1;  // the config fingerprint
    write(other);
    CHECK(error().find("the session was made for a different model") != std::string::npos);
    std::string v1 = bytes;
    v1[8] = 1;  // the version (1: before checksums)
    write(v1);
    CHECK(error().find("session format version 1, this program reads 2 (version 1 files carry no checksum") != std::string::npos);
    // one flipped bit anywhere after the header: the checksum refuses it (was: loaded, and replies were garbage)
    for (const std::size_t at : {std::size_t(30), bytes.size() / 2, bytes.size() - 20, bytes.size() - 1}) {
        std::string flipped = bytes;
        flipped[at] ^= 0x10;
        write(flipped);
        CAPTURE(at);
        CHECK(error().find("the session file is damaged: its checksum does not match") != std::string::npos);
    }
    write(bytes.substr(0, bytes.size() - 100));
    const std::string truncated = error();
    CAPTURE(truncated);
    CHECK(truncated.find("truncated") != std::string::npos);
    write("not a session");
    CHECK(error().find("not a kimik3 session file") != std::string::npos);

    // every count checked against the model and the file's length before anything is allocated
    auto u64 = [](std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
    const std::uint64_t n = c.session.tokens.size(), m = c.pending.size();
    write(bytes.substr(0, 20) + u64(1ull << 32));  // was: a 32 GiB allocation and std::bad_alloc
    CHECK(error().find("the history holds 4294967296 tokens, more than this chat's context of 64") != std::string::npos);
    write(bytes.substr(0, 20) + u64(40));  // within the context, but the file ends: refused before reading
    CHECK(error().find("the session file is truncated (28 bytes, in the token history)") != std::string::npos);
    write(bytes + std::string(100, '\0'));
    CHECK(error().find("trailing bytes after the last layer's state") != std::string::npos);
    // ids inside the vocabulary (a pending 9999 was accepted, and failed the next turn)
    std::string oov = bytes;
    const std::int64_t bad_id = 9999;
    std::memcpy(&oov[36 + 8 * n], &bad_id, 8);
    seal_session(oov);
    write(oov);
    CHECK(error().find("pending tokens token 0 is id 9999, outside the vocabulary (512)") != std::string::npos);
    std::string oov_history = bytes;
    std::memcpy(&oov_history[28 + 8 * 3], &bad_id, 8);
    seal_session(oov_history);
    write(oov_history);
    CHECK(error().find("history token 3 is id 9999") != std::string::npos);
    // a history one token short of its caches (file length consistent with n - 1): refused by size
    std::string short_history = bytes;
    const std::uint64_t n1 = n - 1;
    std::memcpy(&short_history[20], &n1, 8);
    short_history.erase(28, 8);
    write(short_history);
    CHECK(error().find("a session of " + std::to_string(n - 1) + " tokens for this model is") != std::string::npos);
    // finite states: a NaN in a KDA conv history and in an MLA cache (was: accepted, and the next turn exited 1)
    const std::size_t kda0 = 36 + 8 * (n + m);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::string nan_kda = bytes;
    std::memcpy(&nan_kda[kda0 + 24], &nan, 4);
    seal_session(nan_kda);
    write(nan_kda);
    CHECK(error().find("KDA state: the saved conv history holds nan at index 0") != std::string::npos);
    const std::size_t kda_bytes = KdaState(KdaDims::from(t.model.config)).bytes();
    const std::size_t mla0 = kda0 + std::size_t(t.model.config.count(AttnKind::KDA)) * (24 + kda_bytes);
    std::string nan_mla = bytes;
    std::memcpy(&nan_mla[mla0 + 24 + 4 * 5], &nan, 4);
    seal_session(nan_mla);
    write(nan_mla);
    CHECK(error().find("loading the KV cache: position 0 holds nan") != std::string::npos);
    // two caches whose lengths disagree with the history though the file's length adds up
    std::string uneven = bytes;
    const std::size_t mla_bytes = 24 + n * MlaDims::from(t.model.config).cache_width() * 4;
    const std::uint64_t longer = n + 1, shorter = n - 1;
    std::memcpy(&uneven[mla0 + 16], &longer, 8);
    std::memcpy(&uneven[mla0 + mla_bytes + 16], &shorter, 8);
    seal_session(uneven);
    write(uneven);
    CHECK(error().find("holds " + std::to_string(n + 1) + " positions for " + std::to_string(n) + " tokens of history") != std::string::npos);
    // a directory or a FIFO is not a session file
    CHECK(error_of_load(t.model, "/tmp").find("/tmp: is a directory, not a regular file") != std::string::npos);
    // and a refused file leaves the chat as it was
    Chat d(t.model.config, 64);
    d.pending = {1, 2, 3};
    write(nan_kda);
    CHECK_THROWS(load_chat(f.path, t.model, d));
    CHECK(d.pending == std::vector<std::int64_t>{1, 2, 3});
}

TEST_CASE("15.8 the tokenizer must cover exactly the model's vocabulary") {
    Config c = load_config(test::source_path("fixtures/tiny-k3"));
    require_same_vocabulary(tiny(), c, "tiny");  // 480 ranks + 32 specials = 512
    c.vocab_size = 520;
    test::expect_error([&] { require_same_vocabulary(tiny(), c, "tiny"); }, ErrorKind::format,
                       {"tiny: the tokenizer has 512 ids (480 BPE ranks + 32 special tokens), the model's vocab_size is 520"});
}

TEST_CASE("15.2 attributes are four segments each, as the encoder's _attr writes them") {
    ChatWriter w(tiny());
    w.open("call", {{"tool", "a.b"}, {"index", "1"}});
    const std::vector<std::pair<std::string, bool>> want = {{"<|open|>", true}, {"call", false}, {" tool", false}, {"=\"", false}, {"a.b", false},
                                                            {"\"", false}, {" index", false}, {"=\"", false}, {"1", false}, {"\"", false},
                                                            {"<|sep|>", true}};
    CHECK(w.segments() == want);
    // `a.b` then `"` alone: one string would pre-tokenize `b"` differently (`."` would be one piece)
    CHECK(w.ids() == segments({"<|open|>", "call", " tool", "=\"", "a.b", "\"", " index", "=\"", "1", "\"", "<|sep|>"}));
    ChatWriter parts(tiny());
    render_message(parts, {.role = "user", .parts = {"Hel", "lo"}}, {});
    CHECK(parts.ids() == segments({"<|open|>", "message", " role", "=\"", "user", "\"", "<|sep|>", "Hel", "lo", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"}));
}

TEST_CASE("15b.1 JSON as Python's json.dumps writes it: floats as repr, separators, key order, escapes") {
    // each expected text is what CPython 3 prints for repr(x) / json.dumps(x, ensure_ascii=False)
    const std::pair<double, const char*> floats[] = {{1.5, "1.5"}, {2.0, "2.0"}, {0.1, "0.1"}, {-0.0, "-0.0"}, {1e15, "1000000000000000.0"},
                                                     {9999999999999998.0, "9999999999999998.0"}, {1e16, "1e+16"}, {0.0001, "0.0001"},
                                                     {1e-05, "1e-05"}, {-1.25e-7, "-1.25e-07"}, {123456789012345678.0, "1.2345678901234568e+17"},
                                                     {1e300, "1e+300"}, {5e-324, "5e-324"}};
    for (const auto& [v, want] : floats) CHECK(python_float(v) == want);
    const nlohmann::ordered_json v = nlohmann::ordered_json::parse(R"({"z": [1, "two", false, null, 1.0], "a": {"k": "v\n\u0001\"é"}})");
    CHECK(python_json(v) == "{\"z\": [1, \"two\", false, null, 1.0], \"a\": {\"k\": \"v\\n\\u0001\\\"é\"}}");
    CHECK(python_json_sorted(v) == "{\"a\":{\"k\":\"v\\n\\u0001\\\"é\"},\"z\":[1,\"two\",false,null,1.0]}");
}

TEST_CASE("15b.3 OpenAI arguments become the encoder's argument blocks, a json block, or a refusal") {
    const ToolCall typed = tool_call_from("do", nlohmann::ordered_json::parse(R"("{\"b\": 1.5, \"a\": \"x\", \"o\": {\"k\": [1, 2]}}")"));
    REQUIRE(typed.arguments.size() == 3);  // in the object's own order, not sorted
    CHECK(typed.arguments[0].key == "b");
    CHECK(typed.arguments[0].type == "number");
    CHECK(typed.arguments[0].value == "1.5");
    CHECK(typed.arguments[1].type == "string");
    CHECK(typed.arguments[1].value == "x");
    CHECK(typed.arguments[2].type == "object");
    CHECK(typed.arguments[2].value == "{\"k\": [1, 2]}");
    CHECK(tool_call_from("f", nlohmann::ordered_json("not json")).json_block == "not json");
    CHECK(tool_call_from("f", nlohmann::ordered_json(" \n")).arguments.empty());
    CHECK_FALSE(tool_call_from("f", nlohmann::ordered_json(" \n")).json_block);
    test::expect_error([] { tool_call_from("f", nlohmann::ordered_json("[1]")); }, ErrorKind::usage, {"not a JSON object"});
    test::expect_error([] { tool_call_from("f", nlohmann::ordered_json(3)); }, ErrorKind::usage, {"must be a JSON object"});
}

TEST_CASE("15.8 a session from another model of the same shape (top-2 instead of top-4 routing) is refused by the model fingerprint") {
    TempFile f;
    TinyChat t;
    Chat c(t.model.config, 64);
    turn(t.model, c, "Hi.");
    save_chat(f.path, t.model, c);
    // the tiny K3 with two experts per token: every shape the same (was: loaded, though the help said refused)
    test::TempDir dir;
    for (const auto& e : std::filesystem::directory_iterator(test::source_path("fixtures/tiny-k3")))
        if (e.path().filename() != "config.json") std::filesystem::create_symlink(e.path(), dir.path + "/" + e.path().filename().string());
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(test::source_path("fixtures/tiny-k3/config.json")));
    cfg["text_config"]["num_experts_per_token"] = 2;
    std::ofstream(dir.path + "/config.json") << cfg.dump(2);
    ModelOptions o;
    Model top2(dir.path, o);
    REQUIRE(config_fingerprint(top2.config) == config_fingerprint(t.model.config));
    CHECK(model_fingerprint(top2) != model_fingerprint(t.model));
    Chat d(top2.config, 64);
    try {
        load_chat(f.path, top2, d);
        FAIL("loaded");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("made for another model of the same shape") != std::string::npos);
    }
    Chat same(t.model.config, 64);
    load_chat(f.path, t.model, same);  // and the model that saved it loads it
    CHECK(same.session.tokens == c.session.tokens);
}
