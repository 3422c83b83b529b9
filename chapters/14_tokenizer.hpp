// kimik3 chapter 14: the tokenizer -- from text to token ids and back, exactly as tiktoken does it.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Chapters 00-13 turn token ids into logits; this one makes the ids. Kimi K3 uses a tiktoken
//   byte-level BPE: text is cut into pre-tokens by a regular expression, each pre-token's UTF-8 bytes
//   are merged pairwise into vocabulary tokens, and decoding concatenates token bytes. New here:
//   Unicode character classes, a regular expression rewritten as a hand-written scanner, the BPE merge
//   rule and a fast version of it, a hash table over byte strings, strict UTF-8, and a streaming
//   decoder that never prints half a character.
//
// WHERE THIS SITS IN KIMI K3
//   `tiktoken.model` has 163,584 lines `base64(token bytes) rank` (2,795,286 bytes; ranks 0..255 are the
//   single bytes); `tokenizer_config.json` names 256 special ids 163584..163839 ([BOS] 163584,
//   [EOS] 163585, <|end_of_msg|> 163586, <|open|> 163587, ...), so V = 163,840 = the embedding rows.
//   The real file is not bundled (docs/kimi-k3.md section 4): the tests use the tiny K3's 512-token vocabulary
//   (fixtures/tiny-k3) and a synthetic 163,584-token one (tests/large_vocab.hpp).
//
// CONCEPTS
//   rank        a BPE token's id; lower rank = merged earlier. Ranks are ids (tiktoken's convention).
//   pre-token   a piece of the text matched by K3's regex (section 14.3); merges never cross pieces.
//   merge       replace two adjacent tokens by the token whose bytes are their concatenation.
//   special     an id above the BPE ranks ([EOS], <|open|>...): never produced by encoding text.
//   code point  a Unicode scalar value, 1-4 bytes in UTF-8 (below).
//
// UTF-8 LAYOUT (well-formed sequences; anything else is invalid: overlongs, surrogates, > U+10FFFF)
//     U+0000..U+007F     0xxxxxxx
//     U+0080..U+07FF     110xxxxx 10xxxxxx                      lead C2..DF
//     U+0800..U+FFFF     1110xxxx 10xxxxxx 10xxxxxx             lead E0 (2nd A0..BF), E1..EC, ED (2nd 80..9F), EE..EF
//     U+10000..U+10FFFF  11110xxx 10xxxxxx 10xxxxxx 10xxxxxx    lead F0 (2nd 90..BF), F1..F3, F4 (2nd 80..8F)
//
// CONTRACT (what the tests hold this chapter to)
//   1. Pre-tokens are exactly the matches of K3's pat_str (docs/kimi-k3.md section 4) under the semantics of the
//      Rust regex behind tiktoken: leftmost-first alternation with backtracking, \s = White_Space,
//      \p{Han} = Script=Han, Unicode 16.0 data (the version of regex-syntax 0.8.5 inside tiktoken;
//      code points assigned later count as unassigned). (?i:'s) also matches 'ſ (U+017F folds to s).
//   2. BPE merges, inside one pre-token, the adjacent pair whose concatenated bytes have the lowest
//      rank; equal ranks: the leftmost pair. A pre-token that is itself a token is emitted whole
//      without merging (tiktoken does this, even when merges could not reach it).
//   3. Encoding text never yields a special id, whatever the text says ("<|open|>" typed by a user is
//      plain text). Specials are only appended by callers that ask for them by name (special_id).
//   4. Invalid UTF-8 given to encode is an Error (ErrorKind::usage) naming the byte offset. Decoding
//      returns bytes; decode_text and Utf8Stream replace each maximal invalid subpart by one U+FFFD
//      (Unicode's recommended practice, and what Python's errors="replace" does).
//   5. encode() also applies tokenization_kimi.py's long-input pre-split (14.7) so very long inputs
//      give the same ids as the Python wrapper; encode_ordinary() is tiktoken's core without it.
//   6. The loader refuses, naming file and line: bad base64 (strict: canonical padding), a bad rank,
//      a duplicate rank, duplicate token bytes, a missing rank (gap), an empty token, a missing
//      single byte; and a special id that collides with a rank or a duplicate special name.
//
// WHY A SCANNER AND NOT PCRE2
//   PCRE2 could run the regex (intersections rewritten as lookaheads), but it is a link-time dependency
//   of a header-only course and Debian's 10.42 has Unicode 15.0, not tiktoken's 16.0. The scanner reads
//   a 3,236-run table generated from UCD 16.0 (14_unicode_tables.inc), says in a few lines what each
//   alternative matches, and is checked against tiktoken on both sides of every run boundary.
//
// USES     chapter 00 (Error), chapter 01 (appendix 01a: capped file reads), nlohmann/json.
// RUN      make run-14    (a sentence cut into pre-tokens and merged step by step, tiny vocabulary)
// TEST     make test-14   (hand-worked merges; tiktoken agreement on both vocabularies; refusals)
//
// SECTIONS
//   14.1 Unicode classes        14.2 UTF-8 and the streaming decoder   14.3 the pre-tokenizer
//   14.4 the vocabulary         14.6 BPE merging                       14.7 the long-input split
//   14.8 encode and decode
//   APPENDIX 14a_tokenizer_files.hpp: 14.5 loading tiktoken.model and tokenizer_config.json (strict
//            base64, every refusal of contract item 6). Included at the end of this file.
// ====================================================================================================
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 14.1 Unicode classes
// ---------------------------------------------------------------------------------------------------
// The regex needs, per code point: its general category among Lu Ll Lt Lm Lo, M (Mn Mc Me), N (Nd Nl
// No) or other; whether it is White_Space; whether its script is Han. That is one byte:
//     bit  7 6 5 | 4   | 3     | 2 1 0
//          0 0 0 | Han | White | category (0 other, 1 Lu, 2 Ll, 3 Lt, 4 Lm, 5 Lo, 6 M, 7 N)
namespace detail {
struct UnicodeRun {
    std::uint32_t first;  // first code point of a run of equal class bytes
    std::uint8_t cls;
};
#include "14_unicode_tables.inc"
}  // namespace detail

