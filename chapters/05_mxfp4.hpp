// kimik3 chapter 05: mxfp4 -- the routed experts' 4-bit weights, decoded exactly, multiplied in place.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Kimi K3's routed experts (2,722.74 B, 98.0% of its 2.78 T parameters: docs/at-a-glance.md 3) are
//   stored as MXFP4: 4-bit floats in blocks of 32 that share one 8-bit power-of-two scale. This
//   chapter decodes every code and scale exactly, draws the compressed-tensors byte layout, and builds
//   a matvec that reads the packed bytes directly (an expert's 17.5 MB would become 132 MB if widened
//   to f32 first). New since chapter 04: a number format small enough to test exhaustively, a decode
//   that must be done in registers, and ISA-specific whole functions (AVX2, AVX-512: picked when the
//   program runs) next to the portable xsimd one, all four bit-identical.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 2.2, 2.4)
//   Per expert: w1 (gate) and w3 (up) [3072, 3584], w2 (down) [3584, 3072], i.e. F = 3072, L = 3584.
//   weight_packed [out, in/2] U8 and weight_scale [out, in/32] U8 for each: 3 x (5,505,024 + 344,064)
//   = 17,547,264 bytes per expert, 896 experts x 92 layers. 16 experts run per token and layer, so a
//   token touches 16 x 17.5 MB = 281 MB of MXFP4 per MoE layer, 25.8 GB over the 92 MoE layers.
//
// CONCEPTS
//   E2M1    a 4-bit float: 1 sign, 2 exponent, 1 mantissa bit. Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6;
//           8..15 the same with the sign set (8 is -0). OCP Microscaling (MX) v1.0.
//   E8M0    an 8-bit power of two: byte s means 2^(s-127). s = 0 is 2^-127, a float32 DENORMAL (keep
//           denormals on); s = 255 is NaN in the OCP spec and is refused at load.
//   block   32 consecutive weights of one row share one scale.
//
// BIT LAYOUT (compressed-tensors "mxfp4-pack-quantized", as in the release)
//
//   E2M1 code:   bit 3   bits 2-1    bit 0
//               +------+-----------+--------+      value = (-1)^s * { m/2           if e = 0
//               | sign | exponent  |mantissa|                       { 2^(e-1)(1+m/2) if e > 0
//               +------+-----------+--------+
//
//   weight_packed row r (in/2 bytes), one block = 16 bytes = 32 weights:
//
//     byte j:   7      4 3      0
//              +--------+--------+
//              | col 2j+1| col 2j |      LOW nibble = EVEN column, HIGH nibble = ODD column
//              +--------+--------+
//
//   weight_scale row r (in/32 bytes): byte g is the E8M0 scale of columns 32g .. 32g+31.
//   W[r][c] = E2M1(code(r, c)) * 2^(scale[r][c / 32] - 127), exact in f32 (and in bf16).
//
//   Worked by hand (a 2 x 32 matrix, the test "5.3 hand-worked 2x32"):
//     row 0: scale byte 128 (x2); packed byte 0 = 0x72 -> col 0 code 2 (1.0) -> 2.0, col 1 code 7
//            (6.0) -> 12.0; bytes 1..15 = 0x00 -> zeros. With x = (1, 1, 0, ...): y0 = 2 + 12 = 14.
//     row 1: scale byte 126 (x0.5); packed byte 15 = 0x9A -> col 30 code 0xA (-1.0) -> -0.5, col 31
//            code 9 (-0.5) -> -0.25; with x30 = 4, x31 = 8: y1 = -2 + -2 = -4.
//     A swapped nibble order would give y0 = 12*1 + 2*1 = 14 too (symmetric x), but row 1 would be
//     -0.25*4 + -0.5*8 = -5: only a positional test catches the swap (trap 5.1.6 of docs/kimi-k3.md).
//
// NUMERICS CONTRACT
//   w = e2m1(code) * scale (one rounding, exact unless it overflows to Inf at scale >= 2^126), then
//   exactly the lanes of chapter 00: lane l = sum over i = l, l+16, ... of (w_i * x_i), hsum16 at the
//   end. Hence matvec_mxfp4(W) has the same bits as a f32 matvec over the dequantized W (a test).
//   `in` must be a multiple of 32. Scales of 255 are refused by check_e8m0_scales before any matvec.
//   Rows split across threads; T tokens at once give per token the bits of a single matvec.
//
// SOURCES  Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0, 2023 (E2M1,
//          E8M0, blocks of 32); Rouhani et al., arXiv:2310.10537; vllm-project/compressed-tensors (the
//          mxfp4-pack-quantized nibble order). docs/sources.md 05.
// USES     chapter 00 (lanes, hsum16, shim, parallel_rows)
// RUN      make run-05        TEST   make test-05        BENCH   make bench
//
// SECTIONS
//   5.1 E2M1 codes     5.2 E8M0 scales      5.3 dequantizing     5.4 the reference matvec
//   5.5 the xsimd kernel                    5.6 the AVX2 kernel  5.7 the AVX-512 kernel
//   5.8 dispatch
// ====================================================================================================
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "00_numerics.hpp"

