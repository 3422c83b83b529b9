// kimik3 chapter 08: mla -- Gated Multi-head Latent Attention over a latent KV cache.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   K3's 24 full-attention layers are softmax attention, but they never store per-head keys and values.
//   Each position leaves one 576-float latent in the cache (a 512-wide compressed KV, plus a 64-wide key
//   part shared by every head), and the per-head up-projections are folded into the query and the output
//   instead ("absorbed"). This chapter writes that absorbed form, the naive form it must equal, the
//   cache and its lifecycle (append, truncate, save, load), and the sigmoid output gate.
//   New since chapter 06: attention itself (scores, causal softmax, a weighted sum over positions); the
//   transposed product y += W^T x (sums that run down a column, not in 16 lanes, see 8.3); a cache that
//   grows with the context; reading a cache shared by all heads once per block of positions.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.5; its traps 5.1.2 and 5.1.9)
//   Layers 3, 7, 11, ..., 91 and 92 (0-based; config full_attn_layers is one-based). Per layer:
//     q_a_proj [1536, 7168] -> q_a_layernorm -> q_b_proj [18432 = 96 x 192, 1536]
//     kv_a_proj_with_mqa [576 = 512 + 64, 7168] -> kv_a_layernorm on the first 512 -> the cache
//     kv_b_proj [24576 = 96 x (128 + 128), 512]: per head W_UK (128 rows) then W_UV (128 rows)
//     g_proj [12288, 7168] (sigmoid gate), o_proj [7168, 12288].  232.2 M parameters = 464 MB of bf16.
//   The tiny K3: layers 3, 7, 11, 12; D 128, H 4, Q 64, R 32, N 32, X 16, Dv 32 (C = 48).
//
//   What the latent cache saves (f32; K3's 24 MLA layers; a position = one token of context):
//     latent    576 floats                      =   2,304 B per layer,     55,296 B per position
//     expanded  96 heads x (192 key + 128 value) = 122,880 B per layer,  2,949,120 B per position
//     at   8,192 positions:  latent   453 MB,  expanded  24.16 GB
//     at 131,072 positions:  latent  7.25 GB,  expanded 386.55 GB        ratio 122,880 / 2,304 = 53.3x
//
// CONCEPTS (letters local to this chapter; the legend's V is the vocabulary, so values are Dv wide)
//   Q q_lora_rank 1536   R kv_lora_rank 512   N qk_nope_head_dim 128   X qk_rope_head_dim 64
//   Dv v_head_dim 128    C = R + X = 576 (the cache width)             S cached positions
//   latent c_s   RMSNorm(kv_a_proj(u_s)[0:R]): what is cached instead of 96 heads of K and V.
//   k_x          kv_a_proj(u_s)[R:R+X]: raw, never normalised, never rotated (K3 is NoPE), shared by all
//                heads (trap 5.1.2 of docs/kimi-k3.md). The name "rope" survives from DeepSeek's MLA; nothing rotates here.
//   absorption   q_nope . (W_UK c_s) = (W_UK^T q_nope) . c_s = qbar . c_s, and
//                sum_s p_s (W_UV c_s) = W_UV (sum_s p_s c_s): the up-projections run once per token and
//                head, not once per cached position.
//   the gate     G = sigmoid(g_proj(u)) multiplies the 96 x 128 attention output before o_proj.
//
// NUMERICS CONTRACT (T tokens at the cache's end; token t sees positions 0 .. S0 + t, S0 = length before)
//   cq = rmsnorm(q_a_proj u, q_a_norm, 1e-6);  Qt = q_b_proj cq: head h = columns h(N+X) ..;
//        q_nope = Qt[h, 0:N], q_x = Qt[h, N:N+X].
//   kva = kv_a_proj u;  c = rmsnorm(kva[0:R], kv_a_norm, 1e-6);  k_x = kva[R:R+X]; appended as [c ; k_x].
//        Both norms take eps 1e-6, the class default Moonshot's code leaves in place, NOT rms_norm_eps
//        (trap 5.1.9 of docs/kimi-k3.md). Norm weights are bf16 widened to f32; projections are chapter 04's matvec.
//   qbar[h][j] = sum over i = 0..N-1 IN ORDER of W_UK[h][i][j] * q_nope[h][i], from +0, per column j.
//        A transposed product: the sum runs down column j of W_UK, and SIMD vectorises ACROSS columns, so
//        no lane ever mixes two columns and every width gives the same bits. It and ctx below are the
//        sums that are not in the 16-lane form; every other sum is.
//   score_h(s) = (dot(qbar_h, c_s) + dot(q_x_h, k_x_s)) * scale,  scale = 1.0f / sqrtf(float(N + X))
//        (192^-1/2, not 128^-1/2: the 64 shared dims count); dot = chapter 00's 16-lane dot.
//   p = softmax over s = 0 .. S0 + t: m = max score; e_s = exp_f32(score_s - m); denom = the 16-lane sum
//        of e (e_s in lane s % 16, then hsum16); p_s = e_s / denom. A NaN score makes that head's p NaN.
//   ctx_h[j] = sum over s ascending of p_s * c_s[j], from +0 (the same transposed product, in f32).
//   out_h[j] = dot_bf16(W_UV[h][j], ctx_h) (chapter 04's 16-lane row dot).
//   y = o_proj(attn * G), G = sigmoid(g_proj u) elementwise (scalar sigmoid, from the layer input u).
//   Shapes: any widths (the lane rule's tail, chapter 00). Threads split heads (8.5) and matrix rows
//   (chapter 04), never a sum: any thread count gives the same bits. Prefill of T tokens = T single
//   steps, bit for bit; a matrix streamed in row chunks = resident, bit for bit.
//   The naive form (8.6) expands K and V per head and position; it agrees with the absorbed form within
//   rounding (the tests name the tolerance), not bit for bit: the sums are associated differently.
//
// LEAVES OUT  HF's bf16 rounding points (this engine is f32, docs/kimi-k3.md 3.8); flash-attention's padding of V
//          to 192 (no effect on the math); a bf16 cache (half the bytes;
//          the f32 one is what the reference is compared against).
// SOURCES  DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434 (Multi-head Latent Attention and its absorbed
//          form); Kimi Linear, arXiv:2510.26692 (NoPE MLA in the KDA/MLA hybrid). docs/sources.md 08.
// USES     chapters 00 (dot, hsum16, sigmoid, parallel_rows), 02 (Config), 03 (rmsnorm), 04 (matmul_bf16,
//          MatrixRef, for_each_rows)
// RUN      make run-08        TEST   make test-08        BENCH   bench/bench_mla.hpp (make bench)
//
// SECTIONS
//   8.1 dims, weights, kernels     8.2 the latent KV cache         8.3 the transposed product y += W^T x
//   8.4 attention over the cache   8.5 the layer (absorbed form)
//   APPENDIX 08a_mla_naive.hpp: 8.6 the naive form (the yardstick the tests compare against), and the
//            cache's file form (MlaCache::save, load: 8.2). Included at the end of this file.
// ====================================================================================================
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "00_numerics.hpp"
#include "02_config.hpp"
#include "03_norms.hpp"
#include "04_matvec_bf16.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 8.1 Dims, weights, the record, and the kernel table
// ---------------------------------------------------------------------------------------------------
// The class default of Moonshot's q_a_layernorm / kv_a_layernorm (trap 5.1.9 of docs/kimi-k3.md; llama.cpp uses 1e-5).
inline constexpr float kMlaLoraEps = 1e-6f;

