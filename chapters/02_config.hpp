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
//   2.1 the Config struct      2.2 reading config.json     2.3 validation and refusals
//   2.4 the layer schedule     2.5 expected tensors        2.6 binding       2.7 the census
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
// 2.2 Reading config.json
// ---------------------------------------------------------------------------------------------------
// Caps on counts: sane multiples of Kimi K3 (93 layers; its largest width is the vocabulary, 163,840),
// so that nothing derived from a config (the schedule, a census, a plan, a message) can exhaust memory or
// overflow an int. A config past them is refused, naming the field.
inline constexpr int kMaxLayers = 1024;    // num_hidden_layers, and the length of a layer list
inline constexpr int kMaxWidth = 1 << 20;  // every width, head count and expert count (1,048,576)

// A reader that never throws on the first problem: each accessor records what is wrong at which JSON
// path and returns a harmless value, so one run lists everything.
namespace detail {

struct ConfigReader {
    std::vector<std::string> problems;
    std::set<std::string> failed;  // keys already reported missing or mistyped
    static std::string x(const nlohmann::json& v) { return json_excerpt(v); }  // what a message quotes

    void bad(const std::string& path, const std::string& key, const std::string& what) {
        problems.push_back(path + key + what);
        failed.insert(key);
    }

    const nlohmann::json* find(const nlohmann::json& obj, const std::string& path, const std::string& key) {
        if (!obj.is_object() || !obj.contains(key)) {
            bad(path, key, ": missing");
            return nullptr;
        }
        return &obj[key];
    }
    int integer(const nlohmann::json& obj, const std::string& path, const std::string& key, int min = 1, int max = kMaxWidth) {
        const nlohmann::json* v = find(obj, path, key);
        if (!v) return min;
        if (!v->is_number_integer()) return bad(path, key, ": " + x(*v) + " is not an integer"), min;
        if (v->is_number_unsigned() ? v->get<std::uint64_t>() > std::uint64_t(max) : v->get<std::int64_t>() > max)
            return bad(path, key, ": " + x(*v) + " is more than " + std::to_string(max)), min;
        if (v->get<std::int64_t>() < min) return bad(path, key, ": " + x(*v) + " is less than " + std::to_string(min)), min;
        return int(v->get<std::int64_t>());
    }
    // A number; `null` is accepted only when the caller passes a value for it (Moonshot's defaults).
    float number(const nlohmann::json& obj, const std::string& path, const std::string& key,
                 std::optional<float> if_null = std::nullopt) {
        const nlohmann::json* v = find(obj, path, key);
        if (!v) return 0;
        if (v->is_null() && if_null) return *if_null;
        if (!v->is_number()) return bad(path, key, ": " + x(*v) + " is not a number"), 0.0f;
        const double d = v->get<double>();  // converted only once it is known to fit (a double past FLT_MAX is undefined)
        if (!(std::fabs(d) <= double(std::numeric_limits<float>::max())))
            return bad(path, key, ": " + x(*v) + " does not fit a 32-bit float"), 0.0f;
        return float(d);
    }
    bool boolean(const nlohmann::json& obj, const std::string& path, const std::string& key) {
        const nlohmann::json* v = find(obj, path, key);
        if (!v) return false;
        if (!v->is_boolean()) return bad(path, key, ": " + x(*v) + " is not true/false"), false;
        return v->get<bool>();
    }
    std::string string(const nlohmann::json& obj, const std::string& path, const std::string& key) {
        const nlohmann::json* v = find(obj, path, key);
        if (!v) return "";
        if (!v->is_string()) return bad(path, key, ": " + x(*v) + " is not a string"), "";
        return v->get<std::string>();
    }
    std::vector<int> int_list(const nlohmann::json& obj, const std::string& path, const std::string& key) {
        const nlohmann::json* v = find(obj, path, key);
        std::vector<int> out;
        if (!v) return out;
        if (!v->is_array()) return bad(path, key, ": " + x(*v) + " is not a list"), out;
        if (v->size() > std::size_t(kMaxLayers))
            return bad(path, key, ": " + std::to_string(v->size()) + " elements, more than " + std::to_string(kMaxLayers)), out;
        for (const auto& e : *v) {
            if (!e.is_number_integer()) return bad(path, key, ": element " + x(e) + " is not an integer"), out;
            if (e.is_number_unsigned() ? e.get<std::uint64_t>() > (1u << 30) : e.get<std::int64_t>() < -(1 << 30) || e.get<std::int64_t>() > (1 << 30))
                return bad(path, key, ": element " + x(e) + " is out of range"), out;
            out.push_back(int(e.get<std::int64_t>()));
        }
        return out;
    }
    // A rule about fields that were read: checked only when none of `keys` already failed to read, so a
    // mistyped field is reported once, not again by every rule that would see its placeholder value.
    void require(bool ok, const std::string& what, std::initializer_list<const char*> keys = {}) {
        for (const char* k : keys)
            if (failed.count(k)) return;
        if (!ok) problems.push_back(what);
    }
};

// A config number as written in messages: "-6", "1e-05" (never a long decimal expansion).
inline std::string number_str(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

// "[1,2,3]"; a long list names its first 10 elements and how many more there are.
inline std::string list_str(const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size() && i < 10; ++i) s += (i ? "," : "") + std::to_string(v[i]);
    return s + (v.size() > 10 ? ", and " + std::to_string(v.size() - 10) + " more]" : "]");
}

// The message of a refusal: the first `shown` problems, then how many more there are.
inline std::string problem_list(const std::string& head, const std::vector<std::string>& problems, std::size_t shown = 20) {
    std::string msg = head + " (" + std::to_string(problems.size()) + " problem" + (problems.size() > 1 ? "s" : "") + "):";
    for (std::size_t i = 0; i < problems.size() && i < shown; ++i) msg += "\n  - " + problems[i];
    if (problems.size() > shown) msg += "\n  - and " + std::to_string(problems.size() - shown) + " more";
    return msg;
}

}  // namespace detail

