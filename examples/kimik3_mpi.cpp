// kimik3-mpi: kimik3 run over N MPI ranks (chapter 17), and the cost model's table.
//
//   mpirun -np N kimik3-mpi run MODEL_DIR ...   kimik3 run's options; every rank computes its share, rank 0 prints
//   mpirun -np N kimik3-mpi chat MODEL_DIR ...  kimik3 chat's: rank 0 reads each line and sends it to every rank
//   kimik3-mpi plan MODEL_DIR --ranks N [--budget SIZE]   each rank's share, and its plan at a budget
//   kimik3-mpi cost [CONFIG_JSON]               projected seconds per token of a config on 2-16 machines
//
// A separate program (make build/g++/kimik3-mpi, built with mpicxx) so that kimik3 itself needs no MPI.
// Ranks other than 0 write nothing to stdout or stderr, except the one line that names a fault.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cli/common.hpp"
#include "cli/run.hpp"
#include "cli/text.hpp"
#include "../chapters/17_mpi.hpp"

using namespace kimik3;
using namespace kimik3::cli;

namespace {

constexpr const char* kUsage =
    "usage: mpirun -np N kimik3-mpi run MODEL_DIR [kimik3 run's options]\n"
    "       mpirun -np N kimik3-mpi chat MODEL_DIR [kimik3 chat's options]   (rank 0 reads the lines; Ctrl-C ends\n"
    "           the job; no /save or /load)\n"
    "       kimik3-mpi plan (MODEL_DIR | --config CONFIG.json) --ranks N [--budget SIZE|floor] [--context N]\n"
    "           what each rank computes and holds, its floor, the budget that holds all of its share, and the\n"
    "           traffic per token; with --budget, each rank's plan at that budget (resident, streamed, messages)\n"
    "       kimik3-mpi cost [CONFIG_JSON]   (default fixtures/k3-release/config.json)\n"
    "environment: KIMIK3_MPI_STATS=1 makes rank 0 print each rank's messages, floats and MPI seconds\n";

int cost(const std::string& path) {
    const Config c = load_config(path);
    std::printf("%s: %s", path.c_str(), describe_cost(c, config_census(c)).c_str());
    return kExitOk;
}

// The smallest budget at which every one of a rank's bytes is resident (bisection over make_plan).
std::uint64_t resident_from(const Config& c, const Census& s, const PlanOptions& o, const RankShare& sh) {
    auto resident = [&](std::uint64_t b) {
        const Plan p = rank_plans(c, s, b, o, {sh})[0].plan;
        return p.budget >= p.floor && RankPlan{sh, p}.all_resident();
    };
    std::uint64_t lo = rank_plans(c, s, kBudgetFloor, o, {sh})[0].plan.floor, hi = std::uint64_t(1) << 62;
    if (resident(lo)) return lo;
    while (hi - lo > 1) {  // resident(hi), not resident(lo)
        const std::uint64_t mid = lo + (hi - lo) / 2;
        (resident(mid) ? hi : lo) = mid;
    }
    return hi;
}

int plan(const std::string& model, const std::string& config_path, int ranks, const std::string& budget, const std::string& context) {
    if (ranks < 1 || ranks > 4096) throw Usage("--ranks " + std::to_string(ranks) + " is outside 1..4096\n");
    const Config c = load_config(config_path.empty() ? model : config_path);
    Census s;
    std::vector<RankShare> shares;
    if (config_path.empty()) {
        Checkpoint ck(model);
        const ModelTensors m = bind_tensors(ck, c);
        s = take_census(ck, c, m), shares = rank_shares(c, m, ranks);
    } else {
        s = config_census(c), shares = rank_shares(c, s, ranks);
    }
    PlanOptions o;
    if (!context.empty()) o.context = std::uint64_t(parse_count(context, "--context", kUsage, kMaxPositions));
    const std::vector<RankPlan> floors = rank_plans(c, s, kBudgetFloor, o, shares);
    std::printf("the split of %s over %d ranks: each computes its rows of every matrix and the experts it owns\n",
                (config_path.empty() ? model : config_path).c_str(), ranks);
    std::printf("%6s %18s %16s %16s %12s %16s\n", "rank", "matrix rows", "experts owned", "expert bytes", "floor", "all resident at");
    for (int r = 0; r < ranks; ++r) {
        const RankShare& sh = shares[std::size_t(r)];
        std::printf("%6d %18s %16llu %16s %12s %16s\n", r, human_bytes(double(sh.trunk)).c_str(), (unsigned long long)sh.experts,
                    human_bytes(double(sh.expert_bytes)).c_str(), human_bytes(double(floors[std::size_t(r)].plan.floor)).c_str(),
                    human_bytes(double(resident_from(c, s, o, sh))).c_str());
    }
    const MpiTraffic t = mpi_traffic(c);
    std::printf("per token: %llu gathers, %.1f kB gathered, a rank receiving %.1f kB of it\n", (unsigned long long)t.collectives,
                double(t.floats) * 4 / 1e3, double(t.floats) * 4 / 1e3 * (ranks - 1) / ranks);
    if (budget.empty()) return kExitOk;
    const std::uint64_t b = budget == "floor" ? kBudgetFloor : parse_size(budget);
    const std::vector<RankPlan> plans = rank_plans(c, s, b, o, shares);
    for (int r = 0; r < ranks; ++r)
        if (plans[std::size_t(r)].plan.budget < plans[std::size_t(r)].plan.floor)
            fail(ErrorKind::budget, "rank " + std::to_string(r) + " of " + std::to_string(ranks) + ": " + plan_error_floor(plans[std::size_t(r)].plan));
    std::printf("each rank at %s (chapter 12's plan of its share; what it streams per token, from its own disk)\n",
                budget == "floor" ? "its floor" : ("a budget of " + human_bytes(double(b))).c_str());
    std::printf("%6s %12s %10s %8s %10s %14s %14s %10s %14s %6s\n", "rank", "resident", "layers", "lm_head", "experts", "trunk/token",
                "experts/token", "messages", "received", "all");
    for (int r = 0; r < ranks; ++r) {
        const RankPlan& rp = plans[std::size_t(r)];
        const MpiTraffic mine = mpi_traffic(c, r, ranks);
        std::printf("%6d %12s %6d/%-3d %8s %5zu/%-4llu %14s %14s %10llu %14s %6s\n", r, human_bytes(double(rp.plan.total())).c_str(),
                    rp.plan.pinned_layers(), c.num_hidden_layers, rp.plan.lm_head_pinned ? "pinned" : "streamed", rp.plan.expert_slots,
                    (unsigned long long)rp.share.experts, human_bytes(double(rp.plan.trunk_read_per_token)).c_str(),
                    human_bytes(rp.expert_streamed(c.num_experts_per_token)).c_str(), (unsigned long long)mine.collectives,
                    human_bytes(double(mine.received) * 4).c_str(), rp.all_resident() ? "yes" : "no");
    }
    std::printf("(layers: pinned of all; experts: cache slots / experts owned; experts/token: expected with uniform routing, at most\n"
                " %s; messages: collectives per token; received: floats from the other ranks, at most)\n",
                human_bytes(double(plans[0].plan.expert_read_per_token)).c_str());
    return kExitOk;
}

// For tests only: KIMIK3_TEST_MEMORY_MB=N lets this process's address space grow by N MB past what it has
// once MPI is up (RLIMIT_AS), so that a rank runs out of memory while the model loads, the same way on
// any machine, to check that the job ends naming the rank and the cause.
void test_memory_limit() {
    const char* mb = std::getenv("KIMIK3_TEST_MEMORY_MB");
    if (!mb) return;
    std::ifstream status("/proc/self/status");
    std::uint64_t kb = 0;
    for (std::string line; std::getline(status, line);)
        if (line.rfind("VmSize:", 0) == 0) kb = std::strtoull(line.c_str() + 7, nullptr, 10);
    const rlim_t limit = rlim_t(kb * 1024 + std::strtoull(mb, nullptr, 10) * 1024 * 1024);
    const rlimit r{limit, limit};
    setrlimit(RLIMIT_AS, &r);
}

int exit_code(const Error& e) {
    switch (e.kind) {
        case ErrorKind::usage:
        case ErrorKind::format: return kExitUsage;
        case ErrorKind::budget: return kExitBudget;
        case ErrorKind::io: return kExitRead;
        case ErrorKind::runtime: return kExitRuntime;
    }
    return kExitRuntime;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (args.empty()) return std::fputs(kUsage, stderr), kExitUsage;
    if (args[0] == "--help" || args[0] == "-h") return std::fputs(kUsage, stdout), kExitOk;
    if (args[0] == "cost") {
        try {
            return cost(args.size() > 1 ? args[1] : std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json");
        } catch (const std::exception& e) {
            return std::fprintf(stderr, "kimik3-mpi cost: error: %s\n", e.what()), kExitUsage;
        }
    }
    if (args[0] == "plan") {
        try {
            const std::string ranks = take_option(args, "--ranks", kUsage), config = take_option(args, "--config", kUsage),
                              budget = take_option(args, "--budget", kUsage), context = take_option(args, "--context", kUsage);
            if (args.size() != (config.empty() ? 2u : 1u) || ranks.empty())
                throw Usage(std::string("plan takes MODEL_DIR (or --config CONFIG.json) and --ranks N\n") + kUsage);
            return plan(config.empty() ? args[1] : "", config, int(parse_count(ranks, "--ranks", kUsage, 4096)), budget, context);
        } catch (const Usage& e) {
            return std::fprintf(stderr, "kimik3-mpi plan: %s", e.what()), kExitUsage;
        } catch (const Error& e) {
            return std::fprintf(stderr, "kimik3-mpi plan: error: %s\n", e.what()), exit_code(e);
        }
    }
    if (args[0] != "run" && args[0] != "chat") return std::fprintf(stderr, "kimik3-mpi: unknown command '%s'\n%s", args[0].c_str(), kUsage), kExitUsage;
    const std::string command = args[0];
    args.erase(args.begin());
    MpiJob job(&argc, &argv);
    test_memory_limit();
    if (job.rank() != 0) {  // rank 0 alone prints and writes files; a fault still reaches the terminal (MpiJob::abort)
        for (const char* file : {"--dump-logits", "--trace-experts", "--out"})
            for (std::size_t i = 0; i + 1 < args.size(); ++i)
                if (args[i] == file) args.erase(args.begin() + std::ptrdiff_t(i), args.begin() + std::ptrdiff_t(i) + 2);
        const int null = open("/dev/null", O_WRONLY);
        job.keep_stderr(dup(2));
        dup2(null, 1), dup2(null, 2), close(null);
    }
    int rc = kExitOk;
    try {
        (void)kernel_isa();
        if (command == "run") {
            rc = cmd_run(args);
        } else {
            ChatIO io{.read_line = [&job](std::string& line) { return job.share_line(line, job.rank() == 0 && bool(std::getline(std::cin, line))); },
                      .files = false, .interrupts = false};
            rc = cmd_chat_with(args, io);
        }
    } catch (const Usage& e) {
        job.abort(command + ": " + e.what(), kExitUsage);
    } catch (const Error& e) {
        job.abort(command + ": error: " + e.what(), exit_code(e));
    } catch (const std::exception& e) {
        job.abort(command + ": error: " + describe_exception(e), kExitRuntime);
    }
    if (std::getenv("KIMIK3_MPI_STATS")) {
        const MpiStats st = job.stats();
        std::vector<double> all(std::size_t(job.ranks()) * 4);
        const double mine[4] = {double(st.collectives), double(st.floats_gathered), double(st.floats_received), st.seconds};
        MPI_Gather(mine, 4, MPI_DOUBLE, all.data(), 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        for (int r = 0; job.rank() == 0 && r < job.ranks(); ++r)
            std::fprintf(stderr, "mpi rank %d of %d: %.0f collectives, %.0f floats gathered, %.0f received, %.3f s in MPI\n", r, job.ranks(),
                         all[std::size_t(r) * 4], all[std::size_t(r) * 4 + 1], all[std::size_t(r) * 4 + 2], all[std::size_t(r) * 4 + 3]);
    }
    return rc;
}
