// Chapter 08's benchmark: one Gated MLA decode step at K3 size. Called from bench/bench.cpp:
//   #include "bench_mla.hpp"   ...   kimik3::bench_mla(stdout, g_reps, lim.bw1);
// The weights are random bf16 of the real shapes (96 heads; 232.2 M parameters = 464 MB, so every step
// streams them from memory, as a real decode step does); the cache is filled with random latents to
// 1,024 and 8,192 positions. A step is timed as the median of `reps` runs after one warm-up, and set
// against its floor: the bytes it must read (all weights once, plus the cache, which the blocked
// attention of 8.4 reads once per thread) divided by the read bandwidth the caller measured.
// Nothing is asserted: this measures.
#pragma once

#include <algorithm>
#include <cstdio>
#include <vector>

#include "../chapters/08_mla.hpp"
#include "../tests/rng.hpp"
#include "timing.hpp"

namespace kimik3 {

inline void bench_mla(std::FILE* out, int reps, double read_bw_bytes_per_s) {
    const MlaDims d{7168, 96, 1536, 512, 128, 64, 128};  // D, H, Q, R, N, X, Dv of docs/kimi-k3.md 3.5
    const std::size_t D = d.hidden, H = d.heads, C = d.cache_width();
    test::Rng rng(8);
    auto mat = [&](std::size_t rows, std::size_t cols) {  // unit gain: uniform in +-sqrt(3 / cols)
        const float a = std::sqrt(3.0f / float(cols));
        return rng.bf16s(rows * cols, -a, a);
    };
    const auto q_a = mat(d.q_lora, D), q_b = mat(H * d.qk(), d.q_lora), kv_a = mat(C, D), kv_b = mat(H * (d.nope + d.v), d.kv_lora),
               g = mat(H * d.v, D), o = mat(D, H * d.v);
    const auto q_norm = rng.floats(d.q_lora, 0.5f, 1.5f), kv_norm = rng.floats(d.kv_lora, 0.5f, 1.5f);
    auto ref = [](const std::vector<bf16>& w, std::size_t rows) { return MatrixRef{w.data(), nullptr, rows, w.size() / rows}; };
    const MlaWeights w{ref(q_a, d.q_lora), q_norm.data(), ref(q_b, H * d.qk()), ref(kv_a, C), kv_norm.data(),
                       ref(kv_b, H * (d.nope + d.v)), ref(g, H * d.v), ref(o, D)};
    double weight_bytes = 0;
    for (const auto* m : {&q_a, &q_b, &kv_a, &kv_b, &g, &o}) weight_bytes += double(m->size() * sizeof(bf16));
    weight_bytes += double((q_norm.size() + kv_norm.size()) * sizeof(float));
    const auto u = rng.floats(D);
    std::vector<float> y(D);

    std::fprintf(out, "\n== 8 Gated MLA: one decode step at K3 size (weights %.1f MB, random; median of %d)\n", weight_bytes / 1e6, reps);
    std::fprintf(out, "  %-10s %-6s %2s  %10s  %10s  %10s  %s\n", "positions", "path", "th", "median", "bytes", "floor", "median / floor");
    const int threads_before = max_threads();
    for (std::size_t positions : {std::size_t(1024), std::size_t(8192)}) {
        MlaCache cache(positions + 1, C, 3);
        for (std::size_t s = 0; s < positions; ++s) {  // latents of RMSNorm-like size; k_x raw
            float* pos = cache.append();
            for (std::size_t j = 0; j < C; ++j) pos[j] = rng.uniform(-1.7f, 1.7f);
        }
        const double bytes = weight_bytes + double(positions * C * sizeof(float));
        const double floor = bytes / read_bw_bytes_per_s;
        struct Path {
            const char* name;
            const MlaKernels* k;
            int threads, reps;
        };
        for (const Path& p : {Path{"simd", &kMlaSimd, 1, reps}, Path{"simd", &kMlaSimd, 2, reps}, Path{"ref", &kMlaRef, 1, std::min(reps, 3)}}) {
            if (p.threads > threads_before) continue;
            set_threads(p.threads);
            const double sec = bench::median_seconds(p.reps, [&] {
                cache.truncate(positions);  // the step appends one position: undo it, so every run is the same step
                mla_forward_with(*p.k, y.data(), u.data(), 1, w, d, cache);
            });
            std::fprintf(out, "  %-10zu %-6s %2d  %7.2f ms  %7.1f MB  %7.2f ms  %6.2f\n", positions, p.name, p.threads, sec * 1e3, bytes / 1e6,
                         floor * 1e3, sec / floor);
            std::fflush(out);
        }
    }
    set_threads(threads_before);
    std::fprintf(out, "  floor = bytes / %.2f GB/s (the read bandwidth passed in); a K3 token runs 24 such layers\n", read_bw_bytes_per_s / 1e9);
}

}  // namespace kimik3
