// Benchmark for chapter 07: one KDA decode step at K3 size (96 heads x 128 x 128 state), its recurrence
// alone, and the ratio to the memory traffic the step needs (the layer's bf16 weights once, the f32
// state read and written once) over the read bandwidth measured by the caller.
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "../chapters/07_kda.hpp"
#include "../tests/rng.hpp"
#include "timing.hpp"

namespace kimik3 {

inline void bench_kda(std::FILE* out, int reps, double read_bw) {
    const KdaDims d{7168, 96, 128, 4, -5.0f, 1e-5f};
    const std::size_t D = d.hidden, P = d.width(), Dh = d.head_dim, H = d.heads;
    test::Rng rng(9);
    auto mat = [&](std::size_t rows, std::size_t cols, float a) { return rng.bf16s(rows * cols, -a, a); };
    const float a_in = 1.7f / std::sqrt(float(D));
    // the layer's weights at real shapes (887 MB of bf16 + 0.6 MB of f32)
    const auto q = mat(P, D, a_in), k = mat(P, D, a_in), v = mat(P, D, a_in), g = mat(P, D, a_in), o = mat(D, P, 1.7f / std::sqrt(float(P)));
    const auto fa = mat(Dh, D, a_in), fb = mat(P, Dh, 1.7f / std::sqrt(float(Dh))), b = mat(H, D, a_in);
    const auto qc = rng.floats(P * 4, -0.3f, 0.3f), kc = rng.floats(P * 4, -0.3f, 0.3f), vc = rng.floats(P * 4, -0.3f, 0.3f);
    std::vector<float> A_log(Dh, 0.0f), dt = rng.floats(P, -0.05f, 0.05f), onorm(Dh, 1.0f);
    for (std::size_t h = 0; h < H; ++h) A_log[h] = rng.uniform(-1.0f, 1.0f);
    auto ref = [](const std::vector<bf16>& m, std::size_t r, std::size_t c) { return MatrixRef{m.data(), nullptr, r, c}; };
    const KdaWeights w{ref(q, P, D), ref(k, P, D), ref(v, P, D), ref(fa, Dh, D), ref(fb, P, Dh), ref(b, H, D), ref(g, P, D), ref(o, D, P),
                       qc.data(), kc.data(), vc.data(), A_log.data(), dt.data(), onorm.data()};
    const double weight_bytes = double(4 * P * D + D * P + Dh * D + P * Dh + H * D) * 2;
    KdaState st(d);
    const auto u = rng.floats(D, -1.0f, 1.0f);
    std::vector<float> y(D);
    auto median = [&](const std::function<void()>& f) { return bench::median_seconds(reps, f); };
    std::fprintf(out, "  %-44s %2s %11s %12s\n", "KDA at K3 size (96 heads x 128 x 128)", "th", "median", "vs traffic");
    for (int threads : {1, 2}) {
        set_threads(threads);
        const double step = median([&] { kda_forward(y.data(), u.data(), 1, w, d, st); });
        const double traffic = (weight_bytes + 2.0 * double(st.S.size()) * 4) / read_bw;
        std::fprintf(out, "  %-44s %2d %8.2f ms %9.2fx floor\n", "one decode step (projections + recurrence)", threads, step * 1e3, step / traffic);
        std::vector<float> qh(P, 0.01f), kh(P, 0.01f), vv(P, 0.1f), alpha(P, 0.9f), beta(H, 0.5f), oo(P);
        const double rec = median([&] { kda_recurrence(oo.data(), st.S.data(), qh.data(), kh.data(), vv.data(), alpha.data(), beta.data(), H, Dh); });
        std::fprintf(out, "  %-44s %2d %8.2f ms %9.2fx its state traffic (x69 layers: %.0f ms)\n", "  the recurrence alone", threads,
                     rec * 1e3, rec / (2.0 * double(st.S.size()) * 4 / read_bw), rec * 69 * 1e3);
    }
}

}  // namespace kimik3
