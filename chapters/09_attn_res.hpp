// kimik3 chapter 09: attn_res -- Block Attention Residuals, K3's replacement for x + f(x).
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   A transformer usually adds each sublayer's output to a running residual stream. K3 does not: each
//   sublayer's INPUT is a softmax-weighted mix, over depth, of block summaries of this same token (the
//   embedding, then the sum of all sublayer outputs of every finished block of 12 layers) and the
//   partial sum of the current block. Each layer owns two tiny mixers (one 1 x D projection each), and
//   the model has a final one. New since chapter 08: attention over depth instead of over positions,
//   a per-token bank, and a closed form that makes the bookkeeping obvious.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.2; its trap 5.1.10)
//   Block size 12: banks at layers 0, 12, ..., 84, so at most 8 banked vectors plus the running
//   partial: a mix has 2..9 candidates of D = 7168 floats. Per token that is 9 x 28 kB; there is no
//   cross-token state (decode keeps nothing between tokens for AttnRes).
//
// CONCEPTS
//   candidate  a D-vector of this token: B_0 = the embedding, B_n = sum over the n-th block of 12 layers
//              of (attention output + FFN output), and P = the partial sum of the current block.
//   mix        s_i = <v_i / rms(v_i), w> with w = res_norm.weight * res_proj.weight (norm's gamma folded
//              into the projection); pi = softmax(s); mix = sum_i pi_i v_i (the RAW v_i: keys are
//              normalised, values are not).
//   closed form (docs/kimi-k3.md 3.2, verified equal to Moonshot's procedure):
//              attention input of layer l > 0: mix_attn(B_0 .. B_{floor((l-1)/12)}, P)
//              FFN input of layer l:           mix_mlp(B_0 .. B_{floor(l/12)}, P + a_l)
//              final:                          mix_out(B_0 .. B_7, sum over layers 84..92 of (a + m))
//              layer 0's attention input is the embedding itself: its mixer's weights are never used.
//              At a block start (l % 12 == 0) the partial IS the finished block: it is banked after
//              the attention-side mix reads it, and the new partial starts empty.
//
//        bank:  [ B_0 = x0 | B_1 | ... | B_n ]      partial: P (this block so far)
//        layer l:  x = mix_attn(bank ++ [P])  -> if l % 12 == 0: bank += P, P = none
//                  a = attention(norm(x));  P = (P is none) ? a : P + a
//                  x = mix_mlp(bank ++ [P]);  m = ffn(norm(x));  P = P + m
//
// NUMERICS CONTRACT
//   w[j] = bf16(norm[j]) * bf16(proj[j]) in f32 (exact: a product of two 8-bit mantissas).
//   per candidate: inv = rms_inverse(sum_squares(v), D, eps) (chapter 03); s = dot(v, w) * inv.
//   softmax: m = max s (first max); e_i = exp_f32(s_i - m); denom = sum16(e); pi_i = e_i / denom.
//   out[j] = sum over i in candidate order (bank first, partial last) of pi_i * v_i[j], from +0.
//   P + a and P + m are f32 additions (one rounding each). D is any width (chapter 00's tail rule).
//
// SOURCES  Kimi Team, "Attention Residuals", arXiv:2603.15031 (Full and Block AttnRes);
//          MoonshotAI/Attention-Residuals. docs/sources.md 09.
// USES     chapter 00 (dot, sum_squares, hsum16), chapter 03 (rms_inverse)
// RUN      make run-09        TEST   make test-09
//
// SECTIONS
//   9.1 the mixer      9.2 the per-token residual state (bank, partial, the block boundary)
// ====================================================================================================
#pragma once

#include <cmath>
#include <vector>

#include "00_numerics.hpp"
#include "03_norms.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 9.1 The mixer
// ---------------------------------------------------------------------------------------------------
struct AttnResWeights {
    const float* norm = nullptr;  // (D) *_res_norm.weight, widened to f32 (bf16 in the release)
    const float* proj = nullptr;  // (1, D) *_res_proj.weight
};

