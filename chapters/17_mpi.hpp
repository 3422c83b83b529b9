// kimik3 chapter 17: the model over MPI -- N processes (one per machine), the same bits as one.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   How to spread one token's work over N ranks so that every rank count gives the single process's
//   logits bit for bit, and each token gets faster as ranks are added. The rule is chapter 00's rule
//   for threads, one level up: ranks split OUTPUTS, never a sum.
//     trunk    every matrix product y = W x (chapter 04's `linear`, chapter 08's) is split by contiguous
//              output rows: rank r computes rows [R r / N, R (r+1) / N) of W (uneven splits included, a
//              rank may get none), then one MPI_Allgatherv copies every rank's rows to every rank. A row's
//              dot product is computed whole on one rank, by the same kernel, so its bits are those of
//              the single process; the gather only copies.
//     experts  each (layer, expert) has one owner, (expert + layer) mod N. A rank runs only the routed
//              experts it owns, over every token that chose them; one MPI_Allgatherv per MoE layer copies
//              each slot's (T, K, L) output from its owner, and every rank then combines the K slots in
//              slot order exactly as chapter 10 does (the combine is the only sum, and it is never split).
//   Everything else (norms, AttnRes, the KDA recurrence, MLA's attention over the cache, the routing)
//   is small and runs replicated on every rank, on identical inputs, so every rank holds the same state.
//
// WHY NOT A LAYER PIPELINE
//   Giving each rank a block of layers divides memory but not time: a token still visits every layer in
//   order, so with one sequence only one rank works at a time and a token costs what it costs on one
//   machine plus N - 1 hops. Splitting each matrix's rows divides the bytes every rank reads per token
//   (the cost of decoding: memory and disk bandwidth, chapter 12) by N, so per-token time falls with N.
//   The price is messages: one collective per matrix product instead of one hop per rank.
//
// MESSAGES AND BYTES PER TOKEN (counted by `mpi_traffic` below from the config; the test compares the
//   count with what the split measures)
//   collectives = KDA layers x 8 + MLA layers x 5 + dense layers x 3 + MoE layers x (3 + 3 shared + 1
//   expert exchange) + 1 (lm_head); at K3: 69 x 8 + 24 x 5 + 1 x 3 + 92 x 7 + 1 = 1,320 per token.
//   floats gathered = the sum of every product's output rows (+ K L per MoE layer): 14.1 M at K3 =
//   56.4 MB per token, of which a rank receives (N - 1) / N. A ring allgather takes N - 1 steps, so the
//   latency term is 1,320 x (N - 1) x alpha.
//
// MEASURED (loopback, one 2-core machine shared with a training run and a compiler, load average 2-5:
//   ranks oversubscribe the cores, so the times say what waiting for a descheduled rank costs, not what
//   N machines would do; little-k3, 16 decode steps after a 24-token prompt, 1 thread per rank, the
//   difference of --gen 17 and --gen 1 runs of kimik3-mpi with KIMIK3_MPI_STATS=1, divided by 16)
//   ranks   collectives/token   floats gathered/token   received by rank 0   decode s/token   MPI s/token
//     1            123              24,264 (97 kB)              0                0.007            0.000
//     2            123              24,264                 12,204 (49 kB)        0.041            0.017
//     3            123              24,264                 16,160 (65 kB)        0.008           <0.001
//     4            123              24,264                 18,216 (73 kB)        0.226            0.230
//   123 = mpi_traffic(little-k3) exactly (the test checks it). The little K3 computes a token in 7 ms,
//   so only the messages show here; per-token speed-up needs a model whose reads dominate (the cost model).
//   The K3-shaped checkpoint (kimik3 synth: K3's widths, 4 layers, 64 experts per MoE layer, 13.75 GB),
//   every rank at its floor, reading its rows from the one shared disk (--gen 3 minus --gen 1, over 2):
//   ranks   collectives/token   floats gathered/token   received by rank 0   read per rank/token   s/token
//     1             54              747,936 (2.99 MB)           0                  8.90 GB           5.17
//     2             54              747,936                363,216 (1.45 MB)       4.53 GB           4.93
//     3             54              747,936                498,633 (1.99 MB)       3.01 GB           5.72
//     4             54              747,936                553,784 (2.22 MB)       2.30 GB           5.12
//   54 gathers and 2.99 MB are what mpi_traffic and `kimik3-mpi plan` give for it. Each rank reads 1/N of
//   the bytes, but here the N ranks share one disk, so a token still waits for all 8.9 GB of it (rank 0
//   spends 1.3-2.4 s per token in MPI, waiting for the others' reads); with a disk per machine the read
//   time divides by N, which is what the cost model below assumes.
//
// COST MODEL (mpi_cost, `kimik3-mpi cost`: full K3, N machines of 24 GB, each pinning 1/N of the rows of
//   the 111.2 GB trunk + lm_head and caching what else fits of its 1/N of the 1,446.5 GB of experts;
//   assumed per machine 20 GB/s memory, 3 GB/s NVMe, 1.5 GB reserved; per message step alpha = 20 us at
//   10 GbE, 15 us at 25 GbE, 10 us at 100 GbE; seconds per token)
//   machines  expert hits  trunk  experts  comm (10 GbE)  total 10 GbE  25 GbE  100 GbE
//       1         0%       5.558   8.610      0.000          14.168     14.168   14.168
//       2         0%       2.779   4.305      0.049           7.133      7.113    7.099
//       4         0%       1.390   2.152      0.113           3.655      3.615    3.585
//       8       4.8%       0.695   1.025      0.224           1.944      1.874    1.816
//      16      17.2%       0.347   0.446      0.438           1.231      1.107    0.995
//   (one machine cannot hold the trunk in 24 GB: its row is what the same arithmetic gives.) At 16
//   machines the 1,320 x 15 message steps cost as much as the reads: fusing the products that share an
//   input (KDA's q, k, v, g, f_a, b; MoE's router and latent_down) into one gather is the next saving.
//
// EACH RANK'S PLAN (17.6, `kimik3-mpi plan MODEL --ranks N --budget SIZE`; arithmetic only, no MPI)
//   rank_shares gives each rank's share in chapter 12's units: its rows of every matrix (kv_b_proj and the
//   small tensors whole), its owned experts as the most the expert cache may hold (UnitBytes::experts);
//   make_plan decides what of that share the rank pins at its own budget and what it streams. K3 (--config
//   fixtures/k3-release/config.json), 8 ranks at 24 GB: each rank's share is 14.42 GB of matrix rows and
//   10,304 experts (180.8 GB); its plan pins all 93 layers and the lm_head and caches 471 of its experts
//   (one process at 24 GB pins 15 of 93 layers). Little K3 at 4 ranks: 1.95 MB of rows each (7.45 MB on
//   one), every rank all resident from 20.5 MB. What the run does today: a rank's expert cache holds
//   only experts it owns (chapter 10 asks it for no other), and a streamed matrix is read only at the
//   rank's rows (for_each_rows over a range, chapter 12's MatrixStream: at the floor, in 16 KiB pieces,
//   a rank of 2 reads 3.9 MB per token of the little K3 where one process reads 7.6 MB; mpi_logits
//   checks it), and each rank's Model plans and pins its share alone: chapter 13's process_rows gives
//   make_plan the share's units and the trunk's loader only the rank's rows of each pinned matrix
//   (MatrixRef::held), so a rank's memory is its share's plan (mpi_logits checks the plan equals
//   rank_plans' at three budgets, and that resident a rank reads at start exactly its share's bytes).
//
// NUMERICS CONTRACT
//   Bit-identical logits at every rank count and every thread count per rank (each rank splits its own
//   rows over its threads, chapter 00). No MPI reduction is used anywhere: MPI_SUM's order is the
//   library's, not ours (rank 0's sums of test counts are integers).
//
// FAULTS
//   A rank whose model fails to load (a missing shard, a refused budget) or whose step throws prints
//   "kimik3-mpi: rank R of N: <cause>" and calls MPI_Abort, which ends every rank: non-zero exit, no
//   collective left waiting. A rank that dies (a signal) is seen by mpirun, which ends the others. A
//   rank that stays alive but stops (a hung disk, a stopped process) would leave the others waiting in
//   their next gather forever; a watchdog thread on every rank ends it instead: when a gather has waited
//   longer than KIMIK3_MPI_TIMEOUT seconds (default 600, 0: never), the waiting rank names itself and
//   exits non-zero, and mpirun ends the job. A gather is a few milliseconds of waiting when every rank is
//   well; ten minutes is far beyond any layer's reads at K3's floor.
//
// SOURCES  Megatron-LM (Shoeybi et al., arXiv:1909.08053): row/column tensor parallelism; GShard
//          (Lepikhin et al., arXiv:2006.16668): expert parallelism; Thakur, Rabenseifner, Gropp,
//          "Optimization of collective communication operations in MPICH" (2005): the ring allgather.
// USES     chapters 04, 08, 10 (the two hooks), 12 (make_plan: each rank's plan), 13
// RUN      make run-17 (one rank), mpirun -np 3 build/g++/examples/17_mpi (the same transcript), and the
//          whole CLI: mpirun -np 3 build/g++/kimik3-mpi run fixtures/little-k3 --prompt "..." --gen 8
//          (--speculate too: a verify step is a step like any other), or kimik3-mpi chat (share_line below)
// TEST     make test (tests/mpi.sh: logits hashes at 1-4 ranks against kimik3; skipped without MPI)
//
// SECTIONS
//   17.1 the share of a rank   17.2 rows over ranks   17.3 experts over ranks   17.4 faults
//   17.5 traffic and the cost model   17.6 each rank's share and plan
// ====================================================================================================
#pragma once

