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
// x is read unpermuted. One token: rows 8 (or 16) at a time (independent chains of additions, each load
// of x shared; the plan below). Up to 4 tokens: the same loop with 4 rows x T sums in registers, each chunk widened once.
// More: 4.3's tiles (below). Every sum ends with hsum16's tree done in registers (hsum16_avx512).
#if KIMIK3_X86_KERNELS
KIMIK3_AVX512_BEGIN  // (g++ 12's false warnings on its own intrinsics: chapter 00's 0.9)
namespace detail {

// How one token streams the rows: how many rows at a time, how far ahead of each row's reads the kernel
// asks for its lines, and into which cache. This is the one thing that differs between the two AVX-512
// entries of 4.4's table (the bits never do). On the Xeon that tuned it first, the hardware prefetcher
// alone left one thread at 0.90-0.92 of what it reaches with a hint 2 kB ahead into L1 (0.5-8 kB
// measured). On a Zen 4 (2 cores shared with other work, q_proj, medians of 4 alternating runs of the
// same-run read ratio) that hint with 4 rows gave 0.60-0.62 of the read bandwidth; 8 rows with a hint
// 3 kB ahead into L2 (prefetcht1) 0.79 at 1 thread and 0.91 at 2. On a Zen 5 (AMD family 26, q_proj
// streamed, 1 thread, load 0.8, medians of 7 alternations of kernel and a same-run read) the Zen 4's
// plan ran at 0.86 of that read; into L1 (prefetcht0) it went faster the less it asked for in all,
// rows x distance, up to about 8-16 kB (L1 is 48 kB there, and x takes 28 kB of it): 8 rows 2 kB ahead
// 1.20x the Zen 4's plan, 16 rows 1 kB 1.31x, 16 rows 512 bytes 1.34x, 16 rows 2 kB 0.80x. Where x
// fills L1 by itself (o_proj, 12288 columns: 48 kB) 16 rows lost (0.73x) and 8 rows 2 kB ahead into L1
// gained 1.03-1.10x at 1 and 2 threads (1 kB into L2: 1.04-1.09x). So the Zen 5 kernel has two plans, by the
// width of x: up to 8192 columns (32 kB) the narrow one, past that the wide one. (Those reads were of a
// separate buffer. Held to a read of the kernel's own weights, as make bench now does, the Zen 5 plans
// reach 0.79-0.99 of it there and the Zen 4's 0.57-0.80: the README's kernel table. Measured that way,
// o_proj, 12 alternations in each of 3 processes, medians: 8 rows 1 kB ahead 0.79 of the read at 1
// thread and 2, 2 kB ahead 0.78 and 0.70; so the wide plan now asks 1 kB ahead. In make bench, 3 runs
// of each alternated, o_proj went 0.84-0.87 / 0.71-0.93 (1 / 2 threads) to 0.84-1.03 / 0.81-1.04: no
// worse, perhaps better, within that shared host's noise.)
struct Bf16Prefetch {
    int rows;           // rows at a time for one token (independent chains; each load of x shared)
    std::size_t bytes;  // how far ahead of the line being read
    int locality;       // __builtin_prefetch's: 3 = prefetcht0 (into L1), 2 = prefetcht1 (into L2)
};
inline constexpr Bf16Prefetch kBf16PrefetchDefault{8, 3072, 2};     // matmul_bf16_avx512 (Intel, Zen 4)
inline constexpr Bf16Prefetch kBf16PrefetchZen5{8, 1024, 3};        // matmul_bf16_avx512_zen5: the wide plan,
inline constexpr Bf16Prefetch kBf16PrefetchZen5Narrow{16, 512, 3};  // the narrow one (one token, x of at most
inline constexpr std::size_t kBf16NarrowCols = 8192;                 // this many columns)

template <Bf16Prefetch P>
KIMIK3_TARGET_AVX512 inline void prefetch_row_avx512(const bf16* p) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + P.bytes, 0, P.locality);  // (g++'s _mm_prefetch wants its own enum, clang's a literal)
}

KIMIK3_TARGET_AVX512 inline __m512 widen_bf16_avx512(const bf16* p) {  // 16 bf16 -> 16 f32, exact
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Chapter 00's tree (hsum16) in registers: the same 15 additions of the same pairs in the same order,
// lane i + lane i+8 (the two 256-bit halves), then i + i+4 (the 128-bit halves), i + i+2, and the last
// two. Storing the 16 lanes and adding them in scalar code cost ~70 cycles per output here (Zen 4: the
// loads wait for the wide store to forward), a fifth of a T-token matmul's time; this is a few cycles.
KIMIK3_TARGET_AVX512 inline float hsum16_avx512(__m512 v) {  // v: the 16 lanes in logical order
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // s4[0] + s4[2], s4[1] + s4[3]
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));  // s2[0] + s2[1]
}

