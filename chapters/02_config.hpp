// kimik3 chapter 02: config -- what the checkpoint says the model is, checked before anything runs.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   A checkpoint is two things: a `config.json` that gives every dimension, and tensors whose names and
//   shapes must agree with it. This chapter reads the config exactly as Moonshot released it, refuses
//   anything it cannot run correctly (listing every problem at once, with its JSON path), derives the
//   layer schedule, and then binds every tensor of docs/kimi-k3.md section 2 by name, checking shape and dtype
//   against the config. Routed experts are located (shard, offsets, sizes) but never loaded here.
//   New since chapter 01: the model's schema, one-based layer lists, refusing to guess.
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md sections 1 and 2)
//   config.json: top level `kimi_k3` with a nested `text_config` (`kimi_linear`). 93 layers: 69 KDA,
//   24 MLA (every 4th and the last two), layer 0 dense, 1..92 latent MoE. ~500,000 tensors in 96 shards;
//   82,432 routed experts of 17,547,264 bytes each.
//
// CONCEPTS
//   schedule     per layer: attention kind (K = KDA, M = MLA), FFN kind (dense or MoE), and whether
//                the layer banks its input into AttnRes (l % attn_res_block_size == 0).
//   trunk        a layer's non-expert tensors: attention, norms, AttnRes, router, latent and shared FFN.
//   census       how many bytes each part of the checkpoint holds, and how many a token must read.
//
// CONTRACT
//   * A missing or mistyped field is an error; all problems are reported together, each with its JSON
//     path ("text_config.linear_attn_config.kda_layers: ..."): the first 20, then how many more. Nothing
//     is defaulted except where Moonshot's code defines it (an explicit null activation_situ_beta is 1.0;
//     a null linear beta is the identity).
//   * config.json is read through chapter 01's bounded reader (a regular file of at most 16 MiB, JSON
//     nested at most 64 deep, no duplicate keys); counts are capped at sane multiples of K3 (1,024
//     layers, 2^20 for every width and count), numbers must fit a float, and values that cannot be
//     right are refused (rms_norm_eps above 0.01, a non-positive SiTU beta or routed_scaling_factor).
//   * What Moonshot's code runs, this chapter accepts: top-1 routing, `moe_renormalize: false`,
//     `latent_moe_use_norm: false`, KDA with more heads than head_dim, any width (the kernels finish the
//     last n % 16 elements in plain code), BF16, F16 or F32 for any dense tensor. Options of Moonshot's
//     module that Kimi K3 does not use are refused as such ("... is an option of Moonshot's code that
//     Kimi K3 does not use (not implemented here)"): a softmax router, more than one expert group, no
//     gate_lower_bound (Kimi-Linear's softplus decay), a low-rank KDA gate, no q_lora, no AttnRes,
//     non-latent MoE, no shared expert, another activation than SiTU, no output gate, tied embeddings.
//     Values the math cannot take are refused with the reason: gate_lower_bound outside [-5, 0) (the
//     range of fla's chunked KDA kernel), a quantization other than MXFP4, an MXFP4 input width that is
//     not a multiple of its 32-element block.
//   * Binding checks every expected tensor's dtype and shape; a missing tensor, a wrong shape or dtype, an
//     expert missing a part, or a `weight_packed` outside the routed experts is an error naming the
//     tensor, what was expected and what was found (up to 20 problems listed at once).
//   * A_log: Moonshot's module declares it [num_heads]; the release stores it zero-padded to 128 (equal
//     to K3's head_dim by coincidence). Any length >= num_heads is bound; users read the first num_heads.
//
// USES     chapter 00 (Error), chapter 01 (Checkpoint, TensorInfo), nlohmann/json
// RUN      make run-02         TEST   make test-02
//
// SECTIONS
//   2.1 the Config struct      2.4 the layer schedule      2.5 expected tensors      2.7 the census
//   APPENDIX 02a_refusals.hpp: 2.2 reading config.json, 2.3 validation and refusals, 2.6 binding, and
//            the census of a bound checkpoint (take_census). Included at the end of this file, so
//            #include "02_config.hpp" gives the whole chapter; read it when a refusal needs explaining.
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 2.1 The Config struct (config.json names; K3 values in comments, docs/kimi-k3.md 1.2)
// ---------------------------------------------------------------------------------------------------
enum class AttnKind : std::uint8_t { KDA, MLA };
enum class FfnKind : std::uint8_t { Dense, MoE };