enum : std::uint8_t { kCatOther, kCatLu, kCatLl, kCatLt, kCatLm, kCatLo, kCatM, kCatN };
inline constexpr std::uint8_t kClassWhite = 8, kClassHan = 16;

// Reference lookup: binary search for the last run starting at or before cp.
inline std::uint8_t unicode_class_ref(std::uint32_t cp) {
    const auto* end = detail::kUnicodeRuns + detail::kUnicodeRunCount;
    const auto* it = std::upper_bound(detail::kUnicodeRuns, end, cp,
                                      [](std::uint32_t c, const detail::UnicodeRun& r) { return c < r.first; });
    return it == detail::kUnicodeRuns ? 0 : (it - 1)->cls;
}

// Fast lookup: a 64 KiB table for the Basic Multilingual Plane (built once), the search above it.
inline std::uint8_t unicode_class(std::uint32_t cp) {
    static const std::vector<std::uint8_t> bmp = [] {
        std::vector<std::uint8_t> t(0x10000);
        for (std::uint32_t i = 0; i < detail::kUnicodeRunCount && detail::kUnicodeRuns[i].first < 0x10000; ++i) {
            const std::uint32_t end = i + 1 < detail::kUnicodeRunCount ? detail::kUnicodeRuns[i + 1].first : 0x110000;
            std::fill(t.begin() + detail::kUnicodeRuns[i].first, t.begin() + std::min<std::uint32_t>(end, 0x10000),
                      detail::kUnicodeRuns[i].cls);
        }
        return t;
    }();
    return cp < 0x10000 ? bmp[cp] : unicode_class_ref(cp);
}

// ---------------------------------------------------------------------------------------------------
// 14.2 UTF-8: strict decoding, the replacement rule, the streaming decoder
// ---------------------------------------------------------------------------------------------------
struct Utf8Char {
    std::uint32_t cp = 0, len = 0;  // the code point (or U+FFFD); bytes consumed: the sequence or the invalid subpart
    bool valid = false;
    bool truncated = false;         // invalid only because the input ended inside a well-started sequence
};

