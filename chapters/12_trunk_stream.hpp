// kimik3 chapter 12: trunk_stream -- the non-expert weights at any memory budget: pinned, or streamed.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Besides its experts, K3 has a 108.8 GB "trunk" (attention, norms, router, latent and shared FFN of
//   93 layers) plus a 2.35 GB lm_head, and every token reads all of it. This chapter decides, for a
//   memory budget, which of it stays resident and streams the rest from disk in row chunks through a
//   small ring of buffers, with a reader thread working ahead of the computation. Because every output
//   row of a matrix-vector product is computed on its own (chapter 04), streaming changes no bit.
//   New since chapter 11: planning memory, overlapping I/O with compute safely, and packing the trunk.
//
// WHERE THIS SITS IN KIMI K3 (sizes from the release's shapes; the engine before us: kimi-k3-in-c,
//   github.com/FareedKhan-dev/kimi-k3-in-c, its README and PERFORMANCE.md)
//   Per layer 0.84-2.34 GB of trunk (layer 0 with the 33,792-wide dense FFN is the largest); small
//   tensors (norms, conv taps, gate biases) ~0.7 MB per layer, always resident; the KDA states (434 MB)
//   and the latent MLA cache (24 x 576 floats per position) always resident. The engine before us
//   streamed whole layers (slot = 2.34 GB, floor 8.24 GB); streaming row chunks makes the floor the
//   carried state plus a few MB of buffers.
//
// CONCEPTS
//   matrix       a 2-D bf16 weight with more than one row (projections, router, lm_head): the things
//                worth streaming. Everything else is "small" and loaded once.
//   pinned       a whole layer's matrices (or the lm_head) kept in memory, read once at start.
//   piece        a run of consecutive rows of one streamed matrix, at most chunk_bytes; one read.
//   ring         N slots of chunk_bytes. The consumer acquires the piece it needs and releases it when
//                done; a reader thread fills free slots with the pieces the consumer will want next.
//   schedule     the order in which one forward step asks for pieces. It never depends on the data
//                (routing changes which experts run, not which trunk matrices are read), so the ring
//                learns it during the first step and prefetches along it from then on.
//   trunk.bin    `kimik3 pack-trunk`: every layer's non-expert tensors copied verbatim into one file,
//                one 4096-aligned run per layer, described by trunk.json (optional: the engine reads
//                the shards directly when no trunk is given; same bytes, same results).
//
//     ring with 3 slots:    [ piece k  (in use) ][ piece k+1 (ready) ][ piece k+2 (reading) ]
//                             ^ consumer computes  ^ next acquire        ^ reader thread
//     A slot in use is never a read target: the reader only fills FREE slots, so a one-slot ring
//     simply reads the next piece after the consumer releases the current one (the failure of a
//     one-slot reader that overwrote the layer being computed cannot happen; test 12.3).
//
// CONTRACT
//   * Which bytes are resident, the chunk size, the slot count and the reader's timing never change a
//     bit of any output (tests 12.x and chapter 13's invariance gates).
//   * Every read is exact (chapter 01/11 readers): a failed or short read is Error(io) and the piece is
//     never handed to the consumer.
//   * The planner refuses a budget below the floor with ErrorKind::budget and the floor in bytes.
//   * A measured plan (PlanOptions::measure_baseline) bounds the process's peak RSS by its budget.
//   * What pack-trunk promises (verified copies, trunk.json last): appendix 12a.
//
// SOURCES  Sheng et al., "FlexGen", arXiv:2303.06865 (planning where weights live, overlapping I/O with
//          compute); FareedKhan-dev/kimi-k3-in-c (trunk.bin, pinned layers). docs/sources.md 12.
// USES     chapters 00-02 (appendix 01a: pread_exact, detail::pread_direct), 04 (MatrixRef, RowStream)
// RUN      make run-12        TEST   make test-12        CLI   kimik3 pack-trunk, kimik3 plan
//
// SECTIONS
//   12.1 sizes: the floor        12.2 the plan           12.3 the ring
//   APPENDIX 12a_pack_trunk.hpp:     12.4 packing the trunk (trunk.bin + trunk.json), loading it back
//   APPENDIX 12b_trunk_weights.hpp:  12.5 the trunk's weights: carrying out a plan (what is read at
//                                    start, small tensors widened to f32, streamed matrices, the embedding)
// ====================================================================================================
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"
#include "02_config.hpp"
#include "04_matvec_bf16.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 12.1 Sizes: the floor
// ---------------------------------------------------------------------------------------------------
// The planner takes bytes ("8G" and the presets laptop, desktop, server, auto are examples/cli/sizes.hpp's).
// The budget "floor": whatever the plan's floor comes to for this model and context (make_plan resolves
// it; the CLI's --budget floor). No real budget is this large.
constexpr std::uint64_t kBudgetFloor = ~std::uint64_t(0);

