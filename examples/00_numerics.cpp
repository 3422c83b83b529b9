// Example for chapter 00: numbers at the bit level, and the one way kimik3 adds them up.
//   make run-00        (stdout is deterministic; the SIMD architecture goes to stderr)
#include <algorithm>
#include <cstdio>
#include <vector>

#include "../chapters/00_numerics.hpp"

using namespace kimik3;

static void show_f32(const char* label, float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    std::printf("  %-22s %-14.9g sign %u  exponent %3u  mantissa 0x%06x   bits %08x\n", label, double(f), u >> 31,
                (u >> 23) & 0xFF, u & 0x7FFFFF, u);
}

int main() {
    std::printf("0.2 float32 and bfloat16 bit layouts\n");
    show_f32("1.0", 1.0f);
    show_f32("-2.5", -2.5f);
    show_f32("2^-127 (a denormal)", 0x1p-127f);
    const float pi = 3.14159265f;
    const bf16 pb = f32_to_bf16(pi);
    std::printf("  pi as f32 %08x -> bf16 %04x -> back to f32 %.9g (7 mantissa bits kept)\n",
                std::bit_cast<std::uint32_t>(pi), pb, double(bf16_to_f32(pb)));

    std::printf("\n0.2 round to nearest, ties to even (f32 -> bf16)\n");
    const float cases[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, 3.4e38f, -0.0f};
    const char* why[] = {"tie -> even (down)", "tie -> even (up)", "above half -> up", "rounds up to Inf", "-0 stays -0"};
    for (int i = 0; i < 5; ++i)
        std::printf("  %08x -> %04x   %s\n", std::bit_cast<std::uint32_t>(cases[i]), f32_to_bf16(cases[i]), why[i]);
    const float nan = std::bit_cast<float>(0x7F800001u);  // a NaN whose payload is only in the low bits
    std::printf("  NaN %08x -> %04x (truncation would give 7f80 = Inf; we force the quiet bit)\n",
                std::bit_cast<std::uint32_t>(nan), f32_to_bf16(nan));

    std::printf("\n0.5 sixteen lanes and the hsum16 tree\n");
    std::vector<float> a(32, 1.0f), b(32, 1.0f);
    a[0] = 0x1p24f;  // 2^24: adding 1 to it is lost to rounding
    float seq = 0.0f;
    for (std::size_t i = 0; i < 32; ++i) seq = seq + a[i] * b[i];
    std::printf("  sum of 2^24 and thirty-one 1s, exact           %.1f\n", double(0x1p24) + 31.0);
    std::printf("  left to right (one accumulator)                %.1f\n", double(seq));
    std::printf("  16 lanes + hsum16 (the contract, any width)    %.1f\n", double(dot_ref(a.data(), b.data(), 32)));
    std::printf("  the same through the SIMD path                 %.1f\n", double(dot_simd(a.data(), b.data(), 32)));

    std::printf("\n0.6 the FMA canary: (1+2^-12)^2 - (1+2^-11)\n");
    std::printf("  computed %a (0 = unfused, as required; 2^-24 would mean the build fuses)\n", double(fma_canary()));

    std::printf("\n0.8 threads split rows, never sums: 10 rows over the thread team\n  ");
    std::vector<int> owner(10, -1);
    parallel_rows(10, 1u << 20, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r) owner[r] = int(r0);
    });
    std::printf("every row computed exactly once: %s\n", std::count(owner.begin(), owner.end(), -1) == 0 ? "yes" : "no");

    std::fprintf(stderr, "SIMD architecture in use: %s, %d floats per register, %d threads\n", simd::arch_name(), simd::W,
                 max_threads());
    return 0;
}