struct LayerPlan {
    AttnKind attn;
    FfnKind ffn;
    bool bank;  // AttnRes: this layer banks its raw input (l % attn_res_block_size == 0)
};

struct Config {
    // top level
    std::int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;  // 163584, 163586, 163839 (-1: absent)
    // widths
    int hidden_size = 0;              // D = 7168
    int num_hidden_layers = 0;        // 93
    int vocab_size = 0;               // V = 163840
    float rms_norm_eps = 0;           // 1e-5
    // MLA (docs/kimi-k3.md 3.5)
    int num_attention_heads = 0;      // 96
    int q_lora_rank = 0;              // 1536
    int kv_lora_rank = 0;             // 512
    int qk_nope_head_dim = 0;         // 128
    int qk_rope_head_dim = 0;         // 64 (NoPE: never rotated)
    int v_head_dim = 0;               // 128
    // KDA (docs/kimi-k3.md 3.4), from linear_attn_config
    std::vector<int> kda_layers;        // one-based
    std::vector<int> full_attn_layers;  // one-based
    int kda_num_heads = 0;            // 96
    int kda_head_dim = 0;             // 128
    int short_conv_kernel_size = 0;   // 4
    float gate_lower_bound = 0;       // -5
    // FFN (docs/kimi-k3.md 0.2, 3.6)
    float situ_beta = 0;              // beta1 = 4 (gate branch)
    float situ_linear_beta = 0;       // beta2 = 25 (up branch); 0 means "identity" (null in config)
    int intermediate_size = 0;        // I = 33792 (dense layers)
    int first_k_dense_replace = 0;    // 1
    int moe_layer_freq = 0;           // 1
    int num_experts = 0;              // E = 896
    int num_experts_per_token = 0;    // K = 16
    int num_shared_experts = 0;       // 2 (fused: shared width = 2 x 3072)
    int moe_intermediate_size = 0;    // F = 3072
    int routed_expert_hidden_size = 0;  // L = 3584 (latent MoE)
    bool moe_renormalize = true;      // true (with one expert per token the weight is never divided)
    bool latent_moe_use_norm = true;  // true: RMSNorm on the combined latent before the up-projection
    float routed_scaling_factor = 0;  // 1.0
    // AttnRes (docs/kimi-k3.md 3.2)
    int attn_res_block_size = 0;      // 12

    // derived (2.4)
    std::vector<LayerPlan> layers;

    int kda_width() const { return kda_num_heads * kda_head_dim; }               // P = 12288
    int mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // 192
    int mla_cache_width() const { return kv_lora_rank + qk_rope_head_dim; }      // C = 576
    int shared_width() const { return num_shared_experts * moe_intermediate_size; }  // 6144
    int moe_layer_count() const {
        int n = 0;
        for (const LayerPlan& p : layers) n += p.ffn == FfnKind::MoE;
        return n;
    }
    int count(AttnKind k) const {
        int n = 0;
        for (const LayerPlan& p : layers) n += p.attn == k;
        return n;
    }
    std::string schedule_string() const;  // "KKKMKKKM..."
};

// ---------------------------------------------------------------------------------------------------
// 2.4 The layer schedule
// ---------------------------------------------------------------------------------------------------
// Reading and refusing config.json (2.2, 2.3) is appendix 02a; what it hands back is a Config whose
// fields passed every check. From those fields the schedule follows: layer l (zero-based) is MLA when
// l + 1 is in full_attn_layers (the lists are one-based, as Moonshot wrote them) and KDA otherwise;
// latent MoE from first_k_dense_replace on, every moe_layer_freq-th layer; it banks its input into
// AttnRes when l % attn_res_block_size == 0.
inline void layer_schedule(Config& c) {
    c.layers.clear();
    std::set<int> mla(c.full_attn_layers.begin(), c.full_attn_layers.end());
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const bool moe = l >= c.first_k_dense_replace && l % c.moe_layer_freq == 0;
        c.layers.push_back({mla.count(l + 1) ? AttnKind::MLA : AttnKind::KDA, moe ? FfnKind::MoE : FfnKind::Dense,
                            l % c.attn_res_block_size == 0});
    }
}