struct MlaDims {
    std::size_t hidden, heads, q_lora, kv_lora, nope, rope, v;  // D, H, Q, R, N, X, Dv: 7168, 96, 1536, 512, 128, 64, 128
    float eps = kMlaLoraEps;                                     // NOT rms_norm_eps

    static MlaDims from(const Config& c) {
        return MlaDims{std::size_t(c.hidden_size),  std::size_t(c.num_attention_heads), std::size_t(c.q_lora_rank),
                       std::size_t(c.kv_lora_rank), std::size_t(c.qk_nope_head_dim),    std::size_t(c.qk_rope_head_dim),
                       std::size_t(c.v_head_dim),   kMlaLoraEps};
    }
    std::size_t cache_width() const { return kv_lora + rope; }  // C = 576
    std::size_t qk() const { return nope + rope; }               // N + X = 192: the key width per head
    float scale() const { return 1.0f / std::sqrt(float(nope + rope)); }  // 192^-1/2 = 0.0721687...
};

struct MlaWeights {
    MatrixRef q_a_proj;      // (Q, D)
    const float* q_a_norm;   // (Q) widened to f32 (bf16 in the release)
    MatrixRef q_b_proj;      // (H*(N+X), Q)
    MatrixRef kv_a_proj;     // (R+X, D)
    const float* kv_a_norm;  // (R)
    MatrixRef kv_b_proj;     // (H*(N+Dv), R): per head, rows 0..N-1 = W_UK[h], rows N..N+Dv-1 = W_UV[h]
    MatrixRef g_proj;        // (H*Dv, D)
    MatrixRef o_proj;        // (D, H*Dv)
};

// What one call computed, under the names of the PyTorch reference's dump (tests and examples).
struct MlaRecord {
    std::vector<float> c;      // (T, R) latents after kv_a_layernorm
    std::vector<float> k_x;    // (T, X) the shared key part, raw
    std::vector<float> q;      // (T, H, N+X) q_b_proj output
    std::vector<float> probs;  // (H, T, S) S = cache length after the call; zeros past each token's window
    std::vector<float> attn;   // (T, H*Dv) attention output before the gate
    std::vector<float> gate;   // (T, H*Dv) sigmoid(g_proj u)
};

