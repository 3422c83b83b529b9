// Tests for chapter 14: the tokenizer. Sources of truth, strongest first: hand-worked merges and
// pre-tokens (in comments); exhaustive checks (every code point's class, every split point of UTF-8);
// the fast BPE against the reference on many pieces; and OpenAI's tiktoken, whose ids for every corpus
// string on two vocabularies are committed as fixtures (tools/tiktoken_oracle.mjs). Ids are integers:
// plain equality, no tolerance anywhere.
#include "../chapters/14_tokenizer.hpp"

#include <map>

#include "check.hpp"
#include "large_vocab.hpp"

using namespace kimik3;

namespace {

using test::expect_error;

std::string fixture(const std::string& rel) { return detail::read_text_file(test::source_path(rel)); }

const Tokenizer& tiny() {
    static const Tokenizer t = Tokenizer::load(test::source_path("fixtures/tiny-k3"));
    return t;
}

const std::string& large_text() {
    static const std::string v = test::large_vocab_text(fixture("fixtures/tokenizer/large_seed.tiktoken"));
    return v;
}

const Tokenizer& large() {
    static const Tokenizer t = Tokenizer::from_strings(large_text(), "large", fixture("fixtures/tokenizer/k3_tokenizer_config.json"),
                                                       "k3_tokenizer_config.json");
    return t;
}

// name -> text of every corpus case
const std::map<std::string, std::string>& corpus() {
    static const std::map<std::string, std::string> c = [] {
        std::map<std::string, std::string> m;
        for (const auto& e : nlohmann::json::parse(fixture("fixtures/tokenizer/corpus.json"))) m[e["name"]] = e["text"];
        return m;
    }();
    return c;
}

// 256 single bytes (rank = byte) plus the given tokens at ranks 256, 257, ...
std::string byte_vocab(std::initializer_list<std::string> extra) {
    std::string out;
    std::uint32_t r = 0;
    auto line = [&](const std::string& bytes) {
        static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        std::string b64;
        for (std::size_t i = 0; i < bytes.size(); i += 3) {
            std::uint32_t v = std::uint32_t(std::uint8_t(bytes[i])) << 16;
            if (i + 1 < bytes.size()) v |= std::uint32_t(std::uint8_t(bytes[i + 1])) << 8;
            if (i + 2 < bytes.size()) v |= std::uint8_t(bytes[i + 2]);
            b64 += abc[v >> 18], b64 += abc[v >> 12 & 63];
            b64 += i + 1 < bytes.size() ? abc[v >> 6 & 63] : '=';
            b64 += i + 2 < bytes.size() ? abc[v & 63] : '=';
        }
        out += b64 + " " + std::to_string(r++) + "\n";
    };
    for (int b = 0; b < 256; ++b) line(std::string(1, char(b)));
    for (const auto& e : extra) line(e);
    return out;
}

const char* kNoSpecials = R"({"added_tokens_decoder": {}})";

Tokenizer hand_vocab(std::initializer_list<std::string> extra) { return Tokenizer::from_strings(byte_vocab(extra), "hand", kNoSpecials, "cfg"); }

std::vector<std::string> pieces(std::string_view text) {
    std::vector<std::string> out;
    for (auto p : pretokenize(text)) out.emplace_back(p);
    return out;
}

}  // namespace

TEST_CASE("14.1 the class table: fast lookup equals the binary search for all 1,114,112 code points") {
    for (std::uint32_t c = 0; c < 0x110000; ++c) REQUIRE(unicode_class(c) == unicode_class_ref(c));
    CHECK(unicode_class('A') == kCatLu);
    CHECK(unicode_class('a') == kCatLl);
    CHECK(unicode_class(0x01C5) == kCatLt);                  // ǅ
    CHECK(unicode_class(0x02B0) == kCatLm);                  // ʰ
    CHECK(unicode_class(0x4E2D) == (kCatLo | kClassHan));    // 中
    CHECK(unicode_class(0x3007) == (kCatN | kClassHan));     // 〇 is Nl and Han
    CHECK(unicode_class(0x2E80) == (kCatOther | kClassHan)); // a CJK radical: So, Han
    CHECK(unicode_class(0x0301) == kCatM);
    CHECK(unicode_class(' ') == (kCatOther | kClassWhite));
    CHECK(unicode_class(0x1C) == kCatOther);                 // Python's isspace, not White_Space
    CHECK(unicode_class(0x1C89) == kCatLu);                  // new in Unicode 16.0: tiktoken knows it
    CHECK(unicode_class(0x323B0) == kCatOther);              // new in 17.0 (Han there): tiktoken does not
}

