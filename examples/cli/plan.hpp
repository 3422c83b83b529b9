// kimik3 plan (MODEL_DIR | --config CONFIG) --budget SIZE | --preset NAME: what runs where at a budget.
#pragma once

#include <cmath>

#include "common.hpp"

namespace kimik3::cli {

inline const char* kPlanUsage =
    "usage: kimik3 plan (MODEL_DIR | --config CONFIG.json) (--budget SIZE | --preset NAME) [--context N] [--max-batch N]\n"
    "\n"
    "Prints the memory plan for a model at a budget without running it: what stays resident (carried state,\n"
    "latent KV cache, small tensors, pinned layers), how the rest streams (ring slots, chunk size, expert\n"
    "slots), the expected peak memory and the bytes read per token. --config plans from a config.json alone,\n"
    "e.g. the real 93-layer K3: kimik3 plan --config fixtures/k3-release/config.json --preset laptop.\n"
    "A budget below the floor is refused (exit code 3) with the floor in the message; --budget floor asks\n"
    "for exactly the floor.\n"
    "  --context N    positions of latent KV cache to plan for (default 4096)\n"
    "  --max-batch N  conversations stepped together, each with its own carried state and MLA cache (default 1)\n";

// What each conversation of a batch adds to the plan (its carried state and its MLA cache at `context`).
inline std::string per_conversation(const Census& s, std::uint64_t context) {
    return "carried state " + human_bytes(double(s.kda_state_bytes)) + " + MLA cache " + human_bytes(double(s.mla_cache_bytes_per_token * context)) +
           " per conversation";
}

inline int cmd_plan(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kPlanUsage, stdout), kExitOk;
    const std::string config_path = take_option(args, "--config", kPlanUsage), budget = take_option(args, "--budget", kPlanUsage),
                      preset = take_option(args, "--preset", kPlanUsage), context = take_option(args, "--context", kPlanUsage),
                      batch = take_option(args, "--max-batch", kPlanUsage);
    if ((config_path.empty() ? args.size() != 1 : !args.empty()) || (!budget.empty() + !preset.empty()) != 1)
        throw Usage(std::string("plan takes MODEL_DIR or --config, and one of --budget or --preset\n\n") + kPlanUsage);
    const Config c = load_config(config_path.empty() ? args[0] : config_path);
    Census s;
    if (config_path.empty()) {
        Checkpoint ck(args[0]);
        s = take_census(ck, c, bind_tensors(ck, c));
    } else {
        s = config_census(c);
    }
    PlanOptions o;
    if (!context.empty()) o.context = std::uint64_t(parse_count(context, "--context", kPlanUsage, kMaxPositions));
    if (!batch.empty()) o.sessions = std::uint64_t(parse_count(batch, "--max-batch", kPlanUsage, 4096));
    if (o.sessions == 0) throw Usage(std::string("--max-batch: at least 1 conversation\n\n") + kPlanUsage);
    const Plan p = make_plan(c, s, budget_bytes(budget, preset, kPlanUsage), o);
    const std::string each = per_conversation(s, o.context);
    if (p.budget < p.floor) fail(ErrorKind::budget, plan_error_floor(p) + " (" + each + ")");
    std::printf("%s", describe_plan(p, c).c_str());
    if (o.sessions > 1) {
        std::printf("  batch:    %llu conversations, %s\n", (unsigned long long)o.sessions, each.c_str());
        // One step of N decoding conversations reads the streamed trunk once and the union of the experts
        // they route to: under uniform routing a layer's N x K picks of E cover E (1 - (1 - K/E)^N) experts
        // (the pessimistic end: real routing is skewed, and the expert cache's hits are not counted).
        const double N = double(o.sessions), E = double(c.num_experts), K = double(c.num_experts_per_token);
        const double one = double(p.trunk_read_per_token + p.expert_read_per_token);
        const double union_experts = K > 0 ? double(p.expert_read_per_token) * E * (1 - std::pow(1 - K / E, N)) / K : 0.0;
        const double step = double(p.trunk_read_per_token) + union_experts;
        std::printf("            a step of %llu decoding together reads trunk %s + experts up to %s (uniform routing): %s per generated\n"
                    "            token, %.3f of one conversation's %s\n",
                    (unsigned long long)o.sessions, human_bytes(double(p.trunk_read_per_token)).c_str(), human_bytes(union_experts).c_str(),
                    human_bytes(step / N).c_str(), one > 0 ? step / N / one : 0.0, human_bytes(one).c_str());
    }
    return kExitOk;
}

}  // namespace kimik3::cli