// Decodes the sequence starting at s[i] (i < s.size()). An invalid sequence consumes its "maximal
// subpart": the longest prefix that could still have become well-formed (so E0 80 is two subparts,
// E0 and 80, because E0 needs A0..BF next; F0 9F 98 at the end of input is one).
inline Utf8Char utf8_next(std::string_view s, std::size_t i) {
    const auto b0 = std::uint8_t(s[i]);
    if (b0 < 0x80) return {b0, 1, true, false};
    int need = 0;
    std::uint32_t cp = 0;
    std::uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the next continuation byte
    if (b0 >= 0xC2 && b0 <= 0xDF) need = 1, cp = b0 & 0x1Fu;
    else if (b0 >= 0xE0 && b0 <= 0xEF) need = 2, cp = b0 & 0x0Fu, lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    else if (b0 >= 0xF0 && b0 <= 0xF4) need = 3, cp = b0 & 0x07u, lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    else return {0xFFFD, 1, false, false};  // 80..BF alone, C0, C1 (overlong), F5..FF
    std::uint32_t len = 1;
    for (int k = 0; k < need; ++k, lo = 0x80, hi = 0xBF) {
        if (i + len >= s.size()) return {0xFFFD, len, false, true};
        const auto b = std::uint8_t(s[i + len]);
        if (b < lo || b > hi) return {0xFFFD, len, false, false};
        cp = (cp << 6) | (b & 0x3Fu);
        ++len;
    }
    return {cp, len, true, false};
}

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// Valid text is copied; each maximal invalid subpart becomes one U+FFFD.
inline std::string utf8_sanitize(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size();) {
        const Utf8Char c = utf8_next(s, i);
        if (c.valid) out.append(s.substr(i, c.len));
        else out += kReplacementChar;
        i += c.len;
    }
    return out;
}

// Streaming: token bytes arrive one token at a time and a character may straddle two tokens. push()
// returns what is certain: complete characters, and U+FFFD for subparts already known to be invalid.
// A well-started but unfinished sequence at the end is held back (at most 3 bytes). finish() flushes a
// held sequence as one U+FFFD. For any split of a byte string into pushes, the concatenated output
// equals utf8_sanitize of the whole (test 14.2 checks every split point).
class Utf8Stream {
  public:
    std::string push(std::string_view bytes) {
        pending_.append(bytes);
        std::string out;
        std::size_t i = 0;
        while (i < pending_.size()) {
            const Utf8Char c = utf8_next(pending_, i);
            if (c.truncated) break;  // wait for the rest of this character
            if (c.valid) out.append(pending_, i, c.len);
            else out += kReplacementChar;
            i += c.len;
        }
        pending_.erase(0, i);
        return out;
    }
    std::string finish() {
        const bool held_some = !pending_.empty();
        pending_.clear();
        return held_some ? std::string(kReplacementChar) : std::string();
    }
    std::size_t held() const { return pending_.size(); }

  private:
    std::string pending_;
};

// ---------------------------------------------------------------------------------------------------
// 14.3 The pre-tokenizer: K3's regex as a scanner
// ---------------------------------------------------------------------------------------------------
// pat_str is eight alternatives joined with "|" (docs/kimi-k3.md section 4). Written with U = [\p{Lu}\p{Lt}\p{Lm}
// \p{Lo}\p{M}&&[^\p{Han}]] ("upper-ish"), W = [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] ("lower-ish"),
// X = [^\r\n\p{L}\p{N}] (an optional one-character prefix), C = (?i:'s|'t|'re|'ve|'m|'ll|'d):
//   A1  [\p{Han}]+                     A5   ?[^\s\p{L}\p{N}]+[\r\n]*
//   A2  X? U* W+ C?                    A6  \s*[\r\n]+
//   A3  X? U+ W* C?                    A7  \s+(?!\S)
//   A4  \p{N}{1,3}                     A8  \s+
// The regex engine tries the alternatives in order at the current position and takes the first that
// matches; inside one, greedy quantifiers take as much as they can and give back one character at a
// time. Each function below returns where the match of one alternative ends (or 0: no match),
// worked out from that rule. Every character matches some alternative (a letter A2/A3, a digit A4,
// white space A8, anything else A5), so the pieces tile the text.
namespace detail {
struct ScanText {
    const std::uint32_t* cp;  // (n) code points
    const std::uint8_t* cls;  // (n) class bytes
    std::size_t n;
    std::uint8_t cat(std::size_t i) const { return cls[i] & 7; }
    bool han(std::size_t i) const { return cls[i] & kClassHan; }
    bool space(std::size_t i) const { return cls[i] & kClassWhite; }
    bool letter(std::size_t i) const { return cat(i) >= kCatLu && cat(i) <= kCatLo; }
    bool upperish(std::size_t i) const { return !han(i) && cat(i) != kCatLl && cat(i) >= kCatLu && cat(i) <= kCatM; }
    bool lowerish(std::size_t i) const { return !han(i) && (cat(i) == kCatLl || cat(i) == kCatLm || cat(i) == kCatLo || cat(i) == kCatM); }
    bool newline(std::size_t i) const { return cp[i] == '\r' || cp[i] == '\n'; }
    bool prefix(std::size_t i) const { return !newline(i) && !letter(i) && cat(i) != kCatN; }  // X
    bool symbol(std::size_t i) const { return !space(i) && !letter(i) && cat(i) != kCatN; }    // [^\s\p{L}\p{N}]