// The kernels the layer is made of, as a table: kMlaRef uses every _ref, kMlaSimd every _simd, and
// mla_forward picks one (the one dispatch point), so a test can run the whole layer both ways.
struct MlaKernels {
    void (*matmul)(WeightType, float*, const float*, const void*, std::size_t, std::size_t, std::size_t, std::size_t);  // 4.1-4.5
    void (*rmsnorm)(float*, const float*, const float*, std::size_t, float);                                // 3.1
    float (*dot)(const float*, const float*, std::size_t);                                                  // 0.5
    void (*matvec_t)(WeightType, float*, const float*, const void*, std::size_t, std::size_t);               // 8.3
    void (*matvec_t_f32)(float*, const float*, const float*, std::size_t, std::size_t, std::size_t);        // 8.3
    void (*matvec_f32)(float*, const float*, const float*, std::size_t, std::size_t, std::size_t);          // 8.4
};

namespace detail {
// y = W x for T tokens through a kernel table, wherever W's rows live (chapter 04's `linear`).
inline void mla_linear(const MlaKernels& k, float* y, const float* x, std::size_t tokens, const MatrixRef& w) {  // y (T, out), x (T, in)
    if (RowSplit* s = row_split(); s && !in_parallel()) return s->linear(k.matmul, y, x, tokens, w);  // chapter 17
    for_each_rows(w, [&](std::size_t r0, std::size_t r1, const void* rows) { k.matmul(w.type, y + r0, x, rows, tokens, r1 - r0, w.cols, w.rows); });
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// 8.2 The latent KV cache of one MLA layer
// ---------------------------------------------------------------------------------------------------
// Position s holds C floats: c_s (R, after kv_a_layernorm) then k_x_s (X, raw). Positions are only ever
// appended (a full cache is an error, never an overwrite: silently forgetting context would change the
// answer), dropped from the end (truncate: a session rewinds), or saved and loaded whole.
// Memory is reserved for `capacity` positions up front but committed by the OS only as positions are
// written, so a 128k-capacity cache costs what its used part costs.
class MlaCache {
  public:
    MlaCache(std::size_t capacity, std::size_t width, int layer) : capacity_(capacity), width_(width), layer_(layer) {
        data_.reserve(capacity * width);
    }
    MlaCache(const MlaCache& o) : capacity_(o.capacity_), width_(o.width_), layer_(o.layer_) {
        data_.reserve(capacity_ * width_);  // a copy keeps the full reservation (a vector copy would not)
        data_.insert(data_.end(), o.data_.begin(), o.data_.end());
    }
    MlaCache(MlaCache&&) = default;
    MlaCache& operator=(MlaCache&&) = default;
    MlaCache& operator=(const MlaCache& o) { return *this = MlaCache(o); }

    std::size_t length() const { return width_ ? data_.size() / width_ : 0; }
    std::size_t capacity() const { return capacity_; }
    std::size_t width() const { return width_; }
    int layer() const { return layer_; }
    const float* position(std::size_t s) const { return data_.data() + s * width_; }  // (C)
    const float* data() const { return data_.data(); }                                 // (S, C)

    // Fails unless `n` more positions fit; callers check before writing anything.
    void require_room(std::size_t n) const {
        if (length() + n > capacity_)
            fail(ErrorKind::runtime, "MLA layer " + std::to_string(layer_) + ": the KV cache is full (capacity " +
                                         std::to_string(capacity_) + " positions, " + std::to_string(length()) +
                                         " used, " + std::to_string(n) + " more asked for)");
    }
    float* append() {  // (C) the new position, zero-filled
        require_room(1);
        data_.resize(data_.size() + width_, 0.0f);  // within the reservation: never moves the data
        return data_.data() + data_.size() - width_;
    }
    void reset() { data_.clear(); }
    void truncate(std::size_t n) {
        if (n > length())
            fail(ErrorKind::usage, "MLA layer " + std::to_string(layer_) + ": truncate to " + std::to_string(n) +
                                       " positions, but the cache holds " + std::to_string(length()));
        data_.resize(n * width_);
    }

    // Binary form of the used part ("KK3MLAC1", layer, width, length, the positions): appendix 08a.
    void save(std::ostream& out) const;
    // Replaces the contents; refuses another layer's cache, another width, or more than the capacity.
    void load(std::istream& in);

  private:
    static constexpr char kMagic[9] = "KK3MLAC1";
    std::size_t capacity_, width_;
    int layer_;
    std::vector<float> data_;  // (S, C), reserved for (capacity, C)
};

// Bytes per cached position of one layer, f32: the latent, and what caching expanded K and V would take.
inline std::uint64_t mla_latent_bytes(const MlaDims& d) { return d.cache_width() * sizeof(float); }
inline std::uint64_t mla_expanded_bytes(const MlaDims& d) { return d.heads * (d.qk() + d.v) * sizeof(float); }

// ---------------------------------------------------------------------------------------------------
// 8.3 Absorbing W_UK: the transposed product y += W^T x
// ---------------------------------------------------------------------------------------------------
// qbar = W_UK^T q_nope, with W_UK stored row-major (N, R): a sum over ROWS, one per output column. The
// plain loop runs row by row, adding row r times x[r] into every column: column j sees rows 0, 1, 2, ...
// in order. It ACCUMULATES (y += ...), so a matrix whose rows arrive in chunks gives the same bits as a
// resident one: the caller zeroes y once and feeds the chunks in order.
inline void matvec_t_bf16_ref(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (cols), x (rows), w (rows, cols)
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < cols; ++j) y[j] = y[j] + bf16_to_f32(w[r * cols + j]) * x[r];
}

namespace detail {
// NC chunks of 16 columns, all rows. The accumulators are y's values in chapter 04's even/odd register
// order (lane_of), so that one 32-bit load of two bf16 weights feeds two registers with no shuffle.
template <int NC>
inline void matvec_t_block(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t stride) {  // y (16 NC), w (rows, stride)
    constexpr int A = simd::kBatchesPer16;
    simd::f32 acc[NC][A];
    float reg[kLanes];
    for (int n = 0; n < NC; ++n)  // y into register order
        for (int a = 0; a < A; ++a) {
            for (int j = 0; j < simd::W; ++j) reg[j] = y[n * kLanes + lane_of(a, j)];
            acc[n][a] = simd::load(reg);
        }
    const simd::u32 high_mask = simd::splat_u32(0xFFFF0000u);
    for (std::size_t r = 0; r < rows; ++r) {
        const simd::f32 xr = simd::splat(x[r]);
        KIMIK3_UNROLL for (int n = 0; n < NC; ++n) KIMIK3_UNROLL for (int q = 0; q < A / 2; ++q) {
            const simd::u32 u = simd::load_u32(w + r * stride + std::size_t(n * kLanes + q * 2 * simd::W));
            acc[n][2 * q] = acc[n][2 * q] + simd::as_f32(u << 16) * xr;            // columns 2j   (exact bf16)
            acc[n][2 * q + 1] = acc[n][2 * q + 1] + simd::as_f32(u & high_mask) * xr;  // columns 2j+1
        }
    }
    for (int n = 0; n < NC; ++n)  // and back to column order
        for (int a = 0; a < A; ++a) {
            simd::store(reg, acc[n][a]);
            for (int j = 0; j < simd::W; ++j) y[n * kLanes + lane_of(a, j)] = reg[j];
        }
}
}  // namespace detail

// Bit-identical to matvec_t_bf16_ref: every column still adds rows 0, 1, 2, ... in order, each product
// rounded, then added. The structural difference: 64 columns stay in registers for the whole row loop
// (then 16 at a time, then the last cols % 16 columns in plain code), instead of y being read and
// written once per row. No sum here crosses columns, so a column tail has no lane rule to keep.
inline void matvec_t_bf16_simd(float* y, const float* x, const bf16* w, std::size_t rows, std::size_t cols) {  // y (cols), x (rows), w (rows, cols)
    std::size_t j = 0;
    for (; cols - j >= 4 * kLanes; j += 4 * kLanes) detail::matvec_t_block<4>(y + j, x, w + j, rows, cols);
    for (; cols - j >= kLanes; j += kLanes) detail::matvec_t_block<1>(y + j, x, w + j, rows, cols);
    if (j < cols)
        for (std::size_t r = 0; r < rows; ++r)
            for (std::size_t c = j; c < cols; ++c) y[c] = y[c] + bf16_to_f32(w[r * cols + c]) * x[r];
}

// The same sum over f32 rows `stride` apart: ctx = sum_s p_s c_s is y += W^T x with the cached latents
// as the rows of W (stride C) and the probabilities as x.
inline void matvec_t_f32_ref(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                             std::size_t stride) {  // y (cols), x (rows), w (rows, stride)
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < cols; ++j) y[j] = y[j] + w[r * stride + j] * x[r];
}

