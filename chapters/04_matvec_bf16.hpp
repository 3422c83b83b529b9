// kimik3 chapter 04: matvec_bf16 -- y = W x with bf16 weights, exactly the same bits at any width.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   The kernel that moves most of K3's dense bytes: a matrix-vector product whose weights are bf16 and
//   whose activations are f32. New since chapter 03: the dot product becomes memory-bound (every weight
//   is used once per token), so the SIMD path is about loading 2-byte weights fast; and a SIMD register
//   can hold the 16 logical lanes in a permuted order, as long as each lane still sees its own products
//   in its own order. Also new: a multi-token form that reads each weight row once for T tokens (what
//   prefill needs), giving per token exactly the bits of T single matvecs, and a kernel for AVX-512
//   (picked when the program runs) whose registers hold the 16 lanes as they are.
//
// WHERE THIS SITS IN KIMI K3
//   Every projection outside the routed experts: KDA q/k/v/g [12288, 7168] and o_proj [7168, 12288],
//   MLA projections, the router [896, 7168], the latent down/up projections [3584, 7168]/[7168, 3584],
//   shared experts, the dense FFN of layer 0 [33792, 7168], and lm_head [163840, 7168]. Per token
//   about 108.8 GB of trunk weights pass through this kernel if nothing is resident (the release's tensor
//   shapes, summed in docs/at-a-glance.md).
//
// CONCEPTS
//   row-major [out, in]   W[r][c] at element r*in + c: one output's weights are contiguous.
//   even/odd split        one 32-bit load holds two bf16 weights. Shifting left by 16 gives the even
//                         element as an f32; masking the low half away gives the odd one. No
//                         conversion instruction is needed: bf16 -> f32 is "append 16 zero bits".
//   permuted lanes        after the split, register a holds logical lanes
//                           q*2W + 2j + p   (a = 2q + p, j = 0..W-1)
//                         for W = 8: even register = lanes 0,2,..,14, odd = 1,3,..,15. The input x is
//                         permuted the same way once per call, and the 16 sums are put back into
//                         logical order before hsum16. Each lane's sequence of additions is unchanged.
//
//         W = 8, one chunk of 16 bf16 (32 bytes) loaded as 8 x u32:
//         u32 lane j:   [ w(2j+1) : high 16 | w(2j) : low 16 ]
//         u << 16        -> f32 w(2j)      (register "even", logical lanes 0,2,...,14)
//         u & 0xFFFF0000 -> f32 w(2j+1)    (register "odd",  logical lanes 1,3,...,15)
//
// NUMERICS CONTRACT
//   y[r] = hsum16(lanes), lane l = sum over i = l, l+16, l+32, ... (in that order) of
//   bf16_to_f32(W[r][i]) * x[i], each product rounded, then added. `in` and `out` are anything: the
//   SIMD kernel runs the whole 16-element chunks in registers and adds the last in % 16 products into
//   their lanes in plain code (chapter 00's finish_tail), as the reference does. Rows are split across threads (never a row's sum), so 1 or N threads give the same bits.
//   matmul_bf16 (T tokens): Y[t][r] has exactly the bits of matvec_bf16 on token t alone.
//
// USES     chapter 00 (lanes, hsum16, shim, parallel_rows)
// RUN      make run-04        TEST   make test-04        BENCH   make bench
//
// SECTIONS
//   4.1 the reference      4.2 the even/odd lane layout      4.3 the SIMD kernels (xsimd, AVX-512)
//   4.4 dispatch
//   4.5 matrices stored as F32 or F16 (the same lane rule, widened exactly)
//   4.6 matrices that arrive in pieces (resident or streamed in row chunks: the same bits)
// ====================================================================================================
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "00_numerics.hpp"

#if KIMIK3_X86_KERNELS
#include <immintrin.h>
#endif

