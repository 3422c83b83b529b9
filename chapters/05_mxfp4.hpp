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

#include "04_matvec_bf16.hpp"

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

// The block's 32 weights, decoded: register i covers columns 32b + i*W .. (natural order).
inline void decode_block_simd(simd::f32 (&w)[kMxBlock / simd::W], const simd::u32 (&shift)[8 / simd::W], const std::uint8_t* pblock,
                              std::uint8_t scale_byte) {  // pblock (16 bytes)
    constexpr int PerWord = 8 / simd::W;  // registers one 8-code word fills
    const simd::f32 scale = simd::splat(kE8M0.value[scale_byte]);
    KIMIK3_UNROLL for (int word = 0; word < 4; ++word) {
        const simd::u32 bits = simd::splat_u32(load_word(pblock + 4 * std::size_t(word)));
        KIMIK3_UNROLL for (int k = 0; k < PerWord; ++k) w[word * PerWord + k] = decode_e2m1(bits >> shift[k]) * scale;
    }
}

// One row, one token. Why one row at a time: a block of 4 rows shares each load of x (the textbook
// register tiling), and it was measured SLOWER on the w1 shape (AVX2: 2.2-2.6 ms against 1.7-2.1 ms
// for single rows, xsimd: 3.8-4.5 against 3.5-3.8; make bench's machine, 1 thread): loading x is not
// what binds, decoding is, and 4 rows' 16 decoded registers plus 8 accumulators do not fit in 16.
inline float mxfp4_row_simd(const float* x, const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    // x (in), prow (in/2), srow (in/32)
    constexpr int A = simd::kBatchesPer16;  // registers per 16 lanes
    simd::u32 shift[8 / simd::W];
    for (int k = 0; k < 8 / simd::W; ++k) shift[k] = nibble_shifts(k * simd::W);
    simd::f32 acc[A];
    KIMIK3_UNROLL for (int a = 0; a < A; ++a) acc[a] = simd::splat(0.0f);
    for (std::size_t b = 0; b < cols / kMxBlock; ++b) {  // one MX block: 32 columns, 4 words
        simd::f32 w[kMxBlock / simd::W];
        decode_block_simd(w, shift, prow + b * (kMxBlock / 2), srow[b]);
        // Register i belongs to logical lanes (i*W) % 16, i.e. accumulator i % A, and the two halves
        // of the block reach it in column order.
        KIMIK3_UNROLL for (int i = 0; i < kMxBlock / simd::W; ++i)
            acc[i % A] = acc[i % A] + w[i] * simd::load(x + b * kMxBlock + std::size_t(i * simd::W));
    }
    float lanes[kLanes];
    for (int a = 0; a < A; ++a) simd::store(lanes + a * simd::W, acc[a]);
    return hsum16(lanes);
}

// The tiles' decode asks for the row's next panel as it decodes one (4.3's prefetch_ahead): the packed
// bytes of columns [c1, 2 c1 - c0) and the line of scales they start in.
inline void prefetch_mxfp4_ahead(const std::uint8_t* prow, const std::uint8_t* srow, std::size_t c0, std::size_t c1, std::size_t cols) {
    if (c1 >= cols) return;
    prefetch_ahead(prow + c1 / 2, (std::min(cols, 2 * c1 - c0) - c1) / 2);
    prefetch_ahead(srow + c1 / kMxBlock, 1);
}

// T tokens through chapter 04's tiles (4.3): `decode(tile, r, nr, c0, c1)` writes rows r .. r+nr-1,
// columns [c0, c1), decoded, in the kernel's register order; `lane` names the logical lane of each
// stored position. MXFP4 widths are multiples of 32, so there is never a tail column.
template <class Panel, class Decode>
inline void mxfp4_token_tiles(float* y, const float* xp, std::size_t tokens, std::size_t rows, std::size_t cols, std::size_t r0,
                              std::size_t r1, const int (&lane)[kLanes], Decode&& decode) {  // y (T, out), xp (T, in)
    token_tiles<Panel>(y, rows, xp, tokens, r0, r1, cols, lane, decode, [](std::size_t, std::size_t, std::size_t) { return 0.0f; });
}

}  // namespace detail