#define OMPI_SKIP_MPICXX 1  // the C API only (Open MPI's C++ bindings are deprecated)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "13_model.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 17.1 The share of a rank: contiguous, like chapter 00's threads
// ---------------------------------------------------------------------------------------------------
using Share = RowRange;  // chapter 04's: rows [begin, end)
inline Share rank_share(std::size_t n, int rank, int ranks) {
    return {n * std::size_t(rank) / std::size_t(ranks), n * std::size_t(rank + 1) / std::size_t(ranks)};
}

// What the split sent: collectives, floats received by this rank, and seconds spent inside MPI.
struct MpiStats {
    std::uint64_t collectives = 0, floats_gathered = 0, floats_received = 0;
    double seconds = 0;
};

namespace detail {
// MPI counts are ints: a gather larger than 2^31 floats would need splitting (K3's largest is 163,840 per token).
inline int mpi_count(std::size_t n) {
    if (n > std::size_t(INT32_MAX)) fail(ErrorKind::runtime, "an MPI message of " + std::to_string(n) + " floats (at most 2^31 - 1)");
    return int(n);
}

// When the gather under way began (steady-clock nanoseconds; 0: none), for the watchdog (17.4).
inline std::atomic<std::int64_t>& gather_since() {
    static std::atomic<std::int64_t> since{0};
    return since;
}

// Every rank sends `mine` (its part, in its order); every rank receives all parts, rank by rank, into `all`.
inline void allgather_parts(MpiStats& st, const std::vector<float>& mine, const std::vector<int>& counts, std::vector<float>& all) {
    const auto t0 = std::chrono::steady_clock::now();
    gather_since() = std::max<std::int64_t>(1, t0.time_since_epoch().count());
    std::vector<int> displs(counts.size(), 0);
    std::size_t total = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) displs[r] = mpi_count(total), total += std::size_t(counts[r]);
    all.resize(total);
    MPI_Allgatherv(mine.data(), int(mine.size()), MPI_FLOAT, all.data(), counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
    gather_since() = 0;
    st.collectives += 1, st.floats_gathered += total, st.floats_received += total - mine.size();
    st.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// 17.2 Rows over ranks: every trunk product, then one allgather of its outputs
// ---------------------------------------------------------------------------------------------------
// The rank computes rows [b, e) of y for every token into mine (T, e - b), with the kernel the engine
// chose (mm), from W resident or streamed; the gather brings every rank's (T, rows) block; y is then
// filled block by block. Streamed, the rank reads its rows alone (chapter 12's MatrixStream reads a row
// range by itself); pinned, it holds only those rows (chapter 13's process_rows).
class MpiRowSplit : public RowSplit {
  public:
    MpiRowSplit(int rank, int ranks) : rank_(rank), ranks_(ranks) {}
    MpiStats stats;

    RowRange rows(std::size_t n) const override { return rank_share(n, rank_, ranks_); }

    void linear(TypedMatmul mm, float* y, const float* x, std::size_t tokens, const MatrixRef& w) override {
        const Share s = rank_share(w.rows, rank_, ranks_);
        const std::size_t n = s.end - s.begin;
        mine_.assign(tokens * n, 0.0f);
        for_each_rows(w, s.begin, s.end, [&](std::size_t a, std::size_t b, const void* rows) {  // its rows alone, resident or streamed
            mm(w.type, mine_.data() + (a - s.begin), x, rows, tokens, b - a, w.cols, n);
        });
        counts_.resize(std::size_t(ranks_));
        for (int r = 0; r < ranks_; ++r) {
            const Share o = rank_share(w.rows, r, ranks_);
            counts_[std::size_t(r)] = detail::mpi_count(tokens * (o.end - o.begin));
        }
        detail::allgather_parts(stats, mine_, counts_, all_);
        std::size_t at = 0;
        for (int r = 0; r < ranks_; ++r) {  // rank r's block: (T, its rows)
            const Share o = rank_share(w.rows, r, ranks_);
            const std::size_t m = o.end - o.begin;
            for (std::size_t t = 0; t < tokens; ++t) std::copy_n(&all_[at + t * m], m, y + t * w.rows + o.begin);
            at += tokens * m;
        }
    }

  private:
    int rank_, ranks_;
    std::vector<float> mine_, all_;
    std::vector<int> counts_;
};

// ---------------------------------------------------------------------------------------------------
// 17.3 Experts over ranks: one owner per (layer, expert), outputs copied to every rank in slot order
// ---------------------------------------------------------------------------------------------------
// Each rank knows every slot's expert (the routing is replicated), so each knows, for every rank, which
// slots that rank fills and in what order (ascending slot index): the gather needs no index exchange.
inline int expert_owner(int layer, int expert, int ranks) { return (expert + layer) % ranks; }

class MpiExpertSplit : public ExpertSplit {
  public:
    MpiExpertSplit(int rank, int ranks) : rank_(rank), ranks_(ranks) {}
    MpiStats stats;

    bool owns(int layer, int expert) const override { return expert_owner(layer, expert, ranks_) == rank_; }

    void share(float* expert_out, const Routing& r, std::size_t width, int layer) override {
        const std::size_t slots = r.ids.size();
        mine_.clear();
        counts_.assign(std::size_t(ranks_), 0);
        for (std::size_t i = 0; i < slots; ++i) {
            const int o = expert_owner(layer, r.ids[i], ranks_);
            counts_[std::size_t(o)] += detail::mpi_count(width);
            if (o == rank_) mine_.insert(mine_.end(), expert_out + i * width, expert_out + (i + 1) * width);
        }
        detail::allgather_parts(stats, mine_, counts_, all_);
        std::vector<std::size_t> at(std::size_t(ranks_), 0);
        for (int q = 1; q < ranks_; ++q) at[std::size_t(q)] = at[std::size_t(q - 1)] + std::size_t(counts_[std::size_t(q - 1)]);
        for (std::size_t i = 0; i < slots; ++i) {
            const std::size_t o = std::size_t(expert_owner(layer, r.ids[i], ranks_));
            std::copy_n(&all_[at[o]], width, expert_out + i * width);
            at[o] += width;
        }
    }

  private:
    int rank_, ranks_;
    std::vector<float> mine_, all_;
    std::vector<int> counts_;
};

// ---------------------------------------------------------------------------------------------------
// 17.4 The job: MPI up, the splits installed, faults ending every rank
// ---------------------------------------------------------------------------------------------------
// One per process, made first in main. Every MPI call is made by the calling thread (the compute team's
// workers never call MPI: the hooks run outside a team job), so MPI_THREAD_FUNNELED is enough.
class MpiJob {
  public:
    MpiJob(int* argc, char*** argv) {
        int provided = 0;
        MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
        MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
        rows_ = std::make_unique<MpiRowSplit>(rank_, ranks_);
        experts_ = std::make_unique<MpiExpertSplit>(rank_, ranks_);
        row_split() = rows_.get();
        expert_split() = experts_.get();
        const char* t = std::getenv("KIMIK3_MPI_TIMEOUT");
        const double timeout = t ? std::atof(t) : 600.0;
        if (timeout > 0) watchdog_ = std::thread([this, timeout] { watch(timeout); });
    }
    ~MpiJob() {
        stop_ = true;
        if (watchdog_.joinable()) watchdog_.join();
        row_split() = nullptr, expert_split() = nullptr;
        MPI_Finalize();
    }
    MpiJob(const MpiJob&) = delete;
    MpiJob& operator=(const MpiJob&) = delete;

    int rank() const { return rank_; }
    int ranks() const { return ranks_; }
    MpiStats stats() const {
        MpiStats s = rows_->stats;
        const MpiStats& e = experts_->stats;
        s.collectives += e.collectives, s.floats_gathered += e.floats_gathered, s.floats_received += e.floats_received, s.seconds += e.seconds;
        return s;
    }

    // A line of text from rank 0 to every rank (a chat's input: only rank 0 reads the terminal). `more`
    // (rank 0's) says whether there is a line; false on every rank at the end of the input.
    bool share_line(std::string& line, bool more) const {
        long long n = rank_ == 0 ? (more ? (long long)std::min<std::size_t>(line.size(), 1u << 30) : -1) : 0;
        MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
        if (n < 0) return false;
        line.resize(std::size_t(n));
        MPI_Bcast(line.data(), int(n), MPI_CHAR, 0, MPI_COMM_WORLD);
        return true;
    }

    // Where a fault's line goes when this rank's stderr is silenced (ranks other than 0 print nothing else).
    void keep_stderr(int fd) { err_fd_ = fd; }

    // Ends every rank at once: the cause on stderr, named by rank, then MPI_Abort (never returns).
    [[noreturn]] void abort(const std::string& cause, int code) const {
        std::string line = "kimik3-mpi: rank " + std::to_string(rank_) + " of " + std::to_string(ranks_) + ": " + cause;
        if (line.back() != '\n') line += '\n';
        std::fflush(stderr);
        (void)!::write(err_fd_, line.data(), line.size());
        MPI_Abort(MPI_COMM_WORLD, code == 0 ? 1 : code);
        std::_Exit(code == 0 ? 1 : code);
    }

  private:
    // The watchdog (see FAULTS): it calls no MPI (only the main thread may, MPI_THREAD_FUNNELED); it
    // writes its line and leaves with _exit, and mpirun, seeing a rank gone, ends the others.
    void watch(double timeout) const {
        while (!stop_) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            const std::int64_t since = detail::gather_since();
            const double waited = since ? std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch() -
                                                                        std::chrono::steady_clock::duration(since)).count()
                                        : 0.0;
            if (waited > timeout) {
                char line[256];
                const int n = std::snprintf(line, sizeof line,
                                            "kimik3-mpi: rank %d of %d: waited %.0f s in a gather for the other ranks (KIMIK3_MPI_TIMEOUT=%g): "
                                            "a rank has stopped\n", rank_, ranks_, waited, timeout);
                (void)!::write(err_fd_, line, std::size_t(std::max(0, n)));
                std::_Exit(1);  // kimik3's exit code for a runtime failure
            }
        }
    }
    int rank_ = 0, ranks_ = 1, err_fd_ = 2;
    std::unique_ptr<MpiRowSplit> rows_;
    std::unique_ptr<MpiExpertSplit> experts_;
    std::atomic<bool> stop_{false};
    std::thread watchdog_;
};

