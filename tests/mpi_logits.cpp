// Chapter 17's gate, run under mpirun by tests/mpi.sh at 1-4 ranks: the logits over N ranks are the
// single-process engine's, bit for bit. Usage: mpirun -np N mpi_logits THREADS
// For the tiny and little K3: (a) every rank first computes the teacher-forced logits alone (the splits
// uninstalled: the single-process engine) and checks their hash against the pinned
// fixtures/*/engine_tf_logits.hash (test 13.3); (b) the same logits over the N ranks, everything
// resident, equal them bit for bit; (c) at the smallest budget (every matrix streamed, 2 expert slots)
// too; (d) one decode step sends exactly the collectives and floats mpi_traffic counts from the config,
// and this rank receives what it counts for a rank; (e) each rank's plan (17.6, arithmetic: no MPI);
// (f) streamed, a rank reads only its rows of every split matrix; (g) it plans and pins its share alone.
// Rank 0 prints "kimik3-tests: mpi-N-ranks-tT P passed, F failed" (tests/run.sh reads it).
#include <cmath>
#include <numeric>
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

// (e) chapter 12's planner fed with each rank's share (17.6), no MPI needed: at 1 rank the share is the
// model and the plan is the single process's; at N ranks the shares add up to the model (kv_b_proj once
// per rank), each rank's trunk is its 1/N within a row per matrix, and its plan differs from one process's
// only by the bytes it does not hold; with enough budget every rank holds all of its share.
void plan_gates(int rank, const Model& m, const std::string& rel) {
    const Config& c = m.config;
    const UnitBytes whole = unit_bytes(m.tensors);
    std::uint64_t trunk = whole.lm_head, kv_b = 0, matrices = 1, row_max = whole.largest_row;
    for (std::uint64_t b : whole.layer_matrix) trunk += b;
    for (const LayerTensors& lt : m.tensors.layers) {
        for (const Checkpoint::Ref* r : lt.all) matrices += is_streamable_matrix(*r->info);
        if (lt.kv_b_proj) kv_b += lt.kv_b_proj->info->nbytes();
    }
    const std::uint64_t experts = std::uint64_t(c.num_experts) * std::uint64_t(c.moe_layer_count());
    const std::vector<RankShare> one = rank_shares(c, m.tensors, 1);
    const RankShare& o = one[0];
    check(o.units.layer_matrix == whole.layer_matrix && o.units.layer_small == whole.layer_small && o.units.lm_head == whole.lm_head &&
              o.units.largest_row == whole.largest_row && o.units.largest_matrix == whole.largest_matrix && o.trunk == trunk &&
              o.experts == experts && o.expert_bytes == experts * m.tensors.expert_bytes,
          rank, rel + ": one rank's share is the whole model");
    const std::uint64_t floor1 = make_plan(c, m.census, kBudgetFloor, PlanOptions{}, whole).floor;
    for (std::uint64_t budget : {kBudgetFloor, floor1 + (4u << 20), std::uint64_t(1) << 40}) {
        const Plan a = make_plan(c, m.census, budget, PlanOptions{}, whole), b = rank_plans(c, m.census, budget, PlanOptions{}, one)[0].plan;
        check(a.floor == b.floor && a.total() == b.total() && a.pinned == b.pinned && a.expert_slots == b.expert_slots &&
                  a.trunk_read_per_token == b.trunk_read_per_token && a.expert_read_per_token == b.expert_read_per_token,
              rank, rel + ": one rank's plan is the single process's at " + std::to_string(budget));
    }
    const Plan all1 = rank_plans(c, m.census, std::uint64_t(1) << 40, PlanOptions{}, one)[0].plan;
    for (int n : {2, 3, 4, 7}) {
        const std::vector<RankShare> shares = rank_shares(c, m.tensors, n);
        const std::vector<RankPlan> floors = rank_plans(c, m.census, kBudgetFloor, PlanOptions{}, shares);
        const std::vector<RankPlan> all = rank_plans(c, m.census, std::uint64_t(1) << 40, PlanOptions{}, shares);
        std::uint64_t sum = 0, owned = 0;
        for (int r = 0; r < n; ++r) {
            const RankShare& sh = shares[std::size_t(r)];
            const Plan& f = floors[std::size_t(r)].plan;
            const Plan& p = all[std::size_t(r)].plan;
            sum += sh.trunk, owned += sh.experts;
            const std::string at = rel + ", rank " + std::to_string(r) + " of " + std::to_string(n) + ": ";
            const double split = double(sh.trunk) - double(kv_b) - double(trunk - kv_b) / n;  // its rows, less 1/N of them
            check(std::abs(split) <= double(matrices * row_max), rank, at + "trunk share " + std::to_string(sh.trunk) + " is not 1/N of " + std::to_string(trunk));
            check(f.floor <= floor1 &&
                      f.pinned_layers() == 0 && !f.lm_head_pinned && f.trunk_read_per_token == sh.trunk + std::accumulate(sh.units.layer_reread.begin(), sh.units.layer_reread.end(), std::uint64_t(0)) +
                                                                                       m.census.embed_bytes / std::uint64_t(c.vocab_size),
                  rank, at + "at its floor it streams its share, and the floor is below one process's");
            check(all[std::size_t(r)].all_resident() && p.pinned_bytes == sh.trunk && p.expert_slots == sh.experts &&
                      p.total() - p.pinned_bytes - p.expert_bytes == all1.total() - all1.pinned_bytes - all1.expert_bytes,
                  rank, at + "with enough budget it holds all of its share and nothing else more than one process");
        }
        check(sum == trunk + std::uint64_t(n - 1) * kv_b && owned == experts, rank,
              rel + ": the " + std::to_string(n) + " shares add up to the model: " + std::to_string(sum) + " trunk bytes, " + std::to_string(owned) + " experts");
    }
}