inline std::string Config::schedule_string() const {
    std::string s;
    for (const LayerPlan& p : layers) s += p.attn == AttnKind::KDA ? 'K' : 'M';
    return s;
}

// Parses a config (nested release form or a flat text config). `source` names the file in messages.
inline Config parse_config(const nlohmann::json& root, const std::string& source) {
    detail::ConfigReader r;
    Config c;
    if (!root.is_object()) fail(ErrorKind::format, source + ": not a JSON object");
    const bool nested = root.contains("text_config");
    const nlohmann::json& t = nested ? root["text_config"] : root;
    const std::string tp = nested ? "text_config." : "";
    if (nested && !t.is_object()) fail(ErrorKind::format, source + ": text_config is not an object");

    // token ids live at the top level of the release (and in text_config): optional (absent or null:
    // -1), but one that is given must be a non-negative integer
    auto token_id = [&](const char* key) -> std::int64_t {
        std::int64_t id = -1;
        for (int pass = 0; pass < (nested ? 2 : 1); ++pass) {  // a flat config: t is root, read once
            const nlohmann::json* o = pass == 0 ? &root : &t;
            if (!o->contains(key) || (*o)[key].is_null()) continue;
            const nlohmann::json& v = (*o)[key];
            const std::string where = (o == &root ? std::string() : tp) + key;
            if (!v.is_number_integer()) r.problems.push_back(where + ": " + r.x(v) + " is not an integer");
            else if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(INT64_MAX)) r.problems.push_back(where + ": " + r.x(v) + " is out of range");
            else if (v.get<std::int64_t>() < 0) r.problems.push_back(where + ": " + r.x(v) + " is negative");
            else if (id < 0) id = v.get<std::int64_t>();
        }
        return id;
    };
    c.bos_token_id = token_id("bos_token_id");
    c.eos_token_id = token_id("eos_token_id");
    c.pad_token_id = token_id("pad_token_id");

    c.hidden_size = r.integer(t, tp, "hidden_size");
    c.num_hidden_layers = r.integer(t, tp, "num_hidden_layers", 1, kMaxLayers);
    c.vocab_size = r.integer(t, tp, "vocab_size");
    c.rms_norm_eps = r.number(t, tp, "rms_norm_eps");
    c.num_attention_heads = r.integer(t, tp, "num_attention_heads");
    const int kv_heads = r.integer(t, tp, "num_key_value_heads");
    // An option of Moonshot's modeling code that Kimi K3 does not use: refused with that reason, so a
    // user sees that the checkpoint is a valid Kimi-Linear-family model this engine does not run.
    auto unused_option = [&](const std::string& path, const std::string& what) {
        r.problems.push_back(path + ": " + what + " is an option of Moonshot's code that Kimi K3 does not use (not implemented here)");
        r.failed.insert(path.substr(path.rfind('.') + 1));
    };
    // A field whose absence (or null) selects one of those options.
    auto present = [&](const nlohmann::json& o, const std::string& path, const char* key, const std::string& what) {
        if (o.contains(key) && !o[key].is_null()) return true;
        unused_option(path + key, what);
        return false;
    };
    if (present(t, tp, "q_lora_rank", "no q_lora_rank (MLA without the query low-rank path)")) c.q_lora_rank = r.integer(t, tp, "q_lora_rank");
    c.kv_lora_rank = r.integer(t, tp, "kv_lora_rank");
    c.qk_nope_head_dim = r.integer(t, tp, "qk_nope_head_dim");
    c.qk_rope_head_dim = r.integer(t, tp, "qk_rope_head_dim");
    c.v_head_dim = r.integer(t, tp, "v_head_dim");
    const bool use_nope = r.boolean(t, tp, "mla_use_nope");
    const bool output_gate = r.boolean(t, tp, "mla_use_output_gate");

    const std::string lp = tp + "linear_attn_config.";
    const nlohmann::json* la = r.find(t, tp, "linear_attn_config");
    const nlohmann::json empty = nlohmann::json::object();
    const nlohmann::json& l = la && la->is_object() ? *la : empty;
    if (la && !la->is_object()) r.problems.push_back(tp + "linear_attn_config: not an object");
    c.kda_layers = r.int_list(l, lp, "kda_layers");
    c.full_attn_layers = r.int_list(l, lp, "full_attn_layers");
    c.kda_num_heads = r.integer(l, lp, "num_heads");
    c.kda_head_dim = r.integer(l, lp, "head_dim");
    c.short_conv_kernel_size = r.integer(l, lp, "short_conv_kernel_size");
    if (la && present(l, lp, "use_full_rank_gate", "no use_full_rank_gate (the low-rank KDA output gate g_a/g_b_proj)") &&
        !r.boolean(l, lp, "use_full_rank_gate"))
        unused_option(lp + "use_full_rank_gate", "false (the low-rank KDA output gate g_a/g_b_proj)");
    if (la && present(l, lp, "gate_lower_bound", "no gate_lower_bound (Kimi-Linear's softplus decay, without a lower bound)"))
        c.gate_lower_bound = r.number(l, lp, "gate_lower_bound");

    const std::string act = r.string(t, tp, "hidden_act");
    c.situ_beta = r.number(t, tp, "activation_situ_beta", 1.0f);          // null -> 1.0 (Moonshot's code)
    c.situ_linear_beta = r.number(t, tp, "activation_situ_linear_beta", 0.0f);  // null -> identity
    c.intermediate_size = r.integer(t, tp, "intermediate_size");
    c.first_k_dense_replace = r.integer(t, tp, "first_k_dense_replace", 0);
    c.moe_layer_freq = r.integer(t, tp, "moe_layer_freq");
    c.num_experts = r.integer(t, tp, "num_experts");
    c.num_experts_per_token = r.integer(t, tp, "num_experts_per_token");
    c.num_shared_experts = r.integer(t, tp, "num_shared_experts", 0);
    if (!r.failed.count("num_shared_experts") && c.num_shared_experts == 0)
        unused_option(tp + "num_shared_experts", "0 (a MoE without shared experts)");
    c.moe_intermediate_size = r.integer(t, tp, "moe_intermediate_size");
    if (present(t, tp, "routed_expert_hidden_size", "no routed_expert_hidden_size (a MoE whose experts work at full width, not latent)"))
        c.routed_expert_hidden_size = r.integer(t, tp, "routed_expert_hidden_size");
    c.latent_moe_use_norm = r.boolean(t, tp, "latent_moe_use_norm");
    const std::string router = r.string(t, tp, "moe_router_activation_func");
    c.moe_renormalize = r.boolean(t, tp, "moe_renormalize");
    c.routed_scaling_factor = r.number(t, tp, "routed_scaling_factor");
    const int groups = t.contains("num_expert_group") && !t["num_expert_group"].is_null() ? r.integer(t, tp, "num_expert_group") : 1;
    if (present(t, tp, "attn_res_block_size", "no attn_res_block_size (the plain residual stream, without Attention Residuals)"))
        c.attn_res_block_size = r.integer(t, tp, "attn_res_block_size");
    auto flag = [](const nlohmann::json& o, const char* key) { return o.contains(key) && o[key].is_boolean() && o[key].get<bool>(); };
    const bool tied = flag(root, "tie_word_embeddings") || flag(t, "tie_word_embeddings");

    // ---- 2.3 validation and refusals: what would otherwise run and be wrong ----
    if (!r.failed.count("hidden_act") && act != "situ") unused_option(tp + "hidden_act", "\"" + act + "\" (K3 uses \"situ\")");
    if (!r.failed.count("moe_router_activation_func") && router != "sigmoid")
        unused_option(tp + "moe_router_activation_func", "\"" + router + "\" (K3's router is \"sigmoid\")");
    if (!r.failed.count("num_expert_group") && groups != 1)
        unused_option(tp + "num_expert_group", std::to_string(groups) + " (group-limited top-k with more than one group)");
    r.require(use_nope, tp + "mla_use_nope: false: rotary MLA is refused by Moonshot's code too (K3 is NoPE)", {"mla_use_nope"});
    if (!r.failed.count("mla_use_output_gate") && !output_gate) unused_option(tp + "mla_use_output_gate", "false (MLA without its output gate)");
    // fla's chunk_kda accepts a lower bound in [-5, 0) only ("must be in the safe range [-5, 0)"); so do we
    r.require(!la || !(c.gate_lower_bound < -5.0f || c.gate_lower_bound >= 0.0f),
              lp + "gate_lower_bound: " + detail::number_str(c.gate_lower_bound) +
                  " is outside [-5, 0), the range the official KDA kernel accepts (fla's chunk_kda refuses it)",
              {"gate_lower_bound"});
    if (tied) unused_option("tie_word_embeddings", "true (one matrix for the embedding and lm_head)");
    r.require(kv_heads == c.num_attention_heads, tp + "num_key_value_heads: " + std::to_string(kv_heads) +
                                                     " != num_attention_heads " + std::to_string(c.num_attention_heads) +
                                                     ": grouped-query MLA is not implemented",
              {"num_key_value_heads", "num_attention_heads"});
    r.require(c.rms_norm_eps > 0, tp + "rms_norm_eps: must be positive", {"rms_norm_eps"});
    // products of two fields must stay in range too (the KDA width P and the fused shared-expert width)
    r.require(std::int64_t(c.kda_num_heads) * c.kda_head_dim <= (1 << 30),
              lp + "num_heads x head_dim: " + std::to_string(std::int64_t(c.kda_num_heads) * c.kda_head_dim) + " is out of range",
              {"num_heads", "head_dim"});
    r.require(std::int64_t(c.num_shared_experts) * c.moe_intermediate_size <= (1 << 30),
              tp + "num_shared_experts x moe_intermediate_size: " +
                  std::to_string(std::int64_t(c.num_shared_experts) * c.moe_intermediate_size) + " is out of range",
              {"num_shared_experts", "moe_intermediate_size"});
    r.require(c.num_experts_per_token <= c.num_experts, tp + "num_experts_per_token: " + std::to_string(c.num_experts_per_token) +
                                                            " is more than num_experts " + std::to_string(c.num_experts),
              {"num_experts_per_token", "num_experts"});
    r.require(c.first_k_dense_replace <= c.num_hidden_layers, tp + "first_k_dense_replace: more than num_hidden_layers",
              {"first_k_dense_replace", "num_hidden_layers"});
    for (auto [name, v] : {std::pair<const char*, std::int64_t>{"bos_token_id", c.bos_token_id}, {"eos_token_id", c.eos_token_id},
                           {"pad_token_id", c.pad_token_id}})
        r.require(v < c.vocab_size, std::string(name) + ": " + std::to_string(v) + " is outside the vocabulary (" +
                                        std::to_string(c.vocab_size) + ")",
                  {"vocab_size"});
    // Any width runs (chapter 00: element i goes into lane i % 16 whatever n is), but an MXFP4 block holds 32
    // weights with one scale: the routed experts' input widths must be whole blocks (chapter 05).
    for (auto [name, v] : {std::pair<const char*, int>{"routed_expert_hidden_size", c.routed_expert_hidden_size},
                           {"moe_intermediate_size", c.moe_intermediate_size}})
        r.require(v % 32 == 0, tp + name + ": " + std::to_string(v) +
                                   " is not a multiple of 32: an MXFP4 block holds 32 weights, and the experts' inputs are whole blocks",
                  {name});
    // the one-based layer lists must partition 1..num_hidden_layers
    {
        std::vector<int> seen(std::size_t(c.num_hidden_layers) + 1, 0);
        std::vector<int> bad, dup;
        for (const auto* list : {&c.kda_layers, &c.full_attn_layers})
            for (int x : *list) {
                if (x < 1 || x > c.num_hidden_layers) bad.push_back(x);
                else if (seen[std::size_t(x)]++) dup.push_back(x);
            }
        std::vector<int> missing;
        for (int x = 1; x <= c.num_hidden_layers; ++x)
            if (!seen[std::size_t(x)]) missing.push_back(x);
        const bool lists_read = !r.failed.count("kda_layers") && !r.failed.count("full_attn_layers") && !r.failed.count("num_hidden_layers");
        if (lists_read && (!bad.empty() || !dup.empty() || !missing.empty()))
            r.problems.push_back(lp + "kda_layers/full_attn_layers: must partition 1..num_hidden_layers (" +
                                 std::to_string(c.num_hidden_layers) + ", one-based)" +
                                 (bad.empty() ? "" : "; out of range " + detail::list_str(bad)) +
                                 (dup.empty() ? "" : "; listed twice " + detail::list_str(dup)) +
                                 (missing.empty() ? "" : "; missing " + detail::list_str(missing)));
    }
    // quantization: the routed experts must be MXFP4 in the compressed-tensors layout (docs/kimi-k3.md 2.4)
    {
        const nlohmann::json* q = t.contains("quantization_config") ? &t["quantization_config"]
                                  : root.contains("quantization_config") ? &root["quantization_config"] : nullptr;
        if (!q) {
            r.problems.push_back(tp + "quantization_config: missing: this engine reads MXFP4 routed experts (docs/kimi-k3.md 2.4)");
        } else if (!q->is_object()) {
            r.problems.push_back(tp + "quantization_config: not an object");
        } else try {
            const std::string qp = tp + "quantization_config.";
            const bool ok = q->value("quant_method", "") == "compressed-tensors" && q->value("format", "") == "mxfp4-pack-quantized";
            r.require(ok, qp + "quant_method/format: expected compressed-tensors / mxfp4-pack-quantized, found " +
                              q->value("quant_method", "?") + " / " + q->value("format", "?"));
            if (ok && q->contains("config_groups") && (*q)["config_groups"].is_object())
                for (const auto& [g, grp] : (*q)["config_groups"].items()) {
                    const nlohmann::json w = grp.value("weights", nlohmann::json::object());
                    auto field = [&](const char* k) { return w.is_object() && w.contains(k) ? w[k] : nlohmann::json(); };  // compared as JSON: no conversion
                    r.require(field("num_bits") == 4 && field("type") == "float" && field("group_size") == 32,
                              qp + "config_groups." + g + ".weights: expected 4-bit float, group_size 32 (MXFP4)");
                    r.require(!grp.contains("input_activations") || grp["input_activations"].is_null(),
                              qp + "config_groups." + g + ".input_activations: activation quantization is not implemented");
                }
        } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type
            r.problems.push_back(tp + "quantization_config: malformed (" + e.what() + ")");
        }
    }
    // values that read well but cannot be right: each would run and compute nonsense
    {
        auto given = [&](const char* key) { return t.contains(key) && !t[key].is_null(); };  // null has Moonshot's default
        r.require(c.rms_norm_eps <= 0.01f, tp + "rms_norm_eps: " + std::to_string(c.rms_norm_eps) +
                                               " is more than 0.01 (it is added to a mean square; K3 uses 1e-5)", {"rms_norm_eps"});
        r.require(c.situ_beta > 0, tp + "activation_situ_beta: must be positive (the gate branch's soft cap; K3 uses 4)",
                  {"activation_situ_beta"});
        r.require(!given("activation_situ_linear_beta") || c.situ_linear_beta > 0,
                  tp + "activation_situ_linear_beta: must be positive, or null for an identity up branch (K3 uses 25)",
                  {"activation_situ_linear_beta"});
        r.require(c.routed_scaling_factor > 0, tp + "routed_scaling_factor: must be positive (it multiplies the routing weights; K3 uses 1)",
                  {"routed_scaling_factor"});
        // sums and products the engine forms from two fields stay in an int (the MLA cache width C = R + X)
        r.require(std::int64_t(c.kv_lora_rank) + c.qk_rope_head_dim <= kMaxWidth,
                  tp + "kv_lora_rank + qk_rope_head_dim: " + std::to_string(std::int64_t(c.kv_lora_rank) + c.qk_rope_head_dim) +
                      " is more than " + std::to_string(kMaxWidth),
                  {"kv_lora_rank", "qk_rope_head_dim"});
    }
    if (!r.problems.empty()) fail(ErrorKind::format, detail::problem_list(source + ": the config is refused", r.problems));

    // ---- 2.4 the layer schedule ----
    std::set<int> mla(c.full_attn_layers.begin(), c.full_attn_layers.end());
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        const bool moe = l >= c.first_k_dense_replace && l % c.moe_layer_freq == 0;
        c.layers.push_back({mla.count(l + 1) ? AttnKind::MLA : AttnKind::KDA, moe ? FfnKind::MoE : FfnKind::Dense,
                            l % c.attn_res_block_size == 0});
    }
    return c;
}