// ---------------------------------------------------------------------------------------------------
// 12.2 The plan: what is resident, what streams, and how much memory that takes
// ---------------------------------------------------------------------------------------------------
// A "unit" is what can be pinned: the matrices of one layer, or the lm_head.
struct PlanOptions {
    std::uint64_t context = 4096;            // MLA cache capacity in positions
    std::uint64_t chunk_bytes = 0;           // 0: chosen by the planner
    int ring_slots = 0;                      // 0: chosen by the planner (3)
    std::size_t expert_slots = 0;            // 0: chosen by the planner
    std::uint64_t overhead_bytes = 0;        // process baseline (binary, libraries, headers); 0: measured or estimated
    // The process's resident bytes now (program, libraries, checkpoint metadata, tokenizer: all loaded
    // before planning; the CLI reads VmRSS). Set, the overhead is that plus a reserve (below), so the
    // budget is a ceiling on peak RSS; unset (a plan from a config alone), an estimate.
    std::function<std::uint64_t()> measure_baseline;
    int workers = 0;                         // compute threads the run starts besides the main one
    int readers = 0;                         // I/O threads it starts besides the ring's (expert reads, read-ahead)
    std::uint64_t kept_logits = 0;           // rows of V logits the caller keeps (teacher forcing, --dump-logits)
    std::uint64_t trace_positions = 0;       // positions whose expert requests the cache's trace will hold
    std::uint64_t sessions = 1;              // conversations stepped together (appendix 13a), each its own state and cache
};

// What a run adds to a measured baseline outside the plan's other lines: code first run after planning
// and per-step heap (0.3-0.4 MB and 0.2-0.6 MB measured), and per thread its stack and heap arena (a
// compute worker measured 0.15 MB, an I/O thread under 30 kB).
inline constexpr std::uint64_t kRunReserve = 1ull << 20, kWorkerReserve = 192ull << 10, kReaderReserve = 32ull << 10;

struct Plan {
    std::uint64_t budget = 0, floor = 0;
    std::vector<bool> pinned;                // per layer: its matrices resident
    bool lm_head_pinned = false, embed_resident = false;
    std::uint64_t chunk_bytes = 0;
    int ring_slots = 0;
    std::size_t expert_slots = 0;
    std::uint64_t context = 0, sessions = 1;  // sessions: conversations, each with its carried state and MLA cache
    // accounting (bytes)
    std::uint64_t state_bytes = 0, kv_bytes = 0, small_bytes = 0, work_bytes = 0, overhead_bytes = 0;
    std::uint64_t ring_bytes = 0, expert_bytes = 0, pinned_bytes = 0, embed_bytes = 0;
    std::uint64_t trunk_read_per_token = 0, expert_read_per_token = 0;
    std::uint64_t total() const {
        return state_bytes + kv_bytes + small_bytes + work_bytes + overhead_bytes + ring_bytes + expert_bytes + pinned_bytes + embed_bytes;
    }
    int pinned_layers() const {
        int n = 0;
        for (bool p : pinned) n += p;
        return n;
    }
};

// The bytes of a layer's (or the lm_head's) matrices, and of its small tensors.
struct UnitBytes {
    std::vector<std::uint64_t> layer_matrix, layer_small;  // per layer
    std::vector<std::uint64_t> layer_reread;               // per layer: what a step reads twice when streamed (MLA's kv_b_proj)
    std::uint64_t lm_head = 0, largest_row = 0;            // largest_row: the widest matrix row (one chunk must hold it)
    std::uint64_t largest_matrix = 0, experts = 0;         // no piece exceeds largest_matrix; experts: cacheable (0: all)
};

