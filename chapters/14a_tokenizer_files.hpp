// kimik3 chapter 14, APPENDIX: tokenizer files -- tiktoken.model and tokenizer_config.json, read strictly.
// ====================================================================================================
//
// APPENDIX to chapter 14 (14_tokenizer.hpp, section 14.5 in its index). The lesson cuts text into
// pre-tokens and merges them with a vocabulary; this fills that vocabulary from K3's two files:
// `tiktoken.model` (one "base64(token bytes) rank" per line) and `tokenizer_config.json` (the special
// tokens and which are BOS and EOS). 14_tokenizer.hpp includes this file at its end.
//
// CONTRACT (the lesson's item 6) The loader refuses, naming file and line: bad base64 (strict:
//   canonical padding, unused bits zero), a bad rank, a duplicate rank, duplicate token bytes, a missing
//   rank (gap), an empty token, a missing single byte; and a special id that collides with a rank or a
//   duplicate special name. Both files are regular files of capped size (appendix 01a).
//
// USES     chapter 14 (Tokenizer), appendix 01a (read_file_capped, read through parse_json), nlohmann/json
// TEST     make test-14   (tests "14.5 ...")
// ====================================================================================================
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "14_tokenizer.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 14.5 Loading tiktoken.model and tokenizer_config.json
// ---------------------------------------------------------------------------------------------------
namespace detail {
// Strict base64 (RFC 4648, standard alphabet, '=' padding to a multiple of 4, unused bits zero):
// returns false on anything else, so a corrupted line is reported rather than half-decoded.
inline bool base64_decode(std::string_view in, std::string& out) {
    static const std::array<std::int8_t, 256> value = [] {
        std::array<std::int8_t, 256> v{};
        v.fill(-1);
        const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        for (int i = 0; i < 64; ++i) v[std::uint8_t(abc[i])] = std::int8_t(i);
        return v;
    }();
    if (in.size() % 4 != 0) return false;
    if (in.empty()) return true;  // empty decodes to empty (the loader refuses empty tokens)
    const std::size_t pad = in.back() != '=' ? 0 : in[in.size() - 2] == '=' ? 2 : 1;
    for (std::size_t i = 0; i < in.size(); i += 4) {
        std::uint32_t quad = 0;
        const std::size_t real = i + 4 == in.size() ? 4 - pad : 4;  // characters carrying bits
        for (std::size_t k = 0; k < 4; ++k) {
            const int v = k < real ? value[std::uint8_t(in[i + k])] : (in[i + k] == '=' ? 0 : -1);
            if (v < 0) return false;
            quad = quad << 6 | std::uint32_t(v);
        }
        if ((real == 3 && (quad & 0xFF)) || (real == 2 && (quad & 0xFFFF))) return false;  // non-zero unused bits
        out += char(quad >> 16);
        if (real > 2) out += char(quad >> 8 & 0xFF);
        if (real > 3) out += char(quad & 0xFF);
    }
    return true;
}


// A whole text file (a regular file, at most 1 GiB: chapter 01's read_file_capped).
inline std::string read_text_file(const std::string& path) { return read_file_capped(path, 1u << 30, "text file"); }

inline std::string hex_bytes(std::string_view s) {  // at most 16 bytes, as lowercase hex
    std::string out;
    for (std::size_t i = 0; i < s.size() && i < 16; ++i) out += "0123456789abcdef"[std::uint8_t(s[i]) >> 4], out += "0123456789abcdef"[s[i] & 15];
    return s.size() > 16 ? out + "..." : out;
}
}  // namespace detail