// Reads `path`, a config.json or a directory holding one: a regular file of at most kMaxConfigBytes,
// JSON within chapter 01's bounds (depth, duplicate keys, numbers in range).
inline Config load_config(std::string path) {
    if (is_directory(path)) path += "/config.json";
    return parse_config(read_json_file(path, kMaxConfigBytes, "config.json"), path);
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
// 2.6 Binding
// ---------------------------------------------------------------------------------------------------
// Where one routed expert lives. The release stores its six tensors back to back, so one read of
// [span_offset, span_offset + span_bytes) brings the whole expert; part p then starts at
// part_offset[p] - span_offset inside it. When the parts are scattered, `contiguous` is false and
// chapter 11 reads them one by one.
struct ExpertLocation {
    const SafetensorsFile* file = nullptr;   // the shard of part 0 (all parts when contiguous)
    std::array<const Checkpoint::Ref*, 6> parts{};
    bool contiguous = false;
    std::uint64_t span_offset = 0, span_bytes = 0;
    std::uint64_t bytes() const {
        std::uint64_t n = 0;
        for (auto* p : parts) n += p->info->nbytes();
        return n;
    }
};

struct ModelTensors {
    const Checkpoint::Ref *embed = nullptr, *final_norm = nullptr, *out_res_norm = nullptr, *out_res_proj = nullptr,
                          *lm_head = nullptr;
    std::vector<LayerTensors> layers;
    std::vector<std::vector<ExpertLocation>> experts;  // [layer][expert]; empty for dense layers
    std::uint64_t expert_bytes = 0;                    // bytes of one routed expert (all equal)
};

inline ModelTensors bind_tensors(const Checkpoint& ck, const Config& c) {
    std::vector<std::string> problems;
    auto check = [&](const std::string& name, const DTypes& dtypes, const Shape& shape, std::int64_t at_least = 0) -> const Checkpoint::Ref* {
        const Checkpoint::Ref* r = ck.find(name);
        const std::string want = dtypes_str(dtypes) + " " + (at_least ? "[n >= " + std::to_string(at_least) + "]" : shape.str());
        if (!r) {
            problems.push_back(name + ": missing (expected " + want + ")");
            return nullptr;
        }
        const Shape& got = r->info->shape;
        const bool shape_ok = at_least ? got.rank == 1 && got[0] >= at_least : got == shape;
        if (!dtype_allowed(dtypes, r->info->dtype) || !shape_ok)
            problems.push_back(name + ": expected " + want + ", found " + dtype_name(r->info->dtype) + " " + got.str());
        return r;
    };
    ModelTensors m;
    const std::int64_t D = c.hidden_size, V = c.vocab_size;
    const std::string g = std::string(kPrefix) + "model.";
    m.embed = check(g + "embed_tokens.weight", kBf16Float, {V, D});
    m.final_norm = check(g + "norm.weight", kBf16Float, {D});
    m.out_res_norm = check(g + "output_attn_res_norm.weight", kBf16Float, {D});
    m.out_res_proj = check(g + "output_attn_res_proj.weight", kBf16Float, {1, D});
    m.lm_head = check(std::string(kPrefix) + "lm_head.weight", kBf16Float, {V, D});

    const auto part_shapes = expert_part_shapes(c);
    m.experts.resize(std::size_t(c.num_hidden_layers));
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        LayerTensors lt;
        lt.layer = l;
        lt.plan = c.layers[std::size_t(l)];
        for (const Expected& e : expected_layer_tensors(c, l)) {
            const Checkpoint::Ref* r = check(e.name, e.dtypes, e.shape, e.at_least);
            lt.*(e.member) = r;
            if (r) lt.all.push_back(r);
        }
        m.layers.push_back(std::move(lt));
        if (c.layers[std::size_t(l)].ffn != FfnKind::MoE) continue;
        for (int e = 0; e < c.num_experts; ++e) {
            ExpertLocation loc;
            bool complete = true;
            for (int p = 0; p < 6; ++p) {
                loc.parts[std::size_t(p)] = check(expert_name(l, e, p), kU8Only, part_shapes[std::size_t(p)]);
                complete = complete && loc.parts[std::size_t(p)];
            }
            if (complete) {
                loc.file = loc.parts[0]->file;
                std::uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
                bool same_file = true;
                for (auto* p : loc.parts) {
                    same_file = same_file && p->file == loc.file;
                    lo = std::min(lo, p->info->file_offset);
                    hi = std::max(hi, p->info->file_offset + p->info->nbytes());
                    sum += p->info->nbytes();
                }
                loc.contiguous = same_file && hi - lo == sum;  // no gaps, no foreign bytes in between
                loc.span_offset = lo;
                loc.span_bytes = hi - lo;
                m.expert_bytes = loc.bytes();
            }
            m.experts[std::size_t(l)].push_back(loc);
            if (problems.size() > 40) break;
        }
    }
    // MXFP4 must appear only in routed experts (llama.cpp's converter refuses it elsewhere too).
    for (const auto& [name, ref] : ck.tensors())
        if (name.find("weight_packed") != std::string::npos && name.find(".block_sparse_moe.experts.") == std::string::npos)
            problems.push_back(clipped(name) + ": MXFP4 weight_packed outside the routed experts (docs/kimi-k3.md 2.4: only experts are packed)");
    if (!problems.empty()) fail(ErrorKind::format, detail::problem_list(ck.dir() + ": the checkpoint does not match its config", problems));
    return m;
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

inline Census take_census(const Checkpoint& ck, const Config& c, const ModelTensors& m) {
    Census s;
    std::set<const TensorInfo*> text;
    auto add = [&](const Checkpoint::Ref* r) {
        text.insert(r->info);
        return r->info->nbytes();
    };
    s.embed_bytes = add(m.embed);
    s.lm_head_bytes = add(m.lm_head);
    s.final_bytes = add(m.final_norm) + add(m.out_res_norm) + add(m.out_res_proj);
    for (const LayerTensors& lt : m.layers) {
        std::uint64_t b = 0;
        for (const Checkpoint::Ref* r : lt.all) b += add(r);
        s.layer_trunk_bytes.push_back(b);
        s.trunk_bytes += b;
    }
    for (const auto& layer : m.experts)
        for (const ExpertLocation& e : layer) {
            for (auto* p : e.parts) text.insert(p->info);
            ++s.expert_count;
            s.expert_bytes_total += e.bytes();
        }
    s.expert_bytes = m.expert_bytes;
    for (const auto& [name, ref] : ck.tensors()) {
        ++s.tensors;
        s.bytes += ref.info->nbytes();
        if (!text.count(ref.info)) ++s.other_tensors, s.other_bytes += ref.info->nbytes();
    }
    census_state(s, c);
    return s;
}

}  // namespace kimik3