inline bool is_matrix_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }
inline bool is_streamable_matrix(DType dtype, const Shape& shape) { return is_matrix_dtype(dtype) && shape.rank == 2 && shape[0] > 1; }
inline bool is_streamable_matrix(const TensorInfo& t) { return is_streamable_matrix(t.dtype, t.shape); }

// The resident bytes of a small tensor: kept widened to f32, whatever its stored dtype (12.5).
inline std::uint64_t small_resident_bytes(const Shape& shape) { return std::uint64_t(shape.numel()) * 4; }

namespace detail {
// Adds one layer tensor (its dtype, shape; of a matrix, `rows` of its rows) to the per-unit sums.
inline void add_unit_tensor(UnitBytes& u, std::uint64_t& mat, std::uint64_t& small, DType dtype, const Shape& shape, std::uint64_t rows) {
    if (is_streamable_matrix(dtype, shape)) {
        const std::uint64_t row = std::uint64_t(shape.numel()) / std::uint64_t(shape[0]) * dtype_size(dtype), bytes = rows * row;
        mat += bytes;
        u.largest_row = std::max<std::uint64_t>(u.largest_row, row);
        u.largest_matrix = std::max(u.largest_matrix, bytes);
    } else {
        small += small_resident_bytes(shape);
    }
}
inline void add_lm_head(UnitBytes& u, std::uint64_t bytes, std::uint64_t row_bytes) {
    u.lm_head = bytes;
    u.largest_row = std::max(u.largest_row, row_bytes);
    u.largest_matrix = std::max(u.largest_matrix, u.lm_head);
}
}  // namespace detail

// From the config alone, with the release's dtypes (docs/kimi-k3.md section 2): for `kimik3 plan --config`.
inline UnitBytes unit_bytes(const Config& c) {
    UnitBytes u;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        std::uint64_t mat = 0, small = 0;
        std::uint64_t reread = 0;
        for (const Expected& e : expected_layer_tensors(c, l)) {
            detail::add_unit_tensor(u, mat, small, e.dtypes[0], e.shape, std::uint64_t(e.shape[0]));
            if (e.member == &LayerTensors::kv_b_proj) reread += std::uint64_t(e.shape.numel()) * dtype_size(e.dtypes[0]);
        }
        u.layer_matrix.push_back(mat);
        u.layer_reread.push_back(reread);
        u.layer_small.push_back(small);
    }
    detail::add_lm_head(u, std::uint64_t(c.vocab_size) * std::uint64_t(c.hidden_size) * 2, std::uint64_t(c.hidden_size) * 2);
    return u;
}

// From a bound checkpoint (its real dtypes, a rank's rows): unit_bytes(ModelTensors) in appendix 12b.

inline std::string plan_error_floor(const Plan& p) {
    return "budget " + human_bytes(double(p.budget)) + " (" + std::to_string(p.budget) + " bytes) is below the floor of " +
           human_bytes(double(p.floor)) + " (" + std::to_string(p.floor) + " bytes) for this model at a " +
           std::to_string(p.context) + "-token context" + (p.sessions > 1 ? " and " + std::to_string(p.sessions) + " conversations" : "");
}