TEST_CASE("14.2 UTF-8: strict decoding and U+FFFD per maximal subpart, as Python's errors='replace'") {
    // Expected counts of U+FFFD computed with /usr/bin/python3: bytes.decode('utf-8', 'replace').
    const std::string R(kReplacementChar);
    CHECK(utf8_sanitize("a\x80" "b") == "a" + R + "b");
    CHECK(utf8_sanitize("\xE0\x80") == R + R);                 // E0 needs A0..BF next: two subparts
    CHECK(utf8_sanitize("\xED\xA0\x80") == R + R + R);         // a surrogate: ED needs 80..9F
    CHECK(utf8_sanitize("\xF0\x9F\x98") == R);                 // a truncated emoji: one subpart
    CHECK(utf8_sanitize("\xC0\xAF") == R + R);                 // overlong
    CHECK(utf8_sanitize("\xF5") == R);
    CHECK(utf8_sanitize("\xF4\x90\x80\x80") == R + R + R + R); // above U+10FFFF
    CHECK(utf8_sanitize("\xE4\xB8\xE4\xB8\xAD") == R + "\xE4\xB8\xAD");
    CHECK(utf8_sanitize("\xF0\x9F\x98\x80") == "\xF0\x9F\x98\x80");
    const Utf8Char c = utf8_next("\xF0\x9F\x98\x80", 0);
    CHECK((c.valid && c.cp == 0x1F600 && c.len == 4));
}

TEST_CASE("14.2 the streaming decoder: every split point gives the one-shot result and never half a character") {
    // Characters of 1-4 bytes, then invalid bytes of each kind, then a truncated tail.
    const std::string s = "a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80z\x80\xE0\x80\xED\xA0\x80\xF0\x9F\x98";
    const std::string whole = utf8_sanitize(s);
    for (std::size_t i = 0; i <= s.size(); ++i)
        for (std::size_t j = i; j <= s.size(); ++j) {
            Utf8Stream st;
            std::string out = st.push(s.substr(0, i));
            out += st.push(s.substr(i, j - i));
            out += st.push(s.substr(j));
            out += st.finish();
            REQUIRE(out == whole);
        }
    Utf8Stream st;  // byte by byte: each output is whole characters, at most 3 bytes held back
    std::string out;
    for (char b : s) {
        const std::string piece = st.push(std::string_view(&b, 1));
        CHECK(utf8_sanitize(piece) == piece);
        CHECK(st.held() <= 3);
        out += piece;
    }
    CHECK(st.held() == 3);  // F0 9F 98 is waiting for its last byte
    CHECK(out + st.finish() == whole);
}

TEST_CASE("14.3 pre-tokens worked by hand from the regex's alternatives") {
    using V = std::vector<std::string>;
    CHECK(pieces("Hello world") == V{"Hello", " world"});
    CHECK(pieces("don't DON'T it's") == V{"don't", " DON'T", " it's"});        // A2/A3 keep the suffix
    CHECK(pieces("it\xE2\x80\x99s") == V{"it", "\xE2\x80\x99s"});               // ’ is punctuation: a prefix
    CHECK(pieces("a'\xC5\xBF") == V{"a'\xC5\xBF"});                             // 'ſ folds to 's
    CHECK(pieces("XMLHttpRequest") == V{"XMLHttp", "Request"});                  // A2: U* then W+
    CHECK(pieces("abc123456") == V{"abc", "123", "456"});                        // A4: at most three digits
    CHECK(pieces("\xE4\xB8\xAD\xE6\x96\x87" "abc") == V{"\xE4\xB8\xAD\xE6\x96\x87", "abc"});  // A1: 中文 whole
    CHECK(pieces(" \xE4\xB8\xAD") == V{" ", "\xE4\xB8\xAD"});                  // Han takes no prefix
    CHECK(pieces("<|open|>") == V{"<|", "open", "|>"});                         // A5 then A2 then A5
    // "  hi\n\n x": A7 gives back one space; A2 takes it as a prefix; A6 ends at the last newline.
    CHECK(pieces("  hi\n\n x") == V{" ", " hi", "\n\n", " x"});
    CHECK(pieces("x  ") == V{"x", "  "});                                        // A7 at the end keeps all
    CHECK(pieces("x \n") == V{"x", " \n"});                                      // A6
    CHECK(pieces("\t\tfoo") == V{"\t", "\tfoo"});
    CHECK(pieces("wait ...\n\nok") == V{"wait", " ...\n\n", "ok"});             // A5 swallows newlines
    for (const auto& [name, text] : corpus()) {                                  // the pieces tile the text
        std::string joined;
        for (auto p : pretokenize(text)) {
            CHECK(!p.empty());
            joined += p;
        }
        CHECK(joined == text);
    }
}

