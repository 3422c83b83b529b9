// kimik3 chapter 05, APPENDIX a: the MXFP4 kernels written for one instruction set (AVX2, AVX-512, NEON).
// ====================================================================================================
//
// APPENDIX to chapter 05. The lesson (05_mxfp4.hpp) has the format, the reference, the xsimd kernel
// and the one entry point (5.8); this file has the bodies only one instruction set can run, each a
// whole function guarded as a whole (no #if inside a function). 5.8's table names them and chapter
// 00's rule (0.9) picks one. All are bit-identical to matmul_mxfp4_ref: the tests run every one this
// machine can, and count the others as skipped.
//
//   5.6 AVX2 (x86-64)      5.7 AVX-512 (x86-64)      5.9 NEON (arm64)
//
// Each does one token straight from the packed bytes (decode in registers, multiply, add), a few tokens
// the same way (each decoded word used by every token: AVX2 up to 4, AVX-512 up to 4), and more tokens
// through chapter 04's tiles (4.3): the rows' blocks decoded once into an L1 tile in the kernel's
// register order, then every token multiplies the tile.
// ====================================================================================================
#pragma once

#include "05_mxfp4.hpp"

#if KIMIK3_X86_KERNELS
#include <immintrin.h>
#endif
#if KIMIK3_NEON_KERNELS
#include <arm_neon.h>
#endif

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 5.6 The AVX2 kernel
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

// One row, NT tokens (1 to 4), straight from the packed bytes: each word decoded once, in registers,
// and used by the NT tokens. Per token 2 accumulators of 8 lanes (word k of a block holds columns
// 8k .. 8k+7: logical lanes 0..7 for even k, 8..15 for odd k). Up to 4 tokens this beats the tiles
// below, which store and load every decoded weight once more. y (NT, ldy) at the row, x (NT, in).
template <int NT>
KIMIK3_TARGET_AVX2 inline void mxfp4_row_avx2(float* y, std::size_t ldy, const float* x, const std::uint8_t* prow, const std::uint8_t* srow,
                                              std::size_t cols) {  // prow (in/2), srow (in/32)
    const Avx2Decoder dec;
    __m256 acc[NT][2];
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (std::size_t b = 0; b < cols / kMxBlock; ++b) {  // one MX block: 32 columns, 4 words
        const __m256 table_scaled = dec.scaled_table(srow[b]);
        KIMIK3_UNROLL for (int word = 0; word < 4; ++word) {
            const __m256 w = dec.word(table_scaled, prow + b * (kMxBlock / 2) + 4 * std::size_t(word));
            KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
                const __m256 xv = _mm256_loadu_ps(x + std::size_t(t) * cols + b * kMxBlock + std::size_t(8 * word));
                acc[t][word % 2] = _mm256_add_ps(acc[t][word % 2], _mm256_mul_ps(w, xv));
            }
        }
    }
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
        float lanes[kLanes];
        _mm256_storeu_ps(lanes, acc[t][0]);
        _mm256_storeu_ps(lanes + 8, acc[t][1]);
        y[std::size_t(t) * ldy] = hsum16(lanes);
    }
}