// ---------------------------------------------------------------------------------------------------
// 17.5 Traffic per token from the config, and the cost model
// ---------------------------------------------------------------------------------------------------
// Per token (one decode step): collectives, floats gathered, and what rank `rank` of `ranks` receives of
// them at most (exactly every product's rows but its own; the expert exchange whole, which it receives
// when it owns none of the token's experts).
struct MpiTraffic {
    std::uint64_t collectives = 0, floats = 0, received = 0;
};

inline MpiTraffic mpi_traffic(const Config& c, int rank = 0, int ranks = 1) {
    MpiTraffic t;
    auto product = [&](std::uint64_t rows) {
        const Share sh = rank_share(rows, rank, ranks);
        t.collectives += 1, t.floats += rows, t.received += rows - (sh.end - sh.begin);
    };
    const std::uint64_t D = std::uint64_t(c.hidden_size), P = std::uint64_t(c.kda_width()), H = std::uint64_t(c.num_attention_heads);
    for (const LayerPlan& l : c.layers) {
        if (l.attn == AttnKind::KDA) {
            for (std::uint64_t rows : {P, P, P, P, std::uint64_t(c.kda_head_dim), P, std::uint64_t(c.kda_num_heads), D}) product(rows);
        } else {
            for (std::uint64_t rows : {std::uint64_t(c.q_lora_rank), H * std::uint64_t(c.mla_qk_head_dim()), std::uint64_t(c.mla_cache_width()),
                                       H * std::uint64_t(c.v_head_dim), D})
                product(rows);
        }
        if (l.ffn == FfnKind::Dense) {
            for (std::uint64_t rows : {std::uint64_t(c.intermediate_size), std::uint64_t(c.intermediate_size), D}) product(rows);
        } else {
            for (std::uint64_t rows : {std::uint64_t(c.num_experts), std::uint64_t(c.routed_expert_hidden_size), D}) product(rows);
            if (c.num_shared_experts > 0)
                for (std::uint64_t rows : {std::uint64_t(c.shared_width()), std::uint64_t(c.shared_width()), D}) product(rows);
            const std::uint64_t exchange = std::uint64_t(c.num_experts_per_token) * std::uint64_t(c.routed_expert_hidden_size);
            t.collectives += 1, t.floats += exchange, t.received += ranks > 1 ? exchange : 0;  // the expert exchange
        }
    }
    product(std::uint64_t(c.vocab_size));  // lm_head
    return t;
}

