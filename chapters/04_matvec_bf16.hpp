// kimik3 chapter 04: matvec_bf16 -- y = W x with bf16 weights, exactly the same bits at any width.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   The kernel that moves most of K3's dense bytes: a matrix-vector product whose weights are bf16 and
//   whose activations are f32. New since chapter 03: the dot product becomes memory-bound (every weight
//   is used once per token), so the SIMD path is about loading 2-byte weights fast; and a SIMD register
//   can hold the 16 logical lanes in a permuted order, as long as each lane still sees its own products
//   in its own order. Also new: a T-token form that reads and decodes each weight once for T tokens
//   (prefill chunks, speculative verification), through a small tile of decoded rows in L1, giving per
//   token exactly the bits of T single matvecs; and a kernel family: the reference, the xsimd kernel
//   and ones written for AVX-512 and NEON (in the appendix 04a), one of which is chosen in one place (4.4).
//
// WHERE THIS SITS IN KIMI K3
//   Every projection outside the routed experts: KDA q/k/v/g [12288, 7168] and o_proj [7168, 12288],
//   MLA projections, the router [896, 7168], the latent down/up projections [3584, 7168]/[7168, 3584],
//   shared experts, the dense FFN of layer 0 [33792, 7168], and lm_head [163840, 7168]. Per token
//   about 111.1 GB of trunk weights pass through this kernel if nothing is resident: the 93 layers'
//   matrices (108.8 GB) plus lm_head (2.35 GB) (the release's tensor shapes, summed in docs/at-a-glance.md).
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
//   their lanes in plain code (chapter 00's finish_tail), as the reference does. Rows are split
//   across threads (never a row's sum), so 1 or N threads give the same bits.
//   matmul_bf16 (T tokens): Y[t][r] has exactly the bits of matvec_bf16 on token t alone.
//
// USES     chapter 00 (lanes, hsum16, shim, parallel_rows; 0.9 in 00a: the kernel choice)
// RUN      make run-04        TEST   make test-04        BENCH   make bench
//
// SECTIONS
//   4.1 the reference      4.2 the even/odd lane layout      4.3 T tokens, one read: tiles in L1
//   4.4 the xsimd kernel and the one dispatch point (AVX-512 and NEON bodies: APPENDIX 04a_bf16_kernels.hpp)
//   4.5 matrices stored as F32 or F16 (the same lane rule, widened exactly)
//   4.6 matrices that arrive in pieces (resident or streamed in row chunks: the same bits)
// ====================================================================================================
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "00a_isa.hpp"

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
// 4.3 T tokens, one read of the weights: a tile of decoded rows in L1
// ---------------------------------------------------------------------------------------------------
// One token reads every weight once and uses it once: memory-bound. T tokens (a prefill chunk, a
// speculative verification) should read and decode each weight ONCE and use it T times. Registers
// cannot hold T tokens' sums for several rows (T = 16, 4 rows: 64 sums of 16 lanes), so the plan is:
//
//   for each block of B rows:                                  (B = 8; the AVX-512 plan: B = R = 4)
//     sums[B][T] = 0                                           (16 lanes each, in memory: 8 kB at T = 16)
//     for each panel of P columns (in column order):          (P <= 256: the T tokens' slices in 16 kB)
//       for each group of R rows of the block:                  (R = 2 on 8-wide SIMD, 4 on AVX-512)
//         tile[R][P] = the R rows' weights of the panel, decoded to f32   <- once per weight
//         for each group of NT tokens:                                    <- T / NT times, from L1
//           load sums[R][NT]; for each 16-column chunk: sum += tile * x; store sums[R][NT]
//     y[t][r] = hsum16(sums[r][t] in logical lane order, then the tail columns)
//
// Each (row, token) sum still receives its products chunk by chunk in column order, lane by lane: the
// bits of one row and one token alone. The decoder decides the register order of the tile (and x is
// permuted the same way, 4.2); `lane[p]` says which logical lane position p of a stored sum is. The B
// rows of a block share each panel of x while it is in L1 (one row pair alone re-read all T tokens' x
// from L2 for every pair, which bound the loop on Zen 3); each decode asks for its rows' next panel.
// Who uses it: the xsimd and NEON bf16 kernels, the AVX-512 one past 4 tokens (04a), and the MXFP4
// kernels of chapter 05 (AVX2 and AVX-512 past 4 tokens). Up to 4 tokens those ISA kernels keep every
// sum in registers instead, each weight decoded once and used by every token without the tile's store.
inline constexpr std::size_t kPanel = 256;  // the widest panel, and the tile's row stride

