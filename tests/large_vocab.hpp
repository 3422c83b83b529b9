// The synthetic K3-sized vocabulary (163,584 BPE tokens) for chapter 14's tests and benchmark.
//
// The real tiktoken.model is not available offline (docs/kimi-k3.md section 4) and this one is 2.1 MB as text, so
// it is not committed: it is rebuilt from the committed seed by the rule below, written twice -- here
// and in tools/tiktoken_oracle.mjs, which computed the expected ids with tiktoken. The two agree if the
// text's FNV-1a 64 hash equals "vocab_fnv1a64" in fixtures/tokenizer/large_expected.json (test 14.8).
//
// The rule, rank by rank; a candidate whose bytes are already a token is skipped:
//   1. fixtures/tokenizer/large_seed.tiktoken in rank order (the 256 bytes, then 518 merges learned
//      from tools/tiny_corpus.txt by tools/train_tiny_bpe.py; its first 480 lines are the tiny K3's);
//   2. every 2-byte string b1 b2, in increasing order of mix64(0x4B33000000000000 | b1 << 8 | b2);
//   3. the UTF-8 of every code point of U+3000..U+30FF, U+4E00..U+9FFF, U+AC00..U+D7A3,
//      U+1F300..U+1F6FF, U+1F900..U+1F9FF, in code point order;
//   4. until there are 163,584 tokens: r = the next output of splitmix64 seeded with 0x4B33; with n the
//      token count after step 3, the candidate is token[r mod n] + token[(r >> 32) mod n], skipped when
//      longer than 32 bytes.
// So the vocabulary has realistic merges (step 1), makes every byte pair mergeable in a scrambled
// order that stresses the lowest-rank-first rule (2), whole CJK characters and emoji (3), and ids up to
// 163,583 (4: mostly unreachable filler, as much of a real vocabulary is for any given text).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../chapters/14_tokenizer.hpp"

namespace kimik3::test {

inline constexpr std::uint32_t kLargeVocabSize = 163'584;

// splitmix64's finaliser (a bijection on 64-bit integers).
inline std::uint64_t mix64(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline void append_utf8(std::string& out, std::uint32_t cp) {  // a code point's 1-4 UTF-8 bytes
    if (cp < 0x80) out += char(cp);
    else if (cp < 0x800) out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
    else if (cp < 0x10000) out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
    else out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
}

// The vocabulary as tiktoken.model text ("base64 rank\n" per token), from the seed file's text.
inline std::string large_vocab_text(const std::string& seed_text) {
    std::vector<std::string> tokens;
    std::unordered_set<std::string> seen;
    tokens.reserve(kLargeVocabSize), seen.reserve(2 * kLargeVocabSize);
    auto add = [&](std::string t) {
        if (tokens.size() < kLargeVocabSize && seen.insert(t).second) tokens.push_back(std::move(t));
    };
    for (std::size_t p = 0; p < seed_text.size();) {  // 1
        const std::size_t e = std::min(seed_text.find('\n', p), seed_text.size());
        std::string bytes;
        if (e > p && detail::base64_decode(std::string_view(seed_text).substr(p, seed_text.find(' ', p) - p), bytes)) add(bytes);
        p = e + 1;
    }
    std::vector<std::pair<std::uint64_t, std::uint32_t>> pairs;  // 2
    for (std::uint32_t v = 0; v < 65536; ++v) pairs.push_back({mix64(0x4B33000000000000ull | v), v});
    std::sort(pairs.begin(), pairs.end());
    for (const auto& [key, v] : pairs) add(std::string{char(v >> 8), char(v & 255)});
    for (auto [lo, hi] : {std::pair{0x3000u, 0x30FFu}, {0x4E00u, 0x9FFFu}, {0xAC00u, 0xD7A3u}, {0x1F300u, 0x1F6FFu}, {0x1F900u, 0x1F9FFu}})
        for (std::uint32_t c = lo; c <= hi; ++c) {  // 3
            std::string s;
            append_utf8(s, c);
            add(s);
        }
    const std::uint64_t n = tokens.size();
    std::uint64_t state = 0x4B33;
    while (tokens.size() < kLargeVocabSize) {  // 4
        state += 0x9E3779B97F4A7C15ull;
        const std::uint64_t r = mix64(state);
        std::string cand = tokens[r % n] + tokens[(r >> 32) % n];
        if (cand.size() <= 32) add(std::move(cand));
    }
    static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve(2'200'000);
    for (std::size_t r = 0; r < tokens.size(); ++r) {
        const std::string& t = tokens[r];
        for (std::size_t i = 0; i < t.size(); i += 3) {  // base64 with '=' padding
            const std::uint32_t b = std::uint32_t(std::uint8_t(t[i])) << 16 |
                                    (i + 1 < t.size() ? std::uint32_t(std::uint8_t(t[i + 1])) << 8 : 0) |
                                    (i + 2 < t.size() ? std::uint32_t(std::uint8_t(t[i + 2])) : 0);
            out += abc[b >> 18], out += abc[b >> 12 & 63];
            out += i + 1 < t.size() ? abc[b >> 6 & 63] : '=';
            out += i + 2 < t.size() ? abc[b & 63] : '=';
        }
        out += ' ', out += std::to_string(r), out += '\n';
    }
    return out;
}

}  // namespace kimik3::test