TEST_CASE("14.4 the tiny K3 vocabulary: sizes, specials as tokenizer_config.json names them, lookups") {
    const Tokenizer& t = tiny();
    CHECK(t.bpe_size() == 480);
    CHECK(t.vocab_size() == 512);
    CHECK(t.special_id("[BOS]") == 480);
    CHECK(t.special_id("[EOS]") == 481);
    CHECK(t.special_id("<|end_of_msg|>") == 482);
    CHECK(t.special_id("<|open|>") == 483);
    CHECK(t.special_id("<|close|>") == 484);
    CHECK(t.special_id("<|sep|>") == 485);
    CHECK(t.special_id("[EOT]") == 489);
    CHECK(t.special_id("<|media_pad|>") == 501);
    CHECK(t.special_id("<osagent_mode>") == 502);
    CHECK(t.special_id("[UNK]") == 510);
    CHECK(t.special_id("[PAD]") == 511);
    CHECK(t.special_id("<|reserved_token_488|>") == 488);
    CHECK(!t.special(483).special);
    CHECK(t.special(482).special);
    CHECK(t.bos_token() == "[BOS]");
    CHECK(t.eos_token() == "[EOS]");
    CHECK(t.token_bytes(65) == "A");
    CHECK(t.token_bytes(261) == " the");
    CHECK(t.rank_of(" the") == 261);
    CHECK(t.rank_of("zzzq") == kNoRank);
    CHECK(t.token_bytes(483) == "<|open|>");
    expect_error([&] { t.special_id("<|im_end|>"); }, {"no special token named '<|im_end|>'"});
    expect_error([&] { t.token_bytes(512); }, {"id 512 is outside the vocabulary (512 ids)"});
    const Tokenizer& k3 = large();  // the K3 special ids of docs/kimi-k3.md section 4 on a K3-sized vocabulary
    CHECK(k3.vocab_size() == 163840);
    CHECK(k3.special_id("[BOS]") == 163584);
    CHECK(k3.special_id("<|end_of_msg|>") == 163586);
    CHECK(k3.special_id("<|media_pad|>") == 163605);
    CHECK(k3.special_id("<osagent_mode>") == 163649);
    CHECK(k3.special_id("[PAD]") == 163839);
    CHECK(k3.special_id("<|reserved_token_163592|>") == 163592);
}