inline std::string Config::schedule_string() const {
    std::string s;
    for (const LayerPlan& p : layers) s += p.attn == AttnKind::KDA ? 'K' : 'M';
    return s;
}

// One line per aspect: the attention schedule (KKKM...), the FFN kinds (DEEE...: D = dense, E = latent MoE),
// and the layers where AttnRes opens a new bank.
inline std::string describe_schedule(const Config& c) {
    std::string ffn, banks;
    int moe = 0;
    for (std::size_t l = 0; l < c.layers.size(); ++l) {
        ffn += c.layers[l].ffn == FfnKind::MoE ? 'E' : 'D';
        moe += c.layers[l].ffn == FfnKind::MoE;
        if (c.layers[l].bank) banks += (banks.empty() ? "" : " ") + std::to_string(l);
    }
    return "attention " + c.schedule_string() + " (K = KDA x" + std::to_string(c.count(AttnKind::KDA)) + ", M = MLA x" +
           std::to_string(c.count(AttnKind::MLA)) + ")\nffn       " + ffn + " (D = dense x" +
           std::to_string(int(c.layers.size()) - moe) + ", E = latent MoE x" + std::to_string(moe) + ")\nAttnRes   banks at layers " +
           banks + " (block size " + std::to_string(c.attn_res_block_size) + ")";
}

// ---------------------------------------------------------------------------------------------------
// 2.5 Expected tensors: the release names, dtypes and shapes of docs/kimi-k3.md section 2, from the config
// ---------------------------------------------------------------------------------------------------
inline constexpr const char* kPrefix = "language_model.";

struct LayerTensors;  // 2.6

// The dtypes a float tensor may have. The release's comes first (what the census of a config assumes);
// the others are what a checkpoint saved from Moonshot's modules at another precision holds. All widen
// to f32 exactly; the engine never rounds a weight to a narrower type.
using DTypes = std::array<DType, 3>;
inline constexpr DTypes kBf16Float = {DType::BF16, DType::F16, DType::F32};  // released as BF16
inline constexpr DTypes kF32Float = {DType::F32, DType::BF16, DType::F16};   // released as F32
inline constexpr DTypes kU8Only = {DType::U8, DType::U8, DType::U8};        // MXFP4 codes and scales

inline bool dtype_allowed(const DTypes& allowed, DType d) { return std::find(allowed.begin(), allowed.end(), d) != allowed.end(); }
inline std::string dtypes_str(const DTypes& allowed) {
    std::string s = dtype_name(allowed[0]);
    if (allowed[1] != allowed[0]) s += std::string(" (or ") + dtype_name(allowed[1]) + "/" + dtype_name(allowed[2]) + ")";
    return s;
}

struct Expected {
    std::string name;                                 // full checkpoint name
    DTypes dtypes;                                    // allowed, the release's first
    Shape shape;
    const Checkpoint::Ref* LayerTensors::*member;     // where binding stores it (per-layer tensors)
    std::int64_t at_least = 0;  // > 0: any vector of at least this many entries (A_log); `shape` is then the
                                // release's layout, which a census of the config alone assumes
};