    // C: an ASCII apostrophe and one of the suffixes, case-insensitively. Unicode simple case folding
    // adds exactly one more character: U+017F LATIN SMALL LETTER LONG S folds to 's'.
    std::size_t contraction(std::size_t i) const {
        if (i + 1 >= n || cp[i] != '\'') return 0;
        auto fold = [](std::uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c == 0x17F ? std::uint32_t('s') : c; };
        const std::uint32_t a = fold(cp[i + 1]), b = i + 2 < n ? fold(cp[i + 2]) : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
        return (a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l') ? 3 : 0;
    }
    // A2 from s (after the prefix, if taken): U* is greedy, then gives back characters until W+ can
    // start; the first success is the LAST position k <= end of the U-run where a W character stands.
    std::size_t a2(std::size_t s) const {
        std::size_t u = s;
        while (u < n && upperish(u)) ++u;
        for (std::size_t k = u + 1; k-- > s;) {
            if (k < n && lowerish(k)) {
                std::size_t e = k;
                while (e < n && lowerish(e)) ++e;
                return e + contraction(e);
            }
        }
        return 0;
    }
    // A3 from s: U+ greedy (at least one), then W* greedy, then C?. Nothing to give back.
    std::size_t a3(std::size_t s) const {
        std::size_t e = s;
        while (e < n && upperish(e)) ++e;
        if (e == s) return 0;
        while (e < n && lowerish(e)) ++e;
        return e + contraction(e);
    }
    // The end of the piece that starts at i (> i).
    std::size_t match(std::size_t i) const {
        if (han(i)) {                                                    // A1
            std::size_t e = i;
            while (e < n && han(e)) ++e;
            return e;
        }
        for (auto alt : {&ScanText::a2, &ScanText::a3}) {                // A2, then A3: X? taken first
            if (prefix(i) && i + 1 < n)
                if (std::size_t e = (this->*alt)(i + 1)) return e;
            if (std::size_t e = (this->*alt)(i)) return e;
        }
        if (cat(i) == kCatN) {                                           // A4
            std::size_t e = i;
            while (e < n && e < i + 3 && cat(e) == kCatN) ++e;
            return e;
        }
        std::size_t s = cp[i] == ' ' && i + 1 < n && symbol(i + 1) ? i + 1 : i;
        if (symbol(s)) {                                                 // A5
            while (s < n && symbol(s)) ++s;
            while (s < n && newline(s)) ++s;
            return s;
        }
        std::size_t w = i;                                               // here i is white space
        while (w < n && space(w)) ++w;
        for (std::size_t k = w; k-- > i;)                                // A6: up to the last newline
            if (newline(k)) return k + 1;
        if (w == n) return w;                                            // A7: (?!\S) holds at the end
        if (w - i >= 2) return w - 1;                                    // A7: give back one space
        return w;                                                        // A8
    }
};

[[noreturn]] inline void fail_invalid_utf8(const char* where, std::string_view s, std::size_t at) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", unsigned(std::uint8_t(s[at])));
    fail(ErrorKind::usage, std::string(where) + ": invalid UTF-8 at byte offset " + std::to_string(at) + " (byte " +
                               buf + "); repair it first with utf8_sanitize (one U+FFFD per invalid subpart)");
}
}  // namespace detail

