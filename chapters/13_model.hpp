// kimik3 chapter 13: model -- the whole of Kimi K3, token ids in, logits out, at any memory budget.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Everything so far, assembled in the order of docs/kimi-k3.md 3.9: the embedding, 93 layers of AttnRes mixes,
//   norms, KDA or MLA with their carried state, the dense FFN or the latent MoE, then the final mix, the
//   final norm and lm_head. The forward step takes T tokens at once (a prompt chunk) or one (decode),
//   and gives each token exactly the bits it would get alone; the memory plan (chapter 12) and the
//   expert provider (chapters 10, 11) decide only where weights come from. New since chapter 12: the
//   session (every layer's carried state), teacher forcing, and the one decode loop that every
//   generation in the repository runs (greedy here; sampled in chapter 15; with guessed tokens verified
//   in one step in chapter 16; kimik3 run, chat and serve), checked against full recompute.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.1-3.9)
//   Per token: 1 embedding row (14 kB), 108.8 GB of trunk, 16 x 92 experts (25.8 GB), 2.35 GB lm_head
//   when nothing is resident; the carried state is 69 KDA layers x (96 x 128 x 128 f32 S = 6.29 MB, plus
//   the short convolutions' history: the last 3 inputs of q, k and v, 442 kB) = 465 MB, and 24 x 576
//   floats of latent MLA cache per position.
//
// CONCEPTS
//   session       the per-sequence state: one KdaState per KDA layer (the recurrent matrix S of every head
//                 and the short convolutions' last kernel - 1 inputs), one MlaCache per MLA layer, and the
//                 tokens processed. AttnRes keeps nothing across tokens.
//   step          one forward call over T new tokens at the end of the session; what it writes besides
//                 logits and the session (a record, timings) only when asked, through StepOptions.
//   teacher forcing  run a given sequence and read every position's logits.
//   incremental   prefill the prompt (chunks of kPrefillChunk = 32), then one token per step, carrying the
//                 session: decode (13.4), whose hooks are all that differ between its callers.
//   recompute     for every generated token, a fresh session over the whole sequence so far: slower,
//                 and by construction bit-identical to incremental (a test, and a run option).
//
// NUMERICS CONTRACT
//   Everything is the chapters' contracts composed in the order of docs/kimi-k3.md 3.9; the driver adds
//   no arithmetic of its own except the embedding widening (exact) and argmax (first maximum: the
//   lowest id wins a tie). Logits are f32 (docs/kimi-k3.md 3.7: no soft-capping, no scaling). A step
//   of T tokens = T steps of one token.
//   A tentative step (13.3, for chapter 16) gives the same logits and leaves the KDA states untouched.
//
// SOURCES  Kimi Linear, arXiv:2510.26692; Attention Residuals, arXiv:2603.15031; the K3 release's
//          modeling_kimi_linear.py. Exactness is checked against tools/k3_reference.py (float64 PyTorch,
//          fixtures/tiny-k3/reference). docs/sources.md 13.
// USES     chapters 02, 06-12
// RUN      make run-13 (the little K3 against its float64 reference, then a greedy continuation; make run
//          runs the CLI)     TEST   make test-13 (the exactness gates)
//
// SECTIONS
//   13.1 the model (weights, plan, providers)     13.2 the session     13.3 one forward step (and keeping
//   part of a tentative one)     13.4 teacher forcing, and the decode loop: greedy, incremental, recompute
// ====================================================================================================
#pragma once

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <span>
#include <optional>
#include <set>
#include <vector>

#include "02_config.hpp"
#include "06_situ_ffn.hpp"
#include "07_kda.hpp"
#include "08_mla.hpp"
#include "09_attn_res.hpp"
#include "10_moe.hpp"
#include "11_expert_cache.hpp"
#include "12_trunk_stream.hpp"
#include "12b_trunk_weights.hpp"  // APPENDIX: TrunkWeights, the trunk as the plan says

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 13.1 The model
// ---------------------------------------------------------------------------------------------------
struct ModelOptions {
    std::uint64_t budget = 0;             // bytes; 0 = everything resident (no floor check)
    PlanOptions plan;                     // context, chunk size, ring and expert slots (0 = planner's choice)
    std::string trunk_dir;                // a packed trunk (kimik3 pack-trunk), or "" to read the shards
    bool direct = true;                   // O_DIRECT reads where the filesystem allows them
    int expert_readers = 8;               // parallel expert reads per batch
    Progress progress;                    // called while loading
    std::function<void(const Plan&, const Config&)> on_plan;  // called before any weight is read (may throw)
};

