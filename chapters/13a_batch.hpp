// kimik3 chapter 13, APPENDIX A: batch -- several conversations advanced by one forward step.
// ====================================================================================================
//
// APPENDIX to chapter 13 (13_model.hpp, section 13.3). At the memory floor every step streams the
// whole trunk through the ring, so two conversations stepped one after the other read it twice. A
// batched step reads it once: the rows of every conversation (its prompt chunk, or its one decode
// token) are stacked into one (N, D) activation, every trunk matrix and every routed expert multiplies
// all N rows in one pass, and only what carries state runs per conversation: KDA's conv history and
// recurrence on that conversation's KdaState, MLA's latents appended to and attended over that
// conversation's own cache.
//
// CONTRACT
//   * Exact per user: every conversation's logits are bit-identical to forward() on its session alone,
//     whatever else is in the step. This holds because chapter 04's T-row matmuls give each row the bits
//     it gets alone, MoE routes and combines each row on its own (chapter 10), and the per-row parts
//     (AttnRes, the norms, MLA's attention) never look at another row. Tests 13a.* check it bit for bit
//     against forward() and decode(), with staggered arrivals, a conversation leaving mid-batch and
//     different samplers.
//   * One read per step: every trunk matrix is streamed once per step and every expert the batch routes
//     to is fetched once (the union), however many conversations there are.
//   * A conversation owns its Session; the batch holds a pointer to it while the conversation is active.
//   * Not here: tentative steps (chapter 16) and step records run one conversation at a time (forward).
//
// CONCEPTS
//   BatchItem     one conversation's share of a step: its session, its new tokens, where its logits go.
//   forward_batch one step over several BatchItems (13a.1).
//   Batch         the scheduler (13a.2): conversations join between steps (up to max_batch at once, the
//                 rest wait in arrival order), each step feeds every active one a prompt chunk or its last
//                 chosen token, a conversation leaves when its turn ends (a stop, max_new, or cancelled).
//                 Per conversation it chooses exactly as decode() does without a drafter.
//
// SOURCES  Orca: a distributed serving system for transformer-based generative models (Yu et al., OSDI
//          2022) for iteration-level scheduling; vLLM (Kwon et al., SOSP 2023) for per-sequence caches.
// USES     chapter 13 (Model, Session, forward's order of operations), 07 (kda_token), 08 (mla_attend)
// TEST     make test-13 (tests "13a ...")
// ====================================================================================================
#pragma once

#include <deque>

#include "13_model.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 13a.1 One forward step over several sessions
// ---------------------------------------------------------------------------------------------------
struct BatchItem {
    Session* session = nullptr;
    std::span<const std::int64_t> ids;  // T >= 1 new tokens at the session's end
    float* logits = nullptr;            // (1, V) the last token's row, or (T, V) with Rows::all
    Rows rows = Rows::last;
};