// The inner loop of 4.3's tiles on AVX2: NR rows x NT tokens. A sum is two 8-lane registers, lanes 0-7
// and 8-15, that never meet (columns 16k .. 16k+7 go to the first, 16k+8 .. 16k+15 to the second): so
// the first runs the whole panel, then the second, and one pass holds one register of each sum.
// g++ otherwise folds each load of x into both rows' multiplies (twice the loads) and then runs out
// of registers; an empty asm that "may change" the register pins it (it changes no bit).
KIMIK3_TARGET_AVX2 inline __m256 keep_in_register_avx2(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

struct Avx2Panel : TilePlan<2, 5> {  // 10 sums + 2 weights + 1 input + 1 product of 16 registers
    template <int NR, int NT>
    KIMIK3_TARGET_AVX2 __attribute__((noinline)) static void run(float* sums, std::size_t sums_t, const float* tile, const float* x, std::size_t x_stride, std::size_t n) {
        for (std::size_t a = 0; a < kLanes; a += 8) {  // lanes 0-7, then 8-15
            __m256 acc[NR][NT];
            KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_loadu_ps(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes + a);
            for (std::size_t c = a; c < n; c += kLanes) {
                __m256 w[NR];
                KIMIK3_UNROLL for (int r = 0; r < NR; ++r) w[r] = keep_in_register_avx2(_mm256_loadu_ps(tile + std::size_t(r) * kPanel + c));
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
                    const __m256 xv = keep_in_register_avx2(_mm256_loadu_ps(x + std::size_t(t) * x_stride + c));
                    KIMIK3_UNROLL for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_add_ps(acc[r][t], _mm256_mul_ps(w[r], xv));
                }
            }
            KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) _mm256_storeu_ps(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes + a, acc[r][t]);
        }
    }
};

KIMIK3_TARGET_AVX2 inline void mxfp4_range_avx2(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                                                std::size_t tokens, std::size_t rows, std::size_t cols, std::size_t r0, std::size_t r1) {
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    if (tokens > 4) {
        auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) KIMIK3_TARGET_AVX2 {
            const Avx2Decoder dec;
            for (int i = 0; i < nr; ++i) {
                const std::uint8_t* p = packed + (r + std::size_t(i)) * prow;  // (locals: the stores below may alias anything)
                const std::uint8_t* s = scales + (r + std::size_t(i)) * srow;
                float* out = tile + std::size_t(i) * kPanel;
                prefetch_mxfp4_ahead(p, s, c0, c1, cols);
                for (std::size_t c = c0; c < c1; c += kMxBlock) {
                    const __m256 table_scaled = dec.scaled_table(s[c / kMxBlock]);
                    KIMIK3_UNROLL for (int word = 0; word < 4; ++word)
                        _mm256_storeu_ps(out + (c - c0) + std::size_t(8 * word), dec.word(table_scaled, p + c / 2 + 4 * std::size_t(word)));
                }
            }
        };
        return mxfp4_token_tiles<Avx2Panel>(y, x, tokens, rows, cols, r0, r1, kNaturalLanes, decode);
    }
    auto rows_of = [&](auto nt) KIMIK3_TARGET_AVX2 {
        for (std::size_t r = r0; r < r1; ++r) mxfp4_row_avx2<decltype(nt)::value>(y + r, rows, x, packed + r * prow, scales + r * srow, cols);
    };
    switch (tokens) {
        case 1: return rows_of(std::integral_constant<int, 1>{});
        case 2: return rows_of(std::integral_constant<int, 2>{});
        case 3: return rows_of(std::integral_constant<int, 3>{});
        default: return rows_of(std::integral_constant<int, 4>{});
    }
}

}  // namespace detail

// Bit-identical to matmul_mxfp4_ref (see above for why the table-with-scale gives the same bits).
// Refused on a CPU without AVX2 (the dispatcher of 5.8 never calls it there).
inline void matmul_mxfp4_avx2(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                              std::size_t rows, std::size_t cols) {  // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    if (!cpu_has(Isa::avx2)) fail(ErrorKind::runtime, "matmul_mxfp4_avx2: this CPU has no AVX2");
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) { detail::mxfp4_range_avx2(y, x, packed, scales, tokens, rows, cols, r0, r1); });
}
#endif

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
// 9.4). T tokens: the block is decoded once into chapter 04's tile (4.3), in the same register order.
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

