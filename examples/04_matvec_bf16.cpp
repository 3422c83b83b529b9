// Example for chapter 04: a bf16 matrix times an f32 vector, and how the SIMD path holds its lanes.
//   make run-04
#include <cstdio>
#include <vector>

#include "../chapters/04_matvec_bf16.hpp"

using namespace kimik3;

// A plain loop that adds the products in the given order (for comparison only; not the contract).
static float dot_in_order(const bf16* w, const float* x, std::size_t n, bool backwards) {
    float acc = 0.0f;
    for (std::size_t k = 0; k < n; ++k) {
        const std::size_t c = backwards ? n - 1 - k : k;
        acc = acc + bf16_to_f32(w[c]) * x[c];
    }
    return acc;
}

int main() {
    std::printf("4.1 y = W x, W bf16 [3, 64] row-major, x f32 [64]: large terms that cancel and small ones,\n"
                "    so the order of the additions decides the last bits\n");
    const std::size_t rows = 3, cols = 64;
    std::vector<bf16> w(rows * cols);
    std::vector<float> x(cols);
    // every 4th x is about 10^4, the rest about 10^-3; the weights give the large terms alternating signs
    for (std::size_t c = 0; c < cols; ++c) x[c] = c % 4 == 0 ? 10000.0f + float(c) : 0.001f * float(c + 1) / 11.0f;
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < cols; ++c)
            w[r * cols + c] = f32_to_bf16(c % 4 == 0 ? ((c / 4) % 2 ? -1.0f : 1.0f) : float(r + 1) * ((c % 3) == 0 ? 1.0f : -0.5f));
    std::printf("  x starts        ");
    for (std::size_t c = 0; c < 5; ++c) std::printf(" %g", double(x[c]));
    std::printf(" ...\n  row 0 starts   ");
    for (std::size_t c = 0; c < 5; ++c) std::printf(" %04x=%+.2f", w[c], double(bf16_to_f32(w[c])));
    std::printf(" ...\n");
    std::vector<float> y_ref(rows), y_simd(rows);
    matvec_bf16_ref(y_ref.data(), x.data(), w.data(), rows, cols);
    matvec_bf16_simd(y_simd.data(), x.data(), w.data(), rows, cols);
    auto bits = [](float v) { return std::bit_cast<std::uint32_t>(v); };
    std::printf("        16 lanes + hsum16 (reference | SIMD)      plain loop, left to right   right to left\n");
    for (std::size_t r = 0; r < rows; ++r) {
        const float fwd = dot_in_order(&w[r * cols], x.data(), cols, false), bwd = dot_in_order(&w[r * cols], x.data(), cols, true);
        std::printf("  y[%zu] %+.7e %08x | %08x %s   %+.7e %08x  %+.7e %08x\n", r, double(y_ref[r]), bits(y_ref[r]),
                    bits(y_simd[r]), bits(y_ref[r]) == bits(y_simd[r]) ? "same" : "DIFF", double(fwd), bits(fwd), double(bwd), bits(bwd));
    }
    std::printf("  (the three orders disagree in the last bits; the reference and SIMD paths share one order)\n");

    std::printf("\n4.2 one 32-bit load = two bf16: u << 16 is the even weight, u & 0xFFFF0000 the odd one\n");
    const std::uint32_t u = std::uint32_t(w[0]) | std::uint32_t(w[1]) << 16;
    std::printf("  u = %08x -> even %08x = %+.2f, odd %08x = %+.2f\n", u, u << 16, double(std::bit_cast<float>(u << 16)),
                u & 0xFFFF0000u, double(std::bit_cast<float>(u & 0xFFFF0000u)));
    std::printf("  with 8-wide registers the 16 lanes sit as: even register = lanes");
    for (int j = 0; j < 8; ++j) std::printf(" %d", 2 * j);
    std::printf(", odd register = lanes");
    for (int j = 0; j < 8; ++j) std::printf(" %d", 2 * j + 1);
    std::printf("\n  (x is permuted the same way once per call; each lane still adds its products in order)\n");

    std::printf("\n4.3 four tokens at once read each weight row once and give the bits of four matvecs\n");
    const std::size_t tokens = 4;
    std::vector<float> xs(tokens * cols), ys(tokens * rows), one(rows);
    for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = float(int(i % 7) - 3);
    matmul_bf16(ys.data(), xs.data(), w.data(), tokens, rows, cols);
    bool same = true;
    for (std::size_t t = 0; t < tokens; ++t) {
        matvec_bf16(one.data(), xs.data() + t * cols, w.data(), rows, cols);
        std::printf("  token %zu:", t);
        for (std::size_t r = 0; r < rows; ++r) {
            std::printf(" %8.2f", double(ys[t * rows + r]));
            same = same && std::bit_cast<std::uint32_t>(one[r]) == std::bit_cast<std::uint32_t>(ys[t * rows + r]);
        }
        std::printf("\n");
    }
    std::printf("  identical to one token at a time: %s\n", same ? "yes" : "NO");
    return 0;
}