#include <vector>

#if KIMIK3_X86_KERNELS
#include <immintrin.h>
#endif

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 5.1 E2M1 codes (OCP MX v1.0, table "FP4 E2M1")
// ---------------------------------------------------------------------------------------------------
inline constexpr std::array<float, 16> kE2M1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline constexpr int kMxBlock = 32;  // weights per shared scale

// ---------------------------------------------------------------------------------------------------
// 5.2 E8M0 scales
// ---------------------------------------------------------------------------------------------------
// Byte s -> 2^(s-127) by building the float bits: exponent field s for s >= 1; for s = 0 the value
// 2^-127 is the denormal with only mantissa bit 22 set. (s = 255 would be Inf here; it never gets
// this far: check_e8m0_scales refuses it when the weights are loaded.)
inline float e8m0_to_f32(std::uint8_t s) {
    return s == 0 ? std::bit_cast<float>(0x00400000u) : std::bit_cast<float>(std::uint32_t(s) << 23);
}

// The same 256 values as a table: the kernels look a block's scale up with one load.
struct E8M0Table {
    float value[256];
    E8M0Table() {
        for (int s = 0; s < 256; ++s) value[s] = e8m0_to_f32(std::uint8_t(s));
    }
};
inline const E8M0Table kE8M0;

// Refuses a scale byte of 255 (NaN in the OCP spec), naming the tensor and the first bad position.
inline void check_e8m0_scales(const std::uint8_t* scales, std::size_t n, const std::string& name) {  // scales (n)
    const void* bad = std::memchr(scales, 0xFF, n);
    if (bad)
        fail(ErrorKind::format, "tensor '" + name + "': E8M0 scale byte 255 (NaN in OCP MX) at index " +
                                    std::to_string(static_cast<const std::uint8_t*>(bad) - scales));
}

// ---------------------------------------------------------------------------------------------------
// 5.3 Dequantizing (for tests and teaching; the engine never widens a whole matrix)
// ---------------------------------------------------------------------------------------------------
inline float mxfp4_weight(const std::uint8_t* packed_row, const std::uint8_t* scale_row, std::size_t c) {
    const std::uint8_t byte = packed_row[c / 2];
    const std::uint8_t code = (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);  // low nibble = even column
    return kE2M1[code] * e8m0_to_f32(scale_row[c / kMxBlock]);
}

inline void dequantize_mxfp4(float* w, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t rows,
                             std::size_t cols) {  // w (out, in), packed (out, in/2), scales (out, in/32)
    require_multiple("dequantize_mxfp4", "in", cols, kMxBlock);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < cols; ++c)
            w[r * cols + c] = mxfp4_weight(packed + r * cols / 2, scales + r * cols / kMxBlock, c);
}

// ---------------------------------------------------------------------------------------------------
// 5.4 The reference matvec (T tokens; T = 1 is the matvec)
// ---------------------------------------------------------------------------------------------------
inline float dot_mxfp4_ref(const std::uint8_t* packed_row, const std::uint8_t* scale_row, const float* x,
                           std::size_t cols) {  // packed_row (in/2), scale_row (in/32), x (in)
    float acc[kLanes] = {};
    for (std::size_t c = 0; c < cols; ++c) {
        const float w = mxfp4_weight(packed_row, scale_row, c);
        acc[c % kLanes] = acc[c % kLanes] + w * x[c];
    }
    return hsum16(acc);
}