namespace kimik3 {

static_assert(std::endian::native == std::endian::little, "the weight formats are little-endian and loaded as such");

// ---------------------------------------------------------------------------------------------------
// 4.1 The reference: one row, one token, 16 lanes
// ---------------------------------------------------------------------------------------------------
inline float dot_bf16_ref(const bf16* w, const float* x, std::size_t n) {  // w (n), x (n)
    float acc[kLanes] = {};
    for (std::size_t i = 0; i < n; ++i) acc[i % kLanes] = acc[i % kLanes] + bf16_to_f32(w[i]) * x[i];
    return hsum16(acc);
}

// y = W x for T tokens: Y[t][r] = dot(W[r], X[t]). T = 1 is the plain matvec. Token t's outputs start
// at y + t * ldy (ldy = out unless the caller writes a slice of a wider output, see 4.6).
inline void matmul_bf16_ref(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                            std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (ldy == 0) ldy = rows;
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r)
            for (std::size_t t = 0; t < tokens; ++t) y[t * ldy + r] = dot_bf16_ref(w + r * cols, x + t * cols, cols);
    });
}

inline void matvec_bf16_ref(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (out), x (in), w (out, in)
    matmul_bf16_ref(y, x, w, 1, rows, cols);
}

// ---------------------------------------------------------------------------------------------------
// 4.2 The even/odd lane layout (shared with the MXFP4 kernel of chapter 05)
// ---------------------------------------------------------------------------------------------------
namespace detail {

// Logical lane held by lane j of accumulator register a (a = 2q + p, p = 0 even, 1 odd).
constexpr int lane_of(int a, int j) { return (a / 2) * 2 * simd::W + 2 * j + (a % 2); }

// xp = x with every whole 16-element chunk permuted into register order (16/W registers of W lanes
// each); the last n % 16 elements (the tail, added in plain code) stay in natural order.
inline void permute_input(float* xp, const float* x, std::size_t n) {  // xp (n), x (n)
    const std::size_t full = full_chunks(n);
    for (std::size_t c = 0; c < full; c += kLanes)
        for (int a = 0; a < simd::kBatchesPer16; ++a)
            for (int j = 0; j < simd::W; ++j) xp[c + std::size_t(a * simd::W + j)] = x[c + std::size_t(lane_of(a, j))];
    std::copy(x + full, x + n, xp + full);
}

// The 16 accumulator lanes put back in logical order (then chapter 00's finish_tail and the one tree).
inline void lanes_in_order(float lanes[kLanes], const simd::f32* acc) {  // acc (16/W registers)
    float reg[kLanes];
    for (int a = 0; a < simd::kBatchesPer16; ++a) simd::store(reg + a * simd::W, acc[a]);
    for (int a = 0; a < simd::kBatchesPer16; ++a)
        for (int j = 0; j < simd::W; ++j) lanes[lane_of(a, j)] = reg[a * simd::W + j];
}

// The inner loop: R rows x NT tokens at once, so that each weight load feeds NT tokens and each x load
// feeds R rows, and R*NT*16/W independent additions are in flight. Every (row, token) pair keeps its
// own 16/W registers, updated chunk by chunk in order: the same bits as one row and one token alone.
template <int R, int NT>
inline void bf16_block(float* y, std::size_t y_stride, const float* xp, std::size_t x_stride, const bf16* w,
                       std::size_t cols) {  // y (NT, stride) at row 0, xp (NT, in) permuted, w (R, in)
    constexpr int A = simd::kBatchesPer16;
    simd::f32 acc[R][NT][A];
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t)
            for (int a = 0; a < A; ++a) acc[r][t][a] = simd::splat(0.0f);
    const simd::u32 high_mask = simd::splat_u32(0xFFFF0000u);
    const std::size_t full = full_chunks(cols);
    for (std::size_t c = 0; c < full; c += kLanes) {
        for (int q = 0; q < A / 2; ++q) {       // one u32 load = 2W bf16 = one even + one odd register
            simd::f32 xe[NT], xo[NT];
            for (int t = 0; t < NT; ++t) {
                xe[t] = simd::load(xp + std::size_t(t) * x_stride + c + std::size_t(2 * q) * simd::W);
                xo[t] = simd::load(xp + std::size_t(t) * x_stride + c + std::size_t(2 * q + 1) * simd::W);
            }
            for (int r = 0; r < R; ++r) {
                const simd::u32 u = simd::load_u32(w + std::size_t(r) * cols + c + std::size_t(q) * 2 * simd::W);
                const simd::f32 we = simd::as_f32(u << 16);           // elements 2j   (exact bf16 -> f32)
                const simd::f32 wo = simd::as_f32(u & high_mask);     // elements 2j+1 (exact bf16 -> f32)
                for (int t = 0; t < NT; ++t) {
                    acc[r][t][2 * q] = acc[r][t][2 * q] + we * xe[t];
                    acc[r][t][2 * q + 1] = acc[r][t][2 * q + 1] + wo * xo[t];
                }
            }
        }
    }
    KIMIK3_UNROLL for (int r = 0; r < R; ++r)
        KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
            float lanes[kLanes];
            lanes_in_order(lanes, acc[r][t]);
            const bf16* wr = w + std::size_t(r) * cols;
            const float* xt = xp + std::size_t(t) * x_stride;  // the tail of xp is in natural order
            y[std::size_t(t) * y_stride + std::size_t(r)] =
                finish_tail(lanes, full, cols, [&](std::size_t i) { return bf16_to_f32(wr[i]) * xt[i]; });
        }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// 4.3 The SIMD kernels
