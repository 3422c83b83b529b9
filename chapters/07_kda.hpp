// kimik3 chapter 07: kda -- Kimi Delta Attention, the linear attention of 69 of K3's 93 layers.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   KDA replaces softmax attention's growing cache with a fixed-size memory per head: a Dh x Dh matrix
//   S that every token updates with a "delta rule" (write the value, minus what S already predicted for
//   this key) after decaying each key channel by its own gate. Reading is a matrix-vector product with
//   the query. Before that, a short causal convolution mixes each channel with its last three inputs.
//   New since chapter 06: a recurrent state carried from token to token, and the proof that feeding
//   tokens one at a time (decode) or all together (prefill) gives the same bits.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.4; its traps 5.1.8 and 5.1.1)
//   96 heads x Dh = 128 (P = 12288 channels); u (7168) -> q, k, v, g (12288 each) by four [12288, 7168]
//   bf16 projections, the decay gate through a rank-128 bottleneck, beta per head, o_proj back to 7168.
//   The state: 96 x 128 x 128 f32 = 6.29 MB per layer, 434 MB for all 69 KDA layers, plus the conv
//   history (3 x 3 x 12288 f32 = 442 kB per layer): 6.73 MB per layer with it, 464.6 MB for 69 layers
//   (the plan's "carried state"). It is the part of K3 that must stay resident.
//
// WHY K3 BOUNDS THE DECAY GATE
//   Kimi Linear's KDA gate is g = -exp(A_log) softplus(z): any negative value. One token can then push
//   alpha = exp(g) to a subnormal f32 (g < -87.3) or to exactly 0 (g < -103.3) and erase a key channel.
//   It does worse in the chunked form that prefill and training run on GPUs (fla's chunk_kda): inside a
//   block of tokens the decay from token j to token i is exp(G_i - G_j), where G is the running sum of g,
//   and to make the block one matrix product it is split into exp(G_i) * exp(-G_j). exp(-G_j) is a
//   finite f32 only while -G_j <= 88.72. Sixteen tokens of g = -5.55 already overflow it, and inf times
//   the matching tiny factor gives inf or NaN where the true decay lies in [0, 1] (make run-07 shows
//   both). K3's gate g = lower_bound * sigmoid(exp(A_log) * z) keeps every g in (-5, 0), so a 16-token
//   block's G stays above -80, every factor is finite, and alpha stays above e^-5 = 0.0067: a token can
//   fade a channel to 0.7%, never erase it. It is a different activation, not a clamp on the old one.
//   fla added the bound for exactly this reason (fla-org/flash-linear-attention pull requests #701,
//   "Add lowerbound gate function", and #703, "Speed up chunk_kda by introducing lowerbound gate"; the
//   gate is in fla/ops/kda/gate.py). This engine runs the token-by-token recurrence, which never forms
//   exp(-G). Here the bound is part of the model's definition (it gives the reference's alpha), it keeps
//   every alpha a normal float, and a trained model really does press gates against it: in make run-07,
//   the little K3's first KDA layer has gates within 0.002 of -5 (up to 2.2% of a head's below -4.5).
//
// CONCEPTS
//   short conv   y_t[c] = SiLU(sum_j w[c][j] x_{t-3+j}[c]), tap 3 = the current token; a rolling history
//                of the last 3 inputs per channel replaces padding.
//   decay gate   g = -5 sigmoid(exp(A_log[h]) (f + dt_bias)) in (-5, 0), alpha = exp(g) in (e^-5, 1):
//                K3's lower-bounded form (gate_lower_bound = -5), one value per key channel.
//   delta rule   S <- diag(alpha) S;  r = v - S^T k;  S <- S + beta k r^T;  o = S^T q  (the UPDATED S).
//   state layout value-major: row j of S^T (one per value channel) holds the 128 key-channel weights, as
//                Moonshot stores it (transpose_state_layout): both products become row dot products.
//
//       S^T row j:  [ s_j0  s_j1  ...  s_j127 ]   (key channels i)
//       decay:      s_ji *= alpha_i              prediction: p_j = sum_i s_ji k_i
//       update:     s_ji += (beta (v_j - p_j)) k_i     read: o_j = sum_i s_ji q_i
//
//   induction    a head whose key is the previous token (the short conv can shift by one) and whose query
//                is the current token stores "what followed x" under x: when x comes again, o is the
//                token that followed it last time. That is copying, done by a state instead of attention
//                (Olsson et al., "In-context Learning and Induction Heads", 2022); make run-07 builds one
//                by hand, and shows why keys of one token fail on a list with separators.
//
// NUMERICS CONTRACT
//   Projections: chapter 04 (T tokens at once, per-token bits independent of T).
//   Conv: acc = w0*x0, then acc = acc + w_j*x_j for j = 1..W-1 (taps in time order), y = SiLU(acc).
//   L2 norm (chapter 03): k_hat = l2norm(k, 1), q_hat = l2norm(q, Dh^-1/2), per head.
//   beta = sigmoid(b); z = f + dt_bias; g = lower_bound * sigmoid(exp_f32(A_log[h]) * z); alpha = exp_f32(g).
//   A_log is read at index h only: entries 0..H-1, whether it is stored [H] (Moonshot's module) or
//   zero-padded (the release: [128] for 96 heads); never per channel (trap 5.1.1 of docs/kimi-k3.md). Any H and Dh work.
//   Recurrence per head and value row j, in this order: s_ji = s_ji * alpha_i (all i); p = dot16(s_j,
//   k_hat) (16 lanes + hsum16); c = beta * (v_j - p); s_ji = s_ji + c * k_hat_i (all i); o_j = dot16(s_j,
//   q_hat). kda_recurrence_simd is bit-identical to _ref. Heads split across threads; a head's rows run
//   in order on one thread. Output: gated_head_norm (chapter 03, eps = rms_norm_eps), then o_proj.
//   kda_forward over T tokens = T calls with one token, bit for bit (outputs and final state); several
//   sequences in one call = each alone; kda_advance over kept inputs leaves the state kda_forward would
//   have, bit for bit.
//
// SOURCES  Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", arXiv:2510.26692
//          (KDA); Yang, Kautz, Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464; fla-org/flash-linear-
//          attention fla/ops/kda/naive.py (the recurrent reference), fla/ops/kda/gate.py and pull requests
//          #701 and #703 (the lower-bounded gate and why). docs/sources.md 07.
// USES     chapters 00, 02 (Config, LayerTensors), 03 (l2norm, gated_head_norm), 04 (linear)
// RUN      make run-07        TEST   make test-07        BENCH   make bench (one decode step at K3 size)
//
// SECTIONS
//   7.1 dims, weights and the carried state     7.2 the short convolution     7.3 gates: beta and decay
//   7.4 the delta-rule recurrence               7.5 the layer (prefill = decode, bit for bit; several
//                                                   sequences in one step; advancing a state again from
//                                                   kept inputs)
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstdint>
#include <istream>
#include <ostream>
#include <span>
#include <tuple>
#include <vector>