// Calls f(piece) for each pre-token of text, in order; the pieces concatenate to text. Throws on
// invalid UTF-8 (contract 4).
template <class F> void for_each_pretoken(std::string_view text, F&& f) {
    if (text.size() >= 0xFFFFFFFFu) fail(ErrorKind::usage, "pretokenize: text of 4 GiB or more (encode() cuts it first)");
    std::vector<std::uint32_t> cps, offsets;  // (n), (n + 1): code points and their byte offsets
    std::vector<std::uint8_t> classes;        // (n)
    cps.reserve(text.size()), offsets.reserve(text.size() + 1), classes.reserve(text.size());
    for (std::size_t i = 0; i < text.size();) {
        const Utf8Char c = utf8_next(text, i);
        if (!c.valid) detail::fail_invalid_utf8("pretokenize", text, i);
        cps.push_back(c.cp), offsets.push_back(std::uint32_t(i)), classes.push_back(unicode_class(c.cp));
        i += c.len;
    }
    offsets.push_back(std::uint32_t(text.size()));
    const detail::ScanText scan{cps.data(), classes.data(), cps.size()};
    for (std::size_t i = 0; i < scan.n;) {
        const std::size_t e = scan.match(i);
        f(text.substr(offsets[i], offsets[e] - offsets[i]));
        i = e;
    }
}

inline std::vector<std::string_view> pretokenize(std::string_view text) {
    std::vector<std::string_view> out;
    for_each_pretoken(text, [&](std::string_view p) { out.push_back(p); });
    return out;
}

// ---------------------------------------------------------------------------------------------------
// 14.4 The vocabulary: one byte arena and an open-addressing hash table
// ---------------------------------------------------------------------------------------------------
// 163,584 tokens must load in milliseconds and be looked up millions of times per second. So: every
// token's bytes sit back to back in one string (no allocation per token), and a power-of-two table of
// ranks, probed linearly, finds a byte string's rank with one hash and usually one comparison.
// The hash is FNV-1a 64 (simple, and tokens are short).
inline std::uint64_t fnv1a64(std::string_view s) {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
    return h;
}

inline constexpr std::uint32_t kNoRank = 0xFFFFFFFFu;

struct SpecialToken {
    std::string content;  // e.g. "<|open|>"
    bool special = true;  // tokenizer_config.json's flag: false for <|open|> <|close|> <|sep|>
};

class Tokenizer {
  public:
    // dir/tiktoken.model and dir/tokenizer_config.json (the release's two tokenizer files).
    static Tokenizer load(const std::string& dir);
    // The same from memory; the names are used in error messages.
    static Tokenizer from_strings(std::string_view model_text, const std::string& model_name,
                                  std::string_view config_text, const std::string& config_name);

    std::uint32_t bpe_size() const { return std::uint32_t(token_len_.size()); }            // ranks 0..bpe_size-1
    std::uint32_t vocab_size() const { return bpe_size() + std::uint32_t(specials_.size()); }  // V
    bool is_special(std::uint32_t id) const { return id >= bpe_size() && id < vocab_size(); }
    const SpecialToken& special(std::uint32_t id) const { return specials_.at(id - bpe_size()); }
    std::uint32_t special_id(std::string_view name) const {  // the explicit way to emit a special
        const auto it = special_ids_.find(std::string(name));
        if (it == special_ids_.end()) fail(ErrorKind::usage, "tokenizer: no special token named '" + std::string(name) + "'");
        return it->second;
    }
    const std::string& bos_token() const { return bos_token_; }
    const std::string& eos_token() const { return eos_token_; }

    // The bytes of a BPE token, or a special's content text (what decode writes for it).
    std::string_view token_bytes(std::uint32_t id) const {
        if (id >= vocab_size())
            fail(ErrorKind::usage, "tokenizer: id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(vocab_size()) + " ids)");
        return id < bpe_size() ? bpe_bytes(id) : std::string_view(specials_[id - bpe_size()].content);
    }
    // The rank of a byte string, or kNoRank.
    std::uint32_t rank_of(std::string_view bytes) const {
        for (std::size_t slot = fnv1a64(bytes) & mask_;; slot = (slot + 1) & mask_) {
            const std::uint32_t r = slots_[slot];
            if (r == kNoRank || bpe_bytes(r) == bytes) return r;
        }
    }

    // 14.6: merging one pre-token's bytes (the reference with an optional trace, and the fast form).
    std::vector<std::uint32_t> bpe_merge_ref(std::string_view piece, std::vector<std::vector<std::uint32_t>>* steps = nullptr) const;
    void bpe_merge(std::string_view piece, std::vector<std::uint32_t>& out) const;
    // 14.8
    std::vector<std::uint32_t> encode_ordinary(std::string_view text) const;
    std::vector<std::uint32_t> encode(std::string_view text) const;
    std::string decode(std::span<const std::uint32_t> ids, bool skip_special = false) const;
    std::string decode_text(std::span<const std::uint32_t> ids) const { return utf8_sanitize(decode(ids)); }