// ---------------------------------------------------------------------------------------------------
// Bit-identical to matmul_bf16_ref. The structural difference: lanes live in registers in the even/odd
// order of 4.2, and rows (one token) or tokens (several) are processed four at a time.
inline void matmul_bf16_simd(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (ldy == 0) ldy = rows;
    std::vector<float>& xp = detail::permuted_scratch(tokens * cols);
    for (std::size_t t = 0; t < tokens; ++t) detail::permute_input(xp.data() + t * cols, x + t * cols, cols);
    const float* xpp = xp.data();
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        if (tokens == 1) {
            std::size_t r = r0;
            for (; r1 - r >= 4; r += 4) detail::bf16_block<4, 1>(y + r, ldy, xpp, cols, w + r * cols, cols);
            for (; r < r1; ++r) detail::bf16_block<1, 1>(y + r, ldy, xpp, cols, w + r * cols, cols);
            return;
        }
        for (std::size_t r = r0; r < r1; ++r) {
            std::size_t t = 0;
            for (; tokens - t >= 4; t += 4) detail::bf16_block<1, 4>(y + t * ldy + r, ldy, xpp + t * cols, cols, w + r * cols, cols);
            for (; t < tokens; ++t) detail::bf16_block<1, 1>(y + t * ldy + r, ldy, xpp + t * cols, cols, w + r * cols, cols);
        }
    });
}

inline void matvec_bf16_simd(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (out), x (in), w (out, in)
    matmul_bf16_simd(y, x, w, 1, rows, cols);
}

// The AVX-512 kernel (part of 4.3): the 16 lanes in one register, in their natural order.
// Compiled into every x86-64 build and used when the CPU has AVX-512 (chapter 00's 0.9). With 16 floats
// per register one 16-element chunk of a row is one register, so the even/odd split of 4.2 is not
// needed: vpmovzxwd widens 16 bf16 (32 bytes) into 16 32-bit lanes and a shift by 16 makes them f32,
// lane j = column j. One accumulator per (row, token) holds the 16 logical lanes as they are; x is
// read unpermuted. Rows four at a time when there is one token (four independent chains of additions
// and each load of x shared), tokens eight at a time otherwise.
#if KIMIK3_X86_KERNELS
KIMIK3_AVX512_BEGIN  // (g++ 12's false warnings on its own intrinsics: chapter 00's 0.9)
namespace detail {

// How far ahead of each row's reads the kernel prefetches. The hardware prefetcher alone left one
// thread at 0.90-0.92 of what it reaches with this hint (2 kB measured best of 0.5-8 kB; 8 kB is worse).
inline constexpr std::size_t kPrefetchBytes = 2048;

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
    if (tokens == 1)
        for (; r1 - r >= 4; r += 4) bf16_block_avx512<4, 1>(y + r, ldy, x, cols, w + r * cols, cols);
    for (; r < r1; ++r) bf16_tokens_avx512(y + r, ldy, x, w + r * cols, tokens, cols);
}

}  // namespace detail
KIMIK3_AVX512_END
#endif

