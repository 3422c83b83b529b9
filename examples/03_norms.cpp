// Example for chapter 03: the three norms of K3 on small vectors, step by step.
//   make run-03
#include <cstdio>
#include <vector>

#include "../chapters/03_norms.hpp"

using namespace kimik3;

static void show(const char* label, const std::vector<float>& v, std::size_t n = 6) {
    std::printf("  %-26s", label);
    for (std::size_t i = 0; i < n && i < v.size(); ++i) std::printf(" %9.5f", double(v[i]));
    std::printf("%s\n", v.size() > n ? "  ..." : "");
}

int main() {
    // x: 16 values 1, 2, ..., 16; gamma: alternating 1 and 2.
    std::vector<float> x(16), gamma(16), y(16), y2(16);
    for (int i = 0; i < 16; ++i) x[std::size_t(i)] = float(i + 1), gamma[std::size_t(i)] = (i % 2) ? 2.0f : 1.0f;

    std::printf("3.1 RMSNorm  y = gamma * x / sqrt(mean(x^2) + eps), eps = 1e-5\n");
    const float ss = sum_squares(x.data(), 16);
    std::printf("  sum of squares (16 lanes + hsum16) = %.1f, mean = %.4f, 1/rms = %.7f\n", double(ss), double(ss / 16),
                double(rms_inverse(ss, 16, 1e-5f)));
    show("x", x);
    show("gamma", gamma);
    rmsnorm_ref(y.data(), x.data(), gamma.data(), 16, 1e-5f);
    show("rmsnorm_ref(x)", y);
    rmsnorm_simd(y2.data(), x.data(), gamma.data(), 16, 1e-5f);
    std::printf("  rmsnorm_simd gives the same bits: %s\n", y == y2 ? "yes" : "NO");

    std::printf("\n3.2 the KDA L2 norm  y = scale * x / sqrt(sum(x^2) + 1e-6)   (sum, not mean)\n");
    l2norm(y.data(), x.data(), 16, 1.0f);
    show("key:   scale 1", y);
    l2norm(y.data(), x.data(), 16, 1.0f / std::sqrt(16.0f));
    show("query: scale 16^-1/2", y);
    std::vector<float> zero(16, 0.0f);
    l2norm(y.data(), zero.data(), 16, 1.0f);
    show("an all-zero head", y);
    std::printf("  (the 1e-6 inside the root keeps a zero head at zero instead of 0/0 = NaN)\n");

    std::printf("\n3.3 the gated per-head norm (KDA output): 2 heads of 16, one weight for both heads\n");
    std::vector<float> o(32), g(32), w(16, 1.0f), out(32);
    for (int i = 0; i < 16; ++i) o[std::size_t(i)] = float(i + 1), o[std::size_t(16 + i)] = 100.0f * float(i + 1);
    for (int i = 0; i < 32; ++i) g[std::size_t(i)] = i < 16 ? 0.0f : 8.0f;
    gated_head_norm(out.data(), o.data(), g.data(), w.data(), 2, 16, 1e-5f);
    show("head 0 (gate 0 -> x0.5)", std::vector<float>(out.begin(), out.begin() + 16));
    show("head 1 (x100, gate 8)", std::vector<float>(out.begin() + 16, out.end()));
    std::printf("  head 1 is head 0 times 100 before the norm: the norm removes the scale, the gate\n"
                "  sigmoid(8) = %.6f nearly opens it.\n", double(sigmoid(8.0f)));
    return 0;
}