inline void matmul_mxfp4_ref(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                             std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r)
            for (std::size_t t = 0; t < tokens; ++t)
                y[t * rows + r] = dot_mxfp4_ref(packed + r * cols / 2, scales + r * cols / kMxBlock, x + t * cols, cols);
    });
}

// ---------------------------------------------------------------------------------------------------
// 5.5 The xsimd kernel
// ---------------------------------------------------------------------------------------------------
// Getting nibbles into lanes without a byte-widening instruction (xsimd 8.1 has none): broadcast one
// 32-bit word of packed bytes (8 codes, columns 8w .. 8w+7 in nibble order 0..7, because the low
// nibble of each byte is the even column) to every lane, then shift lane j right by 4*(j + k) (k = 0,
// or 4 for the upper half of the word when W = 4). Lane j then holds the code of column 8w + k + j in
// its low 4 bits: the NATURAL lane order, so x needs no permutation (compare chapter 04).
//
//   word (4 bytes):  [b3 b2 b1 b0] = nibbles  n7 n6 n5 n4 n3 n2 n1 n0   (n0 = column 8w)
//   broadcast, >> (0,4,8,...,28):   lane j = ...n_j  ->  code of column 8w + j
//
// Decoding a 3-bit magnitude m in registers, without a table lookup (xsimd 8.1 has no dynamic one):
//   m >= 2:  f32 bits = (m << 22) + 0x3F000000   (e = m>>1 lands in the exponent, the mantissa bit
//            in bit 22: m=2 -> 0x3F800000 = 1.0, m=7 -> 0x40C00000 = 6.0)
//   m = 1:   0x3F000000 = 0.5;   m = 0: 0
//   sign:    bit 3 of the code moved to bit 31.
namespace detail {

template <class U> inline simd::f32 decode_e2m1(U t) {  // t: codes in the low 4 bits of each lane
    const U mag = t & simd::splat_u32(7u);
    const U sign = (t & simd::splat_u32(8u)) << 28;
    const U big = (mag << 22) + simd::splat_u32(0x3F000000u);
    const U small = (simd::splat_u32(0u) - mag) & simd::splat_u32(0x3F000000u);  // m=1 -> 0.5, m=0 -> 0
    const U bits = xsimd::select(mag > simd::splat_u32(1u), big, small);
    return simd::as_f32(bits | sign);
}

// Per-lane right shifts 0, 4, 8, ... for the W lanes that take nibbles k .. k+W-1 of a word.
inline simd::u32 nibble_shifts(int k) {
    alignas(32) std::uint32_t s[8];
    for (int j = 0; j < simd::W; ++j) s[j] = std::uint32_t(4 * (k + j));
    return simd::load_u32(s);
}

inline std::uint32_t load_word(const std::uint8_t* p) {
    std::uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

template <int NT>
inline void mxfp4_row_simd(float* y, std::size_t y_stride, const float* x, std::size_t x_stride,
                           const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    // y (NT, stride) at this row, x (NT, in), prow (in/2), srow (in/32)
    constexpr int A = simd::kBatchesPer16;  // registers per 16 lanes
    constexpr int PerWord = 8 / simd::W;    // registers one 8-code word fills
    simd::u32 shift[PerWord];
    for (int k = 0; k < PerWord; ++k) shift[k] = nibble_shifts(k * simd::W);
    simd::f32 acc[NT][A];
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t)
        KIMIK3_UNROLL for (int a = 0; a < A; ++a) acc[t][a] = simd::splat(0.0f);
    for (std::size_t b = 0; b < cols / kMxBlock; ++b) {            // one MX block: 32 columns, 4 words
        simd::f32 w[4 * PerWord];                                   // the block's 32 weights
        const simd::f32 scale = simd::splat(kE8M0.value[srow[b]]);
        KIMIK3_UNROLL for (int word = 0; word < 4; ++word) {
            const simd::u32 bits = simd::splat_u32(load_word(prow + b * (kMxBlock / 2) + 4 * std::size_t(word)));
            KIMIK3_UNROLL for (int k = 0; k < PerWord; ++k) w[word * PerWord + k] = decode_e2m1(bits >> shift[k]) * scale;
        }
        // Register i of the block covers columns 32b + i*W ..; it belongs to logical lanes (i*W) % 16,
        // i.e. accumulator i % A, and the two halves of the block reach it in column order.
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t)
            KIMIK3_UNROLL for (int i = 0; i < 4 * PerWord; ++i) {
                const simd::f32 xv = simd::load(x + std::size_t(t) * x_stride + b * kMxBlock + std::size_t(i * simd::W));
                acc[t][i % A] = acc[t][i % A] + w[i] * xv;
            }
    }
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
        float lanes[kLanes];
        for (int a = 0; a < A; ++a) simd::store(lanes + a * simd::W, acc[t][a]);
        y[std::size_t(t) * y_stride] = hsum16(lanes);
    }
}