namespace detail {
// A batch row range [row0, row0 + T) and the state it belongs to.
template <class State>
struct Segment {
    std::size_t row0 = 0, tokens = 0;
    State* state = nullptr;
};

// kda_forward over stacked rows: the eight projections once for all N rows, the sequential part per
// segment on its own state (the same kda_token, in the same token order, as kda_forward).
inline void kda_forward_batch(float* y, const float* u, std::size_t N, std::span<const Segment<KdaState>> segs, const KdaWeights& w,
                              const KdaDims& d) {  // y (N, D), u (N, D)
    for (const auto& s : segs) kda_check(w, d, *s.state);
    const std::size_t P = d.width(), H = d.heads, Dh = d.head_dim;
    KdaInputs in;
    in.tokens = N;
    for (auto* m : {&in.q, &in.k, &in.v, &in.f}) m->resize(N * P);
    in.b.resize(N * H);
    std::vector<float> gate(N * P), fa(N * Dh), o_gated(N * P);
    linear(in.q.data(), u, N, w.q_proj);
    linear(in.k.data(), u, N, w.k_proj);
    linear(in.v.data(), u, N, w.v_proj);
    linear(gate.data(), u, N, w.g_proj);
    linear(fa.data(), u, N, w.f_a_proj);
    linear(in.f.data(), fa.data(), N, w.f_b_proj);
    linear(in.b.data(), u, N, w.b_proj);
    KdaTokenBuffers x(d);
    for (const auto& s : segs)
        for (std::size_t t = s.row0; t < s.row0 + s.tokens; ++t) {
            kda_token(x, in, t, w, d, *s.state);
            gated_head_norm(&o_gated[t * P], x.o.data(), &gate[t * P], w.o_norm, H, Dh, d.eps);
        }
    linear(y, o_gated.data(), N, w.o_proj);
}

// mla_forward_with over stacked rows: every projection and both kv_b_proj passes once for all N rows;
// each segment's latents go to its own cache, and row r attends over its own cache only, up to its
// position (the same mla_attend call, the same length, as mla_forward_with gives it).
inline void mla_forward_batch(const MlaKernels& k, float* y, const float* u, std::size_t N, std::span<const Segment<MlaCache>> segs,
                              const MlaWeights& w, const MlaDims& d) {  // y (N, D), u (N, D)
    for (const auto& s : segs) mla_check(w, d, *s.state, s.tokens, "mla_forward_batch");
    const std::size_t H = d.heads, Q = d.q_lora, R = d.kv_lora, X = d.rope, N_ = d.nope, NX = d.qk(), NV = d.nope + d.v, Dv = d.v;
    std::vector<const float*> cache_of(N);  // row r: its cache, and how many positions it attends over
    std::vector<std::size_t> len_of(N);
    for (const auto& s : segs)
        for (std::size_t t = 0; t < s.tokens; ++t) len_of[s.row0 + t] = s.state->length() + t + 1;
    // 3.5.1, 3.5.2, the gate's input half (mla_project), the T positions appended per segment
    std::vector<float> q(N * H * NX), gate(N * H * Dv), cq(N * Q), kva(N * (R + X));
    mla_linear(k, cq.data(), u, N, w.q_a_proj);
    for (std::size_t t = 0; t < N; ++t) k.rmsnorm(&cq[t * Q], &cq[t * Q], w.q_a_norm, Q, d.eps);
    mla_linear(k, q.data(), cq.data(), N, w.q_b_proj);
    mla_linear(k, kva.data(), u, N, w.kv_a_proj);
    for (const auto& s : segs)
        for (std::size_t t = s.row0; t < s.row0 + s.tokens; ++t) {
            float* pos = s.state->append();
            k.rmsnorm(pos, &kva[t * (R + X)], w.kv_a_norm, R, d.eps);
            std::copy_n(&kva[t * (R + X) + R], X, pos + R);
        }
    for (const auto& s : segs)  // after the appends: a cache's data pointer is stable within its reservation
        for (std::size_t t = s.row0; t < s.row0 + s.tokens; ++t) cache_of[t] = s.state->data();
    mla_linear(k, gate.data(), u, N, w.g_proj);
    for (std::size_t i = 0; i < N * H * Dv; ++i) gate[i] = sigmoid(gate[i]);
    // 8.5.1 absorb, per row and head, in kv_b_proj's chunk order
    std::vector<float> qbar(H * N * R, 0.0f), ctx(H * N * R);  // (H, N, R)
    const WeightType kv_type = w.kv_b_proj.type;
    const std::size_t kv_row = w.kv_b_proj.row_bytes();
    auto row_at = [&](const void* rows, std::size_t i) { return static_cast<const std::byte*>(rows) + i * kv_row; };
    for_each_rows(w.kv_b_proj, [&](std::size_t r0, std::size_t r1, const void* rows) {
        if (r1 <= r0) return;
        const std::size_t h0 = r0 / NV, h1 = (r1 - 1) / NV + 1;
        parallel_rows(h1 - h0, N * N_ * R, [&](std::size_t a, std::size_t b) {
            for (std::size_t h = h0 + a; h < h0 + b; ++h) {
                const std::size_t i0 = std::max(r0, h * NV), i1 = std::min(r1, h * NV + N_);
                for (std::size_t t = 0; i0 < i1 && t < N; ++t)
                    k.matvec_t(kv_type, &qbar[(h * N + t) * R], &q[(t * H + h) * NX + (i0 - h * NV)], row_at(rows, i0 - r0), i1 - i0, R);
            }
        });
    });
    // 8.5.2 attend: row t over its own cache's positions 0 .. len_of[t] - 1
    std::size_t longest = 0;
    for (std::size_t t = 0; t < N; ++t) longest = std::max(longest, len_of[t]);
    parallel_rows(H, N * longest * (2 * R + X), [&](std::size_t h0, std::size_t h1) {
        std::vector<float> probs((h1 - h0) * longest);
        std::vector<MlaHeadQuery> hq(h1 - h0);
        for (std::size_t t = 0; t < N; ++t) {
            for (std::size_t h = h0; h < h1; ++h)
                hq[h - h0] = MlaHeadQuery{&qbar[(h * N + t) * R], &q[(t * H + h) * NX + N_], &probs[(h - h0) * longest], &ctx[(h * N + t) * R]};
            mla_attend(k, hq.data(), h1 - h0, cache_of[t], len_of[t], d);
        }
    });
    // 8.5.3 values, 8.5.4 gate and o_proj
    std::vector<float> attn(N * H * Dv);
    for_each_rows(w.kv_b_proj, [&](std::size_t r0, std::size_t r1, const void* rows) {
        if (r1 <= r0) return;
        const std::size_t h0 = r0 / NV, h1 = (r1 - 1) / NV + 1;
        parallel_rows(h1 - h0, N * Dv * R, [&](std::size_t a, std::size_t b) {
            for (std::size_t h = h0 + a; h < h0 + b; ++h) {
                const std::size_t j0 = std::max(r0, h * NV + N_), j1 = std::min(r1, (h + 1) * NV);
                if (j0 < j1) k.matmul(kv_type, &attn[h * Dv + (j0 - h * NV - N_)], &ctx[h * N * R], row_at(rows, j0 - r0), N, j1 - j0, R, H * Dv);
            }
        });
    });
    for (std::size_t i = 0; i < attn.size(); ++i) attn[i] *= gate[i];
    mla_linear(k, y, attn.data(), N, w.o_proj);
}
}  // namespace detail