// Decides the plan. Order of priorities, each justified by a measurement (this project's, or kimi-k3-in-c's
// published ones): (1) the floor: carried state, latent KV cache, small tensors, work buffers, three ring
// slots (two reads in flight while the consumer holds a third), two expert slots; (2) bigger chunks (streaming
// throughput); (3) pin units largest first (every pinned byte is a byte not read per token; giving memory to
// the trunk first measured 1.69x faster than to the expert cache); (4) expert cache slots (the cache retained
// nothing below ~36 GB on K3, so it comes after the trunk); (5) the embedding table (resident, it saves one
// row read per token: the least per byte). `u` may be one MPI rank's share of the model (chapter 17.6).
inline Plan make_plan(const Config& c, const Census& s, std::uint64_t budget, const PlanOptions& o, const UnitBytes& u) {
    Plan p;
    p.budget = budget;
    p.context = o.context, p.sessions = std::max<std::uint64_t>(1, o.sessions);
    p.pinned.assign(std::size_t(c.num_hidden_layers), false);
    p.state_bytes = s.kda_state_bytes * p.sessions;
    p.kv_bytes = s.mla_cache_bytes_per_token * o.context * p.sessions;
    for (std::uint64_t b : u.layer_small) p.small_bytes += b;
    p.small_bytes += 3 * std::uint64_t(c.hidden_size) * 4;  // model.norm and the output AttnRes pair, widened to f32
    // work buffers of one decode step: activations and projections (a few widths of D, P, I, V)
    const std::uint64_t widest = std::max({std::uint64_t(c.intermediate_size), std::uint64_t(c.kda_width()) * 4,
                                           std::uint64_t(c.vocab_size), std::uint64_t(c.num_attention_heads) * c.kv_lora_rank});
    p.work_bytes = (16 * std::uint64_t(c.hidden_size) + 4 * widest) * 4 * p.sessions + 2 * 4096;  // a row per conversation
    // what the run keeps as it goes, when the caller says: the logits it keeps, and the expert trace the
    // cache records (chapter 11: 8 bytes per request, k per MoE layer and position; twice, for a vector's growth)
    p.work_bytes += o.kept_logits * std::uint64_t(c.vocab_size) * 4 +
                    2 * o.trace_positions * std::uint64_t(c.moe_layer_count()) * std::uint64_t(c.num_experts_per_token) * 8;
    // the process itself: measured (resident now, to 64 KiB, plus the reserves of the run and of its
    // threads, the ring's two included), or estimated: program, libraries, thread stacks (~8 MB measured)
    // and the checkpoint's metadata (~700 bytes per tensor measured on a header-only K3: ~350 MB for ~500,000)
    const std::uint64_t measured = o.overhead_bytes || !o.measure_baseline ? 0 : o.measure_baseline();
    p.overhead_bytes = o.overhead_bytes ? o.overhead_bytes
                       : measured     ? round_up(std::size_t(measured), 64 << 10) + kRunReserve +
                                          std::uint64_t(o.workers) * kWorkerReserve + std::uint64_t(o.readers + 2) * kReaderReserve
                                      : (8ull << 20) + 700 * s.tensors;
    const std::uint64_t expert_slot = widened_bound(s.expert_bytes);  // one expert's slot, wherever it starts
    // The smallest useful piece: 4 MiB (smaller reads waste the disk's bandwidth for a saving of a few MB),
    // or one row of the widest matrix if that is larger. But a piece never holds more than one matrix, so
    // a chunk larger than the largest matrix is memory no read can use (a small model's whole layer can be
    // under 4 MiB). An explicit chunk_bytes may go lower (tests).
    const std::uint64_t min_row = round_up(std::size_t(std::max<std::uint64_t>(u.largest_row, kPageAlign)), kPageAlign);
    const std::uint64_t whole = round_up(std::size_t(std::max<std::uint64_t>(u.largest_matrix, kPageAlign)), kPageAlign);
    const std::uint64_t min_chunk = std::max<std::uint64_t>(min_row, std::min<std::uint64_t>(whole, 4 << 20));
    const std::uint64_t max_chunk = std::max(min_chunk, whole);
    auto slot_bytes = [&](std::uint64_t chunk) { return chunk + 2 * kPageAlign; };
    p.chunk_bytes = o.chunk_bytes ? std::max(o.chunk_bytes, min_row) : min_chunk;
    p.ring_slots = o.ring_slots ? o.ring_slots : 3;  // two pieces in flight while the consumer holds a third
    p.expert_slots = o.expert_slots ? o.expert_slots : (c.moe_layer_count() > 0 ? 2 : 0);
    p.ring_bytes = std::uint64_t(p.ring_slots) * slot_bytes(p.chunk_bytes);
    p.expert_bytes = p.expert_slots * expert_slot;
    p.floor = p.total();
    if (budget == kBudgetFloor) budget = p.budget = p.floor;
    if (budget < p.floor) return p;  // the caller refuses (plan_error_floor)
    std::uint64_t spare = budget - p.floor;
    // (2) streaming throughput: the largest chunk of 64, 32, ..., 4 MiB whose ring takes at most a quarter
    // of what is left (only when the caller left the choice to the planner): bigger reads run closer to
    // the disk's sequential bandwidth.
    if (!o.chunk_bytes && !o.ring_slots)
        for (std::uint64_t mb = 64; mb >= 4; mb /= 2) {
            const std::uint64_t want_chunk = std::min(max_chunk, std::max(min_chunk, mb << 20));
            if (want_chunk <= p.chunk_bytes) break;
            const std::uint64_t grow = 3 * slot_bytes(want_chunk) - p.ring_bytes;
            if (grow <= spare / 4) {
                p.chunk_bytes = want_chunk, p.ring_slots = 3, p.ring_bytes += grow, spare -= grow;
                break;
            }
        }
    // (3) pin units, largest first
    std::vector<std::pair<std::uint64_t, int>> units;  // bytes, layer (-1 = lm_head)
    for (std::size_t l = 0; l < u.layer_matrix.size(); ++l) units.push_back({u.layer_matrix[l], int(l)});
    units.push_back({u.lm_head, -1});
    std::stable_sort(units.begin(), units.end(), [](auto& a, auto& b) { return a.first > b.first; });
    for (auto [bytes, l] : units)
        if (bytes <= spare) {
            spare -= bytes;
            p.pinned_bytes += bytes;
            if (l < 0) p.lm_head_pinned = true;
            else p.pinned[std::size_t(l)] = true;
        }
    // (4) expert cache slots: at least k + 1 to be a cache at all (or every expert there is to hold)
    if (!o.expert_slots && c.moe_layer_count() > 0) {
        const std::size_t all = u.experts ? std::size_t(u.experts) : std::size_t(c.num_experts) * std::size_t(c.moe_layer_count());
        const std::size_t total = std::min<std::size_t>(p.expert_slots + std::size_t(spare / expert_slot), all);
        if (total > p.expert_slots && (total >= std::size_t(c.num_experts_per_token) + 1 || total == all)) {
            spare -= (total - p.expert_slots) * expert_slot;
            p.expert_slots = total;
            p.expert_bytes = total * expert_slot;
        }
    }
    // (5) the embedding table last: resident, it saves one 14 kB row read per token
    if (p.pinned_layers() == c.num_hidden_layers && p.lm_head_pinned && s.embed_bytes <= spare)
        p.embed_resident = true, p.embed_bytes = s.embed_bytes, spare -= s.embed_bytes;
    // a ring with nothing to stream only costs memory
    bool streams = !p.lm_head_pinned;
    for (bool pin : p.pinned) streams = streams || !pin;
    if (!streams) p.ring_slots = 0, p.ring_bytes = 0;
    // bytes read per token: unpinned matrices, the embedding row, the experts that miss (worst case: all)
    for (std::size_t l = 0; l < u.layer_matrix.size(); ++l)
        if (!p.pinned[l]) p.trunk_read_per_token += u.layer_matrix[l] + (l < u.layer_reread.size() ? u.layer_reread[l] : 0);
    if (!p.lm_head_pinned) p.trunk_read_per_token += u.lm_head;
    if (!p.embed_resident) p.trunk_read_per_token += s.embed_bytes / std::uint64_t(c.vocab_size);
    p.expert_read_per_token = std::uint64_t(c.moe_layer_count()) * std::uint64_t(c.num_experts_per_token) * s.expert_bytes;
    return p;
}

