// kimik3 inspect MODEL_DIR: the config summary, layer schedule and census of a checkpoint.
#pragma once

#include "common.hpp"

namespace kimik3::cli {

inline const char* kInspectUsage =
    "usage: kimik3 inspect MODEL_DIR\n"
    "\n"
    "Reads MODEL_DIR/config.json and the safetensors shards (through model.safetensors.index.json), checks\n"
    "every tensor against the config, and prints the schedule (K = KDA, M = MLA per layer) and a census:\n"
    "bytes per part of the checkpoint, bytes one token must read, and the smallest memory it can run in.\n"
    "Reads only headers: it is instant even on the 1.56 TB release.\n";

inline int cmd_inspect(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kInspectUsage, stdout), kExitOk;
    if (args.size() != 1 || args[0].rfind("-", 0) == 0) throw Usage(std::string("inspect takes one MODEL_DIR\n\n") + kInspectUsage);
    const std::string dir = args[0];
    const Config c = load_config(dir);
    std::printf("config      %s/config.json\n", dir.c_str());
    std::printf("  hidden %d, %d layers, vocab %d, rms_norm_eps %g\n", c.hidden_size, c.num_hidden_layers, c.vocab_size,
                double(c.rms_norm_eps));
    std::printf("  KDA  %d heads x %d, conv %d, decay lower bound %g\n", c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size,
                double(c.gate_lower_bound));
    std::printf("  MLA  %d heads, q_lora %d, kv_lora %d, qk %d+%d (NoPE), v %d: %d floats cached per position\n",
                c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                c.mla_cache_width());
    std::printf("  MoE  %d experts, top %d, %d shared (width %d), expert FFN %d, latent %d; dense FFN %d\n", c.num_experts,
                c.num_experts_per_token, c.num_shared_experts, c.shared_width(), c.moe_intermediate_size,
                c.routed_expert_hidden_size, c.intermediate_size);
    std::printf("  SiTU beta %g (gate) / %g (up); AttnRes block %d\n", double(c.situ_beta), double(c.situ_linear_beta),
                c.attn_res_block_size);
    std::printf("schedule\n");
    std::string sched = describe_schedule(c);
    for (std::size_t p = 0, q; p < sched.size(); p = q + 1) {
        q = sched.find('\n', p);
        if (q == std::string::npos) q = sched.size();
        std::printf("  %s\n", sched.substr(p, q - p).c_str());
    }
    Checkpoint ck(dir);
    const ModelTensors m = bind_tensors(ck, c);
    const Census s = take_census(ck, c, m);
    std::size_t contiguous = 0;
    for (const auto& layer : m.experts)
        for (const ExpertLocation& e : layer) contiguous += e.contiguous;
    std::printf("checkpoint  %zu shards, %s tensors, %s (%s bytes of tensor data); every tensor checked\n", ck.shards().size(),
                thousands(s.tensors).c_str(), human_bytes(double(s.bytes)).c_str(), thousands(s.bytes).c_str());
    std::printf("census\n");
    auto line = [](const char* what, std::uint64_t b, const std::string& note) {
        std::printf("  %-22s %12s  %20s B  %s\n", what, human_bytes(double(b)).c_str(), thousands(b).c_str(), note.c_str());
    };
    line("routed experts", s.expert_bytes_total,
         thousands(s.expert_count) + " x " + thousands(s.expert_bytes) + " B, " + thousands(contiguous) + " stored contiguously");
    std::size_t largest = 0;
    for (std::size_t l = 0; l < s.layer_trunk_bytes.size(); ++l)
        if (s.layer_trunk_bytes[l] > s.layer_trunk_bytes[largest]) largest = l;
    line("trunk (per layer)", s.trunk_bytes,
         std::to_string(c.num_hidden_layers) + " layers, largest layer " + std::to_string(largest) + ": " +
             human_bytes(double(s.layer_trunk_bytes[largest])));
    line("embedding", s.embed_bytes, "one row read per token");
    line("lm_head", s.lm_head_bytes, "");
    line("final norm + AttnRes", s.final_bytes, "");
    if (s.other_tensors) line("not text (skipped)", s.other_bytes, thousands(s.other_tensors) + " tensors (vision tower, projector)");
    line("per token reads", s.per_token_bytes, "trunk + lm_head + 1 embedding row + " + std::to_string(c.num_experts_per_token) +
                                                     " experts x " + std::to_string(c.moe_layer_count()) +
                                                     " MoE layers, nothing resident");
    line("KDA state", s.kda_state_bytes, std::to_string(c.count(AttnKind::KDA)) + " layers (recurrent state + conv history)");
    line("MLA cache per position", s.mla_cache_bytes_per_token, std::to_string(c.count(AttnKind::MLA)) + " layers x " +
                                                                    std::to_string(c.mla_cache_width()) + " floats");
    line("smallest memory", make_plan(c, s, 0, PlanOptions{}, unit_bytes(m)).floor,
         "the plan's floor at a 4096-token context (kimik3 plan shows what larger budgets buy)");
    // What the checkpoint stores differently from the release, and what that means (nothing is refused here)
    std::map<std::string, std::uint64_t> dtypes;  // "F32 matrices" -> count
    for (const LayerTensors& lt : m.layers)
        for (const Checkpoint::Ref* r : lt.all)
            if (r->info->dtype != DType::BF16 && r->info->dtype != DType::F32)
                ++dtypes[std::string(dtype_name(r->info->dtype)) + (is_streamable_matrix(*r->info) ? " matrices" : " vectors")];
            else if (r->info->dtype == DType::F32 && is_streamable_matrix(*r->info))
                ++dtypes["F32 matrices"];
    for (const auto& [what, n] : dtypes)
        std::printf("note        %s %s: read exactly (widened to f32), never rounded to bf16\n", thousands(n).c_str(), what.c_str());
    for (const LayerTensors& lt : m.layers) {
        if (!lt.A_log) continue;
        const std::vector<float> a = to_f32(ck.read(lt.A_log->info->name));
        std::size_t nonzero = 0;
        for (std::size_t i = std::size_t(c.kda_num_heads); i < a.size(); ++i) nonzero += a[i] != 0.0f;
        if (nonzero)
            std::printf("warning     layer %d A_log: %zu of the %zu entries past num_heads (%d) are not zero; Moonshot's code\n"
                        "            reads only the first %d (one per head), and so does this engine\n",
                        lt.layer, nonzero, a.size() - std::size_t(c.kda_num_heads), c.kda_num_heads, c.kda_num_heads);
    }
    return kExitOk;
}

}  // namespace kimik3::cli
