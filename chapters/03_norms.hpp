// kimik3 chapter 03: norms -- RMSNorm, the KDA L2 norm, and the gated per-head norm.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   The first real kernels, and the first use of the chapter-00 pattern "reference, then SIMD,
//   bit-identical, one dispatcher". Three normalisations appear in K3, and they differ in details that
//   a plausible implementation gets wrong: mean versus sum of squares, where epsilon goes, what eps is.
//   New since chapter 02: an element-wise template written once for `float` and for a SIMD batch.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 0.1, 3.3, 3.4.4, 3.4.6)
//   RMSNorm          before every attention and FFN (2 x 93), the model's final norm, the latent MoE
//                    norm (3584 wide), the MLA q_a/kv_a norms (1536 and 512 wide, eps 1e-6), and inside
//                    every AttnRes mix (chapter 09). Width D = 7168, eps = 1e-5.
//   L2 norm          KDA normalises q and k per head (Dh = 128) by the square root of the SUM of
//                    squares plus 1e-6; q is then scaled by Dh^-1/2.
//   gated head norm  KDA's output: per head RMSNorm (eps 1e-5) with one weight shared by all heads,
//                    times sigmoid of the output gate. 96 heads x 128 at K3 size.
//
// CONCEPTS
//   rms(x)        sqrt(mean_i x_i^2); RMSNorm divides by it (with eps inside the root) and scales by gamma.
//   KimiRMSNorm   HF rounds the normalised x to bf16 before multiplying by gamma; this engine computes
//                 in f32 throughout (docs/kimi-k3.md 3.8), so the rounding points are ours, fixed below.
//
// NUMERICS CONTRACT
//   rmsnorm:     ss = sum_squares(x) (16 lanes + hsum16);  mean = ss / float(n);
//                inv = 1.0f / sqrtf(mean + eps);           y[i] = (x[i] * inv) * gamma[i]
//   l2norm:      ss as above;  inv = 1.0f / sqrtf(ss + 1e-6f);  c = inv * scale;  y[i] = x[i] * c
//                (scale = 1 for k, Dh^-1/2 for q; with scale 1, c == inv exactly)
//   head norm:   per head h, over its Dh values: mean and inv as rmsnorm with eps;
//                y[h,i] = ((o[h,i] * inv_h) * w[i]) * sigmoid(g[h,i])      (sigmoid from chapter 00)
//   Any n (and Dh): sums follow chapter 00's lane rule with its tail; the element-wise steps have no
//   order to keep, so SIMD code runs W at a time and finishes the last n % W in plain code.
//   y may alias x (the sum is taken before anything is written).
//   Each product and sum is rounded once, in the order written; there is no FMA.
//
// SOURCES  Zhang and Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019, arXiv:1910.07467;
//          fla-org/flash-linear-attention (fla/modules/l2norm.py, fused_norm_gate.py). docs/sources.md 03.
// USES     chapter 00 (lanes, hsum16, sum_squares, the SIMD shim, sigmoid)
// RUN      make run-03        TEST   make test-03
//
// SECTIONS
//   3.1 RMSNorm      3.2 the KDA L2 norm      3.3 the gated per-head norm
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstddef>

#include "00_numerics.hpp"