#include "00_numerics.hpp"
#include "02_config.hpp"
#include "03_norms.hpp"
#include "04_matvec_bf16.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 7.1 Dims, weights and the carried state
// ---------------------------------------------------------------------------------------------------
struct KdaDims {
    std::size_t hidden = 0, heads = 0, head_dim = 0, conv = 0;  // D, H, Dh, W (7168, 96, 128, 4)
    float lower_bound = -5.0f, eps = 1e-5f;                    // gate_lower_bound, rms_norm_eps
    std::size_t width() const { return heads * head_dim; }     // P
    static KdaDims from(const Config& c) {
        return KdaDims{std::size_t(c.hidden_size), std::size_t(c.kda_num_heads), std::size_t(c.kda_head_dim),
                       std::size_t(c.short_conv_kernel_size), c.gate_lower_bound, c.rms_norm_eps};
    }
};

struct KdaWeights {
    MatrixRef q_proj, k_proj, v_proj;  // (P, D) each
    MatrixRef f_a_proj;                // (Dh, D)  decay gate, low-rank A
    MatrixRef f_b_proj;                // (P, Dh)  decay gate, low-rank B
    MatrixRef b_proj;                  // (H, D)   beta logits
    MatrixRef g_proj;                  // (P, D)   output gate (full rank)
    MatrixRef o_proj;                  // (D, P)
    const float* q_conv = nullptr;     // (P, W)   F32 taps, stored [P, 1, W]
    const float* k_conv = nullptr;     // (P, W)
    const float* v_conv = nullptr;     // (P, W)
    const float* A_log = nullptr;      // (H) used: the release pads it with zeros to [Dh], Moonshot's module is [H]
    const float* dt_bias = nullptr;    // (P) head-major
    const float* o_norm = nullptr;     // (Dh) shared by all heads
};