  private:
    std::string_view bpe_bytes(std::uint32_t r) const { return std::string_view(arena_).substr(token_off_[r], token_len_[r]); }
    void parse_model(std::string_view text, const std::string& name);
    void parse_config(std::string_view text, const std::string& name);

    std::string arena_;                                   // every token's bytes, in file order
    std::vector<std::uint32_t> token_off_, token_len_;    // (bpe_size) where rank r's bytes are
    std::vector<std::uint32_t> slots_;                    // (power of two >= 2 bpe_size) ranks or kNoRank
    std::size_t mask_ = 0;
    std::vector<SpecialToken> specials_;                  // (vocab_size - bpe_size) by id - bpe_size
    std::unordered_map<std::string, std::uint32_t> special_ids_;
    std::string bos_token_, eos_token_;
};

// ---------------------------------------------------------------------------------------------------
// 14.6 BPE merging
// ---------------------------------------------------------------------------------------------------
// The rule (tiktoken's _byte_pair_merge): start from single bytes; while some adjacent pair's
// concatenation is a token, merge the pair with the lowest rank, the leftmost on a tie. Worked by hand
// in test 14.6 with a 3-merge vocabulary.
//
// Reference: exactly tiktoken's loop. Every step scans all pairs, so a piece of n bytes costs O(n^2)
// lookups; fine for words, slow for a 25,000-character run. `steps` (optional) receives the token ids
// after each merge (the example prints them).
inline std::vector<std::uint32_t> Tokenizer::bpe_merge_ref(std::string_view piece, std::vector<std::vector<std::uint32_t>>* steps) const {
    std::vector<std::size_t> bounds(piece.size() + 1);  // token k is piece[bounds[k], bounds[k+1])
    for (std::size_t i = 0; i < bounds.size(); ++i) bounds[i] = i;
    auto ids = [&] {
        std::vector<std::uint32_t> out;
        for (std::size_t k = 0; k + 1 < bounds.size(); ++k) out.push_back(rank_of(piece.substr(bounds[k], bounds[k + 1] - bounds[k])));
        return out;
    };
    while (bounds.size() > 2) {
        std::uint32_t best = kNoRank;
        std::size_t at = 0;
        for (std::size_t k = 0; k + 2 < bounds.size(); ++k) {
            const std::uint32_t r = rank_of(piece.substr(bounds[k], bounds[k + 2] - bounds[k]));
            if (r < best) best = r, at = k;  // strict <: the leftmost of equal ranks stays
        }
        if (best == kNoRank) break;
        bounds.erase(bounds.begin() + std::ptrdiff_t(at) + 1);
        if (steps) steps->push_back(ids());
    }
    return ids();
}