// The plan of a release-layout checkpoint of this config (release dtypes): what `kimik3 plan --config` shows.
inline Plan make_plan(const Config& c, const Census& s, std::uint64_t budget, const PlanOptions& o) {
    return make_plan(c, s, budget, o, unit_bytes(c));
}

inline std::string describe_plan(const Plan& p, const Config& c) {
    char buf[2048];
    std::string ring = "none (nothing streams)";
    if (p.ring_slots > 0)
        ring = std::to_string(p.ring_slots) + " slots of " + human_bytes(double(p.chunk_bytes + 2 * kPageAlign)) + " (chunks up to " +
               human_bytes(double(p.chunk_bytes)) + ")" + (p.ring_slots == 1 ? ", no read-ahead" : ", the reader works ahead");
    std::string pinned;
    int run_start = -1;
    for (std::size_t l = 0; l <= p.pinned.size(); ++l) {  // "0-3, 7" style ranges
        const bool on = l < p.pinned.size() && p.pinned[l];
        if (on && run_start < 0) run_start = int(l);
        if (!on && run_start >= 0) {
            pinned += (pinned.empty() ? "" : ",") + std::to_string(run_start) + (int(l) - 1 > run_start ? "-" + std::to_string(l - 1) : "");
            run_start = -1;
        }
    }
    std::snprintf(buf, sizeof buf,
                  "plan for a budget of %s (floor %s) at a %llu-token context\n"
                  "  resident: carried state %s, MLA cache %s, small tensors %s, work buffers %s, overhead %s\n"
                  "  pinned:   %d of %d layers [%s]%s%s: %s\n"
                  "  ring:     %s\n"
                  "  experts:  %zu slots of one expert (%s)%s\n"
                  "  expected peak memory %s; reads per token: trunk %s + experts up to %s\n",
                  human_bytes(double(p.budget)).c_str(), human_bytes(double(p.floor)).c_str(), (unsigned long long)p.context,
                  human_bytes(double(p.state_bytes)).c_str(), human_bytes(double(p.kv_bytes)).c_str(),
                  human_bytes(double(p.small_bytes)).c_str(), human_bytes(double(p.work_bytes)).c_str(),
                  human_bytes(double(p.overhead_bytes)).c_str(), p.pinned_layers(), c.num_hidden_layers, pinned.c_str(),
                  p.lm_head_pinned ? " + lm_head" : "", p.embed_resident ? " + embedding" : "", human_bytes(double(p.pinned_bytes)).c_str(),
                  ring.c_str(), p.expert_slots,
                  human_bytes(double(p.expert_bytes)).c_str(),
                  p.expert_slots > std::size_t(c.num_experts_per_token) ? " (a cache)"
                  : p.expert_slots >= 2 ? " (streamed, no cache: half compute while the rest are read)"
                                        : " (streamed, no cache)",
                  human_bytes(double(p.total())).c_str(), human_bytes(double(p.trunk_read_per_token)).c_str(),
                  human_bytes(double(p.expert_read_per_token)).c_str());
    return buf;
}