// Everything a KDA layer carries from one token to the next. Plain data: copy it to fork a sequence,
// reset() it to start a new one, save()/load() it for sessions.
struct KdaState {
    std::size_t heads = 0, head_dim = 0, conv = 0;
    std::vector<float> history;  // (3, W-1, P): the last W-1 pre-conv inputs of q, k, v, oldest first
    std::vector<float> S;        // (H, Dh, Dh) value-major: S[h][j][i] = weight of key i for value j

    KdaState() = default;
    explicit KdaState(const KdaDims& d) : heads(d.heads), head_dim(d.head_dim), conv(d.conv) {
        if (d.conv < 1) fail(ErrorKind::usage, "KDA state: short_conv_kernel_size must be at least 1");
        history.assign(3 * (d.conv - 1) * d.width(), 0.0f);
        S.assign(d.heads * d.head_dim * d.head_dim, 0.0f);
    }
    void reset() {
        std::fill(history.begin(), history.end(), 0.0f);
        std::fill(S.begin(), S.end(), 0.0f);
    }
    std::size_t bytes() const { return (history.size() + S.size()) * sizeof(float); }
    void save(std::ostream& out) const {
        const std::uint64_t dims[3] = {heads, head_dim, conv};
        out.write(reinterpret_cast<const char*>(dims), sizeof dims);
        out.write(reinterpret_cast<const char*>(history.data()), std::streamsize(history.size() * 4));
        out.write(reinterpret_cast<const char*>(S.data()), std::streamsize(S.size() * 4));
        if (!out) fail(ErrorKind::runtime, "KDA state: write failed");
    }
    void load(std::istream& in) {  // into a state already sized for the layer; refuses other dims
        std::uint64_t dims[3] = {};
        in.read(reinterpret_cast<char*>(dims), sizeof dims);
        if (!in) fail(ErrorKind::format, "KDA state: the saved state is truncated (no header)");
        if (dims[0] != heads || dims[1] != head_dim || dims[2] != conv)
            fail(ErrorKind::format, "KDA state: saved for " + std::to_string(dims[0]) + " heads x " + std::to_string(dims[1]) +
                                        ", conv " + std::to_string(dims[2]) + "; this layer has " + std::to_string(heads) +
                                        " x " + std::to_string(head_dim) + ", conv " + std::to_string(conv));
        in.read(reinterpret_cast<char*>(history.data()), std::streamsize(history.size() * 4));
        in.read(reinterpret_cast<char*>(S.data()), std::streamsize(S.size() * 4));
        if (!in) fail(ErrorKind::format, "KDA state: the saved state is truncated");
        // a state the recurrence produced is finite; a NaN or Inf would poison every later token
        for (const std::vector<float>* v : {&history, &S})
            for (std::size_t i = 0; i < v->size(); ++i)
                if (!std::isfinite((*v)[i]))
                    fail(ErrorKind::format, std::string("KDA state: the saved ") + (v == &S ? "state S" : "conv history") + " holds " +
                                                std::to_string((*v)[i]) + " at index " + std::to_string(i));
    }
};

// ---------------------------------------------------------------------------------------------------
// 7.2 The short convolution (one token, with its rolling history)
// ---------------------------------------------------------------------------------------------------
// y[c] = SiLU( w[c][0] x_{t-W+1}[c] + ... + w[c][W-1] x_t[c] ); then the history shifts by one token.
// Element-wise over channels, so one loop serves every SIMD width (no lane ever mixes two channels).
inline void short_conv_step(float* y, const float* x, const float* taps, float* history, std::size_t channels,
                            std::size_t width) {  // y (P), x (P), taps (P, W), history (W-1, P)
    const std::size_t past = width - 1;
    for (std::size_t c = 0; c < channels; ++c) {
        const float* w = taps + c * width;
        float acc = past ? w[0] * history[c] : w[0] * x[c];
        for (std::size_t j = 1; j < past; ++j) acc = acc + w[j] * history[j * channels + c];
        if (past) acc = acc + w[past] * x[c];
        y[c] = silu(acc);
    }
    for (std::size_t j = 0; j + 1 < past; ++j)  // drop the oldest input, append the current one
        std::copy_n(history + (j + 1) * channels, channels, history + j * channels);
    if (past) std::copy_n(x, channels, history + (past - 1) * channels);
}