// What one machine is assumed to have (the defaults: a desktop with dual-channel DDR5 and one NVMe).
struct Machine {
    double memory_bytes = 24e9, memory_bw = 20e9, disk_bw = 3e9, reserved = 1.5e9;  // reserved: state, activations, OS
};
struct Link {
    const char* name;
    double bits_per_s, alpha;  // alpha: seconds per message step
};
inline constexpr Link kLinks[] = {{"10 GbE", 10e9, 20e-6}, {"25 GbE", 25e9, 15e-6}, {"100 GbE", 100e9, 10e-6}};

struct MpiCost {
    double trunk = 0, experts = 0, comm = 0, hit = 0;  // seconds per token; hit: routed experts served from memory
    double total() const { return trunk + experts + comm; }
};

// Per token on n machines, each holding 1/n of every trunk matrix's rows pinned (trunk_bytes: what a token
// reads, so lm_head but not the embedding: one row of it, from disk) and owning 1/n of the routed experts,
// of which what its free memory holds is cached. Uniform routing is assumed (the LRU hit rate is then the
// cached fraction; real routing is skewed, so this is the pessimistic end). A layer's expert reads
// overlap its expert compute (chapter 10 reads group g + 1 while group g computes) but nothing else:
// the routing is known only after the attention. Messages: a ring allgather per collective, (n - 1)
// alpha, plus the bytes a rank receives; not overlapped with anything.
inline MpiCost mpi_cost(const Config& c, double trunk_bytes, double expert_bytes, int n, const Machine& m, const Link& link) {
    const double E = double(c.num_experts) * double(c.moe_layer_count());
    const double per_token = expert_bytes / E * double(c.num_experts_per_token) * double(c.moe_layer_count());
    const double free = std::max(0.0, m.memory_bytes - m.reserved - trunk_bytes / n);
    MpiCost k;
    k.hit = std::min(1.0, free / (expert_bytes / n));
    k.trunk = trunk_bytes / n / m.memory_bw;
    k.experts = std::max(per_token / n / m.memory_bw, per_token * (1 - k.hit) / n / m.disk_bw);
    const MpiTraffic t = mpi_traffic(c);
    k.comm = double(t.collectives) * (n - 1) * link.alpha + double(t.floats) * 4 * (n - 1) / n / (link.bits_per_s / 8);
    return k;
}