namespace detail {

// Panel::run<NR, nt> for an nt (1 .. Panel::kTokens) known only when running.
template <class Panel, int NR, int NT = Panel::kTokens>
inline void run_panel(int nt, float* sums, std::size_t sums_t, const float* tile, const float* x, std::size_t x_stride, std::size_t n) {
    if constexpr (NT > 1)
        if (nt < NT) return run_panel<Panel, NR, NT - 1>(nt, sums, sums_t, tile, x, x_stride, n);
    Panel::template run<NR, NT>(sums, sums_t, tile, x, x_stride, n);
}

// The next group of `left` tokens, groups of at most `most`, as even as possible (16 tokens, at most 6:
// 6, 5, 5): a group of one or two tokens shares each load of the tile too little.
constexpr int even_group(std::size_t left, int most) {
    const std::size_t groups = (left + std::size_t(most) - 1) / std::size_t(most);
    return int((left + groups - 1) / groups);
}

// The plan visits a block of rows one panel at a time, an order the hardware prefetcher follows less
// well than one row after another: so each decode also asks for the same rows' next panel, the bytes
// [p, p + n) of each row (at most `n`; nothing past the row's end).
inline void prefetch_ahead(const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; i += 64) {
        __builtin_prefetch(static_cast<const char*>(p) + i);
        __asm__ volatile("");  // g++ 12 deleted some loops of nothing but prefetches as dead (its -ffinite-loops)
    }
}

// The T-token plan above for rows [r0, r1). Panel::run<NR, NT>(sums, sums_t, tile, x, x_stride, n) is the
// ISA's inner loop and Panel::finish its end of a block of rows (the tree: TilePlan's, or an ISA's in
// registers); decode(tile, row, nr, c0, c1) fills tile (nr, kPanel); tail(row, t, i) is the product of
// a column past the last full chunk (bf16 only: MXFP4 widths are multiples of 32).
template <class Panel, class Decode, class Tail>
inline void token_tiles(float* y, std::size_t ldy, const float* xp, std::size_t tokens, std::size_t r0, std::size_t r1,
                        std::size_t cols, const int (&lane)[kLanes], Decode&& decode, Tail&& tail) {
    // y (T, ldy), xp (T, in) in the decoder's order
    constexpr int R = Panel::kRows;
    constexpr std::size_t B = Panel::kBlockRows;  // rows that share each panel of x (a multiple of R)
    const std::size_t full = full_chunks(cols), pw = Panel::panel_cols(tokens), panels = (full + pw - 1) / pw;
    thread_local std::vector<int> groups;  // the token groups, worked out once (the rule may divide)
    groups.clear();
    for (std::size_t t = 0; t < tokens; t += std::size_t(groups.back())) groups.push_back(Panel::group(tokens - t));
    thread_local std::vector<float> sums_buf, tile_buf, x_buf;
    sums_buf.resize(B * tokens * kLanes);
    tile_buf.resize(std::size_t(R) * kPanel);
    x_buf.resize(panels * tokens * pw);
    float* sums = sums_buf.data();  // (B, T, 16)
    float* tile = tile_buf.data();  // (R, kPanel)
    float* xq = x_buf.data();       // (panels, T, pw): each panel's slice of every token, side by side
    // (Token rows of x are `in` floats apart; at K3's widths that is a multiple of 2 kB, so 16 tokens'
    // slices would fall into the same few L1 sets and evict each other. Contiguous, they fit.)
    for (std::size_t p = 0; p < panels; ++p)
        for (std::size_t t = 0; t < tokens; ++t)
            std::copy(xp + t * cols + p * pw, xp + t * cols + std::min(full, (p + 1) * pw), xq + (p * tokens + t) * pw);
    for (std::size_t rb = r0; rb < r1; rb += B) {
        const std::size_t re = std::min(r1, rb + B);
        std::fill(sums, sums + (re - rb) * tokens * kLanes, 0.0f);
        for (std::size_t c0 = 0; c0 < full; c0 += pw) {
            const std::size_t c1 = std::min(full, c0 + pw), n = c1 - c0;
            const float* xpanel = xq + c0 / pw * tokens * pw;
            for (std::size_t r = rb; r < re;) {
                const int nr = re - r >= std::size_t(R) ? R : 1;
                decode(tile, r, nr, c0, c1);
                float* s = sums + (r - rb) * tokens * kLanes;
                std::size_t t = 0;
                for (const int nt : groups) {
                    if (nr == R) run_panel<Panel, R>(nt, s + t * kLanes, tokens, tile, xpanel + t * pw, pw, n);
                    else run_panel<Panel, 1>(nt, s + t * kLanes, tokens, tile, xpanel + t * pw, pw, n);
                    t += std::size_t(nt);
                }
                r += std::size_t(nr);
            }
        }
        Panel::finish(y, ldy, sums, tokens, rb, re, full, cols, lane, tail);
    }
}

