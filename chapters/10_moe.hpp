// kimik3 chapter 10: moe -- the router, the latent MoE, and where expert weights come from.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Each of K3's 92 MoE layers holds 896 experts and runs 16 per token. This chapter routes a token
//   (sigmoid scores, a bias that changes WHICH experts are chosen but not HOW MUCH each counts), runs
//   the chosen experts in a smaller latent space, and combines them in a fixed order, so that neither
//   the thread count nor the number of experts that fit in memory can change a bit. Expert weights
//   arrive through an interface, ExpertProvider: this chapter has the trivial all-resident one;
//   chapter 11 builds the cache that makes the real model fit.
//   New since chapter 06: routing, top-k with ties, the combine order, latent MoE, grouped fetches.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.6; its traps 5.1.3 and 5.1.4)
//   x (D = 7168) -> router [896, 7168] -> top 16 -> latent down [3584, 7168] -> 16 experts at L = 3584
//   -> weighted sum -> RMSNorm (3584) -> latent up [7168, 3584];  + shared experts (6144 wide) on x.
//   Per token and layer: 281 MB of MXFP4 experts, 379.9 MB of bf16 trunk for the router/latent/shared.
//
// CONCEPTS
//   score s_e = sigmoid(router logit);  selection by s_e + e_score_correction_bias_e (the "aux-loss-free"
//   bias balances load across experts); weights w_e = s_e / sum of the selected s (renormalised, the
//   bias left out) times routed_scaling_factor.
//   latent MoE: experts work on z = W_down x (3584 wide), their weighted sum is RMS-normalised, then
//   projected up to D. Because of that norm, a global scale on the weights cancels (except via eps).
//   slot: the position of an expert in a token's top-k list, ordered by biased score (highest first).
//
// NUMERICS CONTRACT
//   logits (T, E) by the bf16 matvec of chapter 04; s = sigmoid(logit) (chapter 00); b = s + bias (f32).
//   Top-k: b descending, ties to the LOWER expert id; a NaN logit is an error (never a silent order).
//   denom = 16-lane sum of s over the k slots in slot order (hsum16); w = (s / (denom + 1e-20)) * factor
//   when moe_renormalize and k > 1, else w = s * factor (Moonshot's gate: top-1 is never renormalised).
//   y_lat[j] = sum over slots in slot order of w * expert_out[j], starting from +0: never split or
//   reordered by threads. Experts are computed in groups that fit the provider (the next group may be
//   read meanwhile), each over all the tokens that chose it (chapter 06: T tokens at once = one at a
//   time, bit for bit).
//   Then rmsnorm (eps = rms_norm_eps) and the up-projection; y = y_routed + y_shared (one rounding).
//
// SOURCES  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437 (sigmoid routing, a
//          selection-only bias); Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for
//          Mixture-of-Experts", arXiv:2408.15664 (the bias of noaux_tc). docs/sources.md 10.
// USES     chapters 00, 02 (Config), 03 (rmsnorm), 04 (linear), 05, 06 (expert_ffn, dense_ffn)
// RUN      make run-10        TEST   make test-10
//
// SECTIONS
//   10.1 routing     10.2 where experts come from     10.3 the MoE layer     10.4 all-resident experts
// ====================================================================================================
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <span>
#include <vector>

#include "00_numerics.hpp"
#include "02_config.hpp"
#include "03_norms.hpp"
#include "04_matvec_bf16.hpp"
#include "06_situ_ffn.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 10.1 Routing
// ---------------------------------------------------------------------------------------------------
// A sum of up to 16 values in the chapter-00 contract: element i in lane i, then hsum16.
inline float sum16(const float* v, std::size_t n) {  // v (n): element i -> lane i % 16, any n
    float acc[kLanes] = {};
    for (std::size_t i = 0; i < n; ++i) acc[i % kLanes] = acc[i % kLanes] + v[i];
    return hsum16(acc);
}