// The rows of each matrix this process computes, and the experts it may cache. With chapter 17's splits
// installed (one MPI rank of several): every matrix the forward pass multiplies through `linear`, at the
// rank's rows (MLA's kv_b_proj, read by the absorbed form's own kernels, and the embedding whole), and
// only the experts it owns; then the plan is made, and the trunk pinned, of that share alone.
inline RowsOf process_rows(const ModelTensors& m, const RowSplit* split) {
    if (!split) return {};
    std::set<const TensorInfo*> whole;
    for (const LayerTensors& lt : m.layers)
        if (lt.kv_b_proj) whole.insert(lt.kv_b_proj->info);
    return [split, whole](const Checkpoint::Ref& r) {
        const std::size_t n = std::size_t(r.info->shape[0]);
        return whole.count(r.info) ? RowRange{0, n} : split->rows(n);
    };
}
inline std::size_t process_experts(const ModelTensors& m, const ExpertSplit* split) {
    std::size_t n = 0;
    for (std::size_t l = 0; l < m.experts.size(); ++l)
        for (std::size_t e = 0; e < m.experts[l].size(); ++e) n += !split || split->owns(int(l), int(e));
    return n;
}

class Model {
  public:
    Config config;
    Checkpoint checkpoint;
    ModelTensors tensors;
    Census census;
    Plan plan;

    Model(const std::string& dir, const ModelOptions& o)
        : config(load_config(dir)), checkpoint(dir), tensors(bind_tensors(checkpoint, config)),
          census(take_census(checkpoint, config, tensors)) {
        const std::uint64_t budget = o.budget ? o.budget : UINT64_MAX / 4;
        const RowsOf rows = process_rows(tensors, row_split());
        UnitBytes units = unit_bytes(tensors, rows);
        if (expert_split()) units.experts = process_experts(tensors, expert_split());
        PlanOptions po = o.plan;
        if (!o.budget && !po.expert_slots)  // everything resident: every expert of every layer (that this process owns)
            po.expert_slots = expert_split() ? std::max<std::size_t>(1, units.experts)
                                             : std::size_t(config.num_experts) * std::size_t(std::max(1, config.moe_layer_count()));
        plan = make_plan(config, census, budget, po, units);
        if (budget < plan.floor) fail(ErrorKind::budget, plan_error_floor(plan));
        if (o.on_plan) o.on_plan(plan, config);
        if (!o.trunk_dir.empty()) trunk_layout_ = load_trunk(o.trunk_dir, tensors);
        trunk_ = std::make_unique<TrunkWeights>(tensors, plan, trunk_layout_ ? &*trunk_layout_ : nullptr, o.direct, o.progress, rows);
        if (config.moe_layer_count() > 0)
            experts_ = std::make_unique<ExpertCache>(tensors, config, std::max<std::size_t>(plan.expert_slots, 1),
                                                     ExpertCacheOptions{o.direct, o.expert_readers, PolicyKind::lru});
    }

    TrunkWeights& trunk() { return *trunk_; }
    ExpertCache* experts() { return experts_.get(); }

  private:
    std::optional<TrunkLayout> trunk_layout_;
    std::unique_ptr<TrunkWeights> trunk_;
    std::unique_ptr<ExpertCache> experts_;
};

// ---------------------------------------------------------------------------------------------------
// 13.2 The session
// ---------------------------------------------------------------------------------------------------
struct Session {
    std::vector<std::optional<KdaState>> kda;  // per layer: set for KDA layers
    std::vector<std::optional<MlaCache>> mla;  // per layer: set for MLA layers
    std::vector<std::int64_t> tokens;          // every token processed so far

    Session(const Config& c, std::size_t context) {
        for (int l = 0; l < c.num_hidden_layers; ++l) {
            if (c.layers[std::size_t(l)].attn == AttnKind::KDA) {
                kda.emplace_back(KdaState(KdaDims::from(c)));
                mla.emplace_back();
            } else {
                kda.emplace_back();
                mla.emplace_back(MlaCache(context, MlaDims::from(c).cache_width(), l));
            }
        }
    }
    std::size_t position() const { return tokens.size(); }
    void reset() {
        for (auto& k : kda)
            if (k) k->reset();
        for (auto& m : mla)
            if (m) m->reset();
        tokens.clear();
    }
};

