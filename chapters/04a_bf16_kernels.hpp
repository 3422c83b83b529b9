// kimik3 chapter 04, APPENDIX a: the bf16 kernels written for one instruction set (AVX-512).
// ====================================================================================================
//
// APPENDIX to chapter 04. The lesson (04_matvec_bf16.hpp) has the reference, the even/odd lane layout,
// the T-token tile plan (4.3), the xsimd kernel and the one dispatch point (4.4); this file has the
// bodies that only one instruction set can run, each a whole function guarded as a whole. The
// dispatcher of 4.4 names them in its table; chapter 00's appendix (0.9) chooses.
//
//   4a.1 AVX-512: one register is the 16 lanes (x86-64; picked when the CPU has AVX-512 F/BW/DQ/VL)
//   4a.2 NEON: shll #16 widens in column order (arm64)
//
// ====================================================================================================
#pragma once

#include "04_matvec_bf16.hpp"

#if KIMIK3_X86_KERNELS
#include <immintrin.h>
#endif
#if KIMIK3_NEON_KERNELS
#include <arm_neon.h>
#endif

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 4a.1 AVX-512: the 16 lanes in one register, in their natural order
// ---------------------------------------------------------------------------------------------------
// With 16 floats per register one 16-element chunk of a row is one register, so the even/odd split of
// 4.2 is not needed: vpmovzxwd widens 16 bf16 (32 bytes) into 16 32-bit lanes and a shift by 16 makes
// them f32, lane j = column j. One accumulator per (row, token) holds the 16 logical lanes as they are;
// x is read unpermuted. One token: rows four at a time (four independent chains of additions, each load
// of x shared). T tokens: one row for 8 tokens at a time (below: measured faster than 4.3's tiles here).
#if KIMIK3_X86_KERNELS
KIMIK3_AVX512_BEGIN  // (g++ 12's false warnings on its own intrinsics: chapter 00's 0.9)
namespace detail {

// How far ahead of each row's reads the kernel prefetches. The hardware prefetcher alone left one
// thread at 0.90-0.92 of what it reaches with this hint (2 kB measured best of 0.5-8 kB; 8 kB is worse).
inline constexpr std::size_t kPrefetchBytes = 2048;

KIMIK3_TARGET_AVX512 inline __m512 widen_bf16_avx512(const bf16* p) {  // 16 bf16 -> 16 f32, exact
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One token, R rows: each 64-byte line of each row also asks for the line 2 kB ahead.
template <int R>
KIMIK3_TARGET_AVX512 inline void bf16_rows_avx512(float* y, const float* x, const bf16* w, std::size_t cols) {
    // y (R) at row 0, x (in), w (R, in)
    __m512 acc[R];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const std::size_t full = full_chunks(cols);
    auto chunk = [&](std::size_t c) KIMIK3_TARGET_AVX512 {
        const __m512 xv = _mm512_loadu_ps(x + c);
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(widen_bf16_avx512(w + std::size_t(r) * cols + c), xv));
    };
    std::size_t c = 0;
    for (; c + 2 * kLanes <= full; c += 2 * kLanes) {
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + std::size_t(r) * cols + c) + kPrefetchBytes, _MM_HINT_T0);
        chunk(c);
        chunk(c + kLanes);
    }
    if (c < full) chunk(c);
    KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
        float lanes[kLanes];
        _mm512_storeu_ps(lanes, acc[r]);
        const bf16* wr = w + std::size_t(r) * cols;
        y[r] = finish_tail(lanes, full, cols, [&](std::size_t i) { return bf16_to_f32(wr[i]) * x[i]; });
    }
}

// g++ otherwise folds every use of a loaded register back into a memory operand (loading each weight
// NT times and each input NR times: twice the loads, which then bind). An empty asm that "may change"
// the register pins it: it changes no bit, and the compiler keeps the one load.
KIMIK3_TARGET_AVX512 inline __m512 keep_in_register(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

// The inner loop of 4.3's tiles on AVX-512: NR rows x NT tokens, one register per sum, n columns.
// sums: (row, token) at sums + (row * sums_t + token) * 16; tile (NR, kPanel); x (NT, x_stride).
// Its plan is the one measured when it was written (no AVX-512 machine measured the defaults of
// TilePlan): one group of 4 rows per panel of x, panels of kPanel columns, 4 tokens at a time, then 2, 1.
struct Avx512Panel : TilePlan<4, 4> {  // 16 sums + 4 weights + 1 input of 32 registers
    static constexpr int kBlockRows = kRows;
    static constexpr int group(std::size_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }
    static constexpr std::size_t panel_cols(std::size_t) { return kPanel; }
    template <int NR, int NT>
    KIMIK3_TARGET_AVX512 static void run(float* sums, std::size_t sums_t, const float* tile, const float* x, std::size_t x_stride, std::size_t n) {
        __m512 acc[NR][NT];
        KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
            KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_loadu_ps(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes);
        for (std::size_t c = 0; c < n; c += kLanes) {
            __m512 w[NR];
            KIMIK3_UNROLL for (int r = 0; r < NR; ++r) w[r] = keep_in_register(_mm512_loadu_ps(tile + std::size_t(r) * kPanel + c));
            KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
                const __m512 xv = keep_in_register(_mm512_loadu_ps(x + std::size_t(t) * x_stride + c));
                KIMIK3_UNROLL for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(w[r], xv));
            }
        }
        KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
            KIMIK3_UNROLL for (int t = 0; t < NT; ++t) _mm512_storeu_ps(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes, acc[r][t]);
    }
};