struct Routing {
    std::size_t tokens = 0, k = 0;
    std::vector<int> ids;            // (T, K) expert ids in slot order
    std::vector<float> weights;      // (T, K) combine weights, slot order
    std::vector<float> scores;       // (T, E) sigmoid scores (kept for examples and tests)
};

// Rows [row0, row0 + T) of a routing: one sequence's share of a step over several (chapter 13's record).
inline Routing routing_rows(const Routing& r, std::size_t row0, std::size_t T) {
    const std::size_t E = r.tokens ? r.scores.size() / r.tokens : 0;
    auto rows = [&](const auto& v, std::size_t w) { return std::vector(v.begin() + std::ptrdiff_t(row0 * w), v.begin() + std::ptrdiff_t((row0 + T) * w)); };
    return Routing{T, r.k, rows(r.ids, r.k), rows(r.weights, r.k), rows(r.scores, E)};
}

// Routes T tokens from their router logits. The chosen scores are divided by their sum only when
// `renormalize` (moe_renormalize) AND k > 1, as Moonshot's gate does: with one expert per token its weight
// is sigmoid(score) * routed_scaling_factor, not 1.
inline Routing route(const float* logits, const float* bias, std::size_t tokens, std::size_t experts, std::size_t k,
                     float scaling, int layer, bool renormalize = true) {  // logits (T, E), bias (E)
    const std::string at = "layer " + std::to_string(layer) + ": ";
    if (k < 1 || k > 64 || k > experts)
        fail(ErrorKind::usage, at + "top-k of " + std::to_string(k) + " from " + std::to_string(experts) +
                                   " experts (k must be 1..64 and at most the expert count)");
    for (std::size_t e = 0; e < experts; ++e)  // a NaN bias would break the selection order silently
        if (std::isnan(bias[e])) fail(ErrorKind::format, at + "e_score_correction_bias of expert " + std::to_string(e) + " is NaN");
    Routing r;
    r.tokens = tokens;
    r.k = k;
    r.ids.resize(tokens * k);
    r.weights.resize(tokens * k);
    r.scores.resize(tokens * experts);
    std::vector<float> biased(experts);
    std::vector<int> order(experts);
    for (std::size_t t = 0; t < tokens; ++t) {
        float* s = &r.scores[t * experts];
        for (std::size_t e = 0; e < experts; ++e) {
            const float l = logits[t * experts + e];
            if (std::isnan(l))
                fail(ErrorKind::runtime, at + "router logit of expert " + std::to_string(e) +
                                             " is NaN for token " + std::to_string(t));
            s[e] = sigmoid(l);
            biased[e] = s[e] + bias[e];  // selection only (trap 5.1.3 of docs/kimi-k3.md)
        }
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + long(k), order.end(), [&](int a, int b) {
            return biased[std::size_t(a)] > biased[std::size_t(b)] || (biased[std::size_t(a)] == biased[std::size_t(b)] && a < b);
        });
        float chosen[kLanes * 4];  // k <= 64, checked above
        for (std::size_t i = 0; i < k; ++i) chosen[i] = s[order[i]];
        const bool divide = renormalize && k > 1;
        const float denom = divide ? sum16(chosen, k) + 1e-20f : 1.0f;
        for (std::size_t i = 0; i < k; ++i) {
            r.ids[t * k + i] = order[i];
            // the UNBIASED scores, renormalised (x / 1 is x: the no-division case is the same expression)
            r.weights[t * k + i] = (chosen[i] / denom) * scaling;
        }
    }
    return r;
}

