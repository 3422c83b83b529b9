// Example for chapter 04: a bf16 matrix times an f32 vector, and how the SIMD path holds its lanes.
//   make run-04
#include <cstdio>
#include <vector>

#include "../chapters/04_matvec_bf16.hpp"

using namespace kimik3;

int main() {
    std::printf("4.1 y = W x, W bf16 [3, 32] row-major, x f32 [32]\n");
    const std::size_t rows = 3, cols = 32;
    std::vector<bf16> w(rows * cols);
    std::vector<float> x(cols);
    for (std::size_t c = 0; c < cols; ++c) x[c] = 0.25f * float(c);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < cols; ++c) w[r * cols + c] = f32_to_bf16(float(r + 1) * ((c % 3) == 0 ? 1.0f : -0.5f));
    std::printf("  row 0 starts   ");
    for (std::size_t c = 0; c < 6; ++c) std::printf(" %04x=%+.2f", w[c], double(bf16_to_f32(w[c])));
    std::printf(" ...\n");
    std::vector<float> y_ref(rows), y_simd(rows);
    matvec_bf16_ref(y_ref.data(), x.data(), w.data(), rows, cols);
    matvec_bf16_simd(y_simd.data(), x.data(), w.data(), rows, cols);
    for (std::size_t r = 0; r < rows; ++r)
        std::printf("  y[%zu] = %9.4f  (reference)   %9.4f  (SIMD)   same bits: %s\n", r, double(y_ref[r]), double(y_simd[r]),
                    std::bit_cast<std::uint32_t>(y_ref[r]) == std::bit_cast<std::uint32_t>(y_simd[r]) ? "yes" : "NO");

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