TEST_CASE("14.5 the loader refuses broken files, naming file, line and reason") {
    auto model = [](const std::string& text) { Tokenizer::from_strings(text, "m.model", kNoSpecials, "c.json"); };
    expect_error([&] { model("QQ== 0\nQg=! 1\n"); }, {"m.model: line 2: bad base64 'Qg=!'"});
    expect_error([&] { model("QR== 0\n"); }, {"line 1: bad base64 'QR=='"});     // non-zero unused bits
    expect_error([&] { model("QQ==0\n"); }, {"line 1: expected 'BASE64 RANK'"});
    expect_error([&] { model("QQ== 0 1\n"); }, {"line 1: expected 'BASE64 RANK'"});
    expect_error([&] { model("QQ== x1\n"); }, {"line 1: rank 'x1' is not a decimal number"});
    expect_error([&] { model("QQ== 0\r\n"); }, {"line 1: rank '0\r' is not a decimal number"});
    expect_error([&] { model("QQ== 0\nQg== 0\n"); }, {"line 2: rank 0 was already given on line 1"});
    expect_error([&] { model("QQ== 0\nQQ== 1\n"); }, {"line 2: token bytes 41 were already given on line 1 (rank 0)"});
    expect_error([&] { model("QQ== 0\nQg== 2\n"); }, {"line 2: rank 2 is out of range: 2 tokens need ranks 0..1, so one is missing"});
    expect_error([&] { model(" 0\n"); }, {"line 1: empty token"});
    expect_error([&] { model(""); }, {"m.model: no tokens"});
    std::string no_a = byte_vocab({});
    no_a.replace(no_a.find("QQ== 65"), 7, "QUI= 65");  // "AB" instead of "A"
    expect_error([&] { model(no_a); }, {"m.model: byte 0x41 has no token"});
    CHECK(Tokenizer::from_strings("\n" + byte_vocab({}) + "\n\n", "m", kNoSpecials, "c").bpe_size() == 256);  // blank lines skipped

    auto config = [](const std::string& json) { Tokenizer::from_strings(byte_vocab({}), "m.model", json, "c.json"); };
    expect_error([&] { config("{"); }, {"c.json: not valid JSON"});
    expect_error([&] { config("{}"); }, {"c.json: field 'added_tokens_decoder' is missing"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"5": {"content": "[X]"}}})"); }, {"id 5 collides with a BPE rank"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"x": {"content": "[X]"}}})"); }, {"['x']: the key is not a token id"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"256": {"special": true}}})"); }, {"'content' is missing"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"256": {"content": "[X]"}, "257": {"content": "[X]"}}})"); },
                 {"special token '[X]' is given twice"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"256": {"content": "[X]"}}, "eos_token": "[EOS]"})"); },
                 {"'eos_token' = '[EOS]' is not a special token"});
    expect_error([&] { Tokenizer::load("/nonexistent-kimik3"); }, {"/nonexistent-kimik3/tiktoken.model: cannot open"});
    // bos/eos given as an object must hold a string (was: a raw nlohmann type error, exit 1)
    expect_error([&] { config(R"({"added_tokens_decoder": {"256": {"content": "[X]"}}, "bos_token": {"content": 5}})"); }, ErrorKind::format,
                 {"c.json: 'bos_token' = {\"content\":5} is neither a string nor {\"content\": string}"});
    expect_error([&] { config(R"({"added_tokens_decoder": {"256": {"content": "[X]"}}, "bos_token": [)" + std::string(100000, '[') + "]}"); },
                 ErrorKind::format, {"c.json: bos_token", "nested more than 64 levels deep"});
    // Gaps between specials are named as tokenization_kimi.py names them.
    const Tokenizer t = Tokenizer::from_strings(byte_vocab({}), "m", R"({"added_tokens_decoder": {"256": {"content": "[A]"}, "258": {"content": "[X]"}}})", "c");
    CHECK(t.vocab_size() == 259);
    CHECK(t.token_bytes(257) == "<|reserved_token_257|>");
    // A gap between the last rank and the first special is refused: what a tiktoken.model cut short at a
    // line boundary looks like (its missing ranks would decode as <|reserved_token_N|>, exit 0)
    expect_error([&] { config(R"({"added_tokens_decoder": {"258": {"content": "[X]"}}})"); }, ErrorKind::format,
                 {"c.json: the first special token has id 258, but tiktoken.model ends at rank 255: ids 256..257", "cut short"});
}