// ---------------------------------------------------------------------------------------------------
// 10.2 Where experts come from
// ---------------------------------------------------------------------------------------------------
// The MoE layer asks for experts by (layer, id) and computes with the weights it gets back; keeping
// them in memory, reading them from disk, counting hits are the provider's business (chapter 11).
// Routing never depends on the provider, so every provider gives the same bits.
struct ExpertProvider {
    virtual ~ExpertProvider() = default;
    // How many experts can be in memory at once (at least 1).
    virtual std::size_t capacity() const = 0;
    // Makes experts `ids` of `layer` available: out[i] holds ids[i]'s weights until the next fetch.
    // ids.size() <= capacity(). A read that fails throws (ErrorKind::io): never half-loaded weights.
    virtual void fetch(int layer, std::span<const int> ids, ExpertWeights* out) = 0;
    // Marks the start of a new forward step (a token, or a prefill chunk): caches use it to tell
    // experts kept from an earlier step (retention) from experts fetched within this one.
    virtual void begin_step() {}

    // Read-ahead (optional). A provider that reads ahead accepts prefetch(layer, ids): the group the
    // NEXT fetch will ask for, already chosen by the router (nothing speculative). It starts reading
    // them into room the current group does not occupy and returns at once; the current group's weights
    // stay valid, the next fetch(layer, ids) waits for the reads. moe_forward then computes one group
    // while the next is read. Like grouping, it changes where and when weights arrive, never a bit.
    virtual bool reads_ahead() const { return false; }
    virtual void prefetch(int layer, std::span<const int> ids) { (void)layer; (void)ids; }

    // Kept by moe_forward: how many (token, slot) expert uses it served, and how many distinct experts
    // it asked for to serve them. With T tokens per step, an expert chosen by several tokens is fetched
    // once: uses - requested is what a prompt processed in chunks saves over token by token.
    std::uint64_t slot_uses = 0, experts_requested = 0;
};

// How many experts moe_forward asks for at once, of `unique` distinct ones. When they all fit, one
// group: every hit is found before any miss takes a slot. When they do not, a provider that reads ahead
// gets half its capacity per group (the other half takes the next group, read while this one computes);
// any other provider gets its whole capacity.
inline std::size_t expert_group_size(std::size_t capacity, bool reads_ahead, std::size_t unique) {
    capacity = std::max<std::size_t>(capacity, 1);
    if (unique <= capacity || !reads_ahead || capacity < 2) return capacity;
    return capacity / 2;
}

// ---------------------------------------------------------------------------------------------------
// 10.3 The MoE layer (docs/kimi-k3.md 3.6, steps 1-9)
// ---------------------------------------------------------------------------------------------------
struct MoeWeights {
    MatrixRef router;               // (E, D) gate.weight
    const float* router_bias;       // (E) gate.e_score_correction_bias, F32
    MatrixRef latent_down;          // (L, D) routed_expert_down_proj
    const float* latent_norm;       // (L) routed_expert_norm, widened to f32; null when latent_moe_use_norm is false
    MatrixRef latent_up;            // (D, L) routed_expert_up_proj
    DenseFfnWeights shared;         // (S, D) gate/up, (D, S) down; rows 0 when there are no shared experts
};

struct MoeDims {
    int layer = 0;
    std::size_t hidden = 0, experts = 0, k = 0, ffn = 0, latent = 0;  // D, E, K, F, L
    float scaling = 1.0f, eps = 1e-5f;
    Situ situ;
    bool renormalize = true;  // moe_renormalize (applied only when k > 1)

    static MoeDims from(const Config& c, int layer) {
        return MoeDims{layer,
                       std::size_t(c.hidden_size),
                       std::size_t(c.num_experts),
                       std::size_t(c.num_experts_per_token),
                       std::size_t(c.moe_intermediate_size),
                       std::size_t(c.routed_expert_hidden_size),
                       c.routed_scaling_factor,
                       c.rms_norm_eps,
                       Situ{c.situ_beta, c.situ_linear_beta},
                       c.moe_renormalize};
    }
};

// What the layer did, for examples, tests and traces (optional).
struct MoeRecord {
    Routing routing;
    std::vector<float> z, y_lat, y_routed, y_shared;  // (T, L), (T, L), (T, D), (T, D)
};

