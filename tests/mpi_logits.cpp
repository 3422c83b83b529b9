// Chapter 17's gate, run under mpirun by tests/mpi.sh at 1-4 ranks: the logits over N ranks are the
// single-process engine's, bit for bit. Usage: mpirun -np N mpi_logits THREADS
// For the tiny and little K3: (a) every rank first computes the teacher-forced logits alone (the splits
// uninstalled: the single-process engine) and checks their hash against the pinned
// fixtures/*/engine_tf_logits.hash (test 13.3); (b) the same logits over the N ranks, everything
// resident, equal them bit for bit; (c) at the smallest budget (every matrix streamed, 2 expert slots)
// too; (d) one decode step sends exactly the collectives and floats mpi_traffic counts from the config.
// Rank 0 prints "kimik3-tests: mpi-N-ranks-tT P passed, F failed" (tests/run.sh reads it).
#include <cstdio>
#include <fstream>

#include "../chapters/17_mpi.hpp"

using namespace kimik3;

namespace {

int g_passed = 0, g_failed = 0;

void check(bool ok, int rank, const std::string& what) {
    ++(ok ? g_passed : g_failed);
    if (!ok) std::fprintf(stderr, "FAILED on rank %d: %s\n", rank, what.c_str());
}

std::string hex(std::uint64_t h) {
    char s[32];
    std::snprintf(s, sizeof s, "%016llx", (unsigned long long)h);
    return s;
}

std::uint64_t hash_of(const std::vector<float>& v) { return hash_bytes(reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)); }

std::vector<float> tf(const std::string& dir, const ModelOptions& o, const std::vector<std::int64_t>& ids) {
    Model m(dir, o);
    Session s(m.config, 64);
    return teacher_force(m, s, ids, 32);
}

void gates(MpiJob& job, const std::string& rel) {
    const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/" + rel;
    const std::vector<std::int64_t> ids = to_i64(SafetensorsFile(dir + "/reference/model.safetensors").read("tf_ids"));
    std::string want;
    std::ifstream(dir + "/engine_tf_logits.hash") >> want;
    RowSplit* rows = row_split();
    ExpertSplit* experts = expert_split();
    row_split() = nullptr, expert_split() = nullptr;  // (a) the single-process engine
    const std::vector<float> alone = tf(dir, ModelOptions{}, ids);
    row_split() = rows, expert_split() = experts;
    check(hex(hash_of(alone)) == want, job.rank(), rel + ": alone, hash " + hex(hash_of(alone)) + ", pinned " + want);

    const std::vector<float> spread = tf(dir, ModelOptions{}, ids);  // (b)
    check(spread == alone && hash_of(spread) == hash_of(alone), job.rank(), rel + ": resident over the ranks, hash " + hex(hash_of(spread)));

    Model probe(dir, ModelOptions{});  // (c) the floor: every matrix streamed
    ModelOptions floor;
    floor.budget = make_plan(probe.config, probe.census, 0, floor.plan, unit_bytes(probe.tensors)).floor;
    const std::vector<float> streamed = tf(dir, floor, ids);
    check(hash_of(streamed) == hash_of(alone), job.rank(), rel + ": at the floor over the ranks, hash " + hex(hash_of(streamed)));

    Session s(probe.config, 64);  // (d) one decode step's traffic
    std::vector<float> logits(std::size_t(probe.config.vocab_size));
    const std::int64_t id = ids[0];
    const MpiStats before = job.stats();
    forward(logits.data(), probe, s, std::span<const std::int64_t>(&id, 1));
    const MpiStats after = job.stats();
    const MpiTraffic t = mpi_traffic(probe.config);
    check(after.collectives - before.collectives == t.collectives && after.floats_gathered - before.floats_gathered == t.floats, job.rank(),
          rel + ": one step sent " + std::to_string(after.collectives - before.collectives) + " collectives, " +
              std::to_string(after.floats_gathered - before.floats_gathered) + " floats; mpi_traffic says " + std::to_string(t.collectives) + ", " +
              std::to_string(t.floats));
}

}  // namespace

int main(int argc, char** argv) {
    MpiJob job(&argc, &argv);
    const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
    set_threads(threads);
    parallel_min_work() = 1;  // split even the tiny model's matrices over the threads
    try {
        for (const char* rel : {"fixtures/tiny-k3", "fixtures/little-k3"}) gates(job, rel);
    } catch (const std::exception& e) {
        job.abort(e.what(), 1);
    }
    int mine[2] = {g_passed, g_failed};
    std::vector<int> all(std::size_t(job.ranks()) * 2);
    MPI_Gather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, 0, MPI_COMM_WORLD);
    if (job.rank() == 0) {
        int p = 0, f = 0;
        for (int r = 0; r < job.ranks(); ++r) p += all[std::size_t(r) * 2], f += all[std::size_t(r) * 2 + 1];
        std::printf("kimik3-tests: mpi-%d-ranks-t%d %d passed, %d failed\n", job.ranks(), threads, p, f);
    }
    return g_failed == 0 ? 0 : 1;
}
