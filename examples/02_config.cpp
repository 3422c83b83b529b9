// Example for chapter 02: read the tiny K3's config, derive its schedule, bind its tensors, count bytes.
//   make run-02                                     (the bundled tiny K3)
//   build/g++/examples/02_config MODEL_DIR          (any checkpoint in the release layout)
#include <cstdio>

#include "../chapters/02_config.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main(int argc, char** argv) {
    const std::string dir = argc > 1 ? argv[1] : std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
    try {
        std::printf("2.2 config.json: nested text_config, every field read, nothing guessed\n");
        const Config c = load_config(dir);
        std::printf("  hidden %d, layers %d, vocab %d; KDA %dx%d; MLA %d heads, cache %d floats/position\n", c.hidden_size,
                    c.num_hidden_layers, c.vocab_size, c.kda_num_heads, c.kda_head_dim, c.num_attention_heads, c.mla_cache_width());
        std::printf("  one-based kda_layers      ");
        for (int x : c.kda_layers) std::printf(" %d", x);
        std::printf("\n  one-based full_attn_layers");
        for (int x : c.full_attn_layers) std::printf(" %d", x);

        std::printf("\n\n2.4 the schedule (zero-based layers, left to right)\n");
        const std::string d = describe_schedule(c) + "\n";
        for (std::size_t p = 0, q; (q = d.find('\n', p)) != std::string::npos; p = q + 1) std::printf("  %s\n", d.substr(p, q - p).c_str());

        const std::string prefix = "language_model.model.layers.3.";
        std::printf("\n2.5 what layer 3 (MLA + MoE) must contain, from the config alone (names after %s)\n", prefix.c_str());
        for (const Expected& e : expected_layer_tensors(c, 3))
            std::printf("  %-52s %-4s %s\n", e.name.substr(prefix.size()).c_str(), dtype_name(e.dtypes[0]), e.shape.str().c_str());

        std::printf("\n2.6 binding: every tensor found and checked; experts located, not loaded\n");
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        for (int e : {0, 1, 15}) {
            const ExpertLocation& x = m.experts[1][std::size_t(e)];
            std::printf("  layer 1 expert %2d: %s at offset %llu, %llu bytes, %s\n", e,
                        std::filesystem::path(x.file->path()).filename().c_str(), (unsigned long long)x.span_offset,
                        (unsigned long long)x.span_bytes, x.contiguous ? "one contiguous read" : "scattered");
        }
        std::printf("  (expert ids are not in disk order, as in the release)\n");

        std::printf("\n2.7 census\n");
        const Census s = take_census(ck, c, m);
        std::printf("  trunk per layer:");
        for (std::uint64_t b : s.layer_trunk_bytes) std::printf(" %llu", (unsigned long long)b);
        std::printf("\n  routed experts %llu x %llu bytes; embedding %llu; lm_head %llu\n", (unsigned long long)s.expert_count,
                    (unsigned long long)s.expert_bytes, (unsigned long long)s.embed_bytes, (unsigned long long)s.lm_head_bytes);
        std::printf("  one token reads %s if nothing is resident; the state that must stay resident: KDA %s,\n"
                    "  latent MLA cache %s per position (chapter 12 turns this into a memory plan)\n",
                    human_bytes(double(s.per_token_bytes)).c_str(), human_bytes(double(s.kda_state_bytes)).c_str(),
                    human_bytes(double(s.mla_cache_bytes_per_token)).c_str());
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