// Bit-identical to the reference; the structural difference: 8 registers of y stay in registers for the
// whole row loop (then 1 at a time): eight independent sums hide the adder's latency (3x faster than four
// on the project's machine).
inline void matvec_t_f32_simd(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                              std::size_t stride) {  // y (cols), x (rows), w (rows, stride)
    constexpr std::size_t W = simd::W;
    std::size_t j = 0;
    for (; cols - j >= 8 * W; j += 8 * W) {
        simd::f32 acc[8];
        for (std::size_t a = 0; a < 8; ++a) acc[a] = simd::load(y + j + a * W);
        for (std::size_t r = 0; r < rows; ++r) {
            const simd::f32 xr = simd::splat(x[r]);
            KIMIK3_UNROLL for (std::size_t a = 0; a < 8; ++a) acc[a] = acc[a] + simd::load(w + r * stride + j + a * W) * xr;
        }
        for (std::size_t a = 0; a < 8; ++a) simd::store(y + j + a * W, acc[a]);
    }
    for (; cols - j >= W; j += W) {
        simd::f32 acc = simd::load(y + j);
        for (std::size_t r = 0; r < rows; ++r) acc = acc + simd::load(w + r * stride + j) * simd::splat(x[r]);
        simd::store(y + j, acc);
    }
    if (j < cols)  // the last cols % W columns, in plain code (column sums: no lanes to keep)
        for (std::size_t r = 0; r < rows; ++r)
            for (std::size_t c = j; c < cols; ++c) y[c] = y[c] + w[r * stride + c] * x[r];
}