// T tokens: one row at a time, 8 tokens per read of the row (then the rest together). Measured against
// 4.3's tiles on the Zen 5 guest (q_proj 12288 x 7168, 1 thread, thread CPU time, 9 calls): T = 2
// 11.2 ms against 16.9, T = 16 38.8 against 44.9: a bf16 row needs no decode worth keeping, and the
// tiles' extra pass through L1 costs more than re-reading x from L2.
// One 16-column chunk at column c for R rows x NT tokens.
template <int R, int NT>
KIMIK3_TARGET_AVX512 inline void bf16_chunk_avx512(__m512 (&acc)[R][NT], const float* x, std::size_t x_stride, const bf16* w,
                                                   std::size_t cols, std::size_t c) {
    __m512 wv[R];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + std::size_t(r) * cols + c));
        wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // exact bf16 -> f32
    }
    KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
        const __m512 xv = _mm512_loadu_ps(x + std::size_t(t) * x_stride + c);
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(wv[r], xv));
    }
}

template <int R, int NT>
KIMIK3_TARGET_AVX512 inline void bf16_block_avx512(float* y, std::size_t y_stride, const float* x, std::size_t x_stride, const bf16* w,
                                                   std::size_t cols) {  // y (NT, stride) at row 0, x (NT, in), w (R, in)
    __m512 acc[R][NT];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    const std::size_t full = full_chunks(cols);
    std::size_t c = 0;
    for (; c + 2 * kLanes <= full; c += 2 * kLanes) {  // a 64-byte line of each row: ask for the line 2 kB ahead too
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + std::size_t(r) * cols + c) + kPrefetchBytes, _MM_HINT_T0);
        bf16_chunk_avx512<R, NT>(acc, x, x_stride, w, cols, c);
        bf16_chunk_avx512<R, NT>(acc, x, x_stride, w, cols, c + kLanes);
    }
    if (c < full) bf16_chunk_avx512<R, NT>(acc, x, x_stride, w, cols, c);
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            float lanes[kLanes];
            _mm512_storeu_ps(lanes, acc[r][t]);
            const bf16* wr = w + std::size_t(r) * cols;
            const float* xt = x + std::size_t(t) * x_stride;
            y[std::size_t(t) * y_stride + std::size_t(r)] =
                finish_tail(lanes, full, cols, [&](std::size_t i) { return bf16_to_f32(wr[i]) * xt[i]; });
        }
}

// One row for every token: 8 at a time, then the rest together.
KIMIK3_TARGET_AVX512 inline void bf16_tokens_avx512(float* y, std::size_t ldy, const float* x, const bf16* w, std::size_t tokens,
                                                    std::size_t cols) {
    std::size_t t = 0;
    for (; tokens - t >= 8; t += 8) bf16_block_avx512<1, 8>(y + t * ldy, ldy, x + t * cols, cols, w, cols);
    switch (tokens - t) {
        case 7: bf16_block_avx512<1, 7>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 6: bf16_block_avx512<1, 6>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 5: bf16_block_avx512<1, 5>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 4: bf16_block_avx512<1, 4>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 3: bf16_block_avx512<1, 3>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 2: bf16_block_avx512<1, 2>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        case 1: bf16_block_avx512<1, 1>(y + t * ldy, ldy, x + t * cols, cols, w, cols); break;
        default: break;
    }
}

KIMIK3_TARGET_AVX512 inline void bf16_range_avx512(float* y, std::size_t ldy, const float* x, const bf16* w, std::size_t tokens,
                                                   std::size_t cols, std::size_t r0, std::size_t r1) {
    std::size_t r = r0;
    if (tokens == 1) {
        for (; r1 - r >= 4; r += 4) bf16_rows_avx512<4>(y + r, x, w + r * cols, cols);
        for (; r < r1; ++r) bf16_rows_avx512<1>(y + r, x, w + r * cols, cols);
        return;
    }
    for (; r < r1; ++r) bf16_tokens_avx512(y + r, ldy, x, w + r * cols, tokens, cols);
}

}  // namespace detail
KIMIK3_AVX512_END