// Experts over processes (chapter 17). With an ExpertSplit installed, this process runs only the experts
// it owns, and `share` copies every other slot's output in from its owner (copies, never a sum).
struct ExpertSplit {
    virtual ~ExpertSplit() = default;
    virtual bool owns(int layer, int expert) const = 0;
    virtual void share(float* expert_out, const Routing& r, std::size_t width, int layer) = 0;  // expert_out (T, K, width)
};
inline ExpertSplit*& expert_split() {
    static ExpertSplit* split = nullptr;
    return split;
}

inline void moe_forward(float* y, const float* x, std::size_t tokens, const MoeWeights& w, const MoeDims& d,
                        ExpertProvider& provider, MoeRecord* record = nullptr) {  // y (T, D), x (T, D)
    const std::size_t T = tokens, D = d.hidden, L = d.latent, K = d.k;
    // 1-3: router logits, scores, selection and weights
    std::vector<float> logits(T * d.experts);  // (T, E)
    linear(logits.data(), x, T, w.router);
    Routing r = route(logits.data(), w.router_bias, T, d.experts, K, d.scaling, d.layer, d.renormalize);
    // 4: the latent down-projection
    std::vector<float> z(T * L);  // (T, L)
    linear(z.data(), x, T, w.latent_down);
    // 5: experts, in groups the provider can hold; each expert runs once over every token that chose it.
    //    With a provider that reads ahead, group g + 1 is being read while group g computes.
    std::map<int, std::vector<std::size_t>> users;  // expert id -> (t * K + slot), in token order
    for (std::size_t i = 0; i < T * K; ++i) users[r.ids[i]].push_back(i);
    std::vector<int> unique;
    ExpertSplit* split = expert_split();
    for (const auto& [e, u] : users)
        if (!split || split->owns(d.layer, e)) unique.push_back(e);  // ascending ids
    provider.slot_uses += T * K;
    provider.experts_requested += unique.size();
    std::vector<float> expert_out(T * K * L);               // (T, K, L)
    const std::size_t group = expert_group_size(provider.capacity(), provider.reads_ahead(), unique.size());
    const bool ahead = provider.reads_ahead() && 2 * group <= provider.capacity();  // room for two groups
    std::vector<ExpertWeights> got(group);
    std::vector<float> zin, zout;
    for (std::size_t g0 = 0; g0 < unique.size(); g0 += group) {
        const std::size_t n = std::min(group, unique.size() - g0);
        provider.fetch(d.layer, std::span<const int>(unique.data() + g0, n), got.data());
        if (const std::size_t g1 = g0 + n; ahead && g1 < unique.size())
            provider.prefetch(d.layer, std::span<const int>(unique.data() + g1, std::min(group, unique.size() - g1)));
        for (std::size_t j = 0; j < n; ++j) {
            const std::vector<std::size_t>& u = users[unique[g0 + j]];
            zin.resize(u.size() * L);
            zout.resize(u.size() * L);
            for (std::size_t i = 0; i < u.size(); ++i) std::copy_n(&z[(u[i] / K) * L], L, &zin[i * L]);
            expert_ffn(zout.data(), zin.data(), u.size(), got[j], d.ffn, L, d.situ);
            for (std::size_t i = 0; i < u.size(); ++i) std::copy_n(&zout[i * L], L, &expert_out[u[i] * L]);
        }
    }
    if (split) split->share(expert_out.data(), r, L, d.layer);
    // 6: combine in slot order
    std::vector<float> y_lat(T * L, 0.0f);  // (T, L)
    for (std::size_t t = 0; t < T; ++t)
        for (std::size_t s = 0; s < K; ++s) {
            const float wt = r.weights[t * K + s];
            const float* eo = &expert_out[(t * K + s) * L];
            float* acc = &y_lat[t * L];
            for (std::size_t j = 0; j < L; ++j) acc[j] = acc[j] + wt * eo[j];
        }
    // 7: latent norm (the weighted sum comes BEFORE the norm: trap 5.1.4 of docs/kimi-k3.md) and the up-projection
    std::vector<float> y_norm(T * L), y_routed(T * D);  // (T, L), (T, D)
    if (w.latent_norm)
        for (std::size_t t = 0; t < T; ++t) rmsnorm(&y_norm[t * L], &y_lat[t * L], w.latent_norm, L, d.eps);
    else
        y_norm = y_lat;  // latent_moe_use_norm false: the weighted sum goes up as it is
    linear(y_routed.data(), y_norm.data(), T, w.latent_up);
    // 8: shared experts on the full-width x (not the latent z)
    std::vector<float> y_shared(T * D, 0.0f);  // (T, D)
    if (w.shared.gate.rows > 0) dense_ffn(y_shared.data(), x, T, w.shared, d.situ);
    // 9: the sum
    for (std::size_t i = 0; i < T * D; ++i) y[i] = y_routed[i] + y_shared[i];
    if (record) *record = MoeRecord{std::move(r), std::move(z), std::move(y_lat), std::move(y_routed), std::move(y_shared)};
}