// The plan's defaults for a Panel with Rows x Tokens sums in registers: blocks of 16 rows share each
// panel of x, panels as wide as keep the T tokens' slices in 16 kB, token groups as even as possible.
template <int Rows, int Tokens> struct TilePlan {
    static constexpr int kRows = Rows, kTokens = Tokens, kBlockRows = 8;
    static constexpr int group(std::size_t left) { return even_group(left, kTokens); }
    static constexpr std::size_t panel_cols(std::size_t tokens) {
        return std::clamp<std::size_t>(4096 / tokens / 32 * 32, 32, kPanel);
    }
    // The outputs of rows [rb, re): each sum put back in logical lane order, the tail columns added, the tree.
    // sums: (row - rb, token) at sums + ((row - rb) * tokens + token) * 16.
    template <class Tail>
    static void finish(float* y, std::size_t ldy, const float* sums, std::size_t tokens, std::size_t rb, std::size_t re, std::size_t full,
                       std::size_t cols, const int (&lane)[kLanes], Tail& tail) {
        for (std::size_t r = rb; r < re; ++r)
            for (std::size_t t = 0; t < tokens; ++t) {
                const float* s = sums + ((r - rb) * tokens + t) * kLanes;
                float lanes[kLanes];
                for (int p = 0; p < kLanes; ++p) lanes[lane[p]] = s[p];
                y[t * ldy + r] = finish_tail(lanes, full, cols, [&](std::size_t c) { return tail(r, t, c); });
            }
    }
};

// g++ otherwise loads a weight or an input again at each of its uses (twice the loads, which then bind);
// an empty asm that "may change" the register keeps the one load. It changes no bit.
#if defined(__x86_64__) || defined(__i386__)
inline simd::f32 keep_loaded(simd::f32 v) {
    __asm__("" : "+x"(v.data));
    return v;
}
#elif defined(__aarch64__)
inline simd::f32 keep_loaded(simd::f32 v) {
    __asm__("" : "+w"(v.data));
    return v;
}
#else
inline simd::f32 keep_loaded(simd::f32 v) { return v; }
#endif