// Bit-identical to matmul_bf16_ref. Refused on a CPU without AVX-512 (the dispatcher never calls it there).
inline void matmul_bf16_avx512(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                               std::size_t ldy) {  // y (T, ldy), x (T, in), w (out, in)
    if (!cpu_has(Isa::avx512)) fail(ErrorKind::runtime, "matmul_bf16_avx512: this CPU has no AVX-512 (F, BW, DQ, VL)");
    if (ldy == 0) ldy = rows;
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) { detail::bf16_range_avx512(y, ldy, x, w, tokens, cols, r0, r1); });
}
#endif

// ---------------------------------------------------------------------------------------------------
// 4a.2 NEON: `shll #16` widens 4 bf16 to 4 f32 in column order
// ---------------------------------------------------------------------------------------------------
// The shim's kernel (4.2) compiles on arm64, but xsimd 8.1's NEON integer shifts were not inlined by
// aarch64-linux-gnu-g++ -O2: its inner loop is 28 instructions and 2 calls per 8 weights. Here 16 bf16 (two
// registers of 8 x u16) and four `shll`/`shll2 #16` give columns 0-3, 4-7, 8-11, 12-15 as f32, exactly
// (bf16 -> f32 appends 16 zero bits), so register a holds logical lanes 4a .. 4a+3: the natural order,
// and x is read as it is. One token: 4 rows x 4 registers of sums (16 of the 32 registers), each load
// of x shared by the 4 rows; T tokens: 4.3's tiles with the shim's inner loop (its float operations
// are single NEON instructions). Disassembly (aarch64-linux-gnu-g++ 12 -O2), one token: 68 instructions
// per 16 columns of 4 rows (16 shll/shll2, 16 fmul, 16 fadd, 13 loads, 3 spills): 1.06 per weight.
#if KIMIK3_NEON_KERNELS
namespace detail {

inline void widen_bf16_neon(float32x4_t (&w)[4], const bf16* p) {  // 16 bf16 -> 16 f32, exact, column order
    const uint16x8_t lo = vld1q_u16(p), hi = vld1q_u16(p + 8);
    w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(lo), 16));
    w[1] = vreinterpretq_f32_u32(vshll_high_n_u16(lo, 16));
    w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(hi), 16));
    w[3] = vreinterpretq_f32_u32(vshll_high_n_u16(hi, 16));
}

template <int R>
inline void bf16_rows_neon(float* y, const float* x, const bf16* w, std::size_t cols) {  // y (R) at row 0, x (in), w (R, in)
    float32x4_t acc[R][4];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int a = 0; a < 4; ++a) acc[r][a] = vdupq_n_f32(0.0f);
    const std::size_t full = full_chunks(cols);
    for (std::size_t c = 0; c < full; c += kLanes) {
        float32x4_t xv[4];
        KIMIK3_UNROLL for (int a = 0; a < 4; ++a) xv[a] = vld1q_f32(x + c + std::size_t(4 * a));
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
            float32x4_t wv[4];
            widen_bf16_neon(wv, w + std::size_t(r) * cols + c);
            KIMIK3_UNROLL for (int a = 0; a < 4; ++a) acc[r][a] = vaddq_f32(acc[r][a], vmulq_f32(wv[a], xv[a]));
        }
    }
    KIMIK3_UNROLL for (int r = 0; r < R; ++r) {
        float lanes[kLanes];
        KIMIK3_UNROLL for (int a = 0; a < 4; ++a) vst1q_f32(lanes + 4 * a, acc[r][a]);
        const bf16* wr = w + std::size_t(r) * cols;
        y[r] = finish_tail(lanes, full, cols, [&](std::size_t i) { return bf16_to_f32(wr[i]) * x[i]; });
    }
}

}  // namespace detail

// Bit-identical to matmul_bf16_ref.
inline void matmul_bf16_neon(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                             std::size_t ldy) {  // y (T, ldy), x (T, in), w (out, in)
    if (ldy == 0) ldy = rows;
    auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) {
        for (int i = 0; i < nr; ++i) {
            detail::prefetch_ahead(w + (r + std::size_t(i)) * cols + c1, 2 * (std::min(cols, 2 * c1 - c0) - c1));
            for (std::size_t c = c0; c < c1; c += kLanes) {
                float32x4_t wv[4];
                detail::widen_bf16_neon(wv, w + (r + std::size_t(i)) * cols + c);
                for (int a = 0; a < 4; ++a) vst1q_f32(tile + std::size_t(i) * kPanel + (c - c0) + std::size_t(4 * a), wv[a]);
            }
        }
    };
    auto tail = [&](std::size_t r, std::size_t t, std::size_t i) { return bf16_to_f32(w[r * cols + i]) * x[t * cols + i]; };
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        if (tokens > 1) return detail::token_tiles<detail::SimdPanel>(y, ldy, x, tokens, r0, r1, cols, detail::kNaturalLanes, decode, tail);
        std::size_t r = r0;
        for (; r1 - r >= 4; r += 4) detail::bf16_rows_neon<4>(y + r, x, w + r * cols, cols);
        for (; r < r1; ++r) detail::bf16_rows_neon<1>(y + r, x, w + r * cols, cols);
    });
}
#endif

}  // namespace kimik3