// Bit-identical to matmul_mxfp4_ref. Structural difference: codes are decoded W at a time in registers
// (broadcast word, per-lane shift, arithmetic decode); T tokens share each decoded weight (4.3's tiles).
inline void matmul_mxfp4_simd(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                              std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) {
        simd::u32 shift[8 / simd::W];
        for (int k = 0; k < 8 / simd::W; ++k) shift[k] = detail::nibble_shifts(k * simd::W);
        for (int i = 0; i < nr; ++i) {
            const std::uint8_t* p = packed + (r + std::size_t(i)) * prow;  // (locals: the stores below may alias anything)
            const std::uint8_t* s = scales + (r + std::size_t(i)) * srow;
            float* out = tile + std::size_t(i) * kPanel;
            detail::prefetch_mxfp4_ahead(p, s, c0, c1, cols);
            for (std::size_t c = c0; c < c1; c += kMxBlock) {
                simd::f32 w[kMxBlock / simd::W];
                detail::decode_block_simd(w, shift, p + c / 2, s[c / kMxBlock]);
                for (int k = 0; k < kMxBlock / simd::W; ++k) simd::store(out + (c - c0) + std::size_t(k * simd::W), w[k]);
            }
        }
    };
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        if (tokens > 1) return detail::mxfp4_token_tiles<detail::SimdPanel>(y, x, tokens, rows, cols, r0, r1, detail::kNaturalLanes, decode);
        for (std::size_t r = r0; r < r1; ++r) y[r] = detail::mxfp4_row_simd(x, packed + r * prow, scales + r * srow, cols);
    });
}

// ---------------------------------------------------------------------------------------------------
// 5.6 The AVX2 kernel, 5.7 the AVX-512 kernel, 5.9 the NEON kernel: in the APPENDIX 05a_mxfp4_kernels.hpp
// ---------------------------------------------------------------------------------------------------
// Whole functions for one instruction set each, where the ISA's own instructions are the point: a
// table lookup instead of 5.5's arithmetic decode (AVX2 vpermps on 8 entries, AVX-512 vpermps on all 16
// codes with the block scale folded in, NEON tbl on bytes). All bit-identical to matmul_mxfp4_ref.

// ---------------------------------------------------------------------------------------------------
// 5.8 Dispatch: the one entry point
// ---------------------------------------------------------------------------------------------------
// The family, narrowest first (chapter 00's 0.9 picks the last one this CPU runs, the reference under
// KIMIK3_SCALAR). The entries a build's architecture cannot compile are nullptr.
using Mxfp4Matmul = void (*)(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                             std::size_t rows, std::size_t cols);  // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
inline void matmul_mxfp4_neon(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                              std::size_t rows, std::size_t cols);  // 05a, 5.9 (arm64 builds only)
inline void matmul_mxfp4_avx2(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                              std::size_t rows, std::size_t cols);  // 05a, 5.6 (x86-64 builds only)
inline void matmul_mxfp4_avx512(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                                std::size_t rows, std::size_t cols);  // 05a, 5.7 (x86-64 builds only)
inline void matmul_mxfp4_avx512_zen5(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                                     std::size_t rows, std::size_t cols);  // 05a, 5.7: 8 rows per pass, for Zen 5
inline constexpr Kernel<Mxfp4Matmul> kMxfp4Kernels[] = {
    {"reference", Isa::xsimd, matmul_mxfp4_ref},
    {"xsimd", Isa::xsimd, matmul_mxfp4_simd},
    {"neon", Isa::neon, KIMIK3_NEON_ONLY(matmul_mxfp4_neon)},
    {"avx2", Isa::avx2, KIMIK3_X86_ONLY(matmul_mxfp4_avx2)},
    {"avx512", Isa::avx512, KIMIK3_X86_ONLY(matmul_mxfp4_avx512)},
    {"avx512_zen5", Isa::avx512, KIMIK3_X86_ONLY(matmul_mxfp4_avx512_zen5), cpu_is_zen5},  // the same bits, tuned for AMD family 26
};

// The kernel matmul_mxfp4 runs, chosen once, in this one place.
inline const Kernel<Mxfp4Matmul>& mxfp4_kernel() {
    static const Kernel<Mxfp4Matmul>& k = choose_kernel<Mxfp4Matmul>(kMxfp4Kernels);
    return k;
}
inline const char* mxfp4_kernel_name() { return mxfp4_kernel().name; }  // for the programs' banners

inline void matmul_mxfp4(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                         std::size_t tokens, std::size_t rows, std::size_t cols) {
    // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    mxfp4_kernel().fn(y, x, packed, scales, tokens, rows, cols);
}

inline void matvec_mxfp4(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                         std::size_t rows, std::size_t cols) {  // y (out), x (in), packed (out, in/2), scales (out, in/32)
    matmul_mxfp4(y, x, packed, scales, 1, rows, cols);
}

}  // namespace kimik3

// The kernels written for one instruction set live in the appendix, which includes this file.
#include "05a_mxfp4_kernels.hpp"