// ---------------------------------------------------------------------------------------------------
// 12.3 The ring
// ---------------------------------------------------------------------------------------------------
// A piece: rows [r0, r1) of streamed matrix `matrix`, i.e. bytes [offset, offset + nbytes) of one file.
struct PieceSource {
    int fd = -1, direct_fd = -1;             // buffered and O_DIRECT descriptors of the file
    const std::string* path = nullptr;
};
struct Piece {
    std::uint32_t matrix = 0, chunk = 0;
    std::uint64_t offset = 0, nbytes = 0;
    const PieceSource* src = nullptr;
    std::uint64_t key() const { return std::uint64_t(matrix) << 32 | chunk; }
};

namespace detail {
// A tensor read with O_DIRECT lands `skew` bytes into its 4096-aligned buffer, skew being its file offset
// modulo 4096. Release checkpoints keep every tensor 8-aligned, but a valid file may start its data
// section at any byte (the header length is not required to be a multiple of 8): then a bf16 or f32
// pointer at buf + skew is misaligned, which is undefined behaviour for every plain load in the kernels.
// So such bytes are moved to the buffer's start (memmove: the ranges overlap), once, when they arrive;
// returns the skew the data now has.
inline std::size_t align_piece(std::byte* buf, std::size_t skew, std::size_t nbytes) {
    if (skew % 16 == 0) return skew;
    std::memmove(buf, buf + skew, nbytes);
    return 0;
}
}  // namespace detail

struct RingStats {
    std::uint64_t pieces = 0, bytes = 0, prefetched = 0, waited = 0, mismatches = 0;
    double wait_seconds = 0, read_seconds = 0;  // read_seconds: wall time with at least one read in flight
    std::uint64_t busy_slot_reads = 0;  // reads aimed at a slot in use: must stay 0 (test 12.3)
};