// Fast form, bit-identical output: the tokens form a linked list over byte positions and the
// candidate pairs sit in a min-heap ordered by (rank, position), so each merge costs O(log n). A merge
// makes the entries of its two neighbouring pairs stale; stale entries are recognised when popped
// (the part at `left` no longer spans up to `end` in two tokens) and skipped. Same order as the
// reference: the smallest valid (rank, left) is what the reference's scan finds.
inline void Tokenizer::bpe_merge(std::string_view piece, std::vector<std::uint32_t>& out) const {
    const std::uint32_t n = std::uint32_t(piece.size());
    if (n == 1) return out.push_back(rank_of(piece));
    struct Pair {
        std::uint32_t rank, left, end;  // merging the token at `left` with its right neighbour gives [left, end)
        bool operator>(const Pair& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::vector<std::uint32_t> next(n), prev(n);  // (n) linked list over token start positions
    std::vector<Pair> heap;
    for (std::uint32_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;  // prev[0] wraps to 0xFFFFFFFF
    auto consider = [&](std::uint32_t left) {
        if (left >= n || next[left] >= n) return;
        const std::uint32_t end = next[next[left]];
        const std::uint32_t r = rank_of(piece.substr(left, end - left));
        if (r != kNoRank) heap.push_back({r, left, end}), std::push_heap(heap.begin(), heap.end(), std::greater<>());
    };
    for (std::uint32_t i = 0; i + 1 < n; ++i) consider(i);
    std::vector<std::uint8_t> alive(n, 1);
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<>());
        const Pair p = heap.back();
        heap.pop_back();
        if (!alive[p.left] || next[p.left] >= n || next[next[p.left]] != p.end) continue;  // stale
        alive[next[p.left]] = 0;
        next[p.left] = p.end;
        if (p.end < n) prev[p.end] = p.left;
        consider(prev[p.left]);  // the pair ending at the merged token (no-op at the start)
        consider(p.left);        // the pair starting at it
    }
    for (std::uint32_t s = 0; s < n; s = next[s]) out.push_back(rank_of(piece.substr(s, next[s] - s)));
}

// ---------------------------------------------------------------------------------------------------
// 14.7 The long-input pre-split of tokenization_kimi.py
// ---------------------------------------------------------------------------------------------------
// The Python wrapper cuts its input before calling tiktoken (which could fail on huge inputs): into
// chunks of 400,000 code points, and each chunk wherever a run of whitespace or of non-whitespace
// exceeds 25,000 code points (a new piece starts at the 25,001st). "Whitespace" here is Python's
// str.isspace (bidi class WS/B/S or category Zs), which adds U+001C..U+001F to White_Space. Pieces
// are encoded separately, so a cut changes the ids only for inputs with such long runs.
inline bool python_isspace(std::uint32_t c) {
    return (c >= 9 && c <= 13) || (c >= 28 && c <= 32) || c == 133 || c == 160 || c == 5760 || (c >= 8192 && c <= 8202) ||
           c == 8232 || c == 8233 || c == 8239 || c == 8287 || c == 12288;
}

inline std::vector<std::string_view> split_long_input(std::string_view text, std::size_t max_chunk = 400'000, std::size_t max_run = 25'000) {
    std::vector<std::string_view> out;
    std::size_t chunk_cps = 0, run = 0, start = 0;  // code points in this chunk, in the current run
    bool run_is_space = false;
    for (std::size_t i = 0; i < text.size();) {
        const Utf8Char c = utf8_next(text, i);
        if (!c.valid) detail::fail_invalid_utf8("encode", text, i);
        const bool space = python_isspace(c.cp);
        if (chunk_cps == max_chunk) {  // a new chunk: the run bookkeeping restarts as in Python
            out.push_back(text.substr(start, i - start)), start = i, chunk_cps = 0;
        }
        if (chunk_cps == 0) run = 0, run_is_space = space;
        if (space != run_is_space) run = 1, run_is_space = space;
        else if (++run > max_run) out.push_back(text.substr(start, i - start)), start = i, run = 1;
        ++chunk_cps;
        i += c.len;
    }
    if (start < text.size()) out.push_back(text.substr(start));
    return out;
}

// ---------------------------------------------------------------------------------------------------
// 14.8 Encode and decode
// ---------------------------------------------------------------------------------------------------
// tiktoken's encode_ordinary: pre-tokens, each emitted whole if it is a token, else merged.
inline std::vector<std::uint32_t> Tokenizer::encode_ordinary(std::string_view text) const {
    std::vector<std::uint32_t> ids;
    for_each_pretoken(text, [&](std::string_view piece) {
        const std::uint32_t whole = rank_of(piece);
        if (whole != kNoRank) ids.push_back(whole);
        else bpe_merge(piece, ids);
    });
    return ids;
}

// K3's encode (tokenization_kimi.py, specials not recognised): validate, pre-split, encode the pieces.
inline std::vector<std::uint32_t> Tokenizer::encode(std::string_view text) const {
    std::vector<std::uint32_t> ids;
    for (std::string_view piece : split_long_input(text)) {  // throws on invalid UTF-8
        const std::vector<std::uint32_t> part = encode_ordinary(piece);
        ids.insert(ids.end(), part.begin(), part.end());
    }
    return ids;
}

// Token bytes back to back (specials as their content text, unless skipped: skip_special drops the
// ids whose config flag says special, and keeps <|open|> <|close|> <|sep|>, as HF's
// skip_special_tokens does). The result may end inside a character: use decode_text or Utf8Stream.
inline std::string Tokenizer::decode(std::span<const std::uint32_t> ids, bool skip_special) const {
    std::string out;
    for (std::uint32_t id : ids)
        if (!(skip_special && is_special(id) && special(id).special)) out += token_bytes(id);
    return out;
}

}  // namespace kimik3

// The appendix (it includes this lesson first): Tokenizer::load, from_strings and the two parsers.
#include "14a_tokenizer_files.hpp"