// One MX block decoded: lo = columns 0-15, hi = columns 16-31, each in the register order above.
KIMIK3_TARGET_AVX512 __attribute__((always_inline)) inline void decode_block_avx512(__m512& lo, __m512& hi, __m512 e2m1, __m512i shifts,
                                                                                   const std::uint8_t* pblock, std::uint8_t scale_byte) {
    const __m512 table = _mm512_mul_ps(e2m1, _mm512_set1_ps(kE8M0.value[scale_byte]));  // kE2M1[code] * scale
    std::uint64_t q0, q1;
    std::memcpy(&q0, pblock, 8);
    std::memcpy(&q1, pblock + 8, 8);
    lo = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64((long long)q0), shifts), table);
    hi = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64((long long)q1), shifts), table);
}

// NT tokens (1 to 4), R rows, straight from the packed bytes: each block decoded once, in registers,
// for the NT tokens. y (NT, ldy) at row 0, xp (NT, in) permuted; prow, srow: R rows of bytes and scales.
template <int R, int NT>
KIMIK3_TARGET_AVX512 inline void mxfp4_rows_avx512(float* y, std::size_t ldy, const float* xp, const std::uint8_t* prow, const std::uint8_t* srow,
                                                   std::size_t cols) {
    const std::size_t pstride = cols / 2, sstride = cols / kMxBlock, blocks = cols / kMxBlock;
    const __m512 e2m1 = _mm512_loadu_ps(kE2M1.data());
    const __m512i shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    __m512 acc[R][NT];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (std::size_t b = 0; b < blocks; ++b) {
        if (b % 4 == 0)  // once per 64-byte line of each row: ask for the same line of the next R rows
            KIMIK3_UNROLL for (int r = 0; r < R; ++r)
                _mm_prefetch(reinterpret_cast<const char*>(prow + std::size_t(r + R) * pstride + b * (kMxBlock / 2)), _MM_HINT_T0);
        __m512 lo[R], hi[R];
        KIMIK3_UNROLL for (int r = 0; r < R; ++r)
            decode_block_avx512(lo[r], hi[r], e2m1, shifts, prow + std::size_t(r) * pstride + b * (kMxBlock / 2), srow[std::size_t(r) * sstride + b]);
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            const __m512 x0 = _mm512_loadu_ps(xp + t * cols + b * kMxBlock), x1 = _mm512_loadu_ps(xp + t * cols + b * kMxBlock + kLanes);
            KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
                acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(lo[r], x0));  // columns 0-15 first,
                acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(hi[r], x1));  // then 16-31: lane order
            }
        }
    }
    // back to logical order in the register (lane l comes from position 2l, or 2(l - 8) + 1), then the tree,
    // in registers too (chapter 04a's hsum16_avx512). (Permuting through memory instead made g++ keep every
    // accumulator on the stack for the whole loop.)
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) y[std::size_t(t) * ldy + std::size_t(r)] = hsum16_avx512(_mm512_permutexvar_ps(order, acc[r][t]));
}

// Rows [r0, r1) for NT = 1..4 tokens: R1 rows at a time (one token only), then four, then one.
template <int NT, int R1>
KIMIK3_TARGET_AVX512 inline void mxfp4_few_tokens_avx512(float* y, std::size_t ldy, const float* xp, const std::uint8_t* packed,
                                                         const std::uint8_t* scales, std::size_t cols, std::size_t r0, std::size_t r1) {
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    std::size_t r = r0;
    if constexpr (NT == 1 && R1 > 4)
        for (; r1 - r >= std::size_t(R1); r += R1) mxfp4_rows_avx512<R1, 1>(y + r, ldy, xp, packed + r * prow, scales + r * srow, cols);
    for (; r1 - r >= 4; r += 4) mxfp4_rows_avx512<4, NT>(y + r, ldy, xp, packed + r * prow, scales + r * srow, cols);
    for (; r < r1; ++r) mxfp4_rows_avx512<1, NT>(y + r, ldy, xp, packed + r * prow, scales + r * srow, cols);
}

// Logical lane of position p of a sum stored from these registers (the table above).
struct Avx512Lanes {
    int lane[kLanes];
    constexpr Avx512Lanes() : lane{} {
        for (int p = 0; p < kLanes; ++p) lane[p] = avx512_column(p);
    }
};
inline constexpr Avx512Lanes kAvx512Lanes{};