TEST_CASE("14.6 BPE worked by hand: the lowest rank merges first, the leftmost on a tie") {
    // Vocabulary: the 256 bytes, then "bc" 256, "ab" 257, "abc" 258. Piece "abcd":
    //   pairs a+b = "ab" 257, b+c = "bc" 256, c+d none   -> merge "bc" (256 < 257):  a | bc | d
    //   pairs a+bc = "abc" 258, bc+d none                -> merge "abc":             abc | d
    //   pair abc+d none                                  -> done: [258, 'd' = 100]
    // (A left-to-right greedy merger would have taken "ab" first and ended with ab | c | d.)
    const Tokenizer t = hand_vocab({"bc", "ab", "abc"});
    std::vector<std::vector<std::uint32_t>> steps;
    CHECK(t.bpe_merge_ref("abcd", &steps) == std::vector<std::uint32_t>{258, 100});
    REQUIRE(steps.size() == 2);
    CHECK(steps[0] == std::vector<std::uint32_t>{97, 256, 100});
    CHECK(steps[1] == std::vector<std::uint32_t>{258, 100});
    std::vector<std::uint32_t> fast;
    t.bpe_merge("abcd", fast);
    CHECK(fast == std::vector<std::uint32_t>{258, 100});
    // A tie: "aa" 256. "aaa": pairs (0,1) and (1,2) both rank 256; the leftmost merges: aa | a.
    const Tokenizer a = hand_vocab({"aa"});
    CHECK(a.bpe_merge_ref("aaa") == std::vector<std::uint32_t>{256, 97});
    CHECK(a.encode_ordinary("aaaaa") == std::vector<std::uint32_t>{256, 256, 97});
    // The whole-piece rule: "xyz" is a token but "xy" and "yz" are not, so merging cannot reach it;
    // tiktoken still emits it whole, because the pre-token itself is in the vocabulary.
    const Tokenizer w = hand_vocab({"xyz"});
    CHECK(w.bpe_merge_ref("xyz") == std::vector<std::uint32_t>{120, 121, 122});
    CHECK(w.encode_ordinary("xyz") == std::vector<std::uint32_t>{256});
}