// ---------------------------------------------------------------------------------------------------
// 13.3 One forward step: T new tokens through the whole model (docs/kimi-k3.md 3.9)
// ---------------------------------------------------------------------------------------------------
// The prompt tokens one forward step takes at most, wherever a caller does not choose (`run --chunk`
// does): long enough that a chunk reads each trunk matrix once for many tokens, short enough that its
// (T, D) activations stay small. The logits do not depend on it (a step of T tokens = T steps of one).
inline constexpr std::size_t kPrefillChunk = 32;

// What one step chose, for programs that show the model at work (kimik3 serve's page).
struct StepRecord {
    struct Layer {
        std::size_t attn_candidates = 0, mlp_candidates = 0;  // n of each depth mix (0: layer 0's skipped mix)
        std::vector<float> attn_mix, mlp_mix;                 // (T, n) AttnRes weights pi, bank first, partial last
        Routing routing;                                      // MoE layers: ids, weights (T, K), scores (T, E)
    };
    std::size_t tokens = 0;                                   // T
    std::vector<Layer> layers;                                // (layers)
    std::size_t out_candidates = 0;
    std::vector<float> out_mix;                               // (T, n) the final mix (only the tokens with logits)
};

// Where one step's wall time went (run's step table and the benchmarks split a token's time with it).
struct StepTimes {
    std::vector<double> layers;  // seconds per layer
    double head = 0;             // the embedding, the final mix, model.norm and lm_head
};

// A tentative step (chapter 16 verifies drafted tokens with one): every KDA layer runs on `scratch`, a
// copy of its state, so the session's KDA states stay as they were, and keeps its tokens' projected
// inputs in inputs[layer], from which the tokens that are kept are replayed later (keep_tokens) without
// reading a weight. MLA caches and the token list grow as in any step (a cache truncates). The logits
// are those of an ordinary step, bit for bit.
struct TentativeKda {
    std::vector<KdaInputs> inputs;    // per layer (KDA layers only)
    KdaState scratch;                 // one layer's state at a time (6.7 MB at K3, not 465 MB)
    std::size_t start = 0, tokens = 0;  // the step: its first position and its T
};

enum class Rows { last, all };  // whose logits a step writes: the last token's (1, V), or every token's (T, V)

// How a step runs beyond its tokens. `rows` and `tentative` decide what is computed and kept; `record`
// and `times` only watch (nothing reads them to compute, so they cannot change a bit).
struct StepOptions {
    Rows rows = Rows::last;
    TentativeKda* tentative = nullptr;  // KDA on a scratch copy, the session's states untouched (chapter 16)
    StepRecord* record = nullptr;       // filled with what the step chose
    StepTimes* times = nullptr;         // filled with where its time went
};

