// Example for chapter 09: the depth-mixing weights of one token across the blocks of the tiny K3.
// The sublayer outputs come from the reference's dump (fixtures/tiny-k3/reference/layers.safetensors),
// so this shows AttnRes alone: what each layer's input is made of.
//   make run-09
#include <cstdio>

#include "../chapters/02_config.hpp"
#include "../chapters/09_attn_res.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main() {
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        SafetensorsFile ref(dir + "/reference/layers.safetensors");
        const std::size_t D = std::size_t(c.hidden_size), t = 4;  // token 4 of the reference sequence
        auto row = [&](const std::string& name) {
            const auto v = to_f32(ref.read(name));
            return std::vector<float>(v.begin() + long(t * D), v.begin() + long(t * D + D));
        };
        auto fold = [&](const Checkpoint::Ref* norm, const Checkpoint::Ref* proj) {
            const Tensor n = ck.read(norm->info->name), p = ck.read(proj->info->name);
            std::vector<float> w(D);
            const std::vector<float> nf = to_f32(n), pf = to_f32(p);
            attn_res_fold(w.data(), AttnResWeights{nf.data(), pf.data()}, D);
            return w;
        };
        std::printf("9.2 token %zu of the tiny K3: block size %d, so banks at layers 0 4 8 12\n", t, c.attn_res_block_size);
        std::printf("  candidates: B0 = embedding, B1.. = finished blocks, P = this block's partial sum\n\n");
        std::printf("  layer  side  weights over [bank..., P]\n");
        ResidualState r;
        const auto x0 = row("layer.0.attn_mix_out");
        r.start(x0.data(), D);
        std::vector<float> x(D), pi(16);
        // partial: whether the last of the n candidates is P (read before any banking of this layer)
        auto show = [&](int l, const char* side, std::size_t n, bool partial, const char* note = "") {
            std::printf("  %5d  %-4s ", l, side);
            for (std::size_t i = 0; i < n; ++i) {
                if (i + 1 == n && partial) std::printf("  P %.3f", double(pi[i]));
                else std::printf(" B%zu %.3f", i, double(pi[i]));
            }
            std::printf("%s\n", note);
        };
        for (int l = 0; l < c.num_hidden_layers; ++l) {
            const LayerTensors& lt = m.layers[std::size_t(l)];
            const std::string p = "layer." + std::to_string(l) + ".";
            const std::size_t n = r.candidates().size();
            const bool partial = r.has_partial;
            r.attn_input(x.data(), l, c.attn_res_block_size, fold(lt.attn_res_norm, lt.attn_res_proj).data(), c.rms_norm_eps, pi.data());
            if (l == 0) std::printf("  %5d  attn  (layer 0: the embedding itself, no mix; then banked as B0)\n", l);
            else if (l % c.attn_res_block_size == 0) {
                char note[48];
                std::snprintf(note, sizeof note, "   (P is a finished block: banked as B%zu)", n - 1);
                show(l, "attn", n, partial, note);
            } else show(l, "attn", n, partial);
            r.add(row(p + "attn_out").data());
            r.mix(x.data(), fold(lt.mlp_res_norm, lt.mlp_res_proj).data(), c.rms_norm_eps, pi.data());
            show(l, "ffn", r.candidates().size(), r.has_partial);
            r.add(row(p + "mlp_out").data());
        }
        r.mix(x.data(), fold(m.out_res_norm, m.out_res_proj).data(), c.rms_norm_eps, pi.data());
        show(c.num_hidden_layers, "out", r.candidates().size(), r.has_partial);
        std::printf("\n  (the weights sum to 1 across a row; no candidate is ever simply added)\n");
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