// tiktoken.model: non-empty lines "BASE64 RANK" (empty lines are skipped, as tiktoken's loader does).
// The ranks must be exactly 0..N-1 for N lines, in any order.
inline void Tokenizer::parse_model(std::string_view text, const std::string& name) {
    std::size_t n = 0;
    for (std::size_t p = 0; p < text.size();) {
        const std::size_t e = std::min(text.find('\n', p), text.size());
        n += e > p;
        p = e + 1;
    }
    if (n == 0) fail(ErrorKind::format, name + ": no tokens");
    if (n >= kNoRank) fail(ErrorKind::format, name + ": too many tokens");
    token_off_.assign(n, 0), token_len_.assign(n, 0);
    std::vector<std::uint32_t> line_of_rank(n, 0);  // 1-based line that gave each rank; 0 = not yet
    std::size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots_.assign(cap, kNoRank), mask_ = cap - 1;
    arena_.clear(), arena_.reserve(text.size() / 2);
    std::uint32_t line_no = 0;
    for (std::size_t p = 0; p < text.size();) {
        const std::size_t e = std::min(text.find('\n', p), text.size());
        const std::string_view line = text.substr(p, e - p);
        p = e + 1, ++line_no;
        if (line.empty()) continue;
        const std::string where = name + ": line " + std::to_string(line_no) + ": ";
        const std::size_t sp = line.find(' ');
        if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
            fail(ErrorKind::format, where + "expected 'BASE64 RANK' (one space), got '" + std::string(line.substr(0, 60)) + "'");
        const std::string_view b64 = line.substr(0, sp), num = line.substr(sp + 1);
        std::uint64_t rank = 0;
        if (num.empty() || num.size() > 10 || !std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; }))
            fail(ErrorKind::format, where + "rank '" + std::string(num.substr(0, 20)) + "' is not a decimal number");
        for (char c : num) rank = rank * 10 + std::uint64_t(c - '0');
        const std::size_t off = arena_.size();
        if (!detail::base64_decode(b64, arena_))
            fail(ErrorKind::format, where + "bad base64 '" + std::string(b64.substr(0, 40)) + "'");
        if (arena_.size() == off) fail(ErrorKind::format, where + "empty token");
        if (rank >= n)
            fail(ErrorKind::format, where + "rank " + std::to_string(rank) + " is out of range: " + std::to_string(n) +
                                        " tokens need ranks 0.." + std::to_string(n - 1) + ", so one is missing");
        if (line_of_rank[rank])
            fail(ErrorKind::format, where + "rank " + std::to_string(rank) + " was already given on line " + std::to_string(line_of_rank[rank]));
        line_of_rank[rank] = line_no;
        token_off_[rank] = std::uint32_t(off), token_len_[rank] = std::uint32_t(arena_.size() - off);
        const std::string_view bytes = bpe_bytes(std::uint32_t(rank));
        std::size_t slot = fnv1a64(bytes) & mask_;
        for (; slots_[slot] != kNoRank; slot = (slot + 1) & mask_)
            if (bpe_bytes(slots_[slot]) == bytes)
                fail(ErrorKind::format, where + "token bytes " + detail::hex_bytes(bytes) + " were already given on line " +
                                            std::to_string(line_of_rank[slots_[slot]]) + " (rank " + std::to_string(slots_[slot]) + ")");
        slots_[slot] = std::uint32_t(rank);
    }
    for (int b = 0; b < 256; ++b)  // byte-level BPE: every byte must be encodable on its own
        if (rank_of(std::string(1, char(b))) == kNoRank)
            fail(ErrorKind::format, name + ": byte 0x" + detail::hex_bytes(std::string(1, char(b))) + " has no token (all 256 single bytes are required)");
}

