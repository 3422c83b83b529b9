// Chapter 14's benchmark: loading a K3-sized vocabulary and encoding text. Called from bench/bench.cpp:
//   #include "bench_tokenizer.hpp"   ...   kimik3::bench_tokenizer(stdout);
// The vocabulary is the synthetic 163,584-token one of tests/large_vocab.hpp (the real tiktoken.model
// is not available offline), with K3's 256 specials; the text is every string of the tokenizer corpus
// (prose, code, CJK, emoji, whitespace runs, the Unicode sweep), twice. Medians of 5 timed runs after
// one warm-up. Nothing is asserted: this measures.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../chapters/14_tokenizer.hpp"
#include "../tests/large_vocab.hpp"
#include "timing.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

namespace kimik3 {

inline void bench_tokenizer(std::FILE* out) {
    const std::string root = KIMIK3_SOURCE_DIR;
    const std::string seed = detail::read_text_file(root + "/fixtures/tokenizer/large_seed.tiktoken");
    const std::string config = detail::read_text_file(root + "/fixtures/tokenizer/k3_tokenizer_config.json");
    std::string text;
    for (int rep = 0; rep < 2; ++rep)
        for (const auto& c : nlohmann::json::parse(detail::read_text_file(root + "/fixtures/tokenizer/corpus.json")))
            text += c["text"].get<std::string>() + "\n";

    std::string vocab;
    const double t_build = bench::median_seconds(5, [&] { vocab = test::large_vocab_text(seed); });
    const double t_load = bench::median_seconds(5, [&] { (void)Tokenizer::from_strings(vocab, "large", config, "k3_tokenizer_config.json"); });
    const Tokenizer tok = Tokenizer::from_strings(vocab, "large", config, "k3_tokenizer_config.json");
    std::size_t n_pieces = 0;
    std::vector<std::uint32_t> ids;
    std::string back;
    const double t_pre = bench::median_seconds(5, [&] { n_pieces = 0, for_each_pretoken(text, [&](std::string_view) { ++n_pieces; }); });
    const double t_enc = bench::median_seconds(5, [&] { ids = tok.encode(text); });
    const double t_dec = bench::median_seconds(5, [&] { back = tok.decode(ids); });

    const double mb = double(text.size()) / 1e6;
    std::fprintf(out, "\n== 14 tokenizer: synthetic K3-sized vocabulary (%u BPE tokens + %u specials), median of 5\n",
                 tok.bpe_size(), tok.vocab_size() - tok.bpe_size());
    std::fprintf(out, "  %-44s %10s %12s %12s\n", "step", "seconds", "tokens/s", "MB/s");
    std::fprintf(out, "  %-44s %10.4f %12s %12.1f\n", "build the vocabulary text (2.1 MB, tests/)", t_build, "-", double(vocab.size()) / 1e6 / t_build);
    std::fprintf(out, "  %-44s %10.4f %12.0f %12.1f\n", "load: parse + hash tiktoken.model", t_load, tok.bpe_size() / t_load, double(vocab.size()) / 1e6 / t_load);
    std::fprintf(out, "  %-44s %10.4f %12s %12.1f\n", ("pre-tokenize " + std::to_string(text.size() / 1000) + " KB (" + std::to_string(n_pieces) + " pieces)").c_str(), t_pre, "-", mb / t_pre);
    std::fprintf(out, "  %-44s %10.4f %12.0f %12.1f\n", ("encode -> " + std::to_string(ids.size()) + " ids").c_str(), t_enc, double(ids.size()) / t_enc, mb / t_enc);
    std::fprintf(out, "  %-44s %10.4f %12.0f %12.1f\n", "decode", t_dec, double(ids.size()) / t_dec, double(back.size()) / 1e6 / t_dec);
    if (back != text) std::fprintf(out, "  WARNING: decode(encode(text)) != text\n");
}

}  // namespace kimik3
