// Example for chapter 07: a KDA state written by one token, then decaying channel by channel; then a
// real KDA layer of the tiny K3 run as one prefill of 10 tokens and as prefill 7 + decode 3, bit for bit.
//   make run-07
#include <cstdio>
#include <cstring>
#include <deque>

#include "../chapters/07_kda.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main() {
    std::printf("7.4 one head, Dh = 16: token 1 writes value v under key e0 (beta = 1, no decay)\n");
    const std::size_t Dh = 16;
    std::vector<float> S(Dh * Dh, 0.0f), e0(Dh, 0.0f), v(Dh), o(Dh), alpha(Dh, 1.0f), beta = {1.0f};
    e0[0] = 1.0f;
    for (std::size_t j = 0; j < Dh; ++j) v[j] = float(j + 1);
    kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
    std::printf("  read back with q = e0: o[0..4] = %g %g %g %g %g\n", double(o[0]), double(o[1]), double(o[2]), double(o[3]), double(o[4]));
    std::printf("\n7.4 then four tokens with beta = 0: the state only decays, by alpha (7.3's gate) of each KEY channel\n");
    for (std::size_t i = 0; i < Dh; ++i) alpha[i] = 1.0f - 0.05f * float(i);  // key channel i keeps 1 - 0.05 i per token
    alpha[0] = 0.5f;  // key channel 0 (where v was written) halves each token
    beta[0] = 0.0f;
    std::printf("  step  S^T[j=3][key 0]   S^T[j=15][key 0]   o[3] (q = e0)\n");
    for (int t = 1; t <= 4; ++t) {
        kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
        std::printf("  %4d  %16.5f  %17.5f  %13.5f\n", t, double(S[3 * Dh]), double(S[15 * Dh]), double(o[3]));
    }
    std::printf("  (each step multiplies key channel 0 by alpha_0 = 0.5; key channel 3 would keep %.2f, channel 15 %.2f)\n",
                double(alpha[3]), double(alpha[15]));

    std::printf("\n7.5 the tiny K3's layer 1 on the reference's inputs: 10 tokens at once, and 7 then 3\n");
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        std::vector<Tensor> keep;
        auto at = [&](const Checkpoint::Ref* r) {
            keep.push_back(ck.read(r->info->name));
            return keep.back().bytes.data();
        };
        keep.reserve(64);
        std::deque<std::vector<float>> widened;  // vector tensors as f32 (the engine widens them at load)
        auto mat = [&](const Checkpoint::Ref* r) {
            return MatrixRef{at(r), nullptr, std::size_t(r->info->shape[0]), std::size_t(r->info->shape[1])};
        };
        auto vec = [&](const Checkpoint::Ref* r) { return widened.emplace_back(to_f32(ck.read(r->info->name))).data(); };
        const KdaWeights w = kda_weights(m.layers[1], mat, vec);
        const KdaDims d = KdaDims::from(c);
        SafetensorsFile ref(dir + "/reference/layers.safetensors");
        const auto u = to_f32(ref.read("layer.1.attn_norm_out"));
        KdaState st(d);
        std::printf("  state: %zu heads x %zu x %zu floats + conv history = %zu bytes (K3: 6.29 MB of S + 0.44 MB of conv\n"
                    "  history = 6.73 MB per layer)\n", d.heads, d.head_dim, d.head_dim, st.bytes());
        std::vector<float> y(10 * d.hidden), y10(10 * d.hidden);
        kda_forward(y.data(), u.data(), 7, w, d, st);
        kda_forward(y.data() + 7 * d.hidden, u.data() + 7 * d.hidden, 3, w, d, st);
        KdaState st10(d);
        kda_forward(y10.data(), u.data(), 10, w, d, st10);
        auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        std::printf("  10 at once vs 7 + 3: outputs (10 x %zu floats) same bits: %s; state S same bits: %s; conv history: %s\n",
                    d.hidden, same(y, y10) ? "yes" : "NO", same(st.S, st10.S) ? "yes" : "NO",
                    same(st.history, st10.history) ? "yes" : "NO");
        for (std::size_t h = 0; h < d.heads; ++h) {
            double n2 = 0;
            for (std::size_t i = 0; i < d.head_dim * d.head_dim; ++i) n2 += double(st.S[h * d.head_dim * d.head_dim + i]) * st.S[h * d.head_dim * d.head_dim + i];
            std::printf("  head %zu: A_log %+.2f -> |S| after 10 tokens %.5f\n", h, double(w.A_log[h]), std::sqrt(n2));
        }
        std::printf("  y of the last token, [0..5] (either way):");
        for (int j = 0; j < 6; ++j) std::printf(" %9.5f", double(y[9 * d.hidden + std::size_t(j)]));
        std::printf("\n");
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
