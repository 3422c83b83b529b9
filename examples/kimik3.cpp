// kimik3: the command-line program. Each command lives in examples/cli/NAME.hpp; this file only
// dispatches and turns errors into exit codes (see cli/common.hpp).
//
//   kimik3 inspect MODEL_DIR        config summary, layer schedule and census of a checkpoint
//   kimik3 run MODEL_DIR --ids ...  the model at a memory budget, with a report
//   kimik3 chat MODEL_DIR           a conversation that carries the model's state across turns
//   kimik3 serve MODEL_DIR          the OpenAI chat API over HTTP, and a page that shows the model at work
//   kimik3 tokenize, detokenize     text to ids and back
//   kimik3 plan, pack-trunk, simulate-cache, synth
//   kimik3 --help | help CMD
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cli/common.hpp"
#include "cli/inspect.hpp"
#include "cli/pack_trunk.hpp"
#include "cli/plan.hpp"
#include "cli/run.hpp"
#include "cli/serve.hpp"
#include "cli/simulate_cache.hpp"
#include "cli/synth.hpp"
#include "cli/text.hpp"

using namespace kimik3;
using namespace kimik3::cli;

namespace {

struct Command {
    int (*run)(std::vector<std::string>);
    const char* usage;
    const char* summary;
};

const std::map<std::string, Command>& commands() {
    static const std::map<std::string, Command> c = {
        {"inspect", {cmd_inspect, kInspectUsage, "print the config summary, the layer schedule and a census of the checkpoint"}},
        {"run", {cmd_run, kRunUsage, "run the model on ids or a prompt at a memory budget, with a report"}},
        {"plan", {cmd_plan, kPlanUsage, "print the memory plan for a model (or a config) at a budget"}},
        {"pack-trunk", {cmd_pack_trunk, kPackTrunkUsage, "copy every layer's non-expert tensors into one aligned trunk.bin"}},
        {"chat", {cmd_chat, kChatUsage, "a multi-turn conversation that carries the model's state from turn to turn"}},
        {"serve", {cmd_serve, kServeUsage, "an OpenAI-compatible HTTP server, with a page that shows each token's experts"}},
        {"tokenize", {cmd_tokenize, kTokenizeUsage, "print the token ids of a text"}},
        {"detokenize", {cmd_detokenize, kDetokenizeUsage, "print the text of token ids"}},
        {"synth", {cmd_synth, kSynthUsage, "write a K3-shaped checkpoint (real widths, fewer layers and experts) for benchmarks"}},
        {"simulate-cache", {cmd_simulate_cache, kSimulateCacheUsage, "replay an expert trace under LRU, LFU and Belady at several sizes"}},
    };
    return c;
}

std::string usage() {
    std::string u = "usage: kimik3 COMMAND [ARGS]   (kimik3 help COMMAND for details)\n\ncommands:\n";
    for (const auto& [name, c] : commands()) {
        char line[200];
        std::snprintf(line, sizeof line, "  %-16s %s\n", name.c_str(), c.summary);
        u += line;
    }
    return u + "\nexit codes: 0 ok, 1 runtime failure, 2 usage error or refused config/checkpoint,\n"
               "            3 memory budget refused, 4 a weight read failed\n"
               "\nenvironment: KIMIK3_SCALAR=1 runs the reference kernels (the same bits, slowly);\n"
               "             KIMIK3_ISA=xsimd|neon|avx2|avx512 caps the kernels picked for this CPU;\n"
               "             OMP_NUM_THREADS=N the default thread count\n";
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (args.empty()) return std::fputs(usage().c_str(), stderr), kExitUsage;
    if (args[0] == "--help" || args[0] == "-h" || (args[0] == "help" && args.size() == 1))
        return std::fputs(usage().c_str(), stdout), kExitOk;
    const std::string cmd = args[0] == "help" ? args[1] : args[0];
    const auto it = commands().find(cmd);
    if (it == commands().end()) {
        std::fprintf(stderr, "kimik3: unknown command '%s'\n\n%s", cmd.c_str(), usage().c_str());
        return kExitUsage;
    }
    if (args[0] == "help") return std::fputs(it->second.usage, stdout), kExitOk;
    args.erase(args.begin());
    try {
        (void)kernel_isa();  // a bad KIMIK3_ISA is refused here, before any work
        return it->second.run(args);
    } catch (const Usage& e) {
        std::fprintf(stderr, "kimik3 %s: %s", cmd.c_str(), e.what());
        return kExitUsage;
    } catch (const Error& e) {
        std::fprintf(stderr, "kimik3 %s: error: %s\n", cmd.c_str(), e.what());
        switch (e.kind) {
            case ErrorKind::usage:
            case ErrorKind::format: return kExitUsage;
            case ErrorKind::budget: return kExitBudget;
            case ErrorKind::io: return kExitRead;
            case ErrorKind::runtime: return kExitRuntime;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kimik3 %s: error: %s\n", cmd.c_str(), describe_exception(e).c_str());
    }
    return kExitRuntime;
}