// The row split shared by the xsimd and AVX2 kernels. KERNEL::row does one row for one token;
// KERNEL::tokens one row for T tokens, grouped as that kernel measures fastest.
// Why one row at a time: a block of 4 rows shares each load of x (the textbook register tiling), and
// it was measured SLOWER on the w1 shape (AVX2: 2.2-2.6 ms against 1.7-2.1 ms for single rows, xsimd:
// 3.8-4.5 against 3.5-3.8; make bench's machine, 1 thread): loading x is not what binds, decoding is,
// and 4 rows' 16 decoded registers plus 8 accumulators do not fit in 16 registers.
template <class Kernel>
inline void mxfp4_tiles(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                        std::size_t tokens, std::size_t rows, std::size_t cols) {
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r)
            if (tokens == 1) Kernel::row(y + r, x, packed + r * prow, scales + r * srow, cols);
            else Kernel::tokens(y + r, rows, x, cols, packed + r * prow, scales + r * srow, cols, tokens);
    });
}

struct SimdKernel {
    static void row(float* y, const float* x, const std::uint8_t* p, const std::uint8_t* s, std::size_t cols) {
        mxfp4_row_simd<1>(y, 0, x, cols, p, s, cols);
    }
    static void tokens(float* y, std::size_t ys, const float* x, std::size_t xs, const std::uint8_t* p, const std::uint8_t* s, std::size_t cols,
                       std::size_t tokens) {  // four at a time: each weight decoded once per 4 tokens
        std::size_t t = 0;
        for (; tokens - t >= 4; t += 4) mxfp4_row_simd<4>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
        for (; t < tokens; ++t) mxfp4_row_simd<1>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
    }
};

}  // namespace detail

// Bit-identical to matmul_mxfp4_ref. Structural difference: codes are decoded W at a time in
// registers (broadcast word, per-lane shift, arithmetic decode) and several tokens share each decoded weight.
inline void matmul_mxfp4_simd(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                              std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    detail::mxfp4_tiles<detail::SimdKernel>(y, x, packed, scales, tokens, rows, cols);
}

// ---------------------------------------------------------------------------------------------------
// 5.6 The AVX2 kernel (a whole function for one ISA: clearer than a shim where the ISA's own instructions are the point)
// ---------------------------------------------------------------------------------------------------
// Why a second SIMD kernel: the arithmetic decode of 5.5 costs ~10 instructions per 8 weights; AVX2's
// vpermps looks up 8 floats by the low 3 bits of each lane in one instruction. Each block's scale is
// folded into that 8-entry table once (8 multiplies per 32 weights), and the sign is XORed in:
//   w = table_scaled[code & 7] ^ ((code & 8) << 28)
// This gives the same bits as e2m1(code) * scale: IEEE multiplication is symmetric in sign, and -0
// (code 8) comes out as +0 with the sign bit set, i.e. -0. On this project's AVX2 machine it measured
// ~2x the xsimd kernel (see make bench). It is compiled into every x86-64 build (chapter 00's 0.9) and
// used when the CPU has AVX2, whatever -march the build was given.
#if KIMIK3_X86_KERNELS
namespace detail {

// The decode of one 32-bit word of packed bytes (8 codes) into 8 weights, with the block's scale
// already folded into the table: broadcast, two per-lane shifts, and, vpermps, xor.
struct Avx2Decoder {
    __m256 table;         // E2M1 magnitudes 0 .. 6
    __m256i shift_code;   // nibble j -> bits 0..3
    __m256i shift_sign;   // nibble j's bit 3 -> bit 31
    __m256i sign_bit;