// Rows [r0, r1). Up to 4 tokens: decoded in registers (above), the fastest measured at T <= 4; more:
// 4.3's tiles, decoded once into L1 (make bench; the 4 x 4 tile of registers cannot hold 16 tokens).
// R1: rows per pass for one token (4, or 8 on Zen 5: see matmul_mxfp4_avx512_zen5).
template <int R1>
KIMIK3_TARGET_AVX512 inline void mxfp4_range_avx512(float* y, const float* xp, const std::uint8_t* packed, const std::uint8_t* scales,
                                                    std::size_t tokens, std::size_t rows, std::size_t cols, std::size_t r0, std::size_t r1) {
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) KIMIK3_TARGET_AVX512 {
        const __m512 e2m1 = _mm512_loadu_ps(kE2M1.data());
        const __m512i shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
        for (int i = 0; i < nr; ++i) {
            const std::uint8_t* p = packed + (r + std::size_t(i)) * prow;  // (locals: the stores below may alias anything)
            const std::uint8_t* s = scales + (r + std::size_t(i)) * srow;
            float* out = tile + std::size_t(i) * kPanel;
            prefetch_mxfp4_ahead(p, s, c0, c1, cols);  // this row's next panel (the tiles' order, not one token's)
            for (std::size_t c = c0; c < c1; c += kMxBlock) {
                __m512 lo, hi;
                decode_block_avx512(lo, hi, e2m1, shifts, p + c / 2, s[c / kMxBlock]);
                _mm512_storeu_ps(out + (c - c0), lo);
                _mm512_storeu_ps(out + (c - c0) + kLanes, hi);
            }
        }
    };
    switch (tokens) {
        case 1: return mxfp4_few_tokens_avx512<1, R1>(y, rows, xp, packed, scales, cols, r0, r1);
        case 2: return mxfp4_few_tokens_avx512<2, R1>(y, rows, xp, packed, scales, cols, r0, r1);
        case 3: return mxfp4_few_tokens_avx512<3, R1>(y, rows, xp, packed, scales, cols, r0, r1);
        case 4: return mxfp4_few_tokens_avx512<4, R1>(y, rows, xp, packed, scales, cols, r0, r1);
        default: return mxfp4_token_tiles<Avx512Panel>(y, xp, tokens, rows, cols, r0, r1, kAvx512Lanes.lane, decode);
    }
}

}  // namespace detail
KIMIK3_AVX512_END

namespace detail {
template <int R1>
inline void matmul_mxfp4_avx512_rows(const char* name, float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales,
                                     std::size_t tokens, std::size_t rows, std::size_t cols) {
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    if (!cpu_has(Isa::avx512)) fail(ErrorKind::runtime, std::string(name) + ": this CPU has no AVX-512 (F, BW, DQ, VL)");
    std::vector<float>& xp = permuted_scratch(tokens * cols);
    for (std::size_t t = 0; t < tokens; ++t) permute_input_avx512(xp.data() + t * cols, x + t * cols, cols);
    const float* xpp = xp.data();
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) { mxfp4_range_avx512<R1>(y, xpp, packed, scales, tokens, rows, cols, r0, r1); });
}
}  // namespace detail

// Bit-identical to matmul_mxfp4_ref. Refused on a CPU without AVX-512 (the dispatcher never calls it there).
inline void matmul_mxfp4_avx512(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                                std::size_t rows, std::size_t cols) {  // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    detail::matmul_mxfp4_avx512_rows<4>("matmul_mxfp4_avx512", y, x, packed, scales, tokens, rows, cols);
}