// w = norm (x) proj, folded once per use. Exact in f32 when both are bf16 (8 + 8 mantissa bits fit
// in 24); for f32 weights it is the one rounding the reference makes too.
inline void attn_res_fold(float* w, const AttnResWeights& r, std::size_t dim) {  // w (D)
    for (std::size_t j = 0; j < dim; ++j) w[j] = r.norm[j] * r.proj[j];
}

// The depth softmax over n candidates of one token. weights (n) is optional output (pi).
inline void attn_res_mix(float* out, const float* const* cand, std::size_t n, const float* w, std::size_t dim, float eps,
                         float* weights = nullptr) {  // out (D), cand: n pointers to (D), w (D)
    float s[16], e[16];  // n <= 1 + 8 banks at K3; more than 16 candidates is refused below
    if (n == 0 || n > 16) fail(ErrorKind::usage, "attn_res_mix: " + std::to_string(n) + " candidates (1..16 supported)");
    float m = -INFINITY;
    for (std::size_t i = 0; i < n; ++i) {
        const float inv = rms_inverse(sum_squares(cand[i], dim), dim, eps);  // keys are RMS-normalised...
        s[i] = dot(cand[i], w, dim) * inv;
        if (s[i] > m) m = s[i];
    }
    float acc[kLanes] = {};
    for (std::size_t i = 0; i < n; ++i) acc[i] = e[i] = exp_f32(s[i] - m);
    const float denom = hsum16(acc);  // element i in lane i (n <= 16): the chapter-00 sum
    for (std::size_t i = 0; i < n; ++i) s[i] = e[i] / denom;  // s now holds pi
    for (std::size_t j = 0; j < dim; ++j) out[j] = 0.0f;
    for (std::size_t i = 0; i < n; ++i)  // ...values are raw
        for (std::size_t j = 0; j < dim; ++j) out[j] = out[j] + s[i] * cand[i][j];
    if (weights)
        for (std::size_t i = 0; i < n; ++i) weights[i] = s[i];
}

// ---------------------------------------------------------------------------------------------------
// 9.2 The per-token residual state
// ---------------------------------------------------------------------------------------------------
// The bank of finished blocks and the current block's partial sum, for ONE token.
struct ResidualState {
    std::size_t dim = 0;
    std::vector<std::vector<float>> bank;  // B_0 .. B_n, each (D)
    std::vector<float> partial;            // (D) P, meaningless while has_partial is false
    bool has_partial = false;

    // Layer 0's input: the embedding is the first partial (it is banked at layer 0 as B_0).
    void start(const float* embedding, std::size_t d) {  // embedding (D)
        dim = d;
        bank.clear();
        partial.assign(embedding, embedding + d);
        has_partial = true;
    }
    // The candidates bank ++ [P] as pointers, in mixing order.
    std::vector<const float*> candidates() const {
        std::vector<const float*> c;
        for (const auto& b : bank) c.push_back(b.data());
        if (has_partial) c.push_back(partial.data());
        return c;
    }
    // x = mix over bank ++ [P], or P itself when the bank is empty (layer 0); then the bank boundary.
    void attn_input(float* x, int layer, int block, const float* w, float eps, float* weights = nullptr) {  // x (D), w (D)
        if (bank.empty()) {
            std::copy(partial.begin(), partial.end(), x);  // layer 0: no mix (its mixer is unused)
        } else {
            const auto c = candidates();
            attn_res_mix(x, c.data(), c.size(), w, dim, eps, weights);
        }
        if (layer % block == 0) {  // bank the raw layer input; the next block starts empty
            bank.push_back(partial);
            has_partial = false;
        }
    }
    // P = a (at a block start) or P + a; the same for the FFN output m.
    void add(const float* out) {  // out (D)
        if (!has_partial) {
            partial.assign(out, out + dim);
            has_partial = true;
            return;
        }
        for (std::size_t j = 0; j < dim; ++j) partial[j] = partial[j] + out[j];
    }
    // x = mix over bank ++ [P] (the FFN input of a layer, and the model's final mix).
    void mix(float* x, const float* w, float eps, float* weights = nullptr) const {  // x (D), w (D)
        const auto c = candidates();
        attn_res_mix(x, c.data(), c.size(), w, dim, eps, weights);
    }
};

}  // namespace kimik3