// The shim's inner loop: NR rows x NT tokens over n columns of a panel. A sum is 16/W registers, and
// register a only ever meets positions a*W .. a*W + W-1 of each 16-column chunk: the registers of a
// sum never meet, so the loop runs register 0 of every sum through the whole panel, then register 1,
// ...: one pass holds NR x NT registers, not 16/W times as many. Each lane's additions are unchanged.
// sums: (row, token) at sums + (row * sums_t + token) * 16; tile (NR, kPanel); x (NT, x_stride).
// (Not inlined: inside the caller the compiler kept the decoder's constants in registers and spilled sums.)
struct SimdPanel : TilePlan<2, 5> {  // 10 sums + 2 weights + 1 input + 1 product of 16 registers
    template <int NR, int NT>
    [[gnu::noinline]] static void run(float* sums, std::size_t sums_t, const float* tile, const float* x, std::size_t x_stride, std::size_t n) {
        for (std::size_t a = 0; a < kLanes; a += std::size_t(simd::W)) {
            simd::f32 acc[NR][NT];
            KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = simd::load(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes + a);
            for (std::size_t c = a; c < n; c += kLanes) {
                simd::f32 w[NR];
                KIMIK3_UNROLL for (int r = 0; r < NR; ++r) w[r] = keep_loaded(simd::load(tile + std::size_t(r) * kPanel + c));
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) {
                    const simd::f32 xv = keep_loaded(simd::load(x + std::size_t(t) * x_stride + c));
                    KIMIK3_UNROLL for (int r = 0; r < NR; ++r) acc[r][t] = acc[r][t] + w[r] * xv;
                }
            }
            KIMIK3_UNROLL for (int r = 0; r < NR; ++r)
                KIMIK3_UNROLL for (int t = 0; t < NT; ++t) simd::store(sums + (std::size_t(r) * sums_t + std::size_t(t)) * kLanes + a, acc[r][t]);
        }
    }
};