// The same kernel with eight rows per pass for one token: eight independent chains of additions and
// each load of x shared eight ways (8 sums + 16 decoded registers + 2 of x: 26 of the 32). What bound
// the 4-row kernel on the AMD Zen 5 guest this project measures (family 26, 2 vCPUs) was not the
// multiplies (loading the scaled table instead of multiplying it changed nothing) but too few
// independent chains to hide the decode's shuffles. There, beside ggml's gemv_mxfp4_8x8_q8_0 (d99724f2,
// repacked, activations in int8: not exact) built in the same process, w1 3584 -> 3072, 1 thread,
// thread CPU time, medians of 7, 3 runs each: 4 rows 0.62-0.82x ggml streamed and 0.70-0.81x hot;
// 8 rows 0.96-1.03x streamed and 0.86-1.07x hot; on a quieter one (family 26 model 2, load 0.8-1.0, 5
// runs) 1.06-1.12x streamed and 1.13-1.18x hot, the 4-row kernel 0.64-0.70x and 0.72-0.76x. (Asking for
// the lines into L2 instead, or for the same row's line 0.5-1 kB ahead, was no faster there.) The Intel
// machine that tuned the 4-row kernel could not be measured again, so it keeps that one: 5.8's table
// prefers this one on AMD family 26 only.
inline void matmul_mxfp4_avx512_zen5(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                                     std::size_t rows, std::size_t cols) {  // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    detail::matmul_mxfp4_avx512_rows<8>("matmul_mxfp4_avx512_zen5", y, x, packed, scales, tokens, rows, cols);
}
#endif

// ---------------------------------------------------------------------------------------------------
// 5.9 The NEON kernel (arm64): two byte-table lookups per 16 codes
// ---------------------------------------------------------------------------------------------------
// arm64 has no 32-bit-lane table lookup like vpermps, but `tbl` looks 16 bytes up in a 16-byte table by
// the low byte of each lane. Every E2M1 value is exact in bf16 (at most 2 significant bits), so its f32
// bits are a 16-bit pattern followed by 16 zero bits, and two byte tables give the pattern:
//
//   code:            0     1     2     3     4     5     6     7     8 .. 15: the same, sign bit set
//   value:           0    0.5    1    1.5    2     3     4     6
//   bf16 pattern:  0000  3F00  3F80  3FC0  4000  4040  4080  40C0         8000  BF00 ... C0C0
//
//   per block of 32 codes (16 bytes): and 0x0F / ushr #4 split each byte into its even and odd column,
//   zip1 / zip2 put the 32 codes in column order (two registers of 16); per register of 16 codes:
//   tbl (high bytes), tbl (low bytes), zip1 / zip2 (16 bf16 patterns), shll #16 x 4 (16 f32 = kE2M1[code],
//   -0 for code 8), then fmul by the block's scale: exactly the reference's kE2M1[code] * scale.
//
// Lanes: register i of the block covers columns 32b + 4i .. 4i+3, i.e. logical lanes (4i) % 16: the
// natural order of the xsimd kernel (accumulator i % 4), so x is not permuted.
// Instruction count (the disassembly of aarch64-linux-gnu-g++ 12 -O2, one token): the inner loop is 54
// instructions per block of 32 weights inlined into the kernel, 56 in this function compiled alone (4 tbl,
// 6 zip, 8 shll/shll2, 16 fmul, 8 fadd, 7 loads, and the rest): 1.69-1.75 per weight, against about
// 300 instructions executed per block (9.4 per weight, 17 calls: xsimd 8.1's bit casts are not inlined)
// for the xsimd kernel of 5.5 on NEON. No ARM machine was available to time either: these are counts
// only (the README's kernel section compares them with the x86-64 kernels').
#if KIMIK3_NEON_KERNELS
namespace detail {

alignas(16) inline constexpr std::uint8_t kE2M1HighBytes[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                                                0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
alignas(16) inline constexpr std::uint8_t kE2M1LowBytes[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                                               0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};

// One MX block: w[i] = columns 4i .. 4i+3 of the block, decoded and scaled.
inline void decode_block_neon(float32x4_t (&w)[8], const std::uint8_t* pblock, std::uint8_t scale_byte) {  // pblock (16 bytes)
    const uint8x16_t bytes = vld1q_u8(pblock);
    const uint8x16_t even = vandq_u8(bytes, vdupq_n_u8(0x0F)), odd = vshrq_n_u8(bytes, 4);
    const uint8x16_t codes[2] = {vzip1q_u8(even, odd), vzip2q_u8(even, odd)};  // columns 0-15, 16-31
    const uint8x16_t high_table = vld1q_u8(kE2M1HighBytes), low_table = vld1q_u8(kE2M1LowBytes);
    const float32x4_t scale = vdupq_n_f32(kE8M0.value[scale_byte]);
    KIMIK3_UNROLL for (int h = 0; h < 2; ++h) {
        const uint8x16_t high = vqtbl1q_u8(high_table, codes[h]), low = vqtbl1q_u8(low_table, codes[h]);
        const uint16x8_t b0 = vreinterpretq_u16_u8(vzip1q_u8(low, high)), b1 = vreinterpretq_u16_u8(vzip2q_u8(low, high));
        w[4 * h + 0] = vmulq_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b0), 16)), scale);
        w[4 * h + 1] = vmulq_f32(vreinterpretq_f32_u32(vshll_high_n_u16(b0, 16)), scale);
        w[4 * h + 2] = vmulq_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b1), 16)), scale);
        w[4 * h + 3] = vmulq_f32(vreinterpretq_f32_u32(vshll_high_n_u16(b1, 16)), scale);
    }
}

