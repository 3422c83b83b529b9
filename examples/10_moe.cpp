// Example for chapter 10: route five tokens of the tiny K3 through MoE layer 1, showing what the bias does.
//   make run-10
#include <cstdio>

#include "../chapters/10_moe.hpp"

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
        const int layer = 1;
        const LayerTensors& lt = m.layers[layer];
        auto load = [&](const Checkpoint::Ref* r) { return ck.read(r->info->name); };
        const Tensor router = load(lt.router), bias = load(lt.router_bias), down = load(lt.latent_down), norm = load(lt.latent_norm),
                     up = load(lt.latent_up), sg = load(lt.shared_gate), su = load(lt.shared_up), sd = load(lt.shared_down);
        auto mat = [](const Tensor& t) {
            return MatrixRef{t.bytes.as<bf16>(), nullptr, std::size_t(t.info.shape[0]), std::size_t(t.info.shape[1])};
        };
        const std::vector<float> norm_f32 = to_f32(norm);
        const MoeWeights w{mat(router), bias.bytes.as<float>(), mat(down), norm_f32.data(), mat(up),
                           DenseFfnWeights{mat(sg), mat(su), mat(sd)}};
        const std::size_t T = 5, D = std::size_t(c.hidden_size), E = std::size_t(c.num_experts), K = std::size_t(c.num_experts_per_token);
        // Five inputs: embedding rows of tokens 3, 30, 300, 31, 301, RMS-normalised (as the layer's input is).
        const Tensor embed = load(m.embed);
        std::vector<float> x(T * D), ones(D, 1.0f), y(T * D);
        const int ids[T] = {3, 30, 300, 31, 301};
        for (std::size_t t = 0; t < T; ++t) {
            for (std::size_t j = 0; j < D; ++j) x[t * D + j] = bf16_to_f32(embed.bytes.as<bf16>()[std::size_t(ids[t]) * D + j]);
            rmsnorm(&x[t * D], &x[t * D], ones.data(), D, c.rms_norm_eps);
        }
        ResidentExperts experts(m);
        MoeRecord rec;
        moe_forward(y.data(), x.data(), T, w, MoeDims::from(c, layer), experts, &rec);

        std::printf("10.1 routing %zu tokens through layer %d: %zu experts, top %zu\n", T, layer, E, K);
        const float* b = bias.bytes.as<float>();
        for (std::size_t t = 0; t < T; ++t) {
            const float* s = &rec.routing.scores[t * E];
            // what the scores alone would pick (same tie rule), to show what the bias changed
            std::vector<int> plain(E);
            std::iota(plain.begin(), plain.end(), 0);
            std::partial_sort(plain.begin(), plain.begin() + long(K), plain.end(),
                              [&](int p, int q) { return s[p] > s[q] || (s[p] == s[q] && p < q); });
            std::printf("  token %zu (id %3d)\n    chosen (slot order):", t, ids[t]);
            for (std::size_t k = 0; k < K; ++k) std::printf(" %2d", rec.routing.ids[t * K + k]);
            std::printf("   scores alone would pick:");
            for (std::size_t k = 0; k < K; ++k) std::printf(" %2d", plain[k]);
            std::printf("\n    score + bias, weight:");
            for (std::size_t k = 0; k < K; ++k) {
                const int e = rec.routing.ids[t * K + k];
                std::printf("  e%-2d %.3f%+.3f -> %.3f", e, double(s[e]), double(b[e]), double(rec.routing.weights[t * K + k]));
            }
            std::printf("\n");
        }
        std::printf("\n10.3 output of token 0: y[0..5] =");
        for (int j = 0; j < 6; ++j) std::printf(" %9.5f", double(y[std::size_t(j)]));
        std::printf("\n  routed part %.5f + shared part %.5f for y[0]\n", double(rec.y_routed[0]), double(rec.y_shared[0]));
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