inline void matvec_t_f32(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                         std::size_t stride) {  // y (cols), x (rows), w (rows, stride)
    use_simd ? matvec_t_f32_simd(y, x, w, rows, cols, stride) : matvec_t_f32_ref(y, x, w, rows, cols, stride);
}

// The transposed product over rows of any WeightType (chapter 04, 4.5): bf16 rows as above, F32 rows
// directly, F16 rows widened (exactly) one at a time into a buffer. Each column still adds rows 0, 1,
// 2, ... in order, so the three types give the bits the same weights would give as f32.
namespace detail {
template <class F32Kernel, class Bf16Kernel>
inline void matvec_t_typed(F32Kernel f32k, Bf16Kernel bf16k, WeightType type, float* y, const float* x, const void* w,
                           std::size_t rows, std::size_t cols) {  // y (cols), x (rows), w (rows, cols)
    if (type == WeightType::bf16) return bf16k(y, x, static_cast<const bf16*>(w), rows, cols);
    if (type == WeightType::f32) return f32k(y, x, static_cast<const float*>(w), rows, cols, cols);
    std::vector<float> row(cols);  // (cols) one widened F16 row
    for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t j = 0; j < cols; ++j) row[j] = widen(type, static_cast<const std::byte*>(w) + r * cols * 2, j);
        f32k(y, x + r, row.data(), 1, cols, cols);
    }
}
}  // namespace detail

inline void matvec_t_typed_ref(WeightType type, float* y, const float* x, const void* w, std::size_t rows, std::size_t cols) {
    detail::matvec_t_typed(matvec_t_f32_ref, matvec_t_bf16_ref, type, y, x, w, rows, cols);  // y (cols), x (rows), w (rows, cols)
}
inline void matvec_t_typed_simd(WeightType type, float* y, const float* x, const void* w, std::size_t rows, std::size_t cols) {
    detail::matvec_t_typed(matvec_t_f32_simd, matvec_t_bf16_simd, type, y, x, w, rows, cols);  // y (cols), x (rows), w (rows, cols)
}

// ---------------------------------------------------------------------------------------------------
// 8.4 Attention over the latent cache
// ---------------------------------------------------------------------------------------------------
// Scores are the cache times the query: y[r] = dot(W[r], x) over f32 rows `stride` apart, each the
// 16-lane dot of chapter 00.
inline void matvec_f32_ref(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                           std::size_t stride) {  // y (rows), x (cols), w (rows, stride)
    for (std::size_t r = 0; r < rows; ++r) y[r] = dot_ref(w + r * stride, x, cols);
}

// Bit-identical to the reference (every row keeps its own 16 lanes, filled in dot_simd's order); the
// structural difference: four rows at a time share each load of x.
inline void matvec_f32_simd(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                            std::size_t stride) {  // y (rows), x (cols), w (rows, stride)
    constexpr int A = simd::kBatchesPer16;
    const std::size_t whole = rows / 4 * 4;  // rows in groups of four, then the rest one by one
    const std::size_t full = full_chunks(cols);
    for (std::size_t r = 0; r < whole; r += 4) {
        simd::f32 acc[4][A];
        for (auto& row : acc)
            for (auto& v : row) v = simd::splat(0.0f);
        for (std::size_t i = 0; i < full; i += kLanes)
            KIMIK3_UNROLL for (int a = 0; a < A; ++a) {
                const simd::f32 xv = simd::load(x + i + std::size_t(a * simd::W));
                KIMIK3_UNROLL for (std::size_t q = 0; q < 4; ++q)
                    acc[q][a] = acc[q][a] + simd::load(w + (r + q) * stride + i + std::size_t(a * simd::W)) * xv;
            }
        float lanes[kLanes];
        for (std::size_t q = 0; q < 4; ++q) {
            for (int a = 0; a < A; ++a) simd::store(lanes + a * simd::W, acc[q][a]);
            const float* row = w + (r + q) * stride;
            y[r + q] = finish_tail(lanes, full, cols, [&](std::size_t i) { return row[i] * x[i]; });
        }
    }
    for (std::size_t r = whole; r < rows; ++r) y[r] = dot_simd(w + r * stride, x, cols);
}

inline void matvec_f32(float* y, const float* x, const float* w, std::size_t rows, std::size_t cols,
                       std::size_t stride) {  // y (rows), x (cols), w (rows, stride)
    use_simd ? matvec_f32_simd(y, x, w, rows, cols, stride) : matvec_f32_ref(y, x, w, rows, cols, stride);
}

namespace detail {
// In place: scores (n) -> probabilities. The max is exact in any order; the denominator is pinned
// (e_s in lane s % 16, hsum16); exp_f32 is chapter 00's in every path.
inline void mla_softmax(float* p, std::size_t n) {  // p (n)
    float m = p[0];
    for (std::size_t s = 1; s < n; ++s) m = p[s] > m ? p[s] : m;
    float lanes[kLanes] = {};
    for (std::size_t s = 0; s < n; ++s) {
        p[s] = exp_f32(p[s] - m);
        lanes[s % kLanes] = lanes[s % kLanes] + p[s];
    }
    const float denom = hsum16(lanes);
    for (std::size_t s = 0; s < n; ++s) p[s] = p[s] / denom;
}
}  // namespace detail