inline float mxfp4_row_neon(const float* x, const std::uint8_t* prow, const std::uint8_t* srow, std::size_t cols) {
    // x (in), prow (in/2), srow (in/32)
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    for (std::size_t b = 0; b < cols / kMxBlock; ++b) {
        float32x4_t w[8];
        decode_block_neon(w, prow + b * (kMxBlock / 2), srow[b]);
        KIMIK3_UNROLL for (int i = 0; i < 8; ++i) acc[i % 4] = vaddq_f32(acc[i % 4], vmulq_f32(w[i], vld1q_f32(x + b * kMxBlock + std::size_t(4 * i))));
    }
    float lanes[kLanes];
    for (int a = 0; a < 4; ++a) vst1q_f32(lanes + 4 * a, acc[a]);
    return hsum16(lanes);
}

}  // namespace detail

// Bit-identical to matmul_mxfp4_ref. T tokens: 4.3's tiles, with the shim's inner loop (NEON already).
inline void matmul_mxfp4_neon(float* y, const float* x, const std::uint8_t* packed, const std::uint8_t* scales, std::size_t tokens,
                              std::size_t rows, std::size_t cols) {  // y (T, out), x (T, in), packed (out, in/2), scales (out, in/32)
    require_multiple("matvec_mxfp4", "in", cols, kMxBlock);
    const std::size_t prow = cols / 2, srow = cols / kMxBlock;
    auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) {
        for (int i = 0; i < nr; ++i) {
            const std::uint8_t* p = packed + (r + std::size_t(i)) * prow;
            const std::uint8_t* s = scales + (r + std::size_t(i)) * srow;
            detail::prefetch_mxfp4_ahead(p, s, c0, c1, cols);
            for (std::size_t c = c0; c < c1; c += kMxBlock) {
                float32x4_t w[8];
                detail::decode_block_neon(w, p + c / 2, s[c / kMxBlock]);
                for (int k = 0; k < 8; ++k) vst1q_f32(tile + std::size_t(i) * kPanel + (c - c0) + std::size_t(4 * k), w[k]);
            }
        }
    };
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        if (tokens > 1) return detail::mxfp4_token_tiles<detail::SimdPanel>(y, x, tokens, rows, cols, r0, r1, detail::kNaturalLanes, decode);
        for (std::size_t r = r0; r < r1; ++r) y[r] = detail::mxfp4_row_neon(x, packed + r * prow, scales + r * srow, cols);
    });
}
#endif

}  // namespace kimik3