// ---------------------------------------------------------------------------------------------------
// 10.4 All-resident experts (tests, examples, and any machine with room for every expert)
// ---------------------------------------------------------------------------------------------------
// Reads every routed expert of every MoE layer into memory once. `capacity` only limits how many the
// MoE layer may ask for at once, so tests can check that the grouping never changes a bit.
class ResidentExperts : public ExpertProvider {
  public:
    ResidentExperts(const ModelTensors& m, std::size_t capacity = 0) : capacity_(capacity) {
        for (std::size_t l = 0; l < m.experts.size(); ++l)
            for (std::size_t e = 0; e < m.experts[l].size(); ++e) {
                const ExpertLocation& x = m.experts[l][e];
                AlignedBuffer buf(x.bytes());
                std::array<std::size_t, 6> at{};
                std::size_t off = 0;
                for (int p = 0; p < 6; ++p) {
                    at[std::size_t(p)] = off;
                    x.parts[std::size_t(p)]->file->read_into(*x.parts[std::size_t(p)]->info, buf.data() + off);
                    off += x.parts[std::size_t(p)]->info->nbytes();
                }
                auto part = [&](int p) { return reinterpret_cast<const std::uint8_t*>(buf.data() + at[std::size_t(p)]); };
                for (int p : {1, 3, 5})  // refuse NaN scales at load (chapter 05)
                    check_e8m0_scales(part(p), x.parts[std::size_t(p)]->info->nbytes(), x.parts[std::size_t(p)]->info->name);
                weights_[{int(l), int(e)}] = ExpertWeights{part(0), part(1), part(2), part(3), part(4), part(5)};
                buffers_.push_back(std::move(buf));
                if (capacity_ == 0) all_ = std::max(all_, m.experts[l].size());
            }
        if (capacity_ == 0) capacity_ = std::max<std::size_t>(all_, 1);
    }
    std::size_t capacity() const override { return capacity_; }
    void fetch(int layer, std::span<const int> ids, ExpertWeights* out) override {
        if (ids.size() > capacity_)
            fail(ErrorKind::usage, "ResidentExperts::fetch: " + std::to_string(ids.size()) + " experts at once in layer " +
                                       std::to_string(layer) + ", but the capacity is " + std::to_string(capacity_));
        for (std::size_t i = 0; i < ids.size(); ++i) {
            auto it = weights_.find({layer, ids[i]});
            if (it == weights_.end())
                fail(ErrorKind::usage, "no routed expert " + std::to_string(ids[i]) + " in layer " + std::to_string(layer));
            out[i] = it->second;
        }
    }

  private:
    std::size_t capacity_ = 0, all_ = 0;
    std::map<std::pair<int, int>, ExpertWeights> weights_;
    std::vector<AlignedBuffer> buffers_;
};

}  // namespace kimik3