// ---------------------------------------------------------------------------------------------------
// 7.3 Gates: beta and the lower-bounded decay
// ---------------------------------------------------------------------------------------------------
// alpha[c] = exp(lower_bound * sigmoid(exp(A_log[h]) * (f[c] + dt_bias[c]))), h = c / Dh.
inline void kda_decay(float* alpha, float* g_out, const float* f, const float* A_log, const float* dt_bias, const KdaDims& d) {
    // alpha (P), g_out (P) or null, f (P), A_log (H used; any padding after it is never read), dt_bias (P)
    for (std::size_t h = 0; h < d.heads; ++h) {
        const float a = exp_f32(A_log[h]);  // per HEAD: never per channel (trap 5.1.1 of docs/kimi-k3.md)
        for (std::size_t i = 0; i < d.head_dim; ++i) {
            const std::size_t c = h * d.head_dim + i;
            const float z = f[c] + dt_bias[c];
            const float g = d.lower_bound * sigmoid(a * z);
            if (g_out) g_out[c] = g;
            alpha[c] = exp_f32(g);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 7.4 The delta-rule recurrence (one token, all heads)
// ---------------------------------------------------------------------------------------------------
inline void kda_recurrence_ref(float* o, float* S, const float* q_hat, const float* k_hat, const float* v,
                               const float* alpha, const float* beta, std::size_t heads, std::size_t dh) {
    // o (P), S (H, Dh, Dh) value-major, q_hat/k_hat/v/alpha (P), beta (H)
    parallel_rows(heads, 4 * dh * dh, [&](std::size_t h0, std::size_t h1) {
        for (std::size_t h = h0; h < h1; ++h) {
            const float *q = q_hat + h * dh, *k = k_hat + h * dh, *a = alpha + h * dh;
            for (std::size_t j = 0; j < dh; ++j) {
                float* s = S + (h * dh + j) * dh;  // row j of S^T: value channel j
                float acc[kLanes] = {};
                for (std::size_t i = 0; i < dh; ++i) {
                    s[i] = s[i] * a[i];                                   // decay each key channel
                    acc[i % kLanes] = acc[i % kLanes] + s[i] * k[i];      // prediction p_j = s_j . k_hat
                }
                const float c = beta[h] * (v[h * dh + j] - hsum16(acc));  // beta * (v_j - p_j)
                float out[kLanes] = {};
                for (std::size_t i = 0; i < dh; ++i) {
                    s[i] = s[i] + c * k[i];                               // rank-1 delta update
                    out[i % kLanes] = out[i % kLanes] + s[i] * q[i];      // read with the UPDATED state
                }
                o[h * dh + j] = hsum16(out);
            }
        }
    });
}

// Bit-identical to kda_recurrence_ref: the structural difference is that each row is processed W key
// channels at a time, with the 16 lanes of each sum held in 16/W registers (chapter 00's dot_simd), the
// last Dh % 16 channels in plain code after the whole chunks (finish_tail).
inline void kda_recurrence_simd(float* o, float* S, const float* q_hat, const float* k_hat, const float* v,
                                const float* alpha, const float* beta, std::size_t heads, std::size_t dh) {
    // o (P), S (H, Dh, Dh) value-major, q_hat/k_hat/v/alpha (P), beta (H)
    constexpr int A = simd::kBatchesPer16;
    const std::size_t full = full_chunks(dh);
    parallel_rows(heads, 4 * dh * dh, [&](std::size_t h0, std::size_t h1) {
        for (std::size_t h = h0; h < h1; ++h) {
            const float *q = q_hat + h * dh, *k = k_hat + h * dh, *al = alpha + h * dh;
            for (std::size_t j = 0; j < dh; ++j) {
                float* s = S + (h * dh + j) * dh;
                simd::f32 acc[A];
                for (auto& r : acc) r = simd::splat(0.0f);
                for (std::size_t i = 0; i < full; i += kLanes)
                    KIMIK3_UNROLL for (int a = 0; a < A; ++a) {
                        const std::size_t at = i + std::size_t(a * simd::W);
                        const simd::f32 sd = simd::load(s + at) * simd::load(al + at);
                        simd::store(s + at, sd);
                        acc[a] = acc[a] + sd * simd::load(k + at);
                    }
                float lanes[kLanes];
                for (int a = 0; a < A; ++a) simd::store(lanes + a * simd::W, acc[a]);
                const float pred = finish_tail(lanes, full, dh, [&](std::size_t i) { return (s[i] = s[i] * al[i]) * k[i]; });
                const float c_s = beta[h] * (v[h * dh + j] - pred);
                const simd::f32 c = simd::splat(c_s);
                for (auto& r : acc) r = simd::splat(0.0f);
                for (std::size_t i = 0; i < full; i += kLanes)
                    KIMIK3_UNROLL for (int a = 0; a < A; ++a) {
                        const std::size_t at = i + std::size_t(a * simd::W);
                        const simd::f32 su = simd::load(s + at) + c * simd::load(k + at);
                        simd::store(s + at, su);
                        acc[a] = acc[a] + su * simd::load(q + at);
                    }
                for (int a = 0; a < A; ++a) simd::store(lanes + a * simd::W, acc[a]);
                o[h * dh + j] = finish_tail(lanes, full, dh, [&](std::size_t i) { return (s[i] = s[i] + c_s * k[i]) * q[i]; });
            }
        }
    });
}

inline void kda_recurrence(float* o, float* S, const float* q_hat, const float* k_hat, const float* v, const float* alpha,
                           const float* beta, std::size_t heads, std::size_t dh) {
    use_simd ? kda_recurrence_simd(o, S, q_hat, k_hat, v, alpha, beta, heads, dh)
             : kda_recurrence_ref(o, S, q_hat, k_hat, v, alpha, beta, heads, dh);
}

// ---------------------------------------------------------------------------------------------------
// 7.5 The layer: projections for all T tokens at once, then the recurrence token by token
// ---------------------------------------------------------------------------------------------------
// What the reference dumps per token, for tests and examples (optional).
struct KdaRecord {
    std::vector<float> q_conv, k_conv, v_conv, q_hat, k_hat, beta, g, o, o_gated;  // (T, P) or (T, H)
};

namespace detail {
// Weights, dims and state must agree before anything is read or written: a state built for another
// layer shape, or a matrix of the wrong shape, would otherwise be indexed out of bounds.
inline void kda_check(const KdaWeights& w, const KdaDims& d, const KdaState& st) {
    const std::size_t D = d.hidden, P = d.width(), H = d.heads, Dh = d.head_dim;
    auto shape = [&](const char* name, const MatrixRef& m, std::size_t rows, std::size_t cols) {
        if (m.rows != rows || m.cols != cols)
            fail(ErrorKind::usage, std::string("kda_forward: ") + name + " is [" + std::to_string(m.rows) + ", " +
                                       std::to_string(m.cols) + "], the dims want [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
    };
    shape("q_proj", w.q_proj, P, D);
    shape("k_proj", w.k_proj, P, D);
    shape("v_proj", w.v_proj, P, D);
    shape("f_a_proj", w.f_a_proj, Dh, D);
    shape("f_b_proj", w.f_b_proj, P, Dh);
    shape("b_proj", w.b_proj, H, D);
    shape("g_proj", w.g_proj, P, D);
    shape("o_proj", w.o_proj, D, P);
    if (st.heads != H || st.head_dim != Dh || st.conv != d.conv || st.S.size() != H * Dh * Dh ||
        st.history.size() != 3 * (d.conv - 1) * P)
        fail(ErrorKind::usage, "kda_forward: the state is for " + std::to_string(st.heads) + " heads x " + std::to_string(st.head_dim) +
                                   ", conv " + std::to_string(st.conv) + "; the layer has " + std::to_string(H) + " x " +
                                   std::to_string(Dh) + ", conv " + std::to_string(d.conv));
}
}  // namespace detail

// The projected inputs of T tokens: everything the sequential part (conv, gates, recurrence) reads, so a
// state can be advanced through these tokens again without reading a weight (chapter 16 does, to keep
// only the drafted tokens it accepts). The output gate is not here: it shapes the output, not the state.
struct KdaInputs {
    std::size_t tokens = 0;
    std::vector<float> q, k, v;  // (T, P) each, before the short conv
    std::vector<float> f;        // (T, P) the decay gate's low-rank output, before dt_bias
    std::vector<float> b;        // (T, H) beta logits
};

namespace detail {
// Per-token buffers of the sequential part, allocated once per call.
struct KdaTokenBuffers {
    std::vector<float> qc, kc, vc, qh, kh, alpha, g, beta, o;  // (P) each, beta (H)
    explicit KdaTokenBuffers(const KdaDims& d)
        : qc(d.width()), kc(d.width()), vc(d.width()), qh(d.width()), kh(d.width()), alpha(d.width()), g(d.width()), beta(d.heads),
          o(d.width()) {}
};

// Token t of `in` through the sequential part: the three short convs (the history shifts), the per-head
// norms, beta and the decay, then the recurrence (S advances). x.o receives the read-out o (P).
inline void kda_token(KdaTokenBuffers& x, const KdaInputs& in, std::size_t t, const KdaWeights& w, const KdaDims& d, KdaState& st) {
    const std::size_t P = d.width(), H = d.heads, Dh = d.head_dim, past = (d.conv - 1) * P;
    const float q_scale = 1.0f / std::sqrt(float(Dh));  // Dh^-1/2 = 0.08838834764 at K3
    short_conv_step(x.qc.data(), &in.q[t * P], w.q_conv, st.history.data(), P, d.conv);
    short_conv_step(x.kc.data(), &in.k[t * P], w.k_conv, st.history.data() + past, P, d.conv);
    short_conv_step(x.vc.data(), &in.v[t * P], w.v_conv, st.history.data() + 2 * past, P, d.conv);
    for (std::size_t h = 0; h < H; ++h) {
        l2norm(&x.qh[h * Dh], &x.qc[h * Dh], Dh, q_scale);
        l2norm(&x.kh[h * Dh], &x.kc[h * Dh], Dh, 1.0f);
        x.beta[h] = sigmoid(in.b[t * H + h]);
    }
    kda_decay(x.alpha.data(), x.g.data(), &in.f[t * P], w.A_log, w.dt_bias, d);
    kda_recurrence(x.o.data(), st.S.data(), x.qh.data(), x.kh.data(), x.vc.data(), x.alpha.data(), x.beta.data(), H, Dh);
}
}  // namespace detail

// Several sequences in one step (appendix 13a steps several conversations at once): rows [row0, row0 +
// tokens) of u and y are one sequence's tokens, in order, and advance its own state; `keep`, when given,
// receives those tokens' projected inputs (KdaInputs above).
struct KdaSeq {
    std::size_t row0 = 0, tokens = 0;
    KdaState* state = nullptr;
    KdaInputs* keep = nullptr;
};

// N rows, the sequences one after another. The eight projections run once over all N rows (chapter 04:
// each row gets the bits it gets alone); only the sequential part is per sequence, on its own state. So a
// sequence's outputs and final state do not depend on what else is in the step.
inline void kda_forward(float* y, const float* u, std::size_t N, std::span<const KdaSeq> seqs, const KdaWeights& w, const KdaDims& d,
                        KdaRecord* rec = nullptr) {  // y (N, D), u (N, D): the input_layernorm output
    std::size_t rows = 0;
    for (const KdaSeq& q : seqs) {
        if (!q.state || q.row0 != rows) fail(ErrorKind::usage, "kda_forward: the sequences must have states and follow one another row by row");
        detail::kda_check(w, d, *q.state);
        rows += q.tokens;
    }
    if (rows != N) fail(ErrorKind::usage, "kda_forward: the sequences hold " + std::to_string(rows) + " rows of " + std::to_string(N));
    const std::size_t P = d.width(), H = d.heads, Dh = d.head_dim;
    // Projections: every token's bits are independent of N (chapter 04), so prefill may batch them.
    KdaInputs in;
    in.tokens = N;
    for (auto* m : {&in.q, &in.k, &in.v, &in.f}) m->resize(N * P);
    in.b.resize(N * H);
    std::vector<float> gate(N * P), fa(N * Dh);
    linear(in.q.data(), u, N, w.q_proj);
    linear(in.k.data(), u, N, w.k_proj);
    linear(in.v.data(), u, N, w.v_proj);
    linear(gate.data(), u, N, w.g_proj);
    linear(fa.data(), u, N, w.f_a_proj);
    linear(in.f.data(), fa.data(), N, w.f_b_proj);
    linear(in.b.data(), u, N, w.b_proj);
    detail::KdaTokenBuffers x(d);
    std::vector<float> o_gated(N * P);  // (N, P)
    if (rec) *rec = KdaRecord{};
    for (const KdaSeq& q : seqs) {
        if (q.keep) {  // this sequence's rows of the inputs
            KdaInputs& k = *q.keep;
            k.tokens = q.tokens;
            for (auto [dst, src, n] : {std::tuple{&k.q, &in.q, P}, {&k.k, &in.k, P}, {&k.v, &in.v, P}, {&k.f, &in.f, P}, {&k.b, &in.b, H}})
                dst->assign(src->begin() + std::ptrdiff_t(q.row0 * n), src->begin() + std::ptrdiff_t((q.row0 + q.tokens) * n));
        }
        for (std::size_t t = q.row0; t < q.row0 + q.tokens; ++t) {  // the recurrence is sequential: token t needs t-1's state
            detail::kda_token(x, in, t, w, d, *q.state);
            gated_head_norm(&o_gated[t * P], x.o.data(), &gate[t * P], w.o_norm, H, Dh, d.eps);
            if (rec)
                for (auto [dst, src] : {std::pair{&rec->q_conv, &x.qc}, {&rec->k_conv, &x.kc}, {&rec->v_conv, &x.vc}, {&rec->q_hat, &x.qh},
                                        {&rec->k_hat, &x.kh}, {&rec->beta, &x.beta}, {&rec->g, &x.g}, {&rec->o, &x.o}})
                    dst->insert(dst->end(), src->begin(), src->end());
        }
    }
    if (rec) rec->o_gated = o_gated;
    linear(y, o_gated.data(), N, w.o_proj);
}

// One sequence: T tokens at the end of `st` (a prompt chunk, or one decode token).
inline void kda_forward(float* y, const float* u, std::size_t tokens, const KdaWeights& w, const KdaDims& d, KdaState& st,
                        KdaRecord* rec = nullptr, KdaInputs* keep = nullptr) {  // y (T, D), u (T, D)
    const KdaSeq one{0, tokens, &st, keep};
    kda_forward(y, u, tokens, std::span(&one, 1), w, d, rec);
}

// Advances `st` through the first n tokens of inputs kept by kda_forward, reading no matrix (only the
// conv taps, A_log and dt_bias of `w`): the state ends with the same bits as if kda_forward had run on
// those n tokens alone. The read-out is computed (the recurrence is one function) and dropped.
inline void kda_advance(KdaState& st, const KdaInputs& in, std::size_t n, const KdaWeights& w, const KdaDims& d) {
    const std::size_t P = d.width();
    bool sized = in.b.size() >= in.tokens * d.heads;
    for (const auto* m : {&in.q, &in.k, &in.v, &in.f}) sized = sized && m->size() >= in.tokens * P;
    if (n > in.tokens || !sized)
        fail(ErrorKind::usage, "kda_advance: " + std::to_string(n) + " tokens asked for, the inputs hold " + std::to_string(in.tokens));
    if (st.heads != d.heads || st.head_dim != d.head_dim || st.conv != d.conv || st.S.size() != d.heads * d.head_dim * d.head_dim ||
        st.history.size() != 3 * (d.conv - 1) * P)
        fail(ErrorKind::usage, "kda_advance: the state is for " + std::to_string(st.heads) + " heads x " + std::to_string(st.head_dim) +
                                   "; the layer has " + std::to_string(d.heads) + " x " + std::to_string(d.head_dim));
    detail::KdaTokenBuffers x(d);
    for (std::size_t t = 0; t < n; ++t) detail::kda_token(x, in, t, w, d, st);
}

// The weights of a bound KDA layer, given where its tensors are in memory (chapter 12 or 13 decides):
// mat(r) is a matrix as the kernels see it, vec(r) a vector tensor widened to f32 (the conv taps, A_log,
// dt_bias and o_norm are F32 in the release; a BF16 or F16 checkpoint gives the same values exactly).
template <class Mat, class Vec>  // Mat: const Checkpoint::Ref* -> MatrixRef; Vec: -> const float*
KdaWeights kda_weights(const LayerTensors& t, Mat&& mat, Vec&& vec) {
    return KdaWeights{mat(t.q_proj),  mat(t.k_proj),  mat(t.v_proj),  mat(t.f_a_proj), mat(t.f_b_proj),
                      mat(t.b_proj),  mat(t.g_proj),  mat(t.o_proj),  vec(t.q_conv),   vec(t.k_conv),
                      vec(t.v_conv),  vec(t.A_log),   vec(t.dt_bias), vec(t.o_norm)};
}

}  // namespace kimik3
