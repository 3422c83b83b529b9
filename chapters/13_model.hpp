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
//                 logits and the session (a record, timings) only when asked, through StepOptions. A step
//                 may carry several sessions (StepItems): their rows share every read of the weights and
//                 each gets the bits it gets alone (appendix 13a batches conversations with it).
//   teacher forcing  run a given sequence and read every position's logits.
//   incremental   prefill the prompt (chunks of kPrefillChunk = 32), then one token per step, carrying the
//                 session: decode (13.4), whose hooks are all that differ between its callers. Decoder is
//                 that loop one step at a time (next: what to feed; took: choose from the step's rows),
//                 so that a batch can run several conversations' loops through shared steps.
//   recompute     for every generated token, a fresh session over the whole sequence so far: slower,
//                 and by construction bit-identical to incremental (a test, and a run option).
//
// NUMERICS CONTRACT
//   Everything is the chapters' contracts composed in the order of docs/kimi-k3.md 3.9; the driver adds
//   no arithmetic of its own except the embedding widening (exact) and argmax (first maximum: the
//   lowest id wins a tie). Logits are f32 (docs/kimi-k3.md 3.7: no soft-capping, no scaling). A step
//   of T tokens = T steps of one token; a step over several sessions = a step of each alone.
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
//   13.1 the model (weights, plan, providers)     13.2 the session     13.3 one forward step, over one
//   session or several (and keeping part of a tentative one)     13.4 teacher forcing, and the decode
//   loop: greedy, incremental, recompute, a step at a time (Decoder)
//   APPENDIX 13a_batch.hpp: the scheduler that runs several conversations' Decoders through shared steps.
// ====================================================================================================
#pragma once

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <span>
#include <optional>
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

// The experts this process may cache: all, or with chapter 17's split installed (one MPI rank of several)
// those it owns; its matrices' rows are process_rows' (appendix 12b). The plan is made of that share alone.
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

// One sequence's part of a step. A step may carry several sequences, each on its own session (appendix
// 13a steps a batch of conversations so): their rows are stacked, every matrix and every routed expert
// multiplies all of them in one pass (one read of the weights), and only what carries state (KDA's
// recurrence, MLA's cache) or looks across positions runs per sequence. Each sequence's logits and session
// end exactly as they would in a step of its own: chapter 04's T-row products give each row its own bits,
// MoE routes and combines each row alone (chapter 10), and nothing else mixes rows.
struct StepItem {
    Session* session = nullptr;
    std::span<const std::int64_t> ids;  // T >= 1 new tokens at the session's end
    float* logits = nullptr;            // (1, V) the last token's row, or (T, V) with Rows::all
    StepOptions o{};                    // its rows, tentative and record; `times` gets the whole step's
};