    KIMIK3_TARGET_AVX2 Avx2Decoder()
        : table(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f)),
          shift_code(_mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
          shift_sign(_mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0)),
          sign_bit(_mm256_set1_epi32(int(0x80000000u))) {}

    // the block's scale folded into the 8-entry magnitude table: 8 multiplies per 32 weights
    KIMIK3_TARGET_AVX2 __m256 scaled_table(std::uint8_t scale) const { return _mm256_mul_ps(table, _mm256_set1_ps(kE8M0.value[scale])); }
    KIMIK3_TARGET_AVX2 __m256 word(__m256 table_scaled, const std::uint8_t* p) const {  // p: 4 packed bytes = 8 columns in order
        const __m256i bits = _mm256_set1_epi32(int(load_word(p)));
        const __m256i code = _mm256_srlv_epi32(bits, shift_code);                      // low 3 bits used
        const __m256i sign = _mm256_and_si256(_mm256_sllv_epi32(bits, shift_sign), sign_bit);
        return _mm256_xor_ps(_mm256_permutevar8x32_ps(table_scaled, code), _mm256_castsi256_ps(sign));
    }
};

template <int NT>
KIMIK3_TARGET_AVX2 inline void mxfp4_row_avx2(float* y, std::size_t y_stride, const float* x, std::size_t x_stride,
                                              const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    // y (NT, stride) at this row, x (NT, in), prow (in/2), srow (in/32)
    const Avx2Decoder dec;
    __m256 acc[NT][2];
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (std::size_t b = 0; b < cols / kMxBlock; ++b) {             // one MX block: 32 columns, 4 words
        __m256 w[4];
        const __m256 table_scaled = dec.scaled_table(srow[b]);
        KIMIK3_UNROLL for (int word = 0; word < 4; ++word) w[word] = dec.word(table_scaled, prow + b * (kMxBlock / 2) + 4 * std::size_t(word));
        // word k holds columns 32b + 8k .. 8k+7: logical lanes 0..7 for even k, 8..15 for odd k
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t)
            KIMIK3_UNROLL for (int word = 0; word < 4; ++word) {
                const __m256 xv = _mm256_loadu_ps(x + std::size_t(t) * x_stride + b * kMxBlock + std::size_t(8 * word));
                acc[t][word % 2] = _mm256_add_ps(acc[t][word % 2], _mm256_mul_ps(w[word], xv));
            }
    }
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
        float lanes[kLanes];
        _mm256_storeu_ps(lanes, acc[t][0]);
        _mm256_storeu_ps(lanes + 8, acc[t][1]);
        y[std::size_t(t) * y_stride] = hsum16(lanes);
    }
}

// T tokens: mxfp4_row_avx2<NT> decodes a block once for its NT tokens. Measured on the w1 shape (make
// bench, 1 thread): 2, 3, 4 tokens cost 1.14-1.23x, 1.39-1.47x, 1.63-1.80x one token's time; 16 tokens
// about 6.7x (four groups of 4: more than 4 tokens' accumulators do not fit beside the decode's
// registers). Two half-lane passes (lanes 0-7, then 8-15, NT accumulators instead of 2 NT) were tried
// for 2 and 3 tokens and measured slower (1.4-1.6x, 2.0-2.4x): x is read twice.
struct Avx2Kernel {
    KIMIK3_TARGET_AVX2 static void row(float* y, const float* x, const std::uint8_t* p, const std::uint8_t* s, std::size_t cols) {
        mxfp4_row_avx2<1>(y, 0, x, cols, p, s, cols);
    }
    KIMIK3_TARGET_AVX2 static void tokens(float* y, std::size_t ys, const float* x, std::size_t xs, const std::uint8_t* p, const std::uint8_t* s,
                                          std::size_t cols, std::size_t tokens) {  // 4 at a time (each weight decoded once per 4), then 3, 2 or 1 together
        std::size_t t = 0;
        for (; tokens - t >= 4; t += 4) mxfp4_row_avx2<4>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
        if (tokens - t == 3) mxfp4_row_avx2<3>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
        if (tokens - t == 2) mxfp4_row_avx2<2>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
        if (tokens - t == 1) mxfp4_row_avx2<1>(y + t * ys, ys, x + t * xs, xs, p, s, cols);
    }
};

}  // namespace detail
#endif

