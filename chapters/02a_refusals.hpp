// kimik3 chapter 02, APPENDIX: refusals -- reading config.json and binding tensors, refusing with reasons.
// ====================================================================================================
//
// APPENDIX to chapter 02 (02_config.hpp, sections 2.2, 2.3 and 2.6 in its index). The lesson says what a
// Config holds, the schedule it implies, the tensors it expects and what they weigh; this reads a
// config.json into a Config and binds a checkpoint's tensors to it, refusing anything it cannot run
// correctly with every problem listed at once, each with its JSON path or tensor name (the contract is
// in the lesson's top block). 02_config.hpp includes this file at its end.
//
//   2.2  a reader that never throws on the first problem (ConfigReader), caps on counts, parse_config
//        (the release's nested form or a flat text config), load_config
//   2.3  validation and refusals: options of Moonshot's code K3 does not use, values the math cannot
//        take, the quantization, the one-based layer lists
//   2.6  binding: every expected tensor found, its dtype and shape checked, routed experts located
//   2.7  (the rest) the census of a bound checkpoint
//
// USES     chapter 02 (Config, Expected, LayerTensors, Census), appendix 01a (read_json_file,
//          json_excerpt, clipped), chapter 01 (Checkpoint)
// TEST     make test-02   (tests "2.2 ...", "2.3 ...", "2.6 ...")
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "02_config.hpp"

namespace kimik3 {

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

    layer_schedule(c);  // 2.4, in the lesson
    return c;
}

// Reads `path`, a config.json or a directory holding one: a regular file of at most kMaxConfigBytes,
// JSON within chapter 01's bounds (depth, duplicate keys, numbers in range).
inline Config load_config(std::string path) {
    if (is_directory(path)) path += "/config.json";
    return parse_config(read_json_file(path, kMaxConfigBytes, "config.json"), path);
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
// 2.7 (the rest) The census of a bound checkpoint
// ---------------------------------------------------------------------------------------------------
// The same counts as config_census (2.7), taken from the tensors a checkpoint really holds, plus what it
// holds beyond the text model (a vision tower, say): equal to config_census on a release-layout
// checkpoint (a test).
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