// The cost model's table for a config (`kimik3-mpi cost`, example 17): per token, for 1-16 machines.
inline std::string describe_cost(const Config& c, const Census& s) {
    const MpiTraffic t = mpi_traffic(c);
    const double trunk = double(s.trunk_bytes + s.lm_head_bytes), experts = double(s.expert_bytes_total);
    char line[200];
    std::snprintf(line, sizeof line, "%llu collectives and %.1f MB gathered per token; trunk + lm_head %.1f GB, experts %.1f GB\n",
                  (unsigned long long)t.collectives, double(t.floats) * 4 / 1e6, trunk / 1e9, experts / 1e9);
    std::string out = line;
    std::snprintf(line, sizeof line, "%8s %9s %9s %9s %9s %11s %11s %11s\n", "machines", "hit", "trunk", "experts", "comm10", "s/tok 10G",
                  "s/tok 25G", "s/tok 100G");
    out += line;
    for (int n : {1, 2, 4, 8, 16}) {
        MpiCost k[3];
        for (int i = 0; i < 3; ++i) k[i] = mpi_cost(c, trunk, experts, n, Machine{}, kLinks[i]);
        std::snprintf(line, sizeof line, "%8d %8.1f%% %9.3f %9.3f %9.3f %11.3f %11.3f %11.3f\n", n, 100 * k[0].hit, k[0].trunk, k[0].experts,
                      k[0].comm, k[0].total(), k[1].total(), k[2].total());
        out += line;
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------
// 17.6 Each rank's share, and chapter 12's planner fed with it
// ---------------------------------------------------------------------------------------------------
// What a rank holds of a model: its rows of every matrix `linear` multiplies by (MLA's kv_b_proj, read by
// the absorbed form's own kernels, whole on every rank; the small tensors whole too: everything else runs
// replicated) and the routed experts it owns. `units` is that share in chapter 12's terms, so that
// make_plan, unchanged, decides what of it a rank pins at its budget and what it streams.
struct RankShare {
    UnitBytes units;                              // the rank's rows of each layer's matrices and of the lm_head
    std::uint64_t trunk = 0;                      // their bytes (units' matrices + lm_head)
    std::uint64_t experts = 0, expert_bytes = 0;  // the routed experts it owns, and their bytes
    std::uint64_t expert_reads = 0;               // per token at most: per MoE layer, min(k, experts owned there)
    double expert_reads_mean = 0;                 // per token with uniform routing: k / E of the experts owned
};

namespace detail {
// One layer tensor (l < 0: the lm_head) into every rank's share: a matrix by rows (kv_b_proj whole).
inline void add_rank_tensor(std::vector<RankShare>& out, int l, DType dtype, const Shape& shape, bool split) {
    const int ranks = int(out.size());
    for (int k = 0; k < ranks; ++k) {
        RankShare& r = out[std::size_t(k)];
        if (!is_streamable_matrix(dtype, shape)) {
            r.units.layer_small[std::size_t(l)] += small_resident_bytes(shape);
            continue;
        }
        const std::uint64_t rows = std::uint64_t(shape[0]), row_bytes = std::uint64_t(shape.numel()) / rows * dtype_size(dtype);
        const Share sh = split ? rank_share(rows, k, ranks) : Share{0, rows};
        const std::uint64_t bytes = (sh.end - sh.begin) * row_bytes;
        (l < 0 ? r.units.lm_head : r.units.layer_matrix[std::size_t(l)]) += bytes;
        if (!split && l >= 0) r.units.layer_reread[std::size_t(l)] += bytes;  // kv_b_proj: two passes per step
        r.trunk += bytes;
        r.units.largest_row = std::max(r.units.largest_row, row_bytes);
        r.units.largest_matrix = std::max(r.units.largest_matrix, bytes);
    }
}
// The routed experts of every MoE layer (experts[l] of them, `bytes` each) to their owners.
inline void add_rank_experts(std::vector<RankShare>& out, const std::vector<std::size_t>& experts, std::uint64_t bytes, int k) {
    const int ranks = int(out.size());
    for (std::size_t l = 0; l < experts.size(); ++l) {
        std::vector<std::uint64_t> owned(out.size(), 0);
        for (std::size_t e = 0; e < experts[l]; ++e) owned[std::size_t(expert_owner(int(l), int(e), ranks))] += 1;
        for (std::size_t r = 0; r < out.size(); ++r) {
            out[r].experts += owned[r], out[r].expert_bytes += owned[r] * bytes;
            out[r].expert_reads += std::min<std::uint64_t>(owned[r], std::uint64_t(k)) * bytes;
            if (experts[l] > 0) out[r].expert_reads_mean += double(k) * double(owned[r]) / double(experts[l]) * double(bytes);
            out[r].units.experts = out[r].experts;
        }
    }
}
inline std::vector<RankShare> empty_shares(std::size_t layers, int ranks) {
    if (ranks < 1) fail(ErrorKind::usage, "ranks: at least 1 (got " + std::to_string(ranks) + ")");
    std::vector<RankShare> out(static_cast<std::size_t>(ranks));
    for (RankShare& r : out) r.units.layer_matrix.assign(layers, 0), r.units.layer_small.assign(layers, 0), r.units.layer_reread.assign(layers, 0);
    return out;
}
}  // namespace detail

// Of a bound checkpoint, with every tensor's real dtype.
// Its units are what rank k's Model plans with (chapter 13's process_rows under rank k's row split).
inline std::vector<RankShare> rank_shares(const Config& c, const ModelTensors& m, int ranks) {
    std::vector<RankShare> out = detail::empty_shares(m.layers.size(), ranks);
    for (int k = 0; k < ranks; ++k) {
        const MpiRowSplit split(k, ranks);
        RankShare& r = out[std::size_t(k)];
        r.units = unit_bytes(m, process_rows(m, &split));
        r.trunk = r.units.lm_head;
        for (std::uint64_t b : r.units.layer_matrix) r.trunk += b;
    }
    std::vector<std::size_t> experts;
    for (const std::vector<ExpertLocation>& layer : m.experts) experts.push_back(layer.size());
    detail::add_rank_experts(out, experts, m.expert_bytes, c.num_experts_per_token);
    return out;
}

// Of a release-layout checkpoint of this config (release dtypes): `kimik3-mpi plan --config`.
inline std::vector<RankShare> rank_shares(const Config& c, const Census& s, int ranks) {
    std::vector<RankShare> out = detail::empty_shares(std::size_t(c.num_hidden_layers), ranks);
    std::vector<std::size_t> experts;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        for (const Expected& e : expected_layer_tensors(c, l)) detail::add_rank_tensor(out, l, e.dtypes[0], e.shape, e.member != &LayerTensors::kv_b_proj);
        experts.push_back(c.layers[std::size_t(l)].ffn == FfnKind::Dense ? 0 : std::size_t(c.num_experts));
    }
    detail::add_rank_tensor(out, -1, DType::BF16, Shape{c.vocab_size, c.hidden_size}, true);
    detail::add_rank_experts(out, experts, s.expert_bytes, c.num_experts_per_token);
    return out;
}

// A rank's plan: chapter 12's, of its share at its own budget. Resident: what it holds (plan.total());
// streamed per token: plan.trunk_read_per_token, and of its experts at most share.expert_reads (set as the
// plan's expert_read_per_token), expected expert_streamed(): uniform routing, and a cache of S slots over
// its E experts hitting S / E of them (mpi_cost's assumption; none missed once every owned expert has a
// slot and has been read once; no hits below k + 1 slots). Every rank takes part in every collective.
struct RankPlan {
    RankShare share;
    Plan plan;
    bool all_resident() const { return plan.trunk_read_per_token == 0 && plan.expert_slots >= share.experts; }
    double expert_streamed(int k) const {  // k: experts per token
        if (plan.expert_slots >= share.experts) return 0;
        const double hit = plan.expert_slots > std::size_t(k) ? double(plan.expert_slots) / double(share.experts) : 0.0;
        return share.expert_reads_mean * (1 - hit);
    }
};
inline std::vector<RankPlan> rank_plans(const Config& c, const Census& s, std::uint64_t budget, const PlanOptions& o,
                                        const std::vector<RankShare>& shares) {
    std::vector<RankPlan> out;
    for (const RankShare& sh : shares) {
        RankPlan r{sh, make_plan(c, s, budget, o, sh.units)};
        r.plan.expert_read_per_token = sh.expert_reads;
        out.push_back(r);
    }
    return out;
}

}  // namespace kimik3