inline void forward(float* logits, Model& model, Session& s, std::span<const std::int64_t> ids, const StepOptions& o = {}) {
    const Config& c = model.config;
    const std::size_t D = std::size_t(c.hidden_size), T = ids.size();
    const float eps = c.rms_norm_eps;
    TrunkWeights& tw = model.trunk();
    auto vec = [&](const Checkpoint::Ref* r) { return tw.vec(r); };  // norms, biases, taps: f32 (chapter 12)
    if (model.experts()) model.experts()->begin_step();
    StepRecord* record = o.record;
    TentativeKda* tentative = o.tentative;
    if (tentative) tentative->start = s.position(), tentative->tokens = T;
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
    if (o.times) o.times->layers.assign(std::size_t(c.num_hidden_layers), 0.0);

    // 3.1 the embedding: x0 = embed_tokens[id]; it is the first partial sum of every token's stream
    std::vector<float> x(T * D), u(T * D), out(T * D), w(D);  // (T, D) each; w: a folded AttnRes vector
    const auto t_start = clock::now();
    std::vector<ResidualState> res(T);
    if (record) record->tokens = T, record->layers.assign(std::size_t(c.num_hidden_layers), {});
    // where token t's depth weights of one mix go when recording: rec (T, n), n = this mix's candidates
    auto mix_weights = [&](std::vector<float>& rec, std::size_t& n, std::size_t t) -> float* {
        if (t == 0) n = res[0].bank.size() + (res[0].has_partial ? 1 : 0), rec.assign(T * n, 0.0f);
        return rec.data() + t * n;
    };
    for (std::size_t t = 0; t < T; ++t) {
        tw.embed_row(&x[t * D], ids[t]);
        res[t].start(&x[t * D], D);
    }
    if (o.times) o.times->head = since(t_start);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const auto t_layer = clock::now();
        const LayerTensors& lt = model.tensors.layers[std::size_t(l)];
        // [AttnRes attn-mix] -> RMSNorm(input_layernorm)
        attn_res_fold(w.data(), AttnResWeights{vec(lt.attn_res_norm), vec(lt.attn_res_proj)}, D);
        StepRecord::Layer* rl = record ? &record->layers[std::size_t(l)] : nullptr;
        for (std::size_t t = 0; t < T; ++t) {
            float* pi = rl && l > 0 ? mix_weights(rl->attn_mix, rl->attn_candidates, t) : nullptr;  // layer 0 does not mix
            res[t].attn_input(&x[t * D], l, c.attn_res_block_size, w.data(), eps, pi);
            rmsnorm(&u[t * D], &x[t * D], vec(lt.input_norm), D, eps);
        }
        // {KDA | Gated MLA} -> partial += out
        if (lt.plan.attn == AttnKind::KDA) {
            const KdaWeights kw{tw.matrix(lt.q_proj), tw.matrix(lt.k_proj), tw.matrix(lt.v_proj), tw.matrix(lt.f_a_proj),
                                tw.matrix(lt.f_b_proj), tw.matrix(lt.b_proj), tw.matrix(lt.g_proj), tw.matrix(lt.o_proj),
                                vec(lt.q_conv), vec(lt.k_conv), vec(lt.v_conv), vec(lt.A_log), vec(lt.dt_bias), vec(lt.o_norm)};
            KdaState& state = *s.kda[std::size_t(l)];
            if (tentative) {
                tentative->inputs.resize(std::size_t(c.num_hidden_layers));
                tentative->scratch = state;
                kda_forward(out.data(), u.data(), T, kw, KdaDims::from(c), tentative->scratch, nullptr, &tentative->inputs[std::size_t(l)]);
            } else {
                kda_forward(out.data(), u.data(), T, kw, KdaDims::from(c), state);
            }
        } else {
            const MlaWeights mw{tw.matrix(lt.q_a_proj), vec(lt.q_a_norm), tw.matrix(lt.q_b_proj), tw.matrix(lt.kv_a_proj),
                                vec(lt.kv_a_norm), tw.matrix(lt.kv_b_proj), tw.matrix(lt.g_proj), tw.matrix(lt.o_proj)};
            mla_forward(out.data(), u.data(), T, mw, MlaDims::from(c), *s.mla[std::size_t(l)]);
        }
        for (std::size_t t = 0; t < T; ++t) res[t].add(&out[t * D]);
        // [AttnRes mlp-mix] -> RMSNorm(post_attention_layernorm)
        attn_res_fold(w.data(), AttnResWeights{vec(lt.mlp_res_norm), vec(lt.mlp_res_proj)}, D);
        for (std::size_t t = 0; t < T; ++t) {
            res[t].mix(&x[t * D], w.data(), eps, rl ? mix_weights(rl->mlp_mix, rl->mlp_candidates, t) : nullptr);
            rmsnorm(&u[t * D], &x[t * D], vec(lt.post_attn_norm), D, eps);
        }
        // {dense SiTU | latent MoE + shared} -> partial += out
        const Situ situ{c.situ_beta, c.situ_linear_beta};
        if (lt.plan.ffn == FfnKind::Dense) {
            dense_ffn(out.data(), u.data(), T, DenseFfnWeights{tw.matrix(lt.gate_proj), tw.matrix(lt.up_proj), tw.matrix(lt.down_proj)}, situ);
        } else {
            const DenseFfnWeights shared = lt.shared_gate
                                               ? DenseFfnWeights{tw.matrix(lt.shared_gate), tw.matrix(lt.shared_up), tw.matrix(lt.shared_down)}
                                               : DenseFfnWeights{};
            const MoeWeights mw{tw.matrix(lt.router), vec(lt.router_bias), tw.matrix(lt.latent_down),
                                lt.latent_norm ? vec(lt.latent_norm) : nullptr, tw.matrix(lt.latent_up), shared};
            MoeRecord moe;
            moe_forward(out.data(), u.data(), T, mw, MoeDims::from(c, l), *model.experts(), rl ? &moe : nullptr);
            if (rl) rl->routing = std::move(moe.routing);
        }
        for (std::size_t t = 0; t < T; ++t) res[t].add(&out[t * D]);
        if (o.times) o.times->layers[std::size_t(l)] = since(t_layer);
    }
    // 3.7 the final mix, model.norm, lm_head
    const auto t_head = clock::now();
    attn_res_fold(w.data(), AttnResWeights{vec(model.tensors.out_res_norm), vec(model.tensors.out_res_proj)}, D);
    const std::size_t first = o.rows == Rows::all ? 0 : T - 1, n = T - first;
    if (record) record->out_candidates = res[first].bank.size() + (res[first].has_partial ? 1 : 0), record->out_mix.assign(n * record->out_candidates, 0.0f);
    for (std::size_t t = first; t < T; ++t) {
        res[t].mix(&x[t * D], w.data(), eps, record ? &record->out_mix[(t - first) * record->out_candidates] : nullptr);
        rmsnorm(&u[(t - first) * D], &x[t * D], vec(model.tensors.final_norm), D, eps);
    }
    linear(logits, u.data(), n, tw.lm_head());
    // A NaN or Inf logit means a weight on the way (lm_head, model.norm, any layer's matrix) or an
    // activation is not finite. Greedy argmax would then answer id 0 forever and exit 0; refuse instead.
    // O(V) per position, nothing next to the lm_head's O(V D). (Small tensors are checked at load.)
    const std::size_t V = std::size_t(c.vocab_size);
    for (std::size_t i = 0; i < n * V; ++i)
        if (!std::isfinite(logits[i]))
            fail(ErrorKind::runtime, "the logits at position " + std::to_string(s.tokens.size() + first + i / V) + " are not finite (logit " +
                                         std::to_string(i % V) + " is " + std::to_string(logits[i]) +
                                         "): the checkpoint holds a NaN or Inf on the way (lm_head, model.norm, a layer's weights)");
    s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
    if (o.times) o.times->head += since(t_head);
}