// Every non-expert tensor of layer l, in the order of docs/kimi-k3.md 2.2.
struct LayerTensors {
    int layer = 0;
    LayerPlan plan{};
    // norms and AttnRes (every layer)
    const Checkpoint::Ref *input_norm = nullptr, *post_attn_norm = nullptr;
    const Checkpoint::Ref *attn_res_norm = nullptr, *attn_res_proj = nullptr, *mlp_res_norm = nullptr, *mlp_res_proj = nullptr;
    // KDA
    const Checkpoint::Ref *q_proj = nullptr, *k_proj = nullptr, *v_proj = nullptr, *q_conv = nullptr, *k_conv = nullptr,
                          *v_conv = nullptr, *f_a_proj = nullptr, *f_b_proj = nullptr, *A_log = nullptr, *dt_bias = nullptr,
                          *b_proj = nullptr, *o_norm = nullptr;
    // KDA and MLA
    const Checkpoint::Ref *g_proj = nullptr, *o_proj = nullptr;
    // MLA
    const Checkpoint::Ref *q_a_proj = nullptr, *q_a_norm = nullptr, *q_b_proj = nullptr, *kv_a_proj = nullptr,
                          *kv_a_norm = nullptr, *kv_b_proj = nullptr;
    // dense FFN
    const Checkpoint::Ref *gate_proj = nullptr, *up_proj = nullptr, *down_proj = nullptr;
    // MoE
    const Checkpoint::Ref *router = nullptr, *router_bias = nullptr, *latent_down = nullptr, *latent_norm = nullptr,
                          *latent_up = nullptr, *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
    std::vector<const Checkpoint::Ref*> all;  // every tensor above that exists, in binding order
};

inline std::vector<Expected> expected_layer_tensors(const Config& c, int l) {
    using L = LayerTensors;
    const std::int64_t D = c.hidden_size, P = c.kda_width(), H = c.num_attention_heads;
    const std::string p = std::string(kPrefix) + "model.layers." + std::to_string(l) + ".";
    std::vector<Expected> e = {
        {p + "input_layernorm.weight", kBf16Float, {D}, &L::input_norm},
        {p + "post_attention_layernorm.weight", kBf16Float, {D}, &L::post_attn_norm},
        {p + "self_attention_res_norm.weight", kBf16Float, {D}, &L::attn_res_norm},
        {p + "self_attention_res_proj.weight", kBf16Float, {1, D}, &L::attn_res_proj},
        {p + "mlp_res_norm.weight", kBf16Float, {D}, &L::mlp_res_norm},
        {p + "mlp_res_proj.weight", kBf16Float, {1, D}, &L::mlp_res_proj},
    };
    const std::string a = p + "self_attn.";
    if (c.layers[std::size_t(l)].attn == AttnKind::KDA) {
        const std::int64_t Hk = c.kda_num_heads, Dh = c.kda_head_dim, W = c.short_conv_kernel_size;
        e.insert(e.end(), {
            {a + "q_proj.weight", kBf16Float, {P, D}, &L::q_proj},
            {a + "k_proj.weight", kBf16Float, {P, D}, &L::k_proj},
            {a + "v_proj.weight", kBf16Float, {P, D}, &L::v_proj},
            {a + "q_conv1d.weight", kF32Float, {P, 1, W}, &L::q_conv},
            {a + "k_conv1d.weight", kF32Float, {P, 1, W}, &L::k_conv},
            {a + "v_conv1d.weight", kF32Float, {P, 1, W}, &L::v_conv},
            {a + "f_a_proj.weight", kBf16Float, {Dh, D}, &L::f_a_proj},
            {a + "f_b_proj.weight", kBf16Float, {P, Dh}, &L::f_b_proj},
            // Moonshot's module declares [num_heads]; the release pads it with zeros to [head_dim] (128 = 128
            // by coincidence): any length >= num_heads is accepted, entries past num_heads are never read
            {a + "A_log", kF32Float, {std::max(Hk, Dh)}, &L::A_log, Hk},
            {a + "dt_bias", kF32Float, {P}, &L::dt_bias},
            {a + "b_proj.weight", kBf16Float, {Hk, D}, &L::b_proj},
            {a + "g_proj.weight", kBf16Float, {P, D}, &L::g_proj},
            {a + "o_norm.weight", kF32Float, {Dh}, &L::o_norm},
            {a + "o_proj.weight", kBf16Float, {D, P}, &L::o_proj},
        });
    } else {
        const std::int64_t Q = c.q_lora_rank, R = c.kv_lora_rank, X = c.qk_rope_head_dim, N = c.qk_nope_head_dim, V = c.v_head_dim;
        e.insert(e.end(), {
            {a + "q_a_proj.weight", kBf16Float, {Q, D}, &L::q_a_proj},
            {a + "q_a_layernorm.weight", kBf16Float, {Q}, &L::q_a_norm},
            {a + "q_b_proj.weight", kBf16Float, {H * (N + X), Q}, &L::q_b_proj},
            {a + "kv_a_proj_with_mqa.weight", kBf16Float, {R + X, D}, &L::kv_a_proj},
            {a + "kv_a_layernorm.weight", kBf16Float, {R}, &L::kv_a_norm},
            {a + "kv_b_proj.weight", kBf16Float, {H * (N + V), R}, &L::kv_b_proj},
            {a + "g_proj.weight", kBf16Float, {H * V, D}, &L::g_proj},
            {a + "o_proj.weight", kBf16Float, {D, H * V}, &L::o_proj},
        });
    }
    if (c.layers[std::size_t(l)].ffn == FfnKind::Dense) {
        const std::int64_t I = c.intermediate_size;
        e.insert(e.end(), {
            {p + "mlp.gate_proj.weight", kBf16Float, {I, D}, &L::gate_proj},
            {p + "mlp.up_proj.weight", kBf16Float, {I, D}, &L::up_proj},
            {p + "mlp.down_proj.weight", kBf16Float, {D, I}, &L::down_proj},
        });
    } else {
        const std::string m = p + "block_sparse_moe.";
        const std::int64_t E = c.num_experts, Lt = c.routed_expert_hidden_size, S = c.shared_width();
        e.insert(e.end(), {
            {m + "gate.weight", kBf16Float, {E, D}, &L::router},
            {m + "gate.e_score_correction_bias", kF32Float, {E}, &L::router_bias},
            {m + "routed_expert_down_proj.weight", kBf16Float, {Lt, D}, &L::latent_down},
        });
        if (c.latent_moe_use_norm) e.push_back({m + "routed_expert_norm.weight", kBf16Float, {Lt}, &L::latent_norm});
        e.push_back({m + "routed_expert_up_proj.weight", kBf16Float, {D, Lt}, &L::latent_up});
        if (S > 0)
            e.insert(e.end(), {
                {m + "shared_experts.gate_proj.weight", kBf16Float, {S, D}, &L::shared_gate},
                {m + "shared_experts.up_proj.weight", kBf16Float, {S, D}, &L::shared_up},
                {m + "shared_experts.down_proj.weight", kBf16Float, {D, S}, &L::shared_down},
            });
    }
    return e;
}