// forward() for several sessions at once, in forward's order of operations. Each item's session must
// be a different one. Its logits and session end exactly as forward(item.logits, model, *item.session,
// item.ids, {.rows = item.rows}) would leave them.
inline void forward_batch(Model& model, std::span<const BatchItem> items) {
    const Config& c = model.config;
    const std::size_t D = std::size_t(c.hidden_size), V = std::size_t(c.vocab_size);
    const float eps = c.rms_norm_eps;
    if (items.empty()) fail(ErrorKind::usage, "forward_batch: no conversation to step");
    std::vector<std::size_t> row0(items.size());
    std::size_t N = 0;
    for (std::size_t i = 0; i < items.size(); ++i) {
        if (!items[i].session || items[i].ids.empty() || !items[i].logits)
            fail(ErrorKind::usage, "forward_batch: item " + std::to_string(i) + " has no session, no tokens or nowhere for its logits");
        for (std::size_t j = 0; j < i; ++j)
            if (items[j].session == items[i].session)
                fail(ErrorKind::usage, "forward_batch: items " + std::to_string(j) + " and " + std::to_string(i) + " share one session");
        row0[i] = N, N += items[i].ids.size();
    }
    TrunkWeights& tw = model.trunk();
    auto vec = [&](const Checkpoint::Ref* r) { return tw.vec(r); };
    if (model.experts()) model.experts()->begin_step();
    std::vector<float> x(N * D), u(N * D), out(N * D), w(D);
    std::vector<ResidualState> res(N);
    for (std::size_t i = 0; i < items.size(); ++i)
        for (std::size_t t = 0; t < items[i].ids.size(); ++t) {
            tw.embed_row(&x[(row0[i] + t) * D], items[i].ids[t]);
            res[row0[i] + t].start(&x[(row0[i] + t) * D], D);
        }
    std::vector<detail::Segment<KdaState>> kda_segs(items.size());
    std::vector<detail::Segment<MlaCache>> mla_segs(items.size());
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const LayerTensors& lt = model.tensors.layers[std::size_t(l)];
        attn_res_fold(w.data(), AttnResWeights{vec(lt.attn_res_norm), vec(lt.attn_res_proj)}, D);
        for (std::size_t t = 0; t < N; ++t) {
            res[t].attn_input(&x[t * D], l, c.attn_res_block_size, w.data(), eps, nullptr);
            rmsnorm(&u[t * D], &x[t * D], vec(lt.input_norm), D, eps);
        }
        if (lt.plan.attn == AttnKind::KDA) {
            for (std::size_t i = 0; i < items.size(); ++i) kda_segs[i] = {row0[i], items[i].ids.size(), &*items[i].session->kda[std::size_t(l)]};
            detail::kda_forward_batch(out.data(), u.data(), N, kda_segs, kda_weights(lt, [&](auto* r) { return tw.matrix(r); }, vec), KdaDims::from(c));
        } else {
            const MlaWeights mw{tw.matrix(lt.q_a_proj), vec(lt.q_a_norm), tw.matrix(lt.q_b_proj), tw.matrix(lt.kv_a_proj),
                                vec(lt.kv_a_norm), tw.matrix(lt.kv_b_proj), tw.matrix(lt.g_proj), tw.matrix(lt.o_proj)};
            for (std::size_t i = 0; i < items.size(); ++i) mla_segs[i] = {row0[i], items[i].ids.size(), &*items[i].session->mla[std::size_t(l)]};
            detail::mla_forward_batch(use_simd ? kMlaSimd : kMlaRef, out.data(), u.data(), N, mla_segs, mw, MlaDims::from(c));
        }
        for (std::size_t t = 0; t < N; ++t) res[t].add(&out[t * D]);
        attn_res_fold(w.data(), AttnResWeights{vec(lt.mlp_res_norm), vec(lt.mlp_res_proj)}, D);
        for (std::size_t t = 0; t < N; ++t) {
            res[t].mix(&x[t * D], w.data(), eps, nullptr);
            rmsnorm(&u[t * D], &x[t * D], vec(lt.post_attn_norm), D, eps);
        }
        const Situ situ{c.situ_beta, c.situ_linear_beta};
        if (lt.plan.ffn == FfnKind::Dense) {
            dense_ffn(out.data(), u.data(), N, DenseFfnWeights{tw.matrix(lt.gate_proj), tw.matrix(lt.up_proj), tw.matrix(lt.down_proj)}, situ);
        } else {
            const DenseFfnWeights shared = lt.shared_gate
                                               ? DenseFfnWeights{tw.matrix(lt.shared_gate), tw.matrix(lt.shared_up), tw.matrix(lt.shared_down)}
                                               : DenseFfnWeights{};
            const MoeWeights mw{tw.matrix(lt.router), vec(lt.router_bias), tw.matrix(lt.latent_down),
                                lt.latent_norm ? vec(lt.latent_norm) : nullptr, tw.matrix(lt.latent_up), shared};
            moe_forward(out.data(), u.data(), N, mw, MoeDims::from(c, l), *model.experts(), nullptr);
        }
        for (std::size_t t = 0; t < N; ++t) res[t].add(&out[t * D]);
    }
    // the final mix, model.norm, then ONE lm_head pass over every item's rows that want logits
    attn_res_fold(w.data(), AttnResWeights{vec(model.tensors.out_res_norm), vec(model.tensors.out_res_proj)}, D);
    std::size_t n = 0;
    for (std::size_t i = 0; i < items.size(); ++i) {
        const std::size_t T = items[i].ids.size();
        for (std::size_t t = items[i].rows == Rows::all ? 0 : T - 1; t < T; ++t, ++n) {
            res[row0[i] + t].mix(&x[(row0[i] + t) * D], w.data(), eps, nullptr);
            rmsnorm(&u[n * D], &x[(row0[i] + t) * D], vec(model.tensors.final_norm), D, eps);
        }
    }
    std::vector<float> logits(n * V);
    linear(logits.data(), u.data(), n, tw.lm_head());
    n = 0;
    for (const BatchItem& it : items) {
        const std::size_t rows = it.rows == Rows::all ? it.ids.size() : 1, first = it.ids.size() - rows;
        for (std::size_t i = 0; i < rows * V; ++i)
            if (!std::isfinite(logits[n * V + i]))
                fail(ErrorKind::runtime, "the logits at position " + std::to_string(it.session->position() + first + i / V) +
                                             " are not finite: the checkpoint holds a NaN or Inf on the way (lm_head, model.norm, a layer's weights)");
        std::copy_n(&logits[n * V], rows * V, it.logits);
        n += rows;
        it.session->tokens.insert(it.session->tokens.end(), it.ids.begin(), it.ids.end());
    }
}