TEST_CASE("14.6 the heap BPE equals tiktoken's quadratic loop on every corpus pre-token and 3,000 random pieces") {
    const Tokenizer& t = large();
    std::size_t n = 0;
    auto same = [&](std::string_view piece) {
        std::vector<std::uint32_t> fast;
        t.bpe_merge(piece, fast);
        REQUIRE(fast == t.bpe_merge_ref(piece));
        ++n;
    };
    for (const auto& [name, text] : corpus())
        if (text.size() < 20'000)
            for (auto p : pretokenize(text)) same(p);
    test::Rng rng(14);
    const std::string alphabet = "aabbbcde \xE4\xB8\xAD";  // few symbols: many repeated pairs and ties
    for (int k = 0; k < 3000; ++k) {
        std::string s(1 + rng.bits() % 64, ' ');
        for (char& ch : s) ch = alphabet[rng.bits() % alphabet.size()];
        same(s);
    }
    CHECK(n > 8'000);
}

TEST_CASE("14.7 the long-input pre-split of tokenization_kimi.py, worked with small limits") {
    // Expected pieces from the Python function itself (tools' comment: run with /usr/bin/python3).
    using V = std::vector<std::string_view>;
    CHECK(split_long_input("aaaa  bb", 400'000, 3) == V{"aaa", "a  bb"});        // the 4th 'a' starts a piece
    CHECK(split_long_input("abcdefg", 3, 25'000) == V{"abc", "def", "g"});       // chunks of code points
    CHECK(split_long_input("ab  cd", 4, 25'000) == V{"ab  ", "cd"});
    CHECK(split_long_input("a\x1C\x1C\x1C" "b", 400'000, 2) == V{"a\x1C\x1C", "\x1C" "b"});  // U+001C is space to Python
    CHECK(split_long_input("   xx   ", 400'000, 2) == V{"  ", " xx  ", " "});
    CHECK(split_long_input("\xE4\xB8\xAD\xE4\xB8\xAD\xE4\xB8\xAD", 2, 25'000) == V{"\xE4\xB8\xAD\xE4\xB8\xAD", "\xE4\xB8\xAD"});
    CHECK(split_long_input("").empty());
    // At the real limit, with the vocabulary {bytes, "xx" 256}: "y" + 25,001 x is cut after 25,000
    // code points into "y" + 24,999 x and "xx". Unsplit, the x's pair up as y|xx|...|xx|x; split, the
    // first piece ends y|xx|...|xx|x (12,499 pairs) and the second is one more xx.
    const Tokenizer t = hand_vocab({"xx"});
    const std::string run = "y" + std::string(25'001, 'x');
    std::vector<std::uint32_t> want = t.encode_ordinary(run.substr(0, 25'000));
    want.push_back(256);
    CHECK(t.encode(run) == want);
    CHECK(t.encode_ordinary(run) != want);
}

TEST_CASE("14.8 agrees with OpenAI's tiktoken on every corpus string, tiny K3 vocabulary (exact ids)") {
    const auto expected = nlohmann::json::parse(fixture("fixtures/tokenizer/tiny_expected.json"));
    CHECK(expected["vocab_fnv1a64"] == [] {
        char buf[20];
        std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)fnv1a64(fixture("fixtures/tiny-k3/tiktoken.model")));
        return std::string(buf);
    }());
    std::size_t cases = 0;
    for (const auto& c : expected["cases"]) {
        const std::string& text = corpus().at(c["name"]);
        INFO("case: " << c["name"].get<std::string>());
        const std::vector<std::uint32_t> ids = tiny().encode(text);
        CHECK(ids == c["ids"].get<std::vector<std::uint32_t>>());
        CHECK(tiny().decode(ids) == text);
        ++cases;
    }
    CHECK(cases == corpus().size() - 1);  // all but the Unicode sweep, which needs every byte pair
}

TEST_CASE("14.8 agrees with OpenAI's tiktoken on every corpus string, synthetic 163,584-token vocabulary (exact ids)") {
    const auto expected = nlohmann::json::parse(fixture("fixtures/tokenizer/large_expected.json"));
    char hash[20];
    std::snprintf(hash, sizeof hash, "%016llx", (unsigned long long)fnv1a64(large_text()));
    REQUIRE(expected["vocab_fnv1a64"] == std::string(hash));  // the C++ and JS builders made the same file
    CHECK(large().bpe_size() == test::kLargeVocabSize);
    std::size_t cases = 0;
    for (const auto& c : expected["cases"]) {
        const std::string& text = corpus().at(c["name"]);
        INFO("case: " << c["name"].get<std::string>());
        const std::vector<std::uint32_t> ids = large().encode(text);
        CHECK(ids == c["ids"].get<std::vector<std::uint32_t>>());
        CHECK(large().decode(ids) == text);
        ++cases;
    }
    CHECK(cases == corpus().size());
}

TEST_CASE("14.8 ordinary text never encodes to a special id, even when it spells one") {
    for (const Tokenizer* t : {&tiny(), &large()})
        for (const auto& [name, text] : corpus())
            for (std::uint32_t id : t->encode(text)) REQUIRE(id < t->bpe_size());
    const std::vector<std::uint32_t> ids = tiny().encode("<|open|>[EOS]<|end_of_msg|>");
    CHECK(std::find(ids.begin(), ids.end(), tiny().special_id("<|open|>")) == ids.end());
    CHECK(tiny().decode(ids) == "<|open|>[EOS]<|end_of_msg|>");
}

TEST_CASE("14.8 invalid UTF-8 is refused with its byte offset; decode and decode_text") {
    expect_error([] { tiny().encode("ab\xFF" "cd"); }, {"encode: invalid UTF-8 at byte offset 2 (byte 0xff)"});
    expect_error([] { tiny().encode("\xE4\xB8\xAD\x80"); }, {"byte offset 3 (byte 0x80)"});
    expect_error([] { tiny().encode("x\xC0\xAF"); }, {"byte offset 1 (byte 0xc0)"});      // overlong
    expect_error([] { tiny().encode("\xED\xA0\x80"); }, {"byte offset 0 (byte 0xed)"});   // surrogate
    expect_error([] { tiny().encode("ok\xE4\xB8"); }, {"byte offset 2 (byte 0xe4)"});     // truncated
    expect_error([] { tiny().encode_ordinary("\xFE"); }, {"invalid UTF-8 at byte offset 0"});
    CHECK(tiny().encode("").empty());
    // A 4-byte emoji encodes to several byte tokens; decoding a prefix of them holds/replaces bytes.
    const std::vector<std::uint32_t> ids = tiny().encode("\xF0\x9F\x98\x80");
    REQUIRE(ids.size() >= 2);
    const std::vector<std::uint32_t> head(ids.begin(), ids.end() - 1);
    CHECK(tiny().decode_text(head) == std::string(kReplacementChar));
    const std::uint32_t with_specials[] = {480, 72, 483, 105, 485};  // [BOS] H <|open|> i <|sep|>
    CHECK(tiny().decode(with_specials) == "[BOS]H<|open|>i<|sep|>");
    CHECK(tiny().decode(with_specials, true) == "H<|open|>i<|sep|>");  // only special=true ids are skipped
    const std::uint32_t bad[] = {512};
    expect_error([&] { tiny().decode(bad); }, {"id 512 is outside the vocabulary"});
}
