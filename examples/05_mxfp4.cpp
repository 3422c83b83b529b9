// Example for chapter 05: decode and draw one MXFP4 block, then run a matvec on packed bytes.
//   make run-05
#include <cstdio>
#include <vector>

#include "../chapters/05_mxfp4.hpp"

using namespace kimik3;

int main() {
    std::printf("5.1 the 16 E2M1 codes\n  code ");
    for (int c = 0; c < 16; ++c) std::printf("%5x", c);
    std::printf("\n  value");
    for (int c = 0; c < 16; ++c) std::printf("%5.1f", double(kE2M1[std::size_t(c)]));
    std::printf("\n\n5.2 E8M0 scales: byte s means 2^(s-127)\n");
    for (int s : {0, 1, 120, 127, 128, 254})
        std::printf("  s = %3d -> %-14.8g (bits %08x)%s\n", s, double(e8m0_to_f32(std::uint8_t(s))),
                    std::bit_cast<std::uint32_t>(e8m0_to_f32(std::uint8_t(s))), s == 0 ? "  a denormal: never flush it" : "");

    std::printf("\n5.3 one block of 32 weights: 16 packed bytes + 1 scale byte (here 126: x0.5)\n");
    std::vector<std::uint8_t> packed(16);
    for (int j = 0; j < 16; ++j) packed[std::size_t(j)] = std::uint8_t((j & 15) | ((15 - j) << 4));
    const std::uint8_t scale = 126;
    std::printf("  byte  hex   low nibble -> col 2j     high nibble -> col 2j+1\n");
    for (int j = 0; j < 16; j += 5) {
        const std::uint8_t b = packed[std::size_t(j)];
        std::printf("  %4d  0x%02x  code %x -> col %2d = %5.2f    code %x -> col %2d = %5.2f\n", j, b, b & 15, 2 * j,
                    double(mxfp4_weight(packed.data(), &scale, std::size_t(2 * j))), b >> 4, 2 * j + 1,
                    double(mxfp4_weight(packed.data(), &scale, std::size_t(2 * j + 1))));
    }
    std::vector<float> w(32);
    dequantize_mxfp4(w.data(), packed.data(), &scale, 1, 32);
    std::printf("  the whole block, columns 0..31:\n   ");
    for (int c = 0; c < 32; ++c) std::printf("%s%6.2f", c == 16 ? "\n   " : "", double(w[std::size_t(c)]));
    std::printf("\n\n5.4-5.7 a 4 x 64 MXFP4 matvec read straight from the packed bytes\n");
    const std::size_t rows = 4, cols = 64;
    std::vector<std::uint8_t> p(rows * cols / 2), s(rows * cols / 32);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::uint8_t((i * 37 + 11) & 0xFF);
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = std::uint8_t(125 + i % 4);
    std::vector<float> x(cols), y_ref(rows), y_fast(rows);
    for (std::size_t c = 0; c < cols; ++c) x[c] = float(int(c % 5) - 2) * 0.5f;
    matmul_mxfp4_ref(y_ref.data(), x.data(), p.data(), s.data(), 1, rows, cols);
    matvec_mxfp4(y_fast.data(), x.data(), p.data(), s.data(), rows, cols);
    for (std::size_t r = 0; r < rows; ++r)
        std::printf("  y[%zu] = %10.4f   dispatched fast path: %10.4f   same bits: %s\n", r, double(y_ref[r]), double(y_fast[r]),
                    std::bit_cast<std::uint32_t>(y_ref[r]) == std::bit_cast<std::uint32_t>(y_fast[r]) ? "yes" : "NO");
    std::fprintf(stderr, "fast path on this machine: %s\n", mxfp4_kernel_name());
    return 0;
}