// Logical lane of position p of a sum stored from the even/odd registers of 4.2.
struct EvenOddLanes {
    int lane[kLanes];
    constexpr EvenOddLanes() : lane{} {
        for (int a = 0; a < simd::kBatchesPer16; ++a)
            for (int j = 0; j < simd::W; ++j) lane[a * simd::W + j] = lane_of(a, j);
    }
};
inline constexpr EvenOddLanes kEvenOddLanes{};
inline constexpr int kNaturalLanes[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // position p = lane p

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// 4.4 The xsimd kernel, and the one dispatch point
// ---------------------------------------------------------------------------------------------------
// Bit-identical to matmul_bf16_ref. The structural difference: lanes live in registers in the even/odd
// order of 4.2; one token runs four rows at a time straight from the weights, T tokens run the tiles
// of 4.3 (the tile is the rows widened into even/odd order, exactly as the registers hold them).
inline void matmul_bf16_simd(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    if (ldy == 0) ldy = rows;
    std::vector<float>& xp = detail::permuted_scratch(tokens * cols);
    for (std::size_t t = 0; t < tokens; ++t) detail::permute_input(xp.data() + t * cols, x + t * cols, cols);
    const float* xpp = xp.data();
    auto decode = [&](float* tile, std::size_t r, int nr, std::size_t c0, std::size_t c1) {  // widen, in register order
        const simd::u32 high_mask = simd::splat_u32(0xFFFF0000u);
        for (int i = 0; i < nr; ++i) {
            const bf16* row = w + (r + std::size_t(i)) * cols;  // (locals: the stores below may alias anything)
            float* out = tile + std::size_t(i) * kPanel;
            detail::prefetch_ahead(row + c1, 2 * (std::min(cols, 2 * c1 - c0) - c1));
            for (std::size_t c = c0; c < c1; c += 2 * simd::W) {
                const simd::u32 u = simd::load_u32(row + c);
                simd::store(out + (c - c0), simd::as_f32(u << 16));
                simd::store(out + (c - c0) + simd::W, simd::as_f32(u & high_mask));
            }
        }
    };
    auto tail = [&](std::size_t r, std::size_t t, std::size_t i) { return bf16_to_f32(w[r * cols + i]) * x[t * cols + i]; };
    parallel_rows(rows, cols * tokens, [&](std::size_t r0, std::size_t r1) {
        if (tokens > 1) return detail::token_tiles<detail::SimdPanel>(y, ldy, xpp, tokens, r0, r1, cols, detail::kEvenOddLanes.lane, decode, tail);
        std::size_t r = r0;
        for (; r1 - r >= 4; r += 4) detail::bf16_block<4, 1>(y + r, ldy, xpp, cols, w + r * cols, cols);
        for (; r < r1; ++r) detail::bf16_block<1, 1>(y + r, ldy, xpp, cols, w + r * cols, cols);
    });
}

inline void matvec_bf16_simd(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (out), x (in), w (out, in)
    matmul_bf16_simd(y, x, w, 1, rows, cols);
}

// The family, narrowest first: the reference, the shim's kernel, then the ones written for one
// instruction set (the appendix chapters/04a_bf16_kernels.hpp: NEON on arm64, AVX-512 on x86-64).
using Bf16Matmul = void (*)(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                            std::size_t ldy);  // y (T, ldy), x (T, in), w (out, in)
inline void matmul_bf16_avx512(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                               std::size_t ldy = 0);  // 04a (x86-64 builds only)
inline void matmul_bf16_avx512_zen5(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                                    std::size_t ldy = 0);  // 04a: prefetched for Zen 5
inline void matmul_bf16_neon(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows, std::size_t cols,
                             std::size_t ldy = 0);  // 04a (arm64 builds only)
inline constexpr Kernel<Bf16Matmul> kBf16Kernels[] = {
    {"reference", Isa::xsimd, matmul_bf16_ref},
    {"xsimd", Isa::xsimd, matmul_bf16_simd},
    {"neon", Isa::neon, KIMIK3_NEON_ONLY(matmul_bf16_neon)},
    {"avx512", Isa::avx512, KIMIK3_X86_ONLY(matmul_bf16_avx512)},
    {"avx512_zen5", Isa::avx512, KIMIK3_X86_ONLY(matmul_bf16_avx512_zen5), cpu_is_zen5},  // the same bits, prefetched for AMD family 26
};

// The kernel matmul_bf16 runs, in this one place: the reference when asked (KIMIK3_SCALAR by default),
// else the fastest this CPU runs, chosen once by chapter 00's rule (0.9).
inline const Kernel<Bf16Matmul>& bf16_kernel(bool reference = !use_simd) {
    static const Kernel<Bf16Matmul>& fastest = choose_kernel<Bf16Matmul>(kBf16Kernels, false);
    return reference ? kBf16Kernels[0] : fastest;
}
inline const char* bf16_kernel_name() { return bf16_kernel().name; }  // for the programs' banners

// y = W x for T tokens (T = 1 is the matvec); bit-identical whichever kernel runs.
inline void matmul_bf16(float* y, const float* x, const bf16* w, std::size_t tokens, std::size_t rows,
                        std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    bf16_kernel().fn(y, x, w, tokens, rows, cols, ldy == 0 ? rows : ldy);
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

// y = W x for a matrix of any WeightType: bf16 through the kernel 4.4 chose, F16/F32 through the above.
// `reference` picks the reference kernels (the default follows KIMIK3_SCALAR); chapter 08 names both.
inline void matmul_typed(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                         std::size_t cols, std::size_t ldy = 0, bool reference = !use_simd) {  // y (T, ldy), x (T, in), w (out, in)
    if (ldy == 0) ldy = rows;
    if (type == WeightType::bf16) return bf16_kernel(reference).fn(y, x, static_cast<const bf16*>(w), tokens, rows, cols, ldy);
    (reference ? matmul_wide_ref : matmul_wide_simd)(type, y, x, w, tokens, rows, cols, ldy);
}
inline void matmul_typed_ref(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                             std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    matmul_typed(type, y, x, w, tokens, rows, cols, ldy, true);
}
inline void matmul_typed_simd(WeightType type, float* y, const float* x, const void* w, std::size_t tokens, std::size_t rows,
                              std::size_t cols, std::size_t ldy = 0) {  // y (T, ldy), x (T, in), w (out, in)
    matmul_typed(type, y, x, w, tokens, rows, cols, ldy, false);
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
    // Rows [b, e) alone, read without the others, where the stream can (chapter 17: a rank's rows); false: it cannot.
    virtual bool for_each_chunk_in(std::size_t, std::size_t, const std::function<void(std::size_t, std::size_t, const void*)>&) { return false; }
};

struct RowRange {
    std::size_t begin = 0, end = 0;  // rows [begin, end)
};
struct MatrixRef {
    const void* data = nullptr;    // (rows, cols) row-major, when resident: row `held.begin` first
    RowStream* stream = nullptr;   // otherwise: rows arrive in chunks
    std::size_t rows = 0, cols = 0;
    WeightType type = WeightType::bf16;  // the release's; F16 and F32 checkpoints work too (4.5)
    RowRange held{0, SIZE_MAX};    // resident: the rows held (a rank's share, chapter 17); all by default
    std::size_t row_bytes() const { return cols * weight_bytes(type); }
    bool holds(std::size_t b, std::size_t e) const { return held.begin <= b && e <= std::min(held.end, rows); }
};
namespace detail {
[[noreturn]] inline void not_held(const MatrixRef& w, std::size_t b, std::size_t e) {
    fail(ErrorKind::runtime, "a matrix of " + std::to_string(w.rows) + " rows holds rows [" + std::to_string(w.held.begin) + ", " +
                                 std::to_string(std::min(w.held.end, w.rows)) + ") only (this process's share), not [" + std::to_string(b) + ", " +
                                 std::to_string(e) + ")");
}
}  // namespace detail

// Visits W's rows in order, in one piece when resident or chunk by chunk when streamed: for kernels
// that need the rows themselves (chapter 08's transposed products), not just W x.
inline void for_each_rows(const MatrixRef& w, const std::function<void(std::size_t r0, std::size_t r1, const void* rows)>& f) {
    if (w.data) return w.holds(0, w.rows) ? f(0, w.rows, w.data) : detail::not_held(w, 0, w.rows);
    if (!w.stream) fail(ErrorKind::runtime, "for_each_rows: a matrix with neither data nor a stream");
    w.stream->for_each_chunk(f);
}
// Rows [b, e) of W only (chapter 17: a rank's share): read alone where the stream can, else cut from its chunks.
inline void for_each_rows(const MatrixRef& w, std::size_t b, std::size_t e, const std::function<void(std::size_t, std::size_t, const void*)>& f) {
    if (b >= e) return;
    if (w.data) return w.holds(b, e) ? f(b, e, static_cast<const std::byte*>(w.data) + (b - w.held.begin) * w.row_bytes()) : detail::not_held(w, b, e);
    if (w.stream && w.stream->for_each_chunk_in(b, e, f)) return;
    for_each_rows(w, [&](std::size_t r0, std::size_t r1, const void* rows) {
        const std::size_t a = std::max(r0, b), z = std::min(r1, e);
        if (a < z) f(a, z, static_cast<const std::byte*>(rows) + (a - r0) * w.row_bytes());
    });
}

// Rows over processes (chapter 17). With a RowSplit installed, `linear` (and chapter 08's) hands it the
// product: it computes this process's contiguous rows and copies in the others' (each row's bits are
// its own, 4.1). None installed, the default: nothing changes.
using TypedMatmul = void (*)(WeightType, float*, const float*, const void*, std::size_t, std::size_t, std::size_t, std::size_t);
struct RowSplit {
    virtual ~RowSplit() = default;
    virtual void linear(TypedMatmul mm, float* y, const float* x, std::size_t tokens, const MatrixRef& w) = 0;  // y (T, out)
    virtual RowRange rows(std::size_t n) const = 0;  // the rows of an n-row matrix this process computes
};
inline RowSplit*& row_split() {
    static RowSplit* split = nullptr;
    return split;
}

// y = W x for T tokens, wherever W's rows live, whatever their WeightType. The whole chain of a bf16
// y = W x: linear -> matmul_typed -> the kernel 4.4 chose (e.g. matmul_bf16_avx512) -> its loop.
inline void linear(float* y, const float* x, std::size_t tokens, const MatrixRef& w) {  // y (T, out), x (T, in)
    if (RowSplit* s = row_split(); s && !in_parallel()) return s->linear(use_simd ? matmul_typed_simd : matmul_typed_ref, y, x, tokens, w);
    if (w.data && w.holds(0, w.rows)) return matmul_typed(w.type, y, x, w.data, tokens, w.rows, w.cols);
    for_each_rows(w, [&](std::size_t r0, std::size_t r1, const void* rows) {
        matmul_typed(w.type, y + r0, x, rows, tokens, r1 - r0, w.cols, w.rows);
    });
}

}  // namespace kimik3

// The kernels written for one instruction set (AVX-512, NEON) live in the appendix, which includes this file.
#include "04a_bf16_kernels.hpp"