// Keeping the first n tokens of a tentative step. After a tentative step over T tokens the MLA caches and
// the token list hold all T, the KDA states none of them. keep_tokens(n) truncates the former to n and
// replays n tokens into the latter (kda_advance, chapter 07: no matrix is read), so the session is
// exactly the session that fed only those n tokens (chapter 16 says why replay, not snapshots).
inline void keep_tokens(Model& model, Session& s, const TentativeKda& t, std::size_t n) {
    const Config& c = model.config;
    if (s.position() != t.start + t.tokens || n > t.tokens)
        fail(ErrorKind::usage, "keep_tokens: the session is at position " + std::to_string(s.position()) + ", the tentative step fed " +
                                   std::to_string(t.tokens) + " tokens from " + std::to_string(t.start) + "; keep " + std::to_string(n) +
                                   " (a step is rolled back once, right after it)");
    TrunkWeights& tw = model.trunk();
    auto vec = [&](const Checkpoint::Ref* r) { return tw.vec(r); };  // small tensors, widened to f32 (chapter 12)
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const LayerTensors& lt = model.tensors.layers[std::size_t(l)];
        if (lt.plan.attn == AttnKind::KDA) {
            KdaWeights w{};  // the sequential part reads only the conv taps, A_log and dt_bias: resident small tensors
            w.q_conv = vec(lt.q_conv), w.k_conv = vec(lt.k_conv), w.v_conv = vec(lt.v_conv);
            w.A_log = vec(lt.A_log), w.dt_bias = vec(lt.dt_bias);
            kda_advance(*s.kda[std::size_t(l)], t.inputs[std::size_t(l)], n, w, KdaDims::from(c));
        } else {
            s.mla[std::size_t(l)]->truncate(t.start + n);
        }
    }
    s.tokens.resize(t.start + n);
}