// One head of one token, after absorption: where its query is and where its results go.
struct MlaHeadQuery {
    const float* qbar;  // (R) W_UK[h]^T q_nope
    const float* q_x;   // (X) the query's shared-key part
    float* probs;       // (S) scores, then probabilities, for positions 0 .. len-1
    float* ctx;         // (R) out: sum_s p_s c_s
};

// Positions are visited in blocks, all the given heads per block: the cache (C floats per position,
// shared by every head) is read from memory once per block instead of once per head; a block of 32
// positions (74 KB at K3) stays in the L2 cache while the heads take turns. Each head's sums still run
// over positions in ascending order, so the blocking cannot change a bit.
inline constexpr std::size_t kMlaPositionBlock = 32;

inline void mla_attend(const MlaKernels& k, const MlaHeadQuery* heads, std::size_t n_heads, const float* cache,
                       std::size_t len, const MlaDims& d) {  // cache (len, C)
    const std::size_t R = d.kv_lora, X = d.rope, C = d.cache_width();
    const float scale = d.scale();
    // score_h(s) = (qbar_h . c_s + q_x_h . k_x_s) * scale: two 16-lane dots, added, then scaled
    float shared[kMlaPositionBlock];  // q_x_h . k_x_s for the block
    for (std::size_t s0 = 0; s0 < len; s0 += kMlaPositionBlock) {
        const std::size_t n = std::min(len - s0, kMlaPositionBlock);
        for (std::size_t h = 0; h < n_heads; ++h) {
            float* score = heads[h].probs + s0;
            k.matvec_f32(score, heads[h].qbar, cache + s0 * C, n, R, C);
            k.matvec_f32(shared, heads[h].q_x, cache + s0 * C + R, n, X, C);
            for (std::size_t i = 0; i < n; ++i) score[i] = (score[i] + shared[i]) * scale;
        }
    }
    for (std::size_t h = 0; h < n_heads; ++h) {
        detail::mla_softmax(heads[h].probs, len);
        std::fill_n(heads[h].ctx, R, 0.0f);
    }
    // ctx_h = sum_s p_h(s) c_s, positions ascending: a block of positions at a time (8.3's f32 form)
    for (std::size_t s0 = 0; s0 < len; s0 += kMlaPositionBlock)
        for (std::size_t h = 0; h < n_heads; ++h)
            k.matvec_t_f32(heads[h].ctx, heads[h].probs + s0, cache + s0 * C, std::min(len - s0, kMlaPositionBlock), R, C);
}

// ---------------------------------------------------------------------------------------------------
// 8.5 The layer, absorbed form
// ---------------------------------------------------------------------------------------------------
inline constexpr MlaKernels kMlaRef{matmul_typed_ref, rmsnorm_ref, dot_ref, matvec_t_typed_ref, matvec_t_f32_ref, matvec_f32_ref};
inline constexpr MlaKernels kMlaSimd{matmul_typed_simd, rmsnorm_simd, dot_simd, matvec_t_typed_simd, matvec_t_f32_simd, matvec_f32_simd};

// Several sequences in one step (chapter 13): rows [row0, row0 + tokens) are one sequence's, on its cache.
struct MlaSeq {
    std::size_t row0 = 0, tokens = 0;
    MlaCache* cache = nullptr;
};

