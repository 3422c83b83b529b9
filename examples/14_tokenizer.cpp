// Chapter 14 example: a sentence cut into pre-tokens, each merged step by step, on the tiny K3
// vocabulary (480 BPE tokens + 32 specials). Usage: 14_tokenizer [TOKENIZER_DIR [TEXT]]
#include <cstdio>
#include <string>

#include "../chapters/14_tokenizer.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

// Bytes made printable: whole characters as they are, \n \t \r escaped, stray bytes as \xNN.
static std::string show(std::string_view bytes) {
    std::string out;
    for (std::size_t i = 0; i < bytes.size();) {
        const Utf8Char c = utf8_next(bytes, i);
        char buf[8];
        if (c.valid && c.cp == '\n') out += "\\n";
        else if (c.valid && c.cp == '\t') out += "\\t";
        else if (c.valid && c.cp == '\r') out += "\\r";
        else if (c.valid && c.cp >= 0x20) out.append(bytes.substr(i, c.len));
        else {
            for (std::uint32_t k = 0; k < c.len; ++k) std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(std::uint8_t(bytes[i + k]))), out += buf;
        }
        i += c.len;
    }
    return out;
}

// Tokens separated by '|', spaces shown as '·' so a leading-space token is visible.
static std::string tokens(const Tokenizer& tok, const std::vector<std::uint32_t>& ids) {
    std::string out;
    for (std::size_t k = 0; k < ids.size(); ++k) {
        out += k ? "|" : "";
        for (char c : show(tok.token_bytes(ids[k]))) out += c == ' ' ? std::string("·") : std::string(1, c);
    }
    return out;
}

int main(int argc, char** argv) {
    const std::string dir = argc > 1 ? argv[1] : KIMIK3_SOURCE_DIR "/fixtures/tiny-k3";
    const std::string text = argc > 2 ? argv[2] : "The tokenizer doesn't split 中文; it merges 12345 bytes!\n";
    const Tokenizer tok = Tokenizer::load(dir);

    std::printf("14.2 streaming the bytes of \"中\" (E4 B8 AD) one at a time\n");
    Utf8Stream stream;
    for (char b : std::string("中")) {
        const std::string out = stream.push(std::string_view(&b, 1));
        std::printf("      push %02x -> prints \"%s\" (holding %zu bytes)\n", unsigned(std::uint8_t(b)), out.c_str(), stream.held());
    }

    std::printf("\n14.3 pre-tokens of \"%s\"\n   ", show(text).c_str());
    const std::vector<std::string_view> pieces = pretokenize(text);
    for (std::string_view p : pieces) std::printf(" [%s]", show(p).c_str());
    std::printf("\n");

    std::printf("\n14.5 vocabulary: %u BPE tokens (ranks 0..%u) + %u specials = %u ids; [EOS] = %u\n", tok.bpe_size(),
                tok.bpe_size() - 1, tok.vocab_size() - tok.bpe_size(), tok.vocab_size(), tok.special_id("[EOS]"));

    std::printf("\n14.6 merging each pre-token: the adjacent pair with the lowest rank first\n");
    std::vector<std::uint32_t> ids;
    for (std::string_view p : pieces) {
        std::printf("  [%s]\n", show(p).c_str());
        if (const std::uint32_t whole = tok.rank_of(p); whole != kNoRank) {
            std::printf("      the whole pre-token is token %u\n", whole);
            ids.push_back(whole);
            continue;
        }
        std::vector<std::vector<std::uint32_t>> steps;
        const std::vector<std::uint32_t> merged = tok.bpe_merge_ref(p, &steps);
        std::vector<std::uint32_t> bytes;
        for (char b : p) bytes.push_back(std::uint8_t(b));
        std::printf("      bytes   %s\n", tokens(tok, bytes).c_str());
        for (const auto& s : steps) std::printf("      merge   %s\n", tokens(tok, s).c_str());
        if (steps.empty()) std::printf("      (no adjacent pair is a token: the bytes stay)\n");
        ids.insert(ids.end(), merged.begin(), merged.end());
    }

    std::printf("\n14.8 ids (%zu for %zu bytes):", ids.size(), text.size());
    for (std::uint32_t id : ids) std::printf(" %u", id);
    std::printf("\n     encode() gives the same ids: %s; decode gives the text back: %s\n",
                tok.encode(text) == ids ? "yes" : "NO", tok.decode(ids) == text ? "yes" : "NO");

    return 0;
}