// THE FORWARD STEP, docs/kimi-k3.md 3.9 in order, over the stacked rows of every item.
inline void forward(Model& model, std::span<const StepItem> items) {
    const Config& c = model.config;
    const std::size_t D = std::size_t(c.hidden_size), V = std::size_t(c.vocab_size), L = std::size_t(c.num_hidden_layers);
    const float eps = c.rms_norm_eps;
    if (items.empty()) fail(ErrorKind::usage, "forward: no sequence to step");
    std::vector<std::size_t> row0(items.size());  // item i's rows are [row0[i], row0[i] + T_i)
    std::size_t N = 0;
    StepTimes* times = nullptr;
    for (std::size_t i = 0; i < items.size(); ++i) {
        const StepItem& it = items[i];
        if (!it.session || it.ids.empty() || !it.logits)
            fail(ErrorKind::usage, "forward: item " + std::to_string(i) + " has no session, no tokens or nowhere for its logits");
        for (std::size_t j = 0; j < i; ++j)
            if (items[j].session == it.session) fail(ErrorKind::usage, "forward: items " + std::to_string(j) + " and " + std::to_string(i) + " share one session");
        row0[i] = N, N += it.ids.size();
        if (it.o.tentative) it.o.tentative->start = it.session->position(), it.o.tentative->tokens = it.ids.size(), it.o.tentative->inputs.resize(L);
        if (it.o.record) it.o.record->tokens = it.ids.size(), it.o.record->layers.assign(L, {});
        if (it.o.times) times = it.o.times, times->layers.assign(L, 0.0);
    }
    TrunkWeights& tw = model.trunk();
    auto vec = [&](const Checkpoint::Ref* r) { return tw.vec(r); };  // norms, biases, taps: f32 (chapter 12)
    auto mat = [&](const Checkpoint::Ref* r) { return tw.matrix(r); };
    if (model.experts()) model.experts()->begin_step();
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
    bool recording = false;
    for (const StepItem& it : items) recording = recording || it.o.record;

    // 3.1 the embedding: x0 = embed_tokens[id]; it is the first partial sum of every token's stream
    std::vector<float> x(N * D), u(N * D), out(N * D), w(D);  // (N, D) each; w: a folded AttnRes vector
    const auto t_start = clock::now();
    std::vector<ResidualState> res(N);
    for (std::size_t i = 0; i < items.size(); ++i)
        for (std::size_t t = 0; t < items[i].ids.size(); ++t) {
            tw.embed_row(&x[(row0[i] + t) * D], items[i].ids[t]);
            res[row0[i] + t].start(&x[(row0[i] + t) * D], D);
        }
    if (times) times->head = since(t_start);
    // Where token t of item i records its depth weights of one mix: rec (T, n), n = this mix's candidates.
    auto mix_weights = [&](std::size_t i, std::vector<float>& rec, std::size_t& n, std::size_t t) -> float* {
        const ResidualState& r = res[row0[i]];
        if (t == 0) n = r.bank.size() + (r.has_partial ? 1 : 0), rec.assign(items[i].ids.size() * n, 0.0f);
        return rec.data() + t * n;
    };
    // One AttnRes mix of every row, then RMSNorm: u = norm(mix(x)). attn: the layer's first mix (it adds
    // nothing at layer 0, where a stream holds only its embedding).
    auto mix_and_norm = [&](int l, bool attn, const Checkpoint::Ref* res_norm, const Checkpoint::Ref* res_proj, const Checkpoint::Ref* norm) {
        attn_res_fold(w.data(), AttnResWeights{vec(res_norm), vec(res_proj)}, D);
        for (std::size_t i = 0; i < items.size(); ++i) {
            StepRecord::Layer* rl = items[i].o.record ? &items[i].o.record->layers[std::size_t(l)] : nullptr;
            for (std::size_t t = 0, r = row0[i]; t < items[i].ids.size(); ++t, ++r) {
                if (attn) {
                    float* pi = rl && l > 0 ? mix_weights(i, rl->attn_mix, rl->attn_candidates, t) : nullptr;
                    res[r].attn_input(&x[r * D], l, c.attn_res_block_size, w.data(), eps, pi);
                } else {
                    res[r].mix(&x[r * D], w.data(), eps, rl ? mix_weights(i, rl->mlp_mix, rl->mlp_candidates, t) : nullptr);
                }
                rmsnorm(&u[r * D], &x[r * D], vec(norm), D, eps);
            }
        }
    };
    std::vector<KdaSeq> kda_seqs(items.size());
    std::vector<MlaSeq> mla_seqs(items.size());
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const auto t_layer = clock::now();
        const LayerTensors& lt = model.tensors.layers[std::size_t(l)];
        // [AttnRes attn-mix] -> RMSNorm(input_layernorm)
        mix_and_norm(l, true, lt.attn_res_norm, lt.attn_res_proj, lt.input_norm);
        // {KDA | Gated MLA} on each item's own state -> partial += out
        if (lt.plan.attn == AttnKind::KDA) {
            for (std::size_t i = 0; i < items.size(); ++i) {
                KdaState& state = *items[i].session->kda[std::size_t(l)];
                TentativeKda* tent = items[i].o.tentative;  // a tentative step runs KDA on a copy, keeping its inputs
                if (tent) tent->scratch = state;
                kda_seqs[i] = KdaSeq{row0[i], items[i].ids.size(), tent ? &tent->scratch : &state, tent ? &tent->inputs[std::size_t(l)] : nullptr};
            }
            kda_forward(out.data(), u.data(), N, kda_seqs, kda_weights(lt, mat, vec), KdaDims::from(c));
        } else {
            const MlaWeights mw{mat(lt.q_a_proj), vec(lt.q_a_norm), mat(lt.q_b_proj), mat(lt.kv_a_proj),
                                vec(lt.kv_a_norm), mat(lt.kv_b_proj), mat(lt.g_proj), mat(lt.o_proj)};
            for (std::size_t i = 0; i < items.size(); ++i) mla_seqs[i] = MlaSeq{row0[i], items[i].ids.size(), &*items[i].session->mla[std::size_t(l)]};
            mla_forward_with(use_simd ? kMlaSimd : kMlaRef, out.data(), u.data(), N, mla_seqs, mw, MlaDims::from(c));
        }
        for (std::size_t r = 0; r < N; ++r) res[r].add(&out[r * D]);
        // [AttnRes mlp-mix] -> RMSNorm(post_attention_layernorm)
        mix_and_norm(l, false, lt.mlp_res_norm, lt.mlp_res_proj, lt.post_attn_norm);
        // {dense SiTU | latent MoE + shared} -> partial += out
        const Situ situ{c.situ_beta, c.situ_linear_beta};
        if (lt.plan.ffn == FfnKind::Dense) {
            dense_ffn(out.data(), u.data(), N, DenseFfnWeights{mat(lt.gate_proj), mat(lt.up_proj), mat(lt.down_proj)}, situ);
        } else {
            const DenseFfnWeights shared = lt.shared_gate ? DenseFfnWeights{mat(lt.shared_gate), mat(lt.shared_up), mat(lt.shared_down)} : DenseFfnWeights{};
            const MoeWeights mw{mat(lt.router), vec(lt.router_bias), mat(lt.latent_down), lt.latent_norm ? vec(lt.latent_norm) : nullptr,
                                mat(lt.latent_up), shared};
            MoeRecord moe;
            moe_forward(out.data(), u.data(), N, mw, MoeDims::from(c, l), *model.experts(), recording ? &moe : nullptr);
            for (std::size_t i = 0; i < items.size(); ++i)
                if (items[i].o.record) items[i].o.record->layers[std::size_t(l)].routing = routing_rows(moe.routing, row0[i], items[i].ids.size());
        }
        for (std::size_t r = 0; r < N; ++r) res[r].add(&out[r * D]);
        if (times) times->layers[std::size_t(l)] = since(t_layer);
    }
    // 3.7 the final mix, model.norm, then ONE lm_head pass over the rows that want logits
    const auto t_head = clock::now();
    attn_res_fold(w.data(), AttnResWeights{vec(model.tensors.out_res_norm), vec(model.tensors.out_res_proj)}, D);
    std::size_t n = 0;  // rows with logits so far
    for (std::size_t i = 0; i < items.size(); ++i) {
        const std::size_t T = items[i].ids.size(), first = items[i].o.rows == Rows::all ? 0 : T - 1;
        StepRecord* record = items[i].o.record;
        const ResidualState& r0 = res[row0[i] + first];
        if (record) record->out_candidates = r0.bank.size() + (r0.has_partial ? 1 : 0), record->out_mix.assign((T - first) * record->out_candidates, 0.0f);
        for (std::size_t t = first; t < T; ++t, ++n) {
            const std::size_t r = row0[i] + t;
            res[r].mix(&x[r * D], w.data(), eps, record ? &record->out_mix[(t - first) * record->out_candidates] : nullptr);
            rmsnorm(&u[n * D], &x[r * D], vec(model.tensors.final_norm), D, eps);
        }
    }
    std::vector<float> stacked(items.size() > 1 ? n * V : 0);  // one item writes its own buffer directly
    linear(items.size() > 1 ? stacked.data() : items[0].logits, u.data(), n, tw.lm_head());
    n = 0;
    for (const StepItem& it : items) {
        const std::size_t rows = it.o.rows == Rows::all ? it.ids.size() : 1;
        if (items.size() > 1) std::copy_n(&stacked[n * V], rows * V, it.logits);
        n += rows;
        // A NaN or Inf logit means a weight on the way (lm_head, model.norm, any layer's matrix) or an
        // activation is not finite. Greedy argmax would then answer id 0 forever and exit 0; refuse instead.
        // O(V) per position, nothing next to the lm_head's O(V D). (Small tensors are checked at load.)
        for (std::size_t k = 0; k < rows * V; ++k)
            if (!std::isfinite(it.logits[k]))
                fail(ErrorKind::runtime, "the logits at position " + std::to_string(it.session->position() + it.ids.size() - rows + k / V) +
                                             " are not finite (logit " + std::to_string(k % V) + " is " + std::to_string(it.logits[k]) +
                                             "): the checkpoint holds a NaN or Inf on the way (lm_head, model.norm, a layer's weights)");
    }
    for (const StepItem& it : items) it.session->tokens.insert(it.session->tokens.end(), it.ids.begin(), it.ids.end());
    if (times) times->head += since(t_head);
}