// The end of a row's sum: the tree in registers when the row has no tail, else chapter 00's finish_tail.
template <class Product>
KIMIK3_TARGET_AVX512 inline float finish_avx512(__m512 acc, std::size_t full, std::size_t cols, Product&& product) {
    if (full == cols) return hsum16_avx512(acc);
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, acc);
    return finish_tail(lanes, full, cols, product);
}

// R rows x NT tokens straight from the weights: each chunk of each row widened once, in registers,
// for the NT tokens (R * NT sums, R weights and one input: 4 x 4 fills 21 of the 32 registers); each
// 64-byte line of each row also asks for the line P.bytes ahead. y (NT, ldy) at row 0, x (NT, in), w (R, in).
template <int R, int NT, Bf16Prefetch P>
KIMIK3_TARGET_AVX512 inline void bf16_block_avx512(float* y, std::size_t ldy, const float* x, const bf16* w, std::size_t cols) {
    __m512 acc[R][NT];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    const std::size_t full = full_chunks(cols);
    auto chunk = [&](std::size_t c) KIMIK3_TARGET_AVX512 {
        __m512 wv[R];
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) wv[r] = widen_bf16_avx512(w + std::size_t(r) * cols + c);
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            const __m512 xv = _mm512_loadu_ps(x + std::size_t(t) * cols + c);
            KIMIK3_UNROLL for (int r = 0; r < R; ++r) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(wv[r], xv));
        }
    };
    std::size_t c = 0;
    for (; c + 2 * kLanes <= full; c += 2 * kLanes) {
        KIMIK3_UNROLL for (int r = 0; r < R; ++r) prefetch_row_avx512<P>(w + std::size_t(r) * cols + c);
        chunk(c);
        chunk(c + kLanes);
    }
    if (c < full) chunk(c);
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            const bf16* wr = w + std::size_t(r) * cols;
            const float* xt = x + std::size_t(t) * cols;
            y[std::size_t(t) * ldy + std::size_t(r)] = finish_avx512(acc[r][t], full, cols, [&](std::size_t i) { return bf16_to_f32(wr[i]) * xt[i]; });
        }
}