// Bit-identical to matmul_mxfp4_ref (see above for why the table-with-scale gives the same bits).
// Refused on a CPU without AVX2 (the dispatcher of 5.8 never calls it there).
inline void matmul_mxfp4_avx2(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                              std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    if (cpu_isa() < Isa::avx2) fail(ErrorKind::runtime, "matmul_mxfp4_avx2: this CPU has no AVX2");
#if KIMIK3_X86_KERNELS
    detail::mxfp4_tiles<detail::Avx2Kernel>(y, x, packed, scales, tokens, rows, cols);
#else
    (void)y, (void)x, (void)packed, (void)scales, (void)tokens, (void)rows;
#endif
}

// ---------------------------------------------------------------------------------------------------
// 5.7 The AVX-512 kernel: one register is the 16 lanes
// ---------------------------------------------------------------------------------------------------
// With 16 floats per register a block's 32 weights are two registers, columns 0-15 and 16-31, and
// one token's 16 logical lanes are ONE accumulator. The decode of 16 weights from 8 packed bytes is
// three instructions, one of them a shuffle:
//
//   vpbroadcastq   the 8 bytes (16 codes, nibble n = column n) into each 64-bit lane k = 0..7
//                  (from memory this is a load, not a shuffle)
//   vpsrlvq        64-bit lane k shifted right by 4k: its low 32 bits now begin with nibble k, its high
//                  32 bits with nibble k + 8
//   vpermps        each 32-bit lane looks up the low 4 bits of itself in a 16-float table: all 16 codes,
//                  sign included, already multiplied by the block's scale
//
//   register position p:   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
//   holds column (of 16):  0  8  1  9  2 10  3 11  4 12  5 13  6 14  7 15
//
// That order is the same for both halves of a block, so it is a fixed permutation of the 16 logical
// lanes (compare chapter 04's even/odd registers): x is permuted to match once per call, each lane
// still receives its own products in its own order, and the sums are put back in logical order before
// hsum16. The table is kE2M1[code] * scale for the 16 codes: exactly the product the reference rounds,
// so no sign trick is needed, and one multiply per 32 weights folds the scale in.
//
// Rows four at a time: one token's sum is a chain of dependent additions (two per block, about 4 cycles
// each), so a single row leaves the adder waiting; four independent rows fill it. Measured on the w1
// shape, 1 thread, weights in cache: 1 row 12.7 Gw/s, 2 rows 17.1, 4 rows 19.8 (the AVX2 kernel:
// 9.4). Tokens: 4 rows x up to 4 tokens share every decoded register and every load of x.
//
// Prefetch: streamed from memory, the four rows left one thread at half its in-cache speed (the
// hardware prefetcher does not run far enough ahead of four interleaved streams of 1.5-1.8 kB rows).
// Asking, once per 64-byte line, for the same line of the NEXT four rows (7 kB ahead on the w1 shape)
// took the w1 matvec from 10.8 to 16.5-18.3 Gw/s at 1 thread and from 19.1 to 31-35 at 2 (make bench,
// several runs; distances of 0.25-4 kB gave 13-16 Gw/s, 8-14 kB the same as 7).
#if KIMIK3_X86_KERNELS
KIMIK3_AVX512_BEGIN  // (g++ 12's false warnings on its own intrinsics: chapter 00's 0.9)
namespace detail {

constexpr int avx512_column(int p) { return p % 2 == 0 ? p / 2 : p / 2 + 8; }  // the table above

// xp = x with every 16 columns in the register order above; n is a multiple of 32 here.
inline void permute_input_avx512(float* xp, const float* x, std::size_t n) {  // xp (n), x (n)
    for (std::size_t c = 0; c < n; c += kLanes)
        for (int p = 0; p < kLanes; ++p) xp[c + std::size_t(p)] = x[c + std::size_t(avx512_column(p))];
}

// One MX block (32 columns, 16 bytes and one scale per row) of R rows, added into NT tokens' sums.
template <int R, int NT>
KIMIK3_TARGET_AVX512 __attribute__((always_inline)) inline void mxfp4_block_avx512(
    __m512 (&acc)[R][NT], __m512 e2m1, __m512i shifts, const float* xp, std::size_t x_stride, const std::uint8_t* prow,
    std::size_t pstride, const std::uint8_t* srow, std::size_t sstride, std::size_t b) {
    __m512 lo[R], hi[R];  // columns 0-15 and 16-31 of the block
    KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
        const __m512 table = _mm512_mul_ps(e2m1, _mm512_set1_ps(kE8M0.value[srow[std::size_t(r) * sstride + b]]));
        const std::uint8_t* p = prow + std::size_t(r) * pstride + b * (kMxBlock / 2);
        std::uint64_t q0, q1;
        std::memcpy(&q0, p, 8);
        std::memcpy(&q1, p + 8, 8);
        lo[r] = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64((long long)q0), shifts), table);
        hi[r] = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64((long long)q1), shifts), table);
    }
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
        const float* xb = xp + std::size_t(t) * x_stride + b * kMxBlock;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + kLanes);
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
            acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(lo[r], x0));  // columns 0-15 first,
            acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(hi[r], x1));  // then 16-31: lane order
        }
    }
}