// ---------------------------------------------------------------------------------------------------
// 13a.2 The scheduler: conversations join and leave between steps
// ---------------------------------------------------------------------------------------------------
// One conversation's turn, as decode() takes it (no drafter, no recompute: those run alone).
struct Conversation {
    Session* session = nullptr;         // owned by the caller; used while the conversation is active
    std::vector<std::int64_t> fresh;    // fed first, in chunks of limits.chunk
    DecodeLimits limits;
    Chooser choose;
    DecodeHooks hooks;                  // token, cancelled and logits are used (as decode uses them)
};

class Batch {
  public:
    using Id = std::size_t;
    Batch(Model& model, std::size_t max_batch) : model_(model), max_batch_(max_batch) {
        if (max_batch == 0) fail(ErrorKind::usage, "Batch: --max-batch must be at least 1");
    }

    // Queues a conversation; it joins at the next step that has room (arrival order).
    Id join(Conversation c) {
        if (!c.session || c.fresh.empty() || !c.choose) fail(ErrorKind::usage, "Batch::join: a conversation needs a session, tokens to feed and a chooser");
        if (c.limits.chunk == 0) fail(ErrorKind::usage, "Batch::join: the prompt chunk must be at least 1 token");
        if (c.limits.recompute || c.hooks.draft) fail(ErrorKind::usage, "Batch::join: recompute and drafts run alone (decode)");
        convs_.emplace_back().c = std::move(c);
        waiting_.push_back(convs_.size() - 1);
        return convs_.size() - 1;
    }
    bool done(Id id) const { return convs_.at(id).done; }
    const std::vector<std::int64_t>& drawn(Id id) const { return convs_.at(id).drawn; }
    std::size_t active() const { return active_.size(); }
    std::size_t waiting() const { return waiting_.size(); }
    bool idle() const { return active_.empty() && waiting_.empty(); }
    std::size_t steps() const { return steps_; }

