// kimik3 chapter 08, APPENDIX: the naive MLA -- the yardstick, and the latent cache on disk.
// ====================================================================================================
//
// APPENDIX to chapter 08 (08_mla.hpp, sections 8.6 and 8.2 in its index). The lesson computes attention
// in the absorbed form over the 576-float latent cache. Here are two things a learner can skip:
//   8.6  the naive form, which expands every cached position into per-head keys and values through
//        kv_b_proj and attends with 192-wide dots: what the absorbed form avoids, kept so the tests can
//        compare two associations of the same math (within rounding, a named tolerance; not bit for bit);
//   8.2  (the rest) MlaCache::save and load: the used part of a cache as bytes, refused on load when it
//        is another layer's, another width, longer than the capacity, short, or holds a non-finite value.
//
// USES     chapter 08 (MlaCache, MlaWeights, MlaDims, the kernel tables, mla_project, mla_output)
// TEST     make test-08   (tests "8.6 ..." and "8.2 ...")
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstring>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "08_mla.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 8.2 (the rest) The cache's file form
// ---------------------------------------------------------------------------------------------------
// Binary form of the used part (little-endian, as everything this engine writes):
//   "KK3MLAC1" (8 bytes) | layer (i32) | width (u32) | length (u64) | length x width f32
inline void MlaCache::save(std::ostream& out) const {
    const std::int32_t layer = layer_;
    const std::uint32_t width = std::uint32_t(width_);
    const std::uint64_t len = length();
    out.write(kMagic, 8);
    out.write(reinterpret_cast<const char*>(&layer), 4);
    out.write(reinterpret_cast<const char*>(&width), 4);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out.write(reinterpret_cast<const char*>(data_.data()), std::streamsize(data_.size() * sizeof(float)));
    if (!out) fail(ErrorKind::io, "MLA layer " + std::to_string(layer_) + ": writing the KV cache failed");
}
// Replaces the contents; refuses another layer's cache, another width, or more than the capacity.
inline void MlaCache::load(std::istream& in) {
    char magic[8];
    std::int32_t layer = 0;
    std::uint32_t width = 0;
    std::uint64_t len = 0;
    in.read(magic, 8);
    in.read(reinterpret_cast<char*>(&layer), 4);
    in.read(reinterpret_cast<char*>(&width), 4);
    in.read(reinterpret_cast<char*>(&len), 8);
    const std::string where = "MLA layer " + std::to_string(layer_) + ": loading the KV cache: ";
    if (!in) fail(ErrorKind::io, where + "short read in the header");
    if (std::memcmp(magic, kMagic, 8) != 0) fail(ErrorKind::format, where + "not a saved MLA cache (bad magic)");
    if (layer != layer_ || width != width_)
        fail(ErrorKind::format, where + "it was saved from layer " + std::to_string(layer) + " with width " +
                                    std::to_string(width) + ", this is width " + std::to_string(width_));
    if (len > capacity_)
        fail(ErrorKind::runtime, where + std::to_string(len) + " positions exceed the capacity " + std::to_string(capacity_));
    data_.resize(std::size_t(len) * width_);
    in.read(reinterpret_cast<char*>(data_.data()), std::streamsize(data_.size() * sizeof(float)));
    if (!in) {
        data_.clear();
        fail(ErrorKind::io, where + "short read in the positions");
    }
    for (std::size_t i = 0; i < data_.size(); ++i)  // cached latents are finite; a NaN would poison every later token
        if (!std::isfinite(data_[i])) {
            const float bad = data_[i];
            data_.clear();
            fail(ErrorKind::format, where + "position " + std::to_string(i / width_) + " holds " + std::to_string(bad));
        }
}

// ---------------------------------------------------------------------------------------------------
// 8.6 The naive form (docs/kimi-k3.md 3.5.3): the yardstick, not the engine
// ---------------------------------------------------------------------------------------------------
// Expands every cached position into per-head keys [k_nope ; k_x] and values through kv_b_proj, then
// attends with 192-wide dot products. Same signature and side effects as mla_forward (it appends the
// same latents). It costs H (N + Dv) R multiply-adds per position per call, which is exactly what the
// absorbed form avoids; it exists so that the tests can compare two different associations of the
// same math (docs/kimi-k3.md 3.5.4: equal to 4e-16 in float64; tools/selftest.py repeats the check).
inline void mla_forward_naive(float* y, const float* u, std::size_t tokens, const MlaWeights& w, const MlaDims& d,
                              MlaCache& cache, MlaRecord* record = nullptr) {  // y (T, D), u (T, D)
    detail::mla_check(w, d, cache, tokens, "mla_forward_naive");
    const MlaKernels& k = use_simd ? kMlaSimd : kMlaRef;
    const std::size_t T = tokens, H = d.heads, R = d.kv_lora, N = d.nope, X = d.rope, NX = d.qk(), NV = N + d.v, Dv = d.v;
    const std::size_t S0 = cache.length(), S = S0 + T;
    std::vector<float> q(T * H * NX), gate(T * H * Dv);  // (T, H, N+X), (T, H*Dv)
    const MlaSeq one{0, T, &cache};
    detail::mla_project(k, q.data(), gate.data(), u, T, w, d, std::span(&one, 1));
    // KV_s = kv_b_proj c_s for every cached position
    std::vector<float> latents(S * R), kv(S * H * NV);  // (S, R), (S, H, N+Dv)
    for (std::size_t s = 0; s < S; ++s) std::copy_n(cache.position(s), R, &latents[s * R]);
    detail::mla_linear(k, kv.data(), latents.data(), S, w.kv_b_proj);
    std::vector<float> attn(T * H * Dv, 0.0f);  // (T, H*Dv)
    if (record) record->probs.assign(H * T * S, 0.0f);
    parallel_rows(H, T * S * (NX + Dv), [&](std::size_t h0, std::size_t h1) {
        std::vector<float> p(S), key(NX);  // (S), (N+X)
        for (std::size_t h = h0; h < h1; ++h)
            for (std::size_t t = 0; t < T; ++t) {
                const std::size_t len = S0 + t + 1;
                for (std::size_t s = 0; s < len; ++s) {  // k_s[h] = [k_nope_s[h] ; k_x_s]
                    std::copy_n(&kv[(s * H + h) * NV], N, key.data());
                    std::copy_n(cache.position(s) + R, X, key.data() + N);
                    p[s] = k.dot(&q[(t * H + h) * NX], key.data(), NX) * d.scale();
                }
                detail::mla_softmax(p.data(), len);
                k.matvec_t_f32(&attn[t * H * Dv + h * Dv], p.data(), &kv[h * NV + N], len, Dv, H * NV);  // sum_s p_s v_s[h]
                if (record) std::copy_n(p.data(), len, &record->probs[(h * T + t) * S]);
            }
    });
    detail::mla_output(k, y, attn, gate, q, T, w, d, cache, record);
}

}  // namespace kimik3