// Bit-identical to matmul_bf16_ref. Refused on a CPU without AVX-512 (the dispatcher never calls it there).
inline void matmul_bf16_avx512(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                               std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (cpu_isa() < Isa::avx512) fail(ErrorKind::runtime, "matmul_bf16_avx512: this CPU has no AVX-512 (F, BW, DQ, VL)");
    if (ldy == 0) ldy = rows;
#if KIMIK3_X86_KERNELS
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) { detail::bf16_range_avx512(y, ldy, x, w, tokens, cols, r0, r1); });
#else
    (void)y, (void)x, (void)w, (void)tokens, (void)cols;
#endif
}

// ---------------------------------------------------------------------------------------------------
// 4.4 Dispatch: the reference under KIMIK3_SCALAR, else AVX-512 where the CPU has it, else xsimd
// ---------------------------------------------------------------------------------------------------
inline void matmul_bf16_fast(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    isa_enabled(Isa::avx512) ? matmul_bf16_avx512(y, x, w, tokens, rows, cols, ldy) : matmul_bf16_simd(y, x, w, tokens, rows, cols, ldy);
}

// The name of the kernel matmul_bf16 runs (for the programs' banners).
inline const char* bf16_kernel_name() { return !use_simd ? "reference" : isa_enabled(Isa::avx512) ? "avx512" : simd::arch_name(); }

inline void matmul_bf16(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                        std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    use_simd ? matmul_bf16_fast(y, x, w, tokens, rows, cols, ldy) : matmul_bf16_ref(y, x, w, tokens, rows, cols, ldy);
}

inline void matvec_bf16(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (out), x (in), w (out, in)
    matmul_bf16(y, x, w, 1, rows, cols);
}

// ---------------------------------------------------------------------------------------------------
// 4.5 Matrices stored as F32 or F16
// ---------------------------------------------------------------------------------------------------
// The release stores every dense matrix as bf16, but Moonshot's own code saves whatever dtype a module
// holds: a checkpoint written from float32 or float16 modules is the same model. Both widen to f32
// exactly (chapter 00), so the same lane rule gives the products the bits they would have had as f32
// weights: y[r] = sum over i, element i into lane i % 16, of W[r][i] * x[i]. The reference widens one
// element at a time; the SIMD path widens a row into a small buffer and runs chapter 00's dot_simd on
// it (the widening is exact, so where it happens cannot change a bit). These matrices are rare, so
// this favours one obviously correct kernel over a fast one.
enum class WeightType : std::uint8_t { bf16, f16, f32 };  // how a dense matrix's elements are stored

inline std::size_t weight_bytes(WeightType t) { return t == WeightType::f32 ? 4 : 2; }
inline const char* weight_type_name(WeightType t) { return t == WeightType::bf16 ? "BF16" : t == WeightType::f16 ? "F16" : "F32"; }

namespace detail {
// Element i of a row, exactly as f32. Through memcpy: a row may start at any byte (a data section is
// not aligned to anything in particular), and memcpy of 2 or 4 bytes compiles to one load.
inline float widen(WeightType t, const void* row, std::size_t i) {
    const std::byte* p = static_cast<const std::byte*>(row);
    if (t == WeightType::f32) {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        return f;
    }
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return t == WeightType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}
}  // namespace detail

inline void matmul_wide_ref(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                            std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in) F32 or F16
    if (ldy == 0) ldy = rows;
    const std::size_t row_bytes = cols * weight_bytes(type);
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        for (std::size_t r = r0; r < r1; ++r) {
            const void* wr = static_cast<const std::byte*>(w) + r * row_bytes;
            for (std::size_t t = 0; t < tokens; ++t) {
                float acc[kLanes] = {};
                for (std::size_t i = 0; i < cols; ++i) acc[i % kLanes] = acc[i % kLanes] + detail::widen(type, wr, i) * x[t * cols + i];
                y[t * ldy + r] = hsum16(acc);
            }
        }
    });
}