// ---------------------------------------------------------------------------------------------------
// 13.4 Teacher forcing, and the decode loop: greedy generation, incremental decode, full recompute
// ---------------------------------------------------------------------------------------------------
// The first maximum: ties go to the lowest id (never a platform-dependent order).
inline std::int64_t argmax(const float* v, std::size_t n) {  // v (n)
    std::size_t best = 0;
    for (std::size_t i = 1; i < n; ++i)
        if (v[i] > v[best]) best = i;
    return std::int64_t(best);
}

// Every position's logits for a given sequence, in prompt chunks of at most `chunk` tokens.
inline std::vector<float> teacher_force(Model& model, Session& s, const std::vector<std::int64_t>& ids, std::size_t chunk) {
    const std::size_t V = std::size_t(model.config.vocab_size);
    std::vector<float> logits(ids.size() * V);
    for (std::size_t t0 = 0; t0 < ids.size(); t0 += chunk) {
        const std::size_t n = std::min(chunk, ids.size() - t0);
        forward(&logits[t0 * V], model, s, std::span(ids).subspan(t0, n), {.rows = Rows::all});
    }
    return logits;
}

// THE DECODE LOOP. Every generation in this repository (generate below, chapter 15's sessions and chat
// turns, chapter 16's speculation, kimik3 run, chat and serve) is this one loop:
//   feed the fresh tokens (prompt chunks); choose a token from the last row; then, until a stop:
//   feed [last chosen token, guesses...] in ONE step, choose a token from every row, keep the guesses
//   that equal what was chosen (the first mismatch ends the step with the model's own token), roll the
//   session back over the rest (keep_tokens).
// Without a drafter there are no guesses and each step feeds one token: plain incremental decoding.
// A token is chosen at its position p (p tokens before it): choose(row, p). Chapter 16 proves that the
// guesses change only how many steps it takes, never a token or a logit bit.
//
// What differs between callers are hooks, each optional:
using Chooser = std::function<std::int64_t(std::span<const float> logits, std::uint64_t position)>;
struct DecodeStep {            // what one forward step did (the fresh tokens count as one step)
    std::size_t fed = 0;       // tokens through the model: the fresh tokens, or 1 + drafted
    std::size_t drafted = 0;   // guesses verified
    std::size_t accepted = 0;  // guesses kept
    std::size_t yielded = 0;   // tokens this step added to the output (accepted + 1, less at a stop)
};
struct DecodeHooks {
    std::function<bool(std::int64_t id)> token{};   // each token as it is chosen (stream it); false ends the turn
    std::function<void(const DecodeStep&)> step{};  // after each forward step, the fresh tokens' first
    std::function<bool()> cancelled{};              // asked before each decode step; true ends the turn
    std::function<std::vector<std::int64_t>(std::span<const std::int64_t> seq, std::size_t room)> draft{};  // <= room guesses after seq
    StepRecord* record = nullptr;                   // given to every forward step
    StepTimes* times = nullptr;                     // given to every forward step
    std::vector<float>* logits = nullptr;           // appended: (drawn, V), the row each token was chosen from
};
struct DecodeLimits {
    std::size_t max_new = 0;             // tokens to choose at most
    std::size_t chunk = kPrefillChunk;   // fresh tokens per forward step
    bool recompute = false;              // each token from a fresh session over the whole sequence (the check)
};

