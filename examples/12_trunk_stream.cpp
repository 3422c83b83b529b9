// Example for chapter 12: what the planner keeps resident and what it streams, for the real K3 (from
// its config alone) and for the tiny K3, across budgets.
//   make run-12
#include <cstdio>

#include "../chapters/12_trunk_stream.hpp"
#include "cli/sizes.hpp"  // "8G" -> bytes: the command line's helper

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

static void table(const Config& c, const Census& s, const std::vector<std::string>& budgets) {
    std::printf("  %-8s %10s %8s %9s %7s %12s %8s %12s %12s\n", "budget", "floor", "pinned", "lm_head", "ring", "chunk", "experts",
                "trunk/token", "expected");
    for (const std::string& b : budgets) {
        const Plan p = make_plan(c, s, b == "floor" ? make_plan(c, s, 0, PlanOptions{}).floor : cli::parse_size(b), PlanOptions{});
        if (p.budget < p.floor) {
            std::printf("  %-8s %10s  refused: below the floor\n", b.c_str(), human_bytes(double(p.floor)).c_str());
            continue;
        }
        std::printf("  %-8s %10s %5d/%-2d %9s %7d %12s %8zu %12s %12s\n", b.c_str(), human_bytes(double(p.floor)).c_str(), p.pinned_layers(),
                    c.num_hidden_layers, p.lm_head_pinned ? "pinned" : "streamed", p.ring_slots, human_bytes(double(p.chunk_bytes)).c_str(),
                    p.expert_slots, human_bytes(double(p.trunk_read_per_token)).c_str(), human_bytes(double(p.total())).c_str());
    }
}

int main() {
    try {
        const std::string root = KIMIK3_SOURCE_DIR;
        std::printf("12.2 the real Kimi K3 (planned from fixtures/k3-release/config.json, 4096-token context)\n");
        const Config k3 = load_config(root + "/fixtures/k3-release/config.json");
        const Census s3 = config_census(k3);
        std::printf("  trunk %s in 93 layers (largest %s), lm_head %s, KDA state %s, MLA cache %s per position\n",
                    human_bytes(double(s3.trunk_bytes)).c_str(), human_bytes(double(s3.largest_layer_bytes)).c_str(),
                    human_bytes(double(s3.lm_head_bytes)).c_str(), human_bytes(double(s3.kda_state_bytes)).c_str(),
                    human_bytes(double(s3.mla_cache_bytes_per_token)).c_str());
        table(k3, s3, {"floor", "2G", "8G", "32G", "128G", "512G"});
        std::printf("  (more memory pins the largest units first: every pinned byte is a byte not read per token)\n");

        std::printf("\n12.2 the tiny K3 (every matrix is under 4 MiB, so a chunk is the largest matrix: no slot holds bytes no read can use)\n");
        const Config tiny = load_config(root + "/fixtures/tiny-k3");
        const Census st = config_census(tiny);
        table(tiny, st, {"12M", "floor", "14M", "16M", "64M"});

        std::printf("\n12.3 the ring reads rows of a streamed matrix in pieces; at K3's floor a piece of q_proj\n");
        const std::uint64_t chunk = make_plan(k3, s3, 0, PlanOptions{}).chunk_bytes;
        std::printf("  holds %llu rows of 7168 bf16 (%s): q_proj [12288, 7168] arrives in %llu pieces\n",
                    (unsigned long long)(chunk / (7168 * 2)), human_bytes(double(chunk)).c_str(),
                    (unsigned long long)((12288 + chunk / (7168 * 2) - 1) / (chunk / (7168 * 2))));
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
