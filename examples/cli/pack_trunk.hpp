// kimik3 pack-trunk MODEL_DIR [OUT_DIR]: every layer's non-expert tensors into one aligned trunk.bin.
#pragma once

#include "common.hpp"

namespace kimik3::cli {

inline const char* kPackTrunkUsage =
    "usage: kimik3 pack-trunk MODEL_DIR [OUT_DIR]\n"
    "\n"
    "Copies each layer's non-expert tensors (attention, norms, AttnRes, router, latent and shared FFN)\n"
    "verbatim into OUT_DIR/trunk.bin (default MODEL_DIR), one 4096-aligned run per layer, and describes it\n"
    "in OUT_DIR/trunk.json (per layer its offset, size and hash; per tensor its offset, size, dtype, shape).\n"
    "`kimik3 run --trunk OUT_DIR` then streams the trunk from that file, with the same results. Refuses a\n"
    "layer whose tensors are not one contiguous run in one shard; re-reads what it wrote to verify it; writes\n"
    "trunk.json last, so an interrupted pack never leaves a trunk that looks complete.\n";

inline int cmd_pack_trunk(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kPackTrunkUsage, stdout), kExitOk;
    if (args.empty() || args.size() > 2) throw Usage(std::string("pack-trunk takes MODEL_DIR [OUT_DIR]\n\n") + kPackTrunkUsage);
    for (const std::string& a : args)
        if (a.rfind("-", 0) == 0) throw Usage("unknown option '" + a + "'\n\n" + kPackTrunkUsage);
    const std::string dir = args[0], out = args.size() == 2 ? args[1] : args[0];
    const Config c = load_config(dir);
    Checkpoint ck(dir);
    const ModelTensors m = bind_tensors(ck, c);
    const Census s = take_census(ck, c, m);
    std::fprintf(stderr, "packing %s of trunk (%d layers) into %s/trunk.bin\n", human_bytes(double(s.trunk_bytes)).c_str(),
                 c.num_hidden_layers, out.c_str());
    int last = -1;
    const auto t0 = std::chrono::steady_clock::now();
    const TrunkLayout t = pack_trunk(m, out, [&](const std::string& what, std::uint64_t done, std::uint64_t total) {
        const int pct = int(100 * done / std::max<std::uint64_t>(total, 1));
        if (pct != last || done == total) {
            last = pct;
            std::fprintf(stderr, "\r  %-6s %3d%% (%s of %s)", what.c_str(), pct, human_bytes(double(done)).c_str(), human_bytes(double(total)).c_str());
            if (done == total) std::fputc('\n', stderr);
        }
    });
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("wrote %s/trunk.bin (%s, %zu layers, verified) and %s/trunk.json in %.1f s\n", out.c_str(),
                human_bytes(double(t.file_bytes)).c_str(), t.layers.size(), out.c_str(), sec);
    return kExitOk;
}

}  // namespace kimik3::cli