// The six tensors of one routed expert, in the order the release stores them.
inline constexpr const char* kExpertParts[6] = {"w1.weight_packed", "w1.weight_scale", "w3.weight_packed",
                                                "w3.weight_scale",  "w2.weight_packed", "w2.weight_scale"};

inline std::array<Shape, 6> expert_part_shapes(const Config& c) {
    const std::int64_t F = c.moe_intermediate_size, Lt = c.routed_expert_hidden_size;
    return {Shape{F, Lt / 2}, Shape{F, Lt / 32}, Shape{F, Lt / 2}, Shape{F, Lt / 32}, Shape{Lt, F / 2}, Shape{Lt, F / 32}};
}

inline std::string expert_name(int l, int e, int part) {
    return std::string(kPrefix) + "model.layers." + std::to_string(l) + ".block_sparse_moe.experts." + std::to_string(e) + "." +
           kExpertParts[part];
}

// ---------------------------------------------------------------------------------------------------
// 2.7 The census: where the bytes are, and what one token must touch
// ---------------------------------------------------------------------------------------------------
// "2.34 GB" style, decimal units (disk vendors' and docs/kimi-k3.md's convention).
inline std::string human_bytes(double b) {
    const char* unit[] = {"B", "kB", "MB", "GB", "TB"};
    int u = 0;
    while (b >= 1000 && u < 4) b /= 1000, ++u;
    char buf[32];
    std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, unit[u]);
    return buf;
}