// Trunk bytes the ring reads over `steps` decode steps at the floor (every matrix streamed, in 16 KiB
// pieces), after one step that teaches the ring its schedule.
std::uint64_t streamed_bytes(const std::string& dir, const std::vector<std::int64_t>& ids, int steps) {
    ModelOptions o;
    o.plan.chunk_bytes = 16 << 10;
    {
        Model probe(dir, ModelOptions{});
        o.budget = make_plan(probe.config, probe.census, 0, o.plan, unit_bytes(probe.tensors)).floor;
    }
    Model m(dir, o);
    Session s(m.config, 64);
    std::vector<float> logits(std::size_t(m.config.vocab_size));
    forward(logits.data(), m, s, std::span<const std::int64_t>(&ids[0], 1));
    const std::uint64_t before = m.trunk().ring_stats().bytes;
    for (int t = 1; t <= steps; ++t) forward(logits.data(), m, s, std::span<const std::int64_t>(&ids[std::size_t(t)], 1));
    return m.trunk().ring_stats().bytes - before;
}

// (f) a rank streams its rows alone: over K steps it reads K x (its share - the whole trunk) fewer bytes
// than one process (kv_b_proj whole on both, the difference exact but for pieces in flight at the ends)
void stream_gates(MpiJob& job, const std::string& dir, const std::string& rel, const std::vector<std::int64_t>& ids) {
    RowSplit* rows = row_split();
    ExpertSplit* experts = expert_split();
    row_split() = nullptr, expert_split() = nullptr;
    const int steps = 4;
    const std::uint64_t alone = streamed_bytes(dir, ids, steps);
    row_split() = rows, expert_split() = experts;
    const std::uint64_t mine = streamed_bytes(dir, ids, steps);
    Model probe(dir, ModelOptions{});
    const RankShare sh = rank_shares(probe.config, probe.tensors, job.ranks())[std::size_t(job.rank())];
    const RankShare whole = rank_shares(probe.config, probe.tensors, 1)[0];
    const double want = double(alone) - double(steps) * double(whole.trunk - sh.trunk), slack = 2.0 * 3 * (16 << 10) + 2 * 4096;
    check(std::abs(double(mine) - want) <= slack, job.rank(),
          rel + ": " + std::to_string(steps) + " steps at the floor streamed " + std::to_string(mine) + " bytes on this rank, " + std::to_string(alone) +
              " alone; its share says " + std::to_string(std::uint64_t(want)));
}