namespace detail {
inline void mla_check(const MlaWeights& w, const MlaDims& d, const MlaCache& cache, std::size_t tokens, const char* where) {
    const std::string at = std::string(where) + " (layer " + std::to_string(cache.layer()) + ")";
    const std::size_t H = d.heads, D = d.hidden;
    auto shape = [&](const char* name, const MatrixRef& m, std::size_t rows, std::size_t cols) {
        if (m.rows != rows || m.cols != cols)
            fail(ErrorKind::usage, at + ": " + name + " is [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) +
                                       "], the dims want [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
    };
    shape("q_a_proj", w.q_a_proj, d.q_lora, D);
    shape("q_b_proj", w.q_b_proj, H * d.qk(), d.q_lora);
    shape("kv_a_proj", w.kv_a_proj, d.cache_width(), D);
    shape("kv_b_proj", w.kv_b_proj, H * (d.nope + d.v), d.kv_lora);
    shape("g_proj", w.g_proj, H * d.v, D);
    shape("o_proj", w.o_proj, D, H * d.v);
    if (cache.width() != d.cache_width())
        fail(ErrorKind::usage, at + ": the cache is " + std::to_string(cache.width()) + " wide, the dims want " +
                                   std::to_string(d.cache_width()));
    cache.require_room(tokens);  // before anything is written: a refused call leaves the cache as it was
}

// 3.5.1, 3.5.2 and the gate's input half of 3.5.5, shared by both forms: Qt (T, H, N+X), G (T, H*Dv)
// = sigmoid(g_proj u), and each sequence's new positions appended to its cache.
inline void mla_project(const MlaKernels& k, float* q, float* gate, const float* u, std::size_t T, const MlaWeights& w,
                        const MlaDims& d, std::span<const MlaSeq> seqs) {  // q (T, H*(N+X)), gate (T, H*Dv), u (T, D)
    const std::size_t Q = d.q_lora, R = d.kv_lora, X = d.rope;
    std::vector<float> cq(T * Q), kva(T * (R + X));  // (T, Q), (T, C)
    // query: cq = rmsnorm(q_a_proj u, eps 1e-6), Qt = q_b_proj cq
    mla_linear(k, cq.data(), u, T, w.q_a_proj);
    for (std::size_t t = 0; t < T; ++t) k.rmsnorm(&cq[t * Q], &cq[t * Q], w.q_a_norm, Q, d.eps);
    mla_linear(k, q, cq.data(), T, w.q_b_proj);
    // latent: [c~ ; k_x] = kv_a_proj u; the cache gets [rmsnorm(c~, eps 1e-6) ; k_x as is]
    mla_linear(k, kva.data(), u, T, w.kv_a_proj);
    for (const MlaSeq& sq : seqs)
        for (std::size_t t = sq.row0; t < sq.row0 + sq.tokens; ++t) {
            float* pos = sq.cache->append();
            k.rmsnorm(pos, &kva[t * (R + X)], w.kv_a_norm, R, d.eps);
            std::copy_n(&kva[t * (R + X) + R], X, pos + R);  // not normalised, not rotated (trap 5.1.2 of docs/kimi-k3.md)
        }
    // gate: G = sigmoid(g_proj u), from the layer's normalised input u, not from the attention output
    mla_linear(k, gate, u, T, w.g_proj);
    for (std::size_t i = 0; i < T * d.heads * d.v; ++i) gate[i] = sigmoid(gate[i]);
}

// 3.5.5: y = o_proj(attn * G); fills the record's fields every form shares.
inline void mla_output(const MlaKernels& k, float* y, std::vector<float>& attn, std::vector<float>& gate, std::vector<float>& q,
                       std::size_t T, const MlaWeights& w, const MlaDims& d, const MlaCache& cache, MlaRecord* record) {  // y (T, D)
    std::vector<float> gated(attn.size());  // (T, H*Dv)
    for (std::size_t i = 0; i < attn.size(); ++i) gated[i] = attn[i] * gate[i];
    mla_linear(k, y, gated.data(), T, w.o_proj);
    if (!record) return;
    const std::size_t R = d.kv_lora, X = d.rope, S0 = cache.length() - T;
    record->c.resize(T * R);
    record->k_x.resize(T * X);
    for (std::size_t t = 0; t < T; ++t) {
        std::copy_n(cache.position(S0 + t), R, &record->c[t * R]);
        std::copy_n(cache.position(S0 + t) + R, X, &record->k_x[t * X]);
    }
    record->q = std::move(q), record->attn = std::move(attn), record->gate = std::move(gate);
}
}  // namespace detail

// T tokens (a prefill or one decode step) at the cache's end: appends their T latents, then token t
// attends causally to positions 0 .. S0 + t. y (T, D); u (T, D) is the input_layernorm output. With
// several sequences (MlaSeq) the T rows are theirs one after another: every product runs once over all
// rows, and row t attends over its own sequence's cache only, so each gets the bits it gets alone.
inline void mla_forward_with(const MlaKernels& k, float* y, const float* u, std::size_t tokens, std::span<const MlaSeq> seqs,
                             const MlaWeights& w, const MlaDims& d, MlaRecord* record = nullptr) {  // y (T, D), u (T, D)
    std::size_t rows = 0;
    for (const MlaSeq& sq : seqs) {
        if (!sq.cache || sq.row0 != rows) fail(ErrorKind::usage, "mla_forward: the sequences must have caches and follow one another row by row");
        detail::mla_check(w, d, *sq.cache, sq.tokens, "mla_forward");
        rows += sq.tokens;
    }
    if (seqs.empty() || rows != tokens || (record && seqs.size() != 1))
        fail(ErrorKind::usage, "mla_forward: the sequences hold " + std::to_string(rows) + " rows of " + std::to_string(tokens) +
                                   (record ? " (a record watches one sequence)" : ""));
    const std::size_t T = tokens, H = d.heads, R = d.kv_lora, N = d.nope, NX = d.qk(), NV = d.nope + d.v, Dv = d.v;
    std::vector<float> q(T * H * NX), gate(T * H * Dv);  // (T, H, N+X), (T, H*Dv)
    detail::mla_project(k, q.data(), gate.data(), u, T, w, d, seqs);
    std::vector<const float*> cache_of(T);  // row t: its sequence's cache (stable within its reservation)
    std::vector<std::size_t> len_of(T);     // and the positions it sees
    std::size_t S = 0;
    for (const MlaSeq& sq : seqs)
        for (std::size_t t = 0; t < sq.tokens; ++t) {
            cache_of[sq.row0 + t] = sq.cache->data();
            len_of[sq.row0 + t] = sq.cache->length() - sq.tokens + t + 1;
            S = std::max(S, len_of[sq.row0 + t]);
        }
    // 8.5.1 absorb: qbar[h][t] = W_UK[h]^T q_nope[t][h]. kv_b_proj's rows come in order (resident: one
    // chunk); each chunk adds its W_UK rows to the heads it touches, heads split across threads.
    std::vector<float> qbar(H * T * R, 0.0f), ctx(H * T * R);  // (H, T, R) each
    const WeightType kv_type = w.kv_b_proj.type;
    const std::size_t kv_row = w.kv_b_proj.row_bytes();
    auto row_at = [&](const void* rows, std::size_t i) { return static_cast<const std::byte*>(rows) + i * kv_row; };
    for_each_rows(w.kv_b_proj, [&](std::size_t r0, std::size_t r1, const void* rows) {
        if (r1 <= r0) return;
        const std::size_t h0 = r0 / NV, h1 = (r1 - 1) / NV + 1;
        parallel_rows(h1 - h0, T * N * R, [&](std::size_t a, std::size_t b) {
            for (std::size_t h = h0 + a; h < h0 + b; ++h) {
                const std::size_t i0 = std::max(r0, h * NV), i1 = std::min(r1, h * NV + N);  // W_UK rows here
                for (std::size_t t = 0; i0 < i1 && t < T; ++t)
                    k.matvec_t(kv_type, &qbar[(h * T + t) * R], &q[(t * H + h) * NX + (i0 - h * NV)], row_at(rows, i0 - r0), i1 - i0, R);
            }
        });
    });

    // 8.5.2 attend: token t over positions 0 .. S0 + t of its cache, heads split across threads.
    if (record) record->probs.assign(H * T * S, 0.0f);
    parallel_rows(H, T * S * (2 * R + d.rope), [&](std::size_t h0, std::size_t h1) {
        std::vector<float> probs((h1 - h0) * S);  // (heads here, S)
        std::vector<MlaHeadQuery> hq(h1 - h0);
        for (std::size_t t = 0; t < T; ++t) {
            for (std::size_t h = h0; h < h1; ++h)
                hq[h - h0] = MlaHeadQuery{&qbar[(h * T + t) * R], &q[(t * H + h) * NX + N], &probs[(h - h0) * S], &ctx[(h * T + t) * R]};
            mla_attend(k, hq.data(), h1 - h0, cache_of[t], len_of[t], d);
            if (record)
                for (std::size_t h = h0; h < h1; ++h)
                    std::copy_n(&probs[(h - h0) * S], len_of[t], &record->probs[(h * T + t) * S]);
        }
    });

    // 8.5.3 values: attn[t][h] = W_UV[h] ctx[h][t], one 16-lane bf16 dot per output (chapter 04's kernel).
    // Heads split across threads; inside that region chapter 04's row split sees in_parallel() and runs
    // inline on its thread (no nested team). Either way rows are independent outputs: the same bits.
    std::vector<float> attn(T * H * Dv);  // (T, H*Dv)
    for_each_rows(w.kv_b_proj, [&](std::size_t r0, std::size_t r1, const void* rows) {
        if (r1 <= r0) return;
        const std::size_t h0 = r0 / NV, h1 = (r1 - 1) / NV + 1;
        parallel_rows(h1 - h0, T * Dv * R, [&](std::size_t a, std::size_t b) {
            for (std::size_t h = h0 + a; h < h0 + b; ++h) {
                const std::size_t j0 = std::max(r0, h * NV + N), j1 = std::min(r1, (h + 1) * NV);  // W_UV rows here
                if (j0 < j1) k.matmul(kv_type, &attn[h * Dv + (j0 - h * NV - N)], &ctx[h * T * R], row_at(rows, j0 - r0), T, j1 - j0, R, H * Dv);
            }
        });
    });

    // 8.5.4 gate and output projection
    detail::mla_output(k, y, attn, gate, q, T, w, d, *seqs.front().cache, record);
}
inline void mla_forward_with(const MlaKernels& k, float* y, const float* u, std::size_t tokens, const MlaWeights& w, const MlaDims& d,
                             MlaCache& cache, MlaRecord* record = nullptr) {  // one sequence: y (T, D), u (T, D)
    const MlaSeq one{0, tokens, &cache};
    mla_forward_with(k, y, u, tokens, std::span(&one, 1), w, d, record);
}
inline void mla_forward(float* y, const float* u, std::size_t tokens, const MlaWeights& w, const MlaDims& d, MlaCache& cache,
                        MlaRecord* record = nullptr) {  // y (T, D), u (T, D)
    mla_forward_with(use_simd ? kMlaSimd : kMlaRef, y, u, tokens, w, d, cache, record);
}

}  // namespace kimik3

// The appendix (it includes this lesson first): the naive form and the cache's save and load.
#include "08a_mla_naive.hpp"