    // One forward step over every active conversation (after admitting waiting ones and dropping those
    // cancelled): each is fed its next prompt chunk or its last chosen token. Returns the rows fed.
    std::size_t step() {
        while (!waiting_.empty() && active_.size() < max_batch_) active_.push_back(waiting_.front()), waiting_.pop_front();
        std::erase_if(active_, [&](Id id) {
            State& s = convs_[id];
            if (s.started && s.c.hooks.cancelled && s.c.hooks.cancelled()) s.done = true;  // decode asks before each decode step
            return release(s);
        });
        if (active_.empty()) return 0;
        const std::size_t V = std::size_t(model_.config.vocab_size);
        std::vector<BatchItem> items;
        for (Id id : active_) {
            State& s = convs_[id];
            std::span<const std::int64_t> ids;
            if (s.fed < s.c.fresh.size()) {
                ids = std::span(s.c.fresh).subspan(s.fed, std::min(s.c.limits.chunk, s.c.fresh.size() - s.fed));
                s.fed += ids.size();
            } else {
                ids = std::span(&s.drawn.back(), 1);
            }
            s.row.resize(V);
            items.push_back(BatchItem{s.c.session, ids, s.row.data(), Rows::last});
        }
        forward_batch(model_, items);
        std::size_t rows = 0;
        for (std::size_t i = 0; i < active_.size(); ++i) {
            State& s = convs_[active_[i]];
            rows += items[i].ids.size();
            if (s.fed < s.c.fresh.size()) continue;  // more prompt to feed
            if (s.c.limits.max_new == 0) { s.done = true; continue; }
            s.started = true;
            if (s.c.hooks.logits) s.c.hooks.logits->insert(s.c.hooks.logits->end(), s.row.begin(), s.row.end());
            s.drawn.push_back(s.c.choose(std::span<const float>(s.row), s.c.session->position()));
            const bool more = !s.c.hooks.token || s.c.hooks.token(s.drawn.back());
            if (!more || s.drawn.size() >= s.c.limits.max_new) s.done = true;
        }
        std::erase_if(active_, [&](Id id) { return release(convs_[id]); });
        ++steps_;
        return rows;
    }

    // Steps until every conversation, waiting ones included, has ended.
    void run() {
        while (!idle()) step();
    }

  private:
    struct State {
        Conversation c;
        std::size_t fed = 0;             // fresh tokens fed so far
        bool started = false, done = false;
        std::vector<std::int64_t> drawn;
        std::vector<float> row;          // (V) this step's logits
    };
    // A conversation that has ended keeps only what it drew: its logits row, prompt and hooks (which may
    // hold a caller's objects) go at once, so that a long-lived batch (a server's) grows by its ids only.
    static bool release(State& s) {
        if (s.done) s.row = {}, s.c = Conversation{};
        return s.done;
    }
    Model& model_;
    std::size_t max_batch_;
    std::deque<State> convs_;            // stable addresses: drawn() references stay valid
    std::vector<Id> active_;
    std::deque<Id> waiting_;
    std::size_t steps_ = 0;
};

}  // namespace kimik3
