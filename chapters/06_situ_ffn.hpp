// kimik3 chapter 06: situ_ffn -- the feed-forward block of K3, dense and as one routed expert.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Every FFN in K3 (the dense FFN of layer 0, the shared experts, each routed expert) is a gated linear
//   unit with K3's own activation, SiTU: SiLU's shape on the gate, but soft-capped by tanh so no
//   activation grows without bound, and a second soft cap on the up branch. This chapter writes SiTU,
//   then the two FFNs built from it: bf16 weights (chapter 04) and MXFP4 weights (chapter 05).
//   New since chapter 05: a whole block built from kernels; the routed expert as a unit of weights.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 0.2, 3.6)
//   Dense FFN, layer 0:   D = 7168 -> I = 33792 (gate and up) -> D;   1.45 GB of bf16.
//   Shared experts:       D -> 2 x 3072 = 6144 -> D, on the full-width input, every MoE layer.
//   Routed expert:        L = 3584 -> F = 3072 (w1 gate, w3 up) -> L (w2 down), MXFP4, 17.5 MB each;
//                         16 of 896 per token and layer, in the latent space of chapter 10.
//
// CONCEPTS
//   GLU          y = W_down( act(W_gate x) * (W_up x) ): the gate decides how much of each up unit passes.
//   SiTU         gate(a) = b1 tanh(a/b1) sigmoid(a)   (b1 = activation_situ_beta = 4)
//                up(b)   = b2 tanh(b/b2)               (b2 = activation_situ_linear_beta = 25)
//                For small a, gate(a) ~ a sigmoid(a) = SiLU(a); |gate| < b1 always; |up| < b2.
//                Trap 5.1.5 of docs/kimi-k3.md: the sigmoid takes the UNCAPPED a, and b1 caps the gate, b2 the up branch.
//
// NUMERICS CONTRACT
//   gate = (b1 * tanh_f32(a / b1)) * sigmoid(a);  up = b2 * tanh_f32(b / b2)  (up = b when b2 is null, 0 here);
//   h = gate * up. Each operation rounded once, in that order; tanh_f32 and sigmoid are chapter 00's
//   scalar functions in every path and on every CPU (chapter 00 rule 3), so SiTU has one implementation, not a ref and a SIMD.
//   The FFNs' matrix products are the kernels of chapters 04/05: dense_ffn_ref / expert_ffn_ref use the
//   reference kernels, dense_ffn / expert_ffn the dispatched ones, bit-identical. T tokens at once give
//   per token the bits of one token alone.
//
// SOURCES  the K3 release's modeling_kimi_linear.py (the only definition of SiTU); Shazeer, "GLU Variants
//          Improve Transformer", arXiv:2002.05202. docs/sources.md 06.
// USES     chapter 00 (sigmoid), 04 (linear, matmul_bf16), 05 (matmul_mxfp4)
// RUN      make run-06        TEST   make test-06
//
// SECTIONS
//   6.1 SiTU-GLU      6.2 the dense FFN (bf16)      6.3 one routed expert (MXFP4)
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "00_numerics.hpp"
#include "04_matvec_bf16.hpp"
#include "05_mxfp4.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 6.1 SiTU-GLU
// ---------------------------------------------------------------------------------------------------
struct Situ {
    float beta1 = 4.0f;   // activation_situ_beta (gate branch); 1.0 when the config says null
    float beta2 = 25.0f;  // activation_situ_linear_beta (up branch); 0 = null = no cap
};

inline float situ_gate(float a, const Situ& s) { return (s.beta1 * tanh_f32(a / s.beta1)) * sigmoid(a); }
inline float situ_up(float b, const Situ& s) { return s.beta2 > 0.0f ? s.beta2 * tanh_f32(b / s.beta2) : b; }

// h[i] = gate(a[i]) * up(b[i]) for n values (T tokens of F units each, flattened).
inline void situ_glu(float* h, const float* a, const float* b, std::size_t n, const Situ& s) {  // h (n), a (n), b (n)
    for (std::size_t i = 0; i < n; ++i) h[i] = situ_gate(a[i], s) * situ_up(b[i], s);
}

// SwiGLU, for comparison only (the example prints both): silu(a) * b, no caps.
inline float swiglu(float a, float b) { return silu(a) * b; }