// Bit-identical to matmul_wide_ref (the structural difference: a row is widened once into a buffer,
// then dot_simd runs on it for every token).
inline void matmul_wide_simd(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in) F32 or F16
    if (ldy == 0) ldy = rows;
    const std::size_t row_bytes = cols * weight_bytes(type);
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        std::vector<float> row(type == WeightType::f32 ? 0 : cols);  // (in) one widened row
        for (std::size_t r = r0; r < r1; ++r) {
            const void* wr = static_cast<const std::byte*>(w) + r * row_bytes;
            const float* wf = static_cast<const float*>(wr);
            if (type != WeightType::f32) {
                for (std::size_t i = 0; i < cols; ++i) row[i] = detail::widen(type, wr, i);
                wf = row.data();
            }
            for (std::size_t t = 0; t < tokens; ++t) y[t * ldy + r] = dot_simd(wf, x + t * cols, cols);
        }
    });
}

// One entry point per path for a matrix of any WeightType (bf16 goes to 4.1-4.4), and the dispatcher.
inline void matmul_typed_ref(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (type == WeightType::bf16) return matmul_bf16_ref(y, x, static_cast<const bf16*>(w), tokens, rows, cols, ldy);
    matmul_wide_ref(type, y, x, w, tokens, rows, cols, ldy);
}
inline void matmul_typed_simd(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                              std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (type == WeightType::bf16) return matmul_bf16_fast(y, x, static_cast<const bf16*>(w), tokens, rows, cols, ldy);
    matmul_wide_simd(type, y, x, w, tokens, rows, cols, ldy);
}
inline void matmul_typed(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                         std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    use_simd ? matmul_typed_simd(type, y, x, w, tokens, rows, cols, ldy) : matmul_typed_ref(type, y, x, w, tokens, rows, cols, ldy);
}

// ---------------------------------------------------------------------------------------------------
// 4.6 Matrices that arrive in pieces
// ---------------------------------------------------------------------------------------------------
// A weight matrix is either resident (one pointer) or streamed: chapter 12 delivers its rows in chunks
// through a small ring of buffers, so that K3's 2.35 GB lm_head or 0.48 GB dense down-projection needs
// only a few MB of memory at a time. Every output row's dot product is computed on its own (4.1), so
// cutting the rows into chunks cannot change a bit of y: `linear` is the same function either way.
struct RowStream {
    virtual ~RowStream() = default;
    // Calls f(r0, r1, rows) for consecutive chunks that cover [0, total rows) in order; `rows` points at
    // row r0 (in the matrix's WeightType) and stays valid until f returns.
    virtual void for_each_chunk(const std::function<void(std::size_t r0, std::size_t r1, const void* rows)>& f) = 0;
};

struct MatrixRef {
    const void* data = nullptr;    // (rows, cols) row-major, when resident
    RowStream* stream = nullptr;   // otherwise: rows arrive in chunks
    std::size_t rows = 0, cols = 0;
    WeightType type = WeightType::bf16;  // the release's; F16 and F32 checkpoints work too (4.5)
    std::size_t row_bytes() const { return cols * weight_bytes(type); }
};

// Visits W's rows in order, in one piece when resident or chunk by chunk when streamed: for kernels
// that need the rows themselves (chapter 08's transposed products), not just W x.
inline void for_each_rows(const MatrixRef& w, const std::function<void(std::size_t r0, std::size_t r1, const void* rows)>& f) {
    if (w.data) return f(0, w.rows, w.data);
    if (!w.stream) fail(ErrorKind::runtime, "for_each_rows: a matrix with neither data nor a stream");
    w.stream->for_each_chunk(f);
}

// y = W x for T tokens, wherever W's rows live, whatever their WeightType.
inline void linear(float* y, const float* x, std::size_t tokens, const MatrixRef& w) {  // y (T, out), x (T, in)
    for_each_rows(w, [&](std::size_t r0, std::size_t r1, const void* rows) {
        matmul_typed(w.type, y + r0, x, rows, tokens, r1 - r0, w.cols, w.rows);
    });
}

}  // namespace kimik3