template <int R, int NT>
KIMIK3_TARGET_AVX512 inline void mxfp4_rows_avx512(float* y, std::size_t y_stride, const float* xp, std::size_t x_stride,
                                                   const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    // y (NT, stride) at row 0, xp (NT, in) permuted, prow (R, in/2), srow (R, in/32)
    const std::size_t pstride = cols / 2, sstride = cols / kMxBlock, blocks = cols / kMxBlock;
    const __m512 e2m1 = _mm512_loadu_ps(kE2M1.data());
    const __m512i shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    __m512 acc[R][NT];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (std::size_t b = 0; b < blocks; ++b) {
        if (b % 4 == 0)  // once per 64-byte line of each row: ask for the same line of the next 4 rows
            KIMIK3_UNROLL for (int r = 0; r < R; ++r)
                _mm_prefetch(reinterpret_cast<const char*>(prow + std::size_t(r + 4) * pstride + b * (kMxBlock / 2)), _MM_HINT_T0);
        mxfp4_block_avx512<R, NT>(acc, e2m1, shifts, xp, x_stride, prow, pstride, srow, sstride, b);
    }
    // back to logical order in the register (lane l comes from position 2l, or 2(l - 8) + 1), then the tree.
    // (Permuting through memory instead made g++ keep every accumulator on the stack for the whole loop.)
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            float lanes[kLanes];
            _mm512_storeu_ps(lanes, _mm512_permutexvar_ps(order, acc[r][t]));
            y[std::size_t(t) * y_stride + std::size_t(r)] = hsum16(lanes);
        }
}

// R rows for every token: 4 tokens at a time, then the remaining 3, 2 or 1 together. Measured on the w1
// shape streamed, 1 thread (make bench): 2, 3, 4 and 16 tokens cost 1.1x, 1.4x, 1.6-1.7x and 6.5x one
// token's 0.64-0.66 ms (16 tokens: 4.3 ms). What binds at 16 is arithmetic, not the decode: with no
// FMA (chapter 00) every weight costs each token one multiply and one add, 11 M register multiply+add
// pairs for this matrix at the 3.85 G pairs/s this core sustains: 2.9 ms, 4.5x one token, whatever
// the tiling. Tried and slower: 1 row x 16 tokens (x re-read from L2 for every row: 7.0 ms), 2 rows x
// 8 tokens (5.6 ms), and the block loop unrolled by 4 (5.8 ms: the 4 x 4 tile then spills).
template <int R>
KIMIK3_TARGET_AVX512 inline void mxfp4_tokens_avx512(float* y, std::size_t ldy, const float* xp, std::size_t tokens,
                                                     const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    std::size_t t = 0;
    for (; tokens - t >= 4; t += 4) mxfp4_rows_avx512<R, 4>(y + t * ldy, ldy, xp + t * cols, cols, prow, srow, cols);
    if (tokens - t == 3) mxfp4_rows_avx512<R, 3>(y + t * ldy, ldy, xp + t * cols, cols, prow, srow, cols);
    if (tokens - t == 2) mxfp4_rows_avx512<R, 2>(y + t * ldy, ldy, xp + t * cols, cols, prow, srow, cols);
    if (tokens - t == 1) mxfp4_rows_avx512<R, 1>(y + t * ldy, ldy, xp + t * cols, cols, prow, srow, cols);
}