// ---------------------------------------------------------------------------------------------------
// 6.2 The dense FFN (layer 0; the shared experts use the same function at width 6144)
// ---------------------------------------------------------------------------------------------------
// y = W_down( SiTU(W_gate x, W_up x) ) for T tokens. The weights may be resident or streamed (4.6), of any WeightType (4.5).
struct DenseFfnWeights {
    MatrixRef gate;  // (I, D)
    MatrixRef up;    // (I, D)
    MatrixRef down;  // (D, I)
};

inline void dense_ffn(float* y, const float* x, std::size_t tokens, const DenseFfnWeights& w, const Situ& s) {
    // y (T, D), x (T, D)
    const std::size_t width = w.gate.rows;
    std::vector<float> a(tokens * width), b(tokens * width);  // (T, I) gate and up pre-activations
    linear(a.data(), x, tokens, w.gate);
    linear(b.data(), x, tokens, w.up);
    situ_glu(a.data(), a.data(), b.data(), tokens * width, s);  // h overwrites a
    linear(y, a.data(), tokens, w.down);
}

// The same with the reference kernels (resident weights only): the yardstick for dense_ffn.
inline void dense_ffn_ref(float* y, const float* x, std::size_t tokens, const DenseFfnWeights& w, const Situ& s) {
    // y (T, D), x (T, D)
    const std::size_t width = w.gate.rows, dim = w.gate.cols;
    std::vector<float> a(tokens * width), b(tokens * width);
    matmul_typed_ref(w.gate.type, a.data(), x, w.gate.data, tokens, width, dim);
    matmul_typed_ref(w.up.type, b.data(), x, w.up.data, tokens, width, dim);
    situ_glu(a.data(), a.data(), b.data(), tokens * width, s);
    matmul_typed_ref(w.down.type, y, a.data(), w.down.data, tokens, dim, width);
}

// ---------------------------------------------------------------------------------------------------
// 6.3 One routed expert (MXFP4, compressed-tensors layout)
// ---------------------------------------------------------------------------------------------------
// The six tensors of docs/kimi-k3.md 2.2, wherever chapter 11 put them in memory. In the latent MoE the expert
// works at width L = routed_expert_hidden_size (3584), not D.
struct ExpertWeights {
    const std::uint8_t* w1_packed = nullptr;  // gate (F, L/2)
    const std::uint8_t* w1_scale = nullptr;   //      (F, L/32)
    const std::uint8_t* w3_packed = nullptr;  // up   (F, L/2)
    const std::uint8_t* w3_scale = nullptr;   //      (F, L/32)
    const std::uint8_t* w2_packed = nullptr;  // down (L, F/2)
    const std::uint8_t* w2_scale = nullptr;   //      (L, F/32)
};

using MxMatmul = void (*)(float*, const float*, const std::uint8_t*, const std::uint8_t*, std::size_t, std::size_t, std::size_t);

inline void expert_ffn_with(MxMatmul mm, float* y, const float* z, std::size_t tokens, const ExpertWeights& e,
                            std::size_t ffn, std::size_t latent, const Situ& s) {  // y (T, L), z (T, L)
    std::vector<float> a(tokens * ffn), b(tokens * ffn);  // (T, F)
    mm(a.data(), z, e.w1_packed, e.w1_scale, tokens, ffn, latent);
    mm(b.data(), z, e.w3_packed, e.w3_scale, tokens, ffn, latent);
    situ_glu(a.data(), a.data(), b.data(), tokens * ffn, s);
    mm(y, a.data(), e.w2_packed, e.w2_scale, tokens, latent, ffn);
}

inline void expert_ffn_ref(float* y, const float* z, std::size_t tokens, const ExpertWeights& e, std::size_t ffn,
                           std::size_t latent, const Situ& s) {  // y (T, L), z (T, L)
    expert_ffn_with(matmul_mxfp4_ref, y, z, tokens, e, ffn, latent, s);
}

inline void expert_ffn(float* y, const float* z, std::size_t tokens, const ExpertWeights& e, std::size_t ffn,
                       std::size_t latent, const Situ& s) {  // y (T, L), z (T, L)
    expert_ffn_with(matmul_mxfp4, y, z, tokens, e, ffn, latent, s);
}

}  // namespace kimik3