// Rows [r0, r1) for NT = 1..4 tokens: P.rows at a time for one token, four for more (independent
// chains of additions, each load of x shared by the rows, that many streams of weights in flight), then one.
template <int NT, Bf16Prefetch P>
KIMIK3_TARGET_AVX512 inline void bf16_few_tokens_avx512(float* y, std::size_t ldy, const float* x, const bf16* w, std::size_t cols,
                                                        std::size_t r0, std::size_t r1) {
    constexpr int R = NT == 1 ? P.rows : 4;  // 8 or 16 x 1, or 4 x 4 sums, R weights, 1 input
    std::size_t r = r0;
    for (; r1 - r >= std::size_t(R); r += R) bf16_block_avx512<R, NT, P>(y + r, ldy, x, w + r * cols, cols);
    for (; r < r1; ++r) bf16_block_avx512<1, NT, P>(y + r, ldy, x, w + r * cols, cols);
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
// Its plan, measured on a Zen 4 (MXFP4 w1, 1 thread): one group of 4 rows per panel of x (blocks of 8,
// 16 or 32 rows were no faster: the x panel comes from L2 fast enough), panels of kPanel columns, token
// groups of at most 5 as even as possible (TilePlan's rule: 5 tokens make one group, not 4 + 1, which
// saved 0.15-0.3 ms of 2.0-2.4 at T = 5; groups of 6, 24 sums in 29 of the registers, gained nothing).
struct Avx512Panel : TilePlan<4, 5> {  // 20 sums + 4 weights + 1 input of 32 registers
    static constexpr int kBlockRows = kRows;
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
    // 4.3's end of a block of rows with the tree in registers (hsum16_avx512): position p of a stored sum
    // holds logical lane lane[p], so one vpermps by the inverse puts the sum in logical order.
    template <class Tail>
    KIMIK3_TARGET_AVX512 static void finish(float* y, std::size_t ldy, const float* sums, std::size_t tokens, std::size_t rb, std::size_t re,
                                            std::size_t full, std::size_t cols, const int (&lane)[kLanes], Tail& tail) {
        if (full != cols) return TilePlan::finish(y, ldy, sums, tokens, rb, re, full, cols, lane, tail);
        alignas(64) int at[kLanes];  // at[l]: the position that holds logical lane l
        for (int p = 0; p < kLanes; ++p) at[lane[p]] = p;
        const __m512i order = _mm512_load_si512(at);
        for (std::size_t r = rb; r < re; ++r)
            for (std::size_t t = 0; t < tokens; ++t)
                y[t * ldy + r] = hsum16_avx512(_mm512_permutexvar_ps(order, _mm512_loadu_ps(sums + ((r - rb) * tokens + t) * kLanes)));
    }
};

// Past 4 tokens: 4.3's tiles, the rows widened once into the tile (natural order), every token group
// multiplying it by its panel of x in L1, and the tree in registers (finish above). The plan this
// replaced, one row for 8 tokens at a time (measured best on a Zen 5 guest), read 8 tokens' x (229 kB
// at q_proj's width) from L2 for every row, and on a Zen 4 that bound it: q_proj, 1 thread, T = 16 took
// 68 ms streamed and 3.4 ms for 576 rows in cache against 42-48 and 1.8-2.2 ms with the tiles, and
// T = 2 and 4 (registers, above) 19.6 and 24.9 ms against 12.0-12.3 and 16.3-17.2 (thread CPU time).
// P: the plan (above); PN: the plan for one token when x has at most kBf16NarrowCols columns.
template <Bf16Prefetch P, Bf16Prefetch PN>
KIMIK3_TARGET_AVX512 inline void bf16_range_avx512(float* y, std::size_t ldy, const float* x, const bf16* w, std::size_t tokens,
                                                   std::size_t cols, std::size_t r0, std::size_t r1) {
    switch (tokens) {
        case 1:
            if (cols <= kBf16NarrowCols) return bf16_few_tokens_avx512<1, PN>(y, ldy, x, w, cols, r0, r1);
            return bf16_few_tokens_avx512<1, P>(y, ldy, x, w, cols, r0, r1);
        case 2: return bf16_few_tokens_avx512<2, P>(y, ldy, x, w, cols, r0, r1);
        case 3: return bf16_few_tokens_avx512<3, P>(y, ldy, x, w, cols, r0, r1);
        case 4: return bf16_few_tokens_avx512<4, P>(y, ldy, x, w, cols, r0, r1);
        default: break;
    }
    auto decode = [&](float* tile, std::size_t rt, int nr, std::size_t c0, std::size_t c1) KIMIK3_TARGET_AVX512 {  // widen, natural order
        for (int i = 0; i < nr; ++i) {
            const bf16* row = w + (rt + std::size_t(i)) * cols;  // (locals: the stores below may alias anything)
            float* out = tile + std::size_t(i) * kPanel;
            prefetch_ahead(reinterpret_cast<const char*>(row + c0) + P.bytes, 2 * (c1 - c0));  // (past the row: the next rows)
            for (std::size_t c = c0; c < c1; c += kLanes) _mm512_storeu_ps(out + (c - c0), widen_bf16_avx512(row + c));
        }
    };
    auto tail = [&](std::size_t rt, std::size_t t, std::size_t i) { return bf16_to_f32(w[rt * cols + i]) * x[t * cols + i]; };
    token_tiles<Avx512Panel>(y, ldy, x, tokens, r0, r1, cols, kNaturalLanes, decode, tail);
}

}  // namespace detail
KIMIK3_AVX512_END

namespace detail {
template <Bf16Prefetch P, Bf16Prefetch PN>
inline void matmul_bf16_avx512_with(const char* name, float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                                    std::size_t cols, std::size_t ldy) {
    if (!cpu_has(Isa::avx512)) fail(ErrorKind::runtime, std::string(name) + ": this CPU has no AVX-512 (F, BW, DQ, VL)");
    if (ldy == 0) ldy = rows;
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) { bf16_range_avx512<P, PN>(y, ldy, x, w, tokens, cols, r0, r1); });
}
}  // namespace detail

// Bit-identical to matmul_bf16_ref. Refused on a CPU without AVX-512 (the dispatcher never calls it there).
inline void matmul_bf16_avx512(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                               std::size_t ldy) {  // y (T, ldy), x (T, in), w (out, in)
    detail::matmul_bf16_avx512_with<detail::kBf16PrefetchDefault, detail::kBf16PrefetchDefault>("matmul_bf16_avx512", y, x, w, tokens, rows, cols, ldy);
}

// The same kernel with the Zen 5's plans (above: into L1, and 16 rows at a time for one token when x is
// at most 8192 columns): 4.4's table prefers it on AMD family 26.
inline void matmul_bf16_avx512_zen5(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                                    std::size_t ldy) {  // y (T, ldy), x (T, in), w (out, in)
    detail::matmul_bf16_avx512_with<detail::kBf16PrefetchZen5, detail::kBf16PrefetchZen5Narrow>("matmul_bf16_avx512_zen5", y, x, w, tokens, rows, cols, ldy);
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