// tokenizer_config.json: `added_tokens_decoder` maps "id" -> {"content": name, "special": bool, ...}.
// Special ids start at bpe_size (tokenization_kimi.py numbers them after the ranks) and run to the
// largest id given; ids in that range without an entry are named <|reserved_token_{id}|>.
inline void Tokenizer::parse_config(std::string_view text, const std::string& name) {
    using nlohmann::json;
    const json j = parse_json(text, name);  // chapter 01's bounded reader
    if (!j.is_object() || !j.contains("added_tokens_decoder") || !j["added_tokens_decoder"].is_object())
        fail(ErrorKind::format, name + ": field 'added_tokens_decoder' is missing or not an object");
    std::vector<std::pair<std::uint32_t, SpecialToken>> given;
    for (auto it = j["added_tokens_decoder"].begin(); it != j["added_tokens_decoder"].end(); ++it) {
        const std::string where = name + ": added_tokens_decoder['" + clipped(it.key(), 40) + "']: ";
        const std::string& key = it.key();
        if (key.empty() || key.size() > 9 || !std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }))
            fail(ErrorKind::format, where + "the key is not a token id");
        const std::uint32_t id = std::uint32_t(std::stoul(key));
        const json& v = it.value();
        if (!v.is_object() || !v.contains("content") || !v["content"].is_string())
            fail(ErrorKind::format, where + "'content' is missing or not a string");
        if (id < bpe_size())
            fail(ErrorKind::format, where + "id " + key + " collides with a BPE rank (tiktoken.model has " + std::to_string(bpe_size()) + " tokens)");
        if (id - bpe_size() >= 65536) fail(ErrorKind::format, where + "id " + key + " is more than 65,536 past the BPE ranks");
        given.push_back({id, {v["content"].get<std::string>(), !v.contains("special") || v["special"] == true}});
    }
    std::uint32_t count = 0, lowest = kNoRank;
    for (const auto& g : given) count = std::max(count, g.first + 1 - bpe_size()), lowest = std::min(lowest, g.first);
    // Specials follow the ranks directly (tokenization_kimi.py numbers them from len(ranks)). Ids between
    // the last rank and the first special would be named <|reserved_token_N|> and decode as such: what a
    // tiktoken.model cut short at a line boundary looks like. Holes between specials are reserved ids.
    if (!given.empty() && lowest != bpe_size())
        fail(ErrorKind::format, name + ": the first special token has id " + std::to_string(lowest) + ", but tiktoken.model ends at rank " +
                                    std::to_string(bpe_size() - 1) + ": ids " + std::to_string(bpe_size()) + ".." + std::to_string(lowest - 1) +
                                    " would be neither (is tiktoken.model cut short?)");
    specials_.assign(count, {});
    for (std::uint32_t k = 0; k < count; ++k) specials_[k].content = "<|reserved_token_" + std::to_string(bpe_size() + k) + "|>";
    for (const auto& g : given) specials_[g.first - bpe_size()] = g.second;
    for (std::uint32_t k = 0; k < count; ++k)
        if (!special_ids_.emplace(specials_[k].content, bpe_size() + k).second)
            fail(ErrorKind::format, name + ": special token '" + specials_[k].content + "' is given twice");
    for (const char* field : {"bos_token", "eos_token"}) {  // a string or {"content": ...}
        if (!j.contains(field)) continue;
        const json& v = j[field];
        const json* content = v.is_string() ? &v : v.is_object() && v.contains("content") ? &v["content"] : nullptr;
        if (!content || !content->is_string())
            fail(ErrorKind::format, name + ": '" + field + "' = " + json_excerpt(v) + " is neither a string nor {\"content\": string}");
        const std::string& s = content->get_ref<const std::string&>();
        if (!special_ids_.count(s)) fail(ErrorKind::format, name + ": '" + field + "' = '" + clipped(s, 60) + "' is not a special token");
        (field[0] == 'b' ? bos_token_ : eos_token_) = s;
    }
}

inline Tokenizer Tokenizer::from_strings(std::string_view model_text, const std::string& model_name,
                                         std::string_view config_text, const std::string& config_name) {
    Tokenizer t;
    t.parse_model(model_text, model_name);
    t.parse_config(config_text, config_name);
    return t;
}

inline Tokenizer Tokenizer::load(const std::string& dir) {
    const std::string model = dir + "/tiktoken.model", config = dir + "/tokenizer_config.json";
    const std::string model_text = read_file_capped(model, kMaxTokenizerModelBytes, "tiktoken.model");  // first: errors name it first
    return from_strings(model_text, model, read_file_capped(config, kMaxConfigBytes, "tokenizer_config.json"), config);
}

}  // namespace kimik3