// (g) a rank plans and pins its share alone: its Model's plan is rank_plans' plan for it (at the floor, at
// a budget in between and everything resident), and resident it reads at start exactly its share's matrix
// bytes where one process reads the whole trunk's (the small tensors and the embedding alike on both).
void share_gates(MpiJob& job, const std::string& dir, const std::string& rel) {
    RowSplit* rows = row_split();
    ExpertSplit* experts = expert_split();
    row_split() = nullptr, expert_split() = nullptr;
    Model alone(dir, ModelOptions{});
    row_split() = rows, expert_split() = experts;
    const std::vector<RankShare> shares = rank_shares(alone.config, alone.tensors, job.ranks());
    const RankShare& sh = shares[std::size_t(job.rank())];
    const RankShare whole = rank_shares(alone.config, alone.tensors, 1)[0];
    Model mine(dir, ModelOptions{});
    const std::uint64_t a = alone.trunk().stats().startup_bytes, b = mine.trunk().stats().startup_bytes;
    check(b + (whole.trunk - sh.trunk) == a, job.rank(),
          rel + ": resident, this rank read " + std::to_string(b) + " bytes at start, one process " + std::to_string(a) + "; its share holds " +
              std::to_string(whole.trunk - sh.trunk) + " bytes of matrix rows fewer");
    check(mine.plan.expert_slots == sh.experts, job.rank(), rel + ": resident, the expert cache has a slot for each owned expert");
    const std::uint64_t floor = rank_plans(alone.config, alone.census, 0, PlanOptions{}, shares)[std::size_t(job.rank())].plan.floor;
    for (std::uint64_t budget : {floor, floor + (sh.trunk / 2)}) {
        ModelOptions o;
        o.budget = budget;
        Model m(dir, o);
        const Plan want = rank_plans(m.config, m.census, budget, o.plan, shares)[std::size_t(job.rank())].plan;
        check(m.plan.pinned == want.pinned && m.plan.lm_head_pinned == want.lm_head_pinned && m.plan.pinned_bytes == want.pinned_bytes &&
                  m.plan.expert_slots == want.expert_slots,
              job.rank(), rel + ": at " + std::to_string(budget) + " bytes this rank's Model plans as rank_plans says (pins " +
                              std::to_string(m.plan.pinned_layers()) + " layers, " + std::to_string(m.plan.pinned_bytes) + " bytes; rank_plans " +
                              std::to_string(want.pinned_layers()) + ", " + std::to_string(want.pinned_bytes) + ")");
        check(m.trunk().stats().startup_bytes <= b, job.rank(), rel + ": a smaller budget reads no more at start");
    }
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

    plan_gates(job.rank(), probe, rel);  // (e)
    stream_gates(job, dir, rel, ids);    // (f)
    share_gates(job, dir, rel);          // (g)

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
    // what this rank received: every product's rows but its own, and of the expert exchange what it does not own
    const MpiTraffic mine = mpi_traffic(probe.config, job.rank(), job.ranks());
    const Config& c = probe.config;
    const std::uint64_t exchange = job.ranks() > 1 ? std::uint64_t(c.moe_layer_count() * c.num_experts_per_token * c.routed_expert_hidden_size) : 0;
    const std::uint64_t got = after.floats_received - before.floats_received;
    check(got <= mine.received && got + exchange >= mine.received, job.rank(),
          rel + ": one step received " + std::to_string(got) + " floats; mpi_traffic says at most " + std::to_string(mine.received) + ", at least " +
              std::to_string(mine.received - exchange));
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