struct Census {
    std::uint64_t tensors = 0, bytes = 0;                         // everything in the checkpoint
    std::uint64_t expert_count = 0, expert_bytes_total = 0, expert_bytes = 0;
    std::uint64_t trunk_bytes = 0;                                // all layers' non-expert tensors
    std::vector<std::uint64_t> layer_trunk_bytes;                 // per layer
    std::uint64_t embed_bytes = 0, lm_head_bytes = 0, final_bytes = 0;  // final: norm + output AttnRes
    std::uint64_t other_tensors = 0, other_bytes = 0;             // not part of the text model (vision...)
    std::uint64_t per_token_bytes = 0;  // trunk + one embedding row + lm_head + K experts per MoE layer
    std::uint64_t largest_layer_bytes = 0;
    // What must stay in memory whatever the budget (docs/kimi-k3.md 3.4.8, 3.5.4):
    std::uint64_t kda_state_bytes = 0;         // all KDA layers: H x Dh x Dh f32 state + (W-1) x 3P conv history
    std::uint64_t mla_cache_bytes_per_token = 0;  // all MLA layers: (kv_lora_rank + qk_rope) f32 per position
    // (how little memory this can run in is chapter 12's plan: make_plan(...).floor)

};

// The bytes of the state that stays resident whatever the budget (shared by both census functions).
inline void census_state(Census& s, const Config& c) {
    for (std::uint64_t b : s.layer_trunk_bytes) s.largest_layer_bytes = std::max(s.largest_layer_bytes, b);
    const std::uint64_t P = std::uint64_t(c.kda_width()), Dh = std::uint64_t(c.kda_head_dim);
    s.kda_state_bytes = std::uint64_t(c.count(AttnKind::KDA)) *
                        (std::uint64_t(c.kda_num_heads) * Dh * Dh + std::uint64_t(c.short_conv_kernel_size - 1) * 3 * P) * 4;
    s.mla_cache_bytes_per_token = std::uint64_t(c.count(AttnKind::MLA)) * std::uint64_t(c.mla_cache_width()) * 4;
    s.per_token_bytes = s.trunk_bytes + s.embed_bytes / std::uint64_t(c.vocab_size) + s.lm_head_bytes + s.final_bytes +
                        std::uint64_t(c.moe_layer_count()) * std::uint64_t(c.num_experts_per_token) * s.expert_bytes;
}

// What a release-layout checkpoint of this config holds, from the config alone (docs/kimi-k3.md section 2): for planning
// the real 93-layer K3 without its 1.56 TB. Equal to take_census on a bound checkpoint (a test).
inline Census config_census(const Config& c) {
    Census s;
    const std::uint64_t D = std::uint64_t(c.hidden_size), V = std::uint64_t(c.vocab_size);
    s.embed_bytes = s.lm_head_bytes = V * D * 2;
    s.final_bytes = 3 * D * 2;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        std::uint64_t b = 0;
        for (const Expected& e : expected_layer_tensors(c, l)) b += std::uint64_t(e.shape.numel()) * dtype_size(e.dtypes[0]), ++s.tensors;
        s.layer_trunk_bytes.push_back(b);
        s.trunk_bytes += b;
    }
    for (const Shape& sh : expert_part_shapes(c)) s.expert_bytes += std::uint64_t(sh.numel());
    s.expert_count = std::uint64_t(c.moe_layer_count()) * std::uint64_t(c.num_experts);
    s.expert_bytes_total = s.expert_count * s.expert_bytes;
    s.tensors += 5 + s.expert_count * 6;
    s.bytes = s.embed_bytes + s.lm_head_bytes + s.final_bytes + s.trunk_bytes + s.expert_bytes_total;
    census_state(s, c);
    return s;
}

}  // namespace kimik3

// The appendix (it includes this lesson first): load_config, parse_config, bind_tensors, take_census.
#include "02a_refusals.hpp"