namespace kimik3 {

// The element-wise step every norm ends with, written once for float and for simd::f32 (so the reference and SIMD paths cannot round differently):
// (x * inv) * g, two roundings in this order.
template <class V> inline V scale_mul(V x, V inv, V g) { return (x * inv) * g; }

// ---------------------------------------------------------------------------------------------------
// 3.1 RMSNorm:  y = gamma * x / sqrt(mean(x^2) + eps)
// ---------------------------------------------------------------------------------------------------
inline float rms_inverse(float sum_squares, std::size_t n, float eps) {
    const float mean = sum_squares / float(n);
    return 1.0f / std::sqrt(mean + eps);
}

inline void rmsnorm_ref(float* y, const float* x, const float* gamma, std::size_t n, float eps) {  // y (n), x (n), gamma (n)
    const float inv = rms_inverse(sum_squares_ref(x, n), n, eps);
    for (std::size_t i = 0; i < n; ++i) y[i] = scale_mul(x[i], inv, gamma[i]);
}

// Bit-identical to rmsnorm_ref; the structural difference: the sum of squares and the final scaling
// run W lanes at a time.
inline void rmsnorm_simd(float* y, const float* x, const float* gamma, std::size_t n, float eps) {  // y (n), x (n), gamma (n)
    const float inv_s = rms_inverse(sum_squares_simd(x, n), n, eps);
    const simd::f32 inv = simd::splat(inv_s);
    const std::size_t whole = n / simd::W * simd::W;  // then the last n % W in plain code
    for (std::size_t i = 0; i < whole; i += simd::W) simd::store(y + i, scale_mul(simd::load(x + i), inv, simd::load(gamma + i)));
    for (std::size_t i = whole; i < n; ++i) y[i] = scale_mul(x[i], inv_s, gamma[i]);
}

inline void rmsnorm(float* y, const float* x, const float* gamma, std::size_t n, float eps) {  // y (n), x (n), gamma (n)
    use_simd ? rmsnorm_simd(y, x, gamma, n, eps) : rmsnorm_ref(y, x, gamma, n, eps);
}

// ---------------------------------------------------------------------------------------------------
// 3.2 The KDA L2 norm:  y = scale * x / sqrt(sum(x^2) + 1e-6)
// ---------------------------------------------------------------------------------------------------
// fla's l2norm: the SUM of squares (not the mean) with 1e-6 inside the square root (docs/kimi-k3.md 3.4.4,
// trap 5.1.8 of docs/kimi-k3.md). llama.cpp divides by max(||x||, eps) instead; the two differ only for x near 0.
inline constexpr float kL2Eps = 1e-6f;

inline float l2_factor(float sum_squares, float scale) { return (1.0f / std::sqrt(sum_squares + kL2Eps)) * scale; }

inline void l2norm_ref(float* y, const float* x, std::size_t n, float scale) {  // y (n), x (n)
    const float c = l2_factor(sum_squares_ref(x, n), scale);
    for (std::size_t i = 0; i < n; ++i) y[i] = x[i] * c;
}

inline void l2norm_simd(float* y, const float* x, std::size_t n, float scale) {  // y (n), x (n)
    const float c_s = l2_factor(sum_squares_simd(x, n), scale);
    const simd::f32 c = simd::splat(c_s);
    const std::size_t whole = n / simd::W * simd::W;
    for (std::size_t i = 0; i < whole; i += simd::W) simd::store(y + i, simd::load(x + i) * c);
    for (std::size_t i = whole; i < n; ++i) y[i] = x[i] * c_s;
}

inline void l2norm(float* y, const float* x, std::size_t n, float scale) {  // y (n), x (n)
    use_simd ? l2norm_simd(y, x, n, scale) : l2norm_ref(y, x, n, scale);
}

// ---------------------------------------------------------------------------------------------------
// 3.3 The gated per-head norm (KDA output, docs/kimi-k3.md 3.4.6)
// ---------------------------------------------------------------------------------------------------
// fla's FusedRMSNormGated(Dh, eps, activation='sigmoid'): each head's Dh values are RMS-normalised on
// their own, scaled by ONE weight vector w (Dh) shared by every head, then gated by sigmoid(g).
inline void gated_head_norm_ref(float* y, const float* o, const float* g, const float* w, std::size_t heads,
                                std::size_t dh, float eps) {  // y (H, Dh), o (H, Dh), g (H, Dh), w (Dh)
    for (std::size_t h = 0; h < heads; ++h) {
        const float* oh = o + h * dh;
        const float inv = rms_inverse(sum_squares_ref(oh, dh), dh, eps);
        for (std::size_t i = 0; i < dh; ++i) y[h * dh + i] = scale_mul(oh[i], inv, w[i]) * sigmoid(g[h * dh + i]);
    }
}

// Bit-identical to the reference; the sigmoid is the same scalar function, evaluated into a small
// buffer, and the products run W lanes at a time (the last Dh % W in plain code).
inline void gated_head_norm_simd(float* y, const float* o, const float* g, const float* w, std::size_t heads,
                                 std::size_t dh, float eps) {  // y (H, Dh), o (H, Dh), g (H, Dh), w (Dh)
    float gate[kLanes];  // sigmoid(g) for the 16 values in flight
    for (std::size_t h = 0; h < heads; ++h) {
        const float *oh = o + h * dh, *gh = g + h * dh;
        float* yh = y + h * dh;
        const float inv_s = rms_inverse(sum_squares_simd(oh, dh), dh, eps);
        const simd::f32 inv = simd::splat(inv_s);
        const std::size_t whole = full_chunks(dh);
        for (std::size_t i = 0; i < whole; i += kLanes) {
            for (int j = 0; j < kLanes; ++j) gate[j] = sigmoid(gh[i + std::size_t(j)]);
            for (int j = 0; j < kLanes; j += simd::W)
                simd::store(yh + i + std::size_t(j),
                            scale_mul(simd::load(oh + i + std::size_t(j)), inv, simd::load(w + i + std::size_t(j))) *
                                simd::load(gate + j));
        }
        for (std::size_t i = whole; i < dh; ++i) yh[i] = scale_mul(oh[i], inv_s, w[i]) * sigmoid(gh[i]);
    }
}

inline void gated_head_norm(float* y, const float* o, const float* g, const float* w, std::size_t heads,
                            std::size_t dh, float eps) {  // y (H, Dh), o (H, Dh), g (H, Dh), w (Dh)
    use_simd ? gated_head_norm_simd(y, o, g, w, heads, dh, eps) : gated_head_norm_ref(y, o, g, w, heads, dh, eps);
}

}  // namespace kimik3