// Returns the chosen tokens in order. The last one (a stop token, or the max_new-th) is never fed: a
// chat turn feeds it first next time. The session then holds the fresh tokens and every chosen token
// but the last. (One sequence per step here; several sequences, each with its own session and hooks,
// could share each step's read of the weights, since a step gives each token the bits it gets alone.)
inline std::vector<std::int64_t> decode(Model& model, Session& s, std::span<const std::int64_t> fresh, const DecodeLimits& lim,
                                        const Chooser& choose, const DecodeHooks& h = {}) {
    const std::size_t V = std::size_t(model.config.vocab_size);
    if (fresh.empty()) fail(ErrorKind::usage, "decode: nothing to feed");
    if (lim.chunk == 0) fail(ErrorKind::usage, "decode: the prompt chunk must be at least 1 token");
    if (lim.recompute && h.draft) fail(ErrorKind::usage, "decode: full recompute verifies no drafts");
    std::vector<float> rows(V);  // (T, V): row i = the logits after token i of the step
    auto feed = [&](std::span<const std::int64_t> ids) {  // prompt chunks; the last token's logits in rows[0, V)
        for (std::size_t t0 = 0; t0 < ids.size(); t0 += lim.chunk)
            forward(rows.data(), model, s, ids.subspan(t0, std::min(lim.chunk, ids.size() - t0)), {.record = h.record, .times = h.times});
    };
    std::vector<std::int64_t> drawn, seq, guess;
    auto take = [&](const float* row, std::uint64_t position) {  // chooses one token; false when the turn ends with it
        if (h.logits) h.logits->insert(h.logits->end(), row, row + V);
        drawn.push_back(choose(std::span<const float>(row, V), position));
        const bool more = !h.token || h.token(drawn.back());
        return more && drawn.size() < lim.max_new;
    };
    auto so_far = [&] {  // every token of the sequence: the session's and the chosen one not yet fed
        seq.assign(s.tokens.begin(), s.tokens.end());
        seq.push_back(drawn.back());
    };
    feed(fresh);
    if (lim.max_new == 0) return drawn;
    bool go = take(rows.data(), s.position());
    if (h.step) h.step(DecodeStep{fresh.size(), 0, 0, 1});
    TentativeKda tentative;
    while (go && !(h.cancelled && h.cancelled())) {
        if (lim.recompute) {  // a fresh session over the whole sequence so far: slow, and the same bits
            so_far();
            s.reset();
            feed(seq);
            go = take(rows.data(), s.position());
            if (h.step) h.step(DecodeStep{seq.size(), 0, 0, 1});
            continue;
        }
        const std::size_t room = lim.max_new - drawn.size() - 1;  // never a position one-token steps would not reach
        guess.clear();
        if (h.draft && room) so_far(), guess = h.draft(seq, room);
        if (guess.size() > room) guess.resize(room);
        seq.assign(1, drawn.back());
        seq.insert(seq.end(), guess.begin(), guess.end());
        const std::size_t T = seq.size(), start = s.position();
        rows.resize(T * V);
        forward(rows.data(), model, s, seq, {.rows = Rows::all, .tentative = guess.empty() ? nullptr : &tentative, .record = h.record, .times = h.times});
        std::size_t i = 0, accepted = 0;
        for (;; ++i) {  // row i chooses the token at position start + i + 1
            go = take(&rows[i * V], start + i + 1);
            const bool match = i < guess.size() && drawn.back() == guess[i];
            accepted += match;
            if (!go || !match) break;
        }
        if (!guess.empty()) keep_tokens(model, s, tentative, i + 1);  // the last chosen token and the i guesses kept
        if (h.step) h.step(DecodeStep{T, guess.size(), accepted, i + 1});
    }
    return drawn;
}

struct Generation {
    std::vector<std::int64_t> ids;   // the generated tokens
    std::vector<float> logits;       // (steps, V): the logits each token was chosen from
};

// Generates up to `steps` tokens after `prompt` in a new session: decode, incremental or (recompute)
// every token from a fresh session over the whole sequence so far. `choose(logits)` picks each token
// (greedy: argmax); `on_token(step, id)` sees it as soon as it is chosen and returns false to stop.
template <class Choose, class OnToken>
Generation generate(Model& model, const std::vector<std::int64_t>& prompt, std::size_t steps, std::size_t chunk, bool recompute,
                    std::size_t context, Choose&& choose, OnToken&& on_token) {
    if (prompt.empty()) fail(ErrorKind::usage, "generate: the prompt is empty");
    Generation g;
    Session s(model.config, context);
    std::size_t step = 0;
    g.ids = decode(model, s, prompt, {.max_new = steps, .chunk = chunk, .recompute = recompute},
                   [&](std::span<const float> l, std::uint64_t) { return std::int64_t(choose(l)); },
                   {.token = [&](std::int64_t id) { return bool(on_token(step++, id)); }, .logits = &g.logits});
    return g;
}

template <class OnToken>
Generation generate_greedy(Model& model, const std::vector<std::int64_t>& prompt, std::size_t steps, std::size_t chunk, bool recompute,
                           std::size_t context, OnToken&& on_token) {
    return generate(model, prompt, steps, chunk, recompute, context,
                    [](std::span<const float> l) { return argmax(l.data(), l.size()); },
                    [&](std::size_t step, std::int64_t id) { on_token(step, id); return true; });
}

}  // namespace kimik3