// Rows [r0, r1): four at a time, then one at a time.
KIMIK3_TARGET_AVX512 inline void mxfp4_range_avx512(float* y, const float* xp, const std::uint8_t* packed, const std::uint8_t* scales,
                                                    std::size_t tokens, std::size_t rows, std::size_t cols, std::size_t r0, std::size_t r1) {
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    std::size_t r = r0;
    for (; r1 - r >= 4; r += 4) mxfp4_tokens_avx512<4>(y + r, rows, xp, tokens, packed + r * prow, scales + r * srow, cols);
    for (; r < r1; ++r) mxfp4_tokens_avx512<1>(y + r, rows, xp, tokens, packed + r * prow, scales + r * srow, cols);
}

}  // namespace detail
KIMIK3_AVX512_END
#endif

// Bit-identical to matmul_mxfp4_ref. Refused on a CPU without AVX-512 (the dispatcher never calls it there).
inline void matmul_mxfp4_avx512(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                                std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    if (cpu_isa() < Isa::avx512) fail(ErrorKind::runtime, "matmul_mxfp4_avx512: this CPU has no AVX-512 (F, BW, DQ, VL)");
#if KIMIK3_X86_KERNELS
    std::vector<float>& xp = detail::permuted_scratch(tokens * cols);
    for (std::size_t t = 0; t < tokens; ++t) detail::permute_input_avx512(xp.data() + t * cols, x + t * cols, cols);
    const float* xpp = xp.data();
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        detail::mxfp4_range_avx512(y, xpp, packed, scales, tokens, rows, cols, r0, r1);
    });
#else
    (void)y, (void)x, (void)packed, (void)scales, (void)tokens, (void)rows;
#endif
}

// ---------------------------------------------------------------------------------------------------
// 5.8 Dispatch: the reference under KIMIK3_SCALAR, else the widest kernel the CPU runs (chapter 00's 0.9)
// ---------------------------------------------------------------------------------------------------
// The fastest fast path on this machine: AVX-512, else AVX2, else xsimd. All three have the same bits.
inline void matmul_mxfp4_fast(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                              std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    if (isa_enabled(Isa::avx512)) matmul_mxfp4_avx512(y, x, packed, scales, tokens, rows, cols);
    else if (isa_enabled(Isa::avx2)) matmul_mxfp4_avx2(y, x, packed, scales, tokens, rows, cols);
    else matmul_mxfp4_simd(y, x, packed, scales, tokens, rows, cols);
}

// The name of the kernel matmul_mxfp4 runs (for the programs' banners).
inline const char* mxfp4_kernel_name() {
    return !use_simd ? "reference" : isa_enabled(Isa::avx512) ? "avx512" : isa_enabled(Isa::avx2) ? "avx2" : "xsimd";
}

inline void matmul_mxfp4(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                         std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    if (!use_simd) matmul_mxfp4_ref(y, x, packed, scales, tokens, rows, cols);
    else matmul_mxfp4_fast(y, x, packed, scales, tokens, rows, cols);
}

inline void matvec_mxfp4(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                         std::size_t rows, std::size_t cols) {  // y (out), x (in), packed (out, in/2), scales (out, in/32)
    matmul_mxfp4(y, x, packed, scales, 1, rows, cols);
}

}  // namespace kimik3