class PieceRing {
  public:
    // `readers` threads read ahead (at most slots - 1: the consumer holds one slot); several readers keep
    // more than one read in flight, which most disks need to reach their bandwidth.
    PieceRing(int slots, std::uint64_t chunk_bytes, bool prefetch, int readers = 2)
        : slot_bytes_(chunk_bytes + 2 * kPageAlign), prefetch_(prefetch) {
        if (slots < 1) fail(ErrorKind::usage, "PieceRing: at least one slot");
        arena_.resize(std::size_t(slots) * slot_bytes_);
        slots_.resize(std::size_t(slots));
        if (prefetch_)
            for (int r = 0; r < std::max(1, std::min(readers, slots - 1)); ++r) readers_.emplace_back([this] { reader_loop(); });
    }
    PieceRing(const PieceRing&) = delete;
    PieceRing& operator=(const PieceRing&) = delete;
    ~PieceRing() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (std::thread& t : readers_) t.join();
    }
    RingStats stats() {  // a consistent copy (the reader thread updates the I/O counters)
        std::scoped_lock g(mu_, stats_mu_);
        return stats_;
    }
    std::uint64_t slot_bytes() const { return slot_bytes_; }

    // The consumer: waits for `p` (reading it here if the reader did not), returns its bytes. The slot
    // stays the consumer's until release(). The consumer holds at most one piece at a time.
    const std::byte* acquire(const Piece& p) {
        std::unique_lock<std::mutex> lk(mu_);
        learn(p);
        const auto t0 = std::chrono::steady_clock::now();
        for (;;) {
            const std::size_t at = find(p.key());
            if (at < slots_.size() && slots_[at].state == Ready) {  // prefetched (or read by a failed reader)
                Slot& s = slots_[at];
                if (s.failure) {  // the reader failed on this piece: surface it here, in order
                    std::exception_ptr e = s.failure;
                    s = Slot{};
                    cv_.notify_all();
                    std::rethrow_exception(e);
                }
                s.state = InUse;
                ++stats_.prefetched;
                stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                return arena_.data() + at * slot_bytes_ + s.skew;
            }
            if (at == slots_.size()) {  // not in the ring: read it here, into a free slot or over an unwanted one
                std::size_t victim = next_target();
                if (victim == slots_.size())
                    for (std::size_t i = 0; i < slots_.size(); ++i)
                        if (slots_[i].state == Ready) victim = i;
                if (victim < slots_.size()) {
                    if (slots_[victim].state == Ready) ++stats_.mismatches;  // prefetched, then not wanted
                    Slot& s = slots_[victim];
                    s = Slot{p.key(), Reading, false, 0, nullptr};
                    std::exception_ptr err;
                    const std::size_t skew = read_unlocked(lk, p, victim, err);
                    if (err) {
                        s = Slot{};
                        cv_.notify_all();
                        std::rethrow_exception(err);
                    }
                    s.state = InUse;
                    s.skew = skew;
                    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();  // read here: waited too
                    return arena_.data() + victim * slot_bytes_ + skew;
                }
            }
            ++stats_.waited;  // the reader is on it, or every slot is being read: wait
            cv_.wait(lk);
        }
    }

    // The consumer is done with `p`'s bytes: its slot becomes free for the reader.
    void release(const Piece& p) {
        {
            std::lock_guard<std::mutex> g(mu_);
            for (Slot& s : slots_)
                if (s.key == p.key() && s.state == InUse) {
                    s = Slot{};
                    break;
                }
        }
        cv_.notify_all();
    }

  private:
    enum State { Free, Reading, Ready, InUse };
    struct Slot {
        std::uint64_t key = UINT64_MAX;
        State state = Free;
        bool prefetched = false;
        std::size_t skew = 0;            // where the piece starts inside the slot (O_DIRECT widening)
        std::exception_ptr failure;
    };

    // The schedule is learned from the first pass of requests; after that the reader follows it.
    void learn(const Piece& p) {
        if (learned_) {
            if (cursor_ < schedule_.size() && schedule_[cursor_].key() == p.key()) cursor_ = (cursor_ + 1) % schedule_.size();
            else {
                auto it = std::find_if(schedule_.begin(), schedule_.end(), [&](const Piece& q) { return q.key() == p.key(); });
                cursor_ = it == schedule_.end() ? 0 : std::size_t(it - schedule_.begin() + 1) % schedule_.size();
            }
            return;
        }
        if (!schedule_.empty() && schedule_.front().key() == p.key()) {  // the first piece again: a step completed
            learned_ = true;
            cursor_ = 1 % schedule_.size();
            cv_.notify_all();
            return;
        }
        schedule_.push_back(p);
    }

    std::size_t read_piece(const Piece& p, std::byte* slot) {
        struct InFlight {  // counts this read, also when it throws; read_seconds = time with any read in flight
            PieceRing& r;
            explicit InFlight(PieceRing& ring) : r(ring) {
                std::lock_guard<std::mutex> g(r.stats_mu_);
                if (r.in_flight_++ == 0) r.busy_since_ = std::chrono::steady_clock::now();
            }
            ~InFlight() {
                std::lock_guard<std::mutex> g(r.stats_mu_);
                if (--r.in_flight_ == 0) r.stats_.read_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - r.busy_since_).count();
            }
        } in_flight(*this);
        const std::uint64_t start = p.offset / kPageAlign * kPageAlign;
        const std::size_t skew = std::size_t(p.offset - start), need = skew + std::size_t(p.nbytes);
        bool done = false;
        if (p.src->direct_fd >= 0)
            done = detail::pread_direct(p.src->direct_fd, p.src->fd, slot, start, round_up(need, kPageAlign), need, *p.src->path) > 0;
        if (!done) pread_exact(p.src->fd, slot + skew, std::size_t(p.nbytes), p.offset, *p.src->path);
        std::lock_guard<std::mutex> g(stats_mu_);
        stats_.pieces++;
        stats_.bytes += p.nbytes;
        return detail::align_piece(slot, skew, std::size_t(p.nbytes));
    }

    // Reads `p` into `slot` (marked Reading by the caller) with the lock released, so the consumer and
    // the other readers go on meanwhile; returns the skew, or sets `err`. The lock is held again after.
    std::size_t read_unlocked(std::unique_lock<std::mutex>& lk, const Piece& p, std::size_t slot, std::exception_ptr& err) {
        lk.unlock();
        std::size_t skew = 0;
        try {
            skew = read_piece(p, arena_.data() + slot * slot_bytes_);
        } catch (...) {
            err = std::current_exception();
        }
        lk.lock();
        return skew;
    }

    void reader_loop() {
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
            cv_.wait(lk, [&] { return stop_ || (learned_ && next_target() < slots_.size()); });
            if (stop_) return;
            // the next scheduled pieces not already in the ring, into free slots only
            const std::size_t target = next_target();
            const Piece* want = nullptr;
            for (std::size_t ahead = 0; ahead < schedule_.size() && !want; ++ahead) {
                const Piece& q = schedule_[(cursor_ + ahead) % schedule_.size()];
                bool present = false;
                for (const Slot& s : slots_) present = present || s.key == q.key();
                if (!present) want = &q;
                if (ahead + 1 >= slots_.size()) break;  // never further ahead than the ring is long
            }
            if (!want) {
                cv_.wait(lk);
                continue;
            }
            Slot& s = slots_[target];
            if (s.state != Free) ++stats_.busy_slot_reads;  // (cannot happen: next_target returns free slots)
            const Piece p = *want;
            s = Slot{p.key(), Reading, true, 0, nullptr};
            std::exception_ptr err;
            const std::size_t skew = read_unlocked(lk, p, target, err);
            s.state = Ready;
            s.skew = skew;
            s.failure = err;
            cv_.notify_all();
        }
    }

    std::size_t find(std::uint64_t key) const {
        for (std::size_t i = 0; i < slots_.size(); ++i)
            if (slots_[i].key == key && slots_[i].state != Free) return i;
        return slots_.size();
    }

    std::size_t next_target() const {
        for (std::size_t i = 0; i < slots_.size(); ++i)
            if (slots_[i].state == Free) return i;
        return slots_.size();
    }

    std::uint64_t slot_bytes_;
    bool prefetch_;
    AlignedBuffer arena_;                // (slots, slot_bytes)
    std::vector<Slot> slots_;
    std::vector<Piece> schedule_;
    bool learned_ = false, stop_ = false;
    std::size_t cursor_ = 0;
    std::mutex mu_, stats_mu_;
    std::condition_variable cv_;
    std::vector<std::thread> readers_;
    RingStats stats_;
    int in_flight_ = 0;                                   // reads under way (stats_mu_)
    std::chrono::steady_clock::time_point busy_since_;   // when in_flight_ last became 1
};

}  // namespace kimik3