// One sequence: T new tokens at the end of session s.
inline void forward(float* logits, Model& model, Session& s, std::span<const std::int64_t> ids, const StepOptions& o = {}) {
    const StepItem item{&s, ids, logits, o};
    forward(model, std::span(&item, 1));
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

// The loop, one step at a time: next() says what this sequence feeds in the coming forward step (a prompt
// chunk, or the last chosen token and its guesses), took() reads that step's rows, chooses, keeps or rolls
// back. decode() below runs one sequence's steps one after another; appendix 13a's Batch runs several
// sequences' steps together, one forward step for all of them. Same code, so the same tokens and bits.
class Decoder {
  public:
    Decoder(Model& model, Session& s, std::span<const std::int64_t> fresh, const DecodeLimits& lim, Chooser choose, DecodeHooks h = {})
        : model_(model), s_(s), lim_(lim), choose_(std::move(choose)), h_(std::move(h)), pending_(fresh),
          rows_(std::size_t(model.config.vocab_size)) {
        if (fresh.empty()) fail(ErrorKind::usage, "decode: nothing to feed");
        if (lim.chunk == 0) fail(ErrorKind::usage, "decode: the prompt chunk must be at least 1 token");
        if (lim.recompute && h_.draft) fail(ErrorKind::usage, "decode: full recompute verifies no drafts");
    }
    // This sequence's part of the next forward step; false once the turn has ended (nothing more to feed).
    bool next(StepItem& item) {
        const StepOptions watch{.record = h_.record, .times = h_.times};
        if (done_) return false;
        if (fed_ < pending_.size()) {  // the fresh tokens (or, recomputing, the whole sequence), a chunk at a time
            const std::size_t n = std::min(lim_.chunk, pending_.size() - fed_);
            item = StepItem{&s_, pending_.subspan(fed_, n), rows_.data(), watch};  // its last token's logits in rows_[0, V)
            fed_ += n, chunk_ = true;
            return true;
        }
        if (h_.cancelled && h_.cancelled()) return done_ = true, false;  // asked before each decode step
        if (lim_.recompute) {  // a fresh session over the whole sequence so far: slow, and the same bits
            so_far();
            all_ = seq_;
            s_.reset();
            pending_ = all_, fed_ = 0;
            return next(item);
        }
        const std::size_t room = lim_.max_new - drawn_.size() - 1;  // never a position one-token steps would not reach
        guess_.clear();
        if (h_.draft && room) so_far(), guess_ = h_.draft(seq_, room);
        if (guess_.size() > room) guess_.resize(room);
        seq_.assign(1, drawn_.back());
        seq_.insert(seq_.end(), guess_.begin(), guess_.end());
        start_ = s_.position(), chunk_ = false;
        rows_.resize(seq_.size() * V());
        item = StepItem{&s_, seq_, rows_.data(), {.rows = Rows::all, .tentative = guess_.empty() ? nullptr : &tentative_, .record = h_.record, .times = h_.times}};
        return true;
    }
    // After the step that next() prepared: choose, keep the guesses that match, call the hooks.
    void took() {
        if (chunk_) {
            if (fed_ < pending_.size()) return;  // more chunks to feed
            if (lim_.max_new == 0) return void(done_ = true);
            const bool go = take(rows_.data(), s_.position());
            if (h_.step) h_.step(DecodeStep{pending_.size(), 0, 0, 1});
            done_ = !go;
            return;
        }
        std::size_t i = 0, accepted = 0;
        bool go = true;
        for (;; ++i) {  // row i chooses the token at position start + i + 1
            go = take(&rows_[i * V()], start_ + i + 1);
            const bool match = i < guess_.size() && drawn_.back() == guess_[i];
            accepted += match;
            if (!go || !match) break;
        }
        if (!guess_.empty()) keep_tokens(model_, s_, tentative_, i + 1);  // the last chosen token and the i guesses kept
        if (h_.step) h_.step(DecodeStep{seq_.size(), guess_.size(), accepted, i + 1});
        done_ = !go;
    }
    bool done() const { return done_; }
    std::vector<std::int64_t>& drawn() { return drawn_; }

  private:
    std::size_t V() const { return std::size_t(model_.config.vocab_size); }
    bool take(const float* row, std::uint64_t position) {  // chooses one token; false when the turn ends with it
        if (h_.logits) h_.logits->insert(h_.logits->end(), row, row + V());
        drawn_.push_back(choose_(std::span<const float>(row, V()), position));
        const bool more = !h_.token || h_.token(drawn_.back());
        return more && drawn_.size() < lim_.max_new;
    }
    void so_far() {  // every token of the sequence: the session's and the chosen one not yet fed
        seq_.assign(s_.tokens.begin(), s_.tokens.end());
        seq_.push_back(drawn_.back());
    }
    Model& model_;
    Session& s_;
    DecodeLimits lim_;
    Chooser choose_;
    DecodeHooks h_;
    std::span<const std::int64_t> pending_;  // fed in chunks: the fresh tokens, or (recompute) all_
    std::size_t fed_ = 0;
    bool chunk_ = false, done_ = false;      // the step next() prepared fed a chunk of pending_; the turn has ended
    std::vector<float> rows_;                // (T, V): row i = the logits after token i of the step
    std::vector<std::int64_t> drawn_, seq_, guess_, all_;
    TentativeKda tentative_;
    std::uint64_t start_ = 0;
};

// Returns the chosen tokens in order. The last one (a stop token, or the max_new-th) is never fed: a
// chat turn feeds it first next time. The session then holds the fresh tokens and every chosen token
// but the last.
inline std::vector<std::int64_t> decode(Model& model, Session& s, std::span<const std::int64_t> fresh, const DecodeLimits& lim,
                                        const Chooser& choose, const DecodeHooks& h = {}) {
    Decoder d(model, s, fresh, lim, choose, h);
    for (StepItem item; d.next(item);) {
        forward(model, std::span(&item, 1));
        d.took();
    }
    return std::move(d.drawn());
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
