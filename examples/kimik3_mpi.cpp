// kimik3-mpi: kimik3 run over N MPI ranks (chapter 17), and the cost model's table.
//
//   mpirun -np N kimik3-mpi run MODEL_DIR ...   kimik3 run's options; every rank computes its share, rank 0 prints
//   kimik3-mpi plan MODEL_DIR --ranks N          each rank's rows, experts and traffic
//   kimik3-mpi cost [CONFIG_JSON]               projected seconds per token of a config on 2-16 machines
//
// A separate program (make build/g++/kimik3-mpi, built with mpicxx) so that kimik3 itself needs no MPI.
// Ranks other than 0 write nothing to stdout or stderr, except the one line that names a fault.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.hpp"
#include "cli/run.hpp"
#include "../chapters/17_mpi.hpp"

using namespace kimik3;
using namespace kimik3::cli;

namespace {

constexpr const char* kUsage =
    "usage: mpirun -np N kimik3-mpi run MODEL_DIR [kimik3 run's options]\n"
    "       kimik3-mpi plan MODEL_DIR --ranks N   what each rank computes and holds, and the traffic per token\n"
    "       kimik3-mpi cost [CONFIG_JSON]   (default fixtures/k3-release/config.json)\n"
    "environment: KIMIK3_MPI_STATS=1 makes rank 0 print each rank's messages, floats and MPI seconds\n";

int cost(const std::string& path) {
    const Config c = load_config(path);
    std::printf("%s: %s", path.c_str(), describe_cost(c, config_census(c)).c_str());
    return kExitOk;
}

int plan(const std::string& dir, int ranks) {
    if (ranks < 1 || ranks > 4096) throw Usage("--ranks " + std::to_string(ranks) + " is outside 1..4096\n");
    const Config c = load_config(dir);
    Checkpoint ck(dir);
    const ModelTensors m = bind_tensors(ck, c);
    const std::vector<RankShareBytes> shares = rank_shares(m, ranks);
    const MpiTraffic t = mpi_traffic(c);
    std::printf("the split of %s over %d ranks: each computes its rows of every matrix and the experts it owns\n", dir.c_str(), ranks);
    std::printf("%6s %18s %16s %16s\n", "rank", "matrix rows", "experts owned", "expert bytes");
    for (int r = 0; r < ranks; ++r)
        std::printf("%6d %18s %16llu %16s\n", r, human_bytes(double(shares[std::size_t(r)].trunk)).c_str(),
                    (unsigned long long)shares[std::size_t(r)].experts, human_bytes(double(shares[std::size_t(r)].expert_bytes)).c_str());
    std::printf("per token: %llu gathers, %.1f kB gathered, a rank receiving %.1f kB of it\n", (unsigned long long)t.collectives,
                double(t.floats) * 4 / 1e3, double(t.floats) * 4 / 1e3 * (ranks - 1) / ranks);
    return kExitOk;
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
            const std::string ranks = take_option(args, "--ranks", kUsage);
            if (args.size() != 2 || ranks.empty()) throw Usage(std::string("plan takes MODEL_DIR and --ranks N\n") + kUsage);
            return plan(args[1], int(parse_count(ranks, "--ranks", kUsage, 4096)));
        } catch (const Usage& e) {
            return std::fprintf(stderr, "kimik3-mpi plan: %s", e.what()), kExitUsage;
        } catch (const Error& e) {
            return std::fprintf(stderr, "kimik3-mpi plan: error: %s\n", e.what()), exit_code(e);
        }
    }
    if (args[0] != "run") return std::fprintf(stderr, "kimik3-mpi: unknown command '%s'\n%s", args[0].c_str(), kUsage), kExitUsage;
    args.erase(args.begin());
    MpiJob job(&argc, &argv);
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
        rc = cmd_run(args);
    } catch (const Usage& e) {
        job.abort(std::string("run: ") + e.what(), kExitUsage);
    } catch (const Error& e) {
        job.abort(std::string("run: error: ") + e.what(), exit_code(e));
    } catch (const std::exception& e) {
        job.abort(std::string("run: error: ") + e.what(), kExitRuntime);
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
