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
//   * pack-trunk refuses a layer whose tensors are not one contiguous run in one shard, verifies what it
//     wrote (re-read and compared by hash), and writes trunk.json last, after removing any old one, so
//     an interrupted pack never leaves a trunk that looks complete.
//
// SOURCES  Sheng et al., "FlexGen", arXiv:2303.06865 (planning where weights live, overlapping I/O with
//          compute); FareedKhan-dev/kimi-k3-in-c (trunk.bin, pinned layers). docs/sources.md 12.
// USES     chapters 00-02, 04 (MatrixRef, RowStream), 11 (detail::pread_direct, widened reads)
// RUN      make run-12        TEST   make test-12        CLI   kimik3 pack-trunk, kimik3 plan
//
// SECTIONS
//   12.1 sizes and presets      12.2 the plan           12.3 the ring          12.4 packing the trunk
//   12.5 the trunk's weights: smalls, pinned and streamed matrices, the embedding
// ====================================================================================================
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"
#include "01b_writer.hpp"  // APPENDIX: trunk.json and trunk.bin are written atomically
#include "02_config.hpp"
#include "04_matvec_bf16.hpp"
#include "11_expert_cache.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 12.1 Sizes and presets
// ---------------------------------------------------------------------------------------------------
// "8G", "40M", "1.5G", "123456" (bytes). K, M, G, T (or KB, MB, GB, TB) are decimal, as every size this
// program prints (human_bytes); KiB, MiB, GiB, TiB are binary.
inline std::uint64_t parse_size(const std::string& s) {
    std::size_t end = 0;
    double v = 0;
    try {
        v = std::stod(s, &end);
    } catch (...) {
        end = 0;
    }
    static const std::map<std::string, double> units = {
        {"", 1},          {"B", 1},         {"K", 1e3},       {"KB", 1e3},      {"M", 1e6},       {"MB", 1e6},
        {"G", 1e9},       {"GB", 1e9},      {"T", 1e12},      {"TB", 1e12},     {"KiB", 1024.0},  {"MiB", 1048576.0},
        {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    const auto unit = units.find(s.substr(end));
    if (end == 0 || unit == units.end() || !(v >= 0) || v * unit->second > 1e18)
        fail(ErrorKind::usage, "size '" + s + "' is not a size (examples: 8G, 512M, 40M, 1.5G, 16GiB)");
    return std::uint64_t(v * unit->second);
}

// The budget "floor": whatever the plan's floor comes to for this model and context (make_plan resolves
// it; the CLI's --budget floor). No real budget is this large.
constexpr std::uint64_t kBudgetFloor = ~std::uint64_t(0);

// MemAvailable from /proc/meminfo, in bytes (0 when unknown).
inline std::uint64_t mem_available() {
    std::ifstream f("/proc/meminfo");
    std::string key;
    std::uint64_t kb = 0;
    std::string unit;
    while (f >> key >> kb >> unit)
        if (key == "MemAvailable:") return kb * 1024;
    return 0;
}

// The named presets for the real K3 (the budgets of kimi-k3-in-c's laptop/desktop/server presets, about 8, 32 and
// 128 GB: github.com/FareedKhan-dev/kimi-k3-in-c), and `auto`: 90% of MemAvailable.
inline std::uint64_t preset_bytes(const std::string& name) {
    if (name == "laptop") return parse_size("8G");
    if (name == "desktop") return parse_size("32G");
    if (name == "server") return parse_size("128G");
    if (name == "auto") {
        const std::uint64_t a = mem_available();
        if (a == 0) fail(ErrorKind::usage, "preset auto: MemAvailable is unknown on this system; give --budget");
        return a / 10 * 9;
    }
    fail(ErrorKind::usage, "unknown preset '" + name + "' (laptop 8G, desktop 32G, server 128G, auto)");
}

// ---------------------------------------------------------------------------------------------------
// 12.2 The plan: what is resident, what streams, and how much memory that takes
// ---------------------------------------------------------------------------------------------------
// A "unit" is what can be pinned: the matrices of one layer, or the lm_head.
struct PlanOptions {
    std::uint64_t context = 4096;            // MLA cache capacity in positions
    std::uint64_t chunk_bytes = 0;           // 0: chosen by the planner
    int ring_slots = 0;                      // 0: chosen by the planner (3)
    std::size_t expert_slots = 0;            // 0: chosen by the planner
    std::uint64_t overhead_bytes = 0;        // process baseline (binary, libraries, headers); 0: estimated
};

struct Plan {
    std::uint64_t budget = 0, floor = 0;
    std::vector<bool> pinned;                // per layer: its matrices resident
    bool lm_head_pinned = false, embed_resident = false;
    std::uint64_t chunk_bytes = 0;
    int ring_slots = 0;
    std::size_t expert_slots = 0;
    std::uint64_t context = 0;
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
    std::uint64_t lm_head = 0, largest_row = 0;            // largest_row: the widest matrix row (one chunk must hold it)
    std::uint64_t largest_matrix = 0;                      // no piece is ever larger than this
};

inline bool is_matrix_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }
inline bool is_streamable_matrix(DType dtype, const Shape& shape) { return is_matrix_dtype(dtype) && shape.rank == 2 && shape[0] > 1; }
inline bool is_streamable_matrix(const TensorInfo& t) { return is_streamable_matrix(t.dtype, t.shape); }

// The resident bytes of a small tensor: kept widened to f32, whatever its stored dtype (12.5).
inline std::uint64_t small_resident_bytes(const Shape& shape) { return std::uint64_t(shape.numel()) * 4; }

namespace detail {
// Adds one layer tensor (its dtype, shape) to the per-unit sums.
inline void add_unit_tensor(UnitBytes& u, std::uint64_t& mat, std::uint64_t& small, DType dtype, const Shape& shape) {
    if (is_streamable_matrix(dtype, shape)) {
        const std::uint64_t bytes = std::uint64_t(shape.numel()) * dtype_size(dtype);
        mat += bytes;
        u.largest_row = std::max<std::uint64_t>(u.largest_row, bytes / std::uint64_t(shape[0]));
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
        for (const Expected& e : expected_layer_tensors(c, l)) detail::add_unit_tensor(u, mat, small, e.dtypes[0], e.shape);
        u.layer_matrix.push_back(mat);
        u.layer_small.push_back(small);
    }
    detail::add_lm_head(u, std::uint64_t(c.vocab_size) * std::uint64_t(c.hidden_size) * 2, std::uint64_t(c.hidden_size) * 2);
    return u;
}

// From a bound checkpoint: the same, with every tensor's real dtype (a checkpoint may store F32 or F16).
inline UnitBytes unit_bytes(const ModelTensors& m) {
    UnitBytes u;
    for (const LayerTensors& lt : m.layers) {
        std::uint64_t mat = 0, small = 0;
        for (const Checkpoint::Ref* r : lt.all) detail::add_unit_tensor(u, mat, small, r->info->dtype, r->info->shape);
        u.layer_matrix.push_back(mat);
        u.layer_small.push_back(small);
    }
    const TensorInfo& head = *m.lm_head->info;
    detail::add_lm_head(u, head.nbytes(), head.nbytes() / std::uint64_t(std::max<std::int64_t>(head.shape[0], 1)));
    return u;
}

inline std::string plan_error_floor(const Plan& p) {
    return "budget " + human_bytes(double(p.budget)) + " (" + std::to_string(p.budget) + " bytes) is below the floor of " +
           human_bytes(double(p.floor)) + " (" + std::to_string(p.floor) + " bytes) for this model at a " +
           std::to_string(p.context) + "-token context";
}

// Decides the plan. Order of priorities, each justified by a measurement (this project's, or kimi-k3-in-c's
// published ones): (1) the floor: carried
// state, latent KV cache, small tensors, work buffers, three ring slots (two reads in flight while the
// consumer holds a third), two expert slots; (2) bigger chunks (streaming throughput); (3) pin units largest first (every pinned byte is a
// byte not read per token; giving memory to the trunk first measured 1.69x faster than to the expert
// cache); (4) expert cache slots (the cache retained nothing below ~36 GB on K3, so it comes after the
// trunk); (5) the embedding table (resident, it saves one row read per token: the least per byte).
inline Plan make_plan(const Config& c, const Census& s, std::uint64_t budget, const PlanOptions& o, const UnitBytes& u) {
    Plan p;
    p.budget = budget;
    p.context = o.context;
    p.pinned.assign(std::size_t(c.num_hidden_layers), false);
    p.state_bytes = s.kda_state_bytes;
    p.kv_bytes = s.mla_cache_bytes_per_token * o.context;
    for (std::uint64_t b : u.layer_small) p.small_bytes += b;
    p.small_bytes += 3 * std::uint64_t(c.hidden_size) * 4;  // model.norm and the output AttnRes pair, widened to f32
    // work buffers of one decode step: activations and projections (a few widths of D, P, I, V)
    const std::uint64_t widest = std::max({std::uint64_t(c.intermediate_size), std::uint64_t(c.kda_width()) * 4,
                                           std::uint64_t(c.vocab_size), std::uint64_t(c.num_attention_heads) * c.kv_lora_rank});
    p.work_bytes = (16 * std::uint64_t(c.hidden_size) + 4 * widest) * 4 + 2 * 4096;
    // the process itself (program, libraries, thread stacks: ~8 MB measured) and the checkpoint's
    // metadata (headers, the name index, expert locations: ~700 bytes per tensor measured on a
    // header-only K3; ~350 MB for the release's ~500,000 tensors)
    p.overhead_bytes = o.overhead_bytes ? o.overhead_bytes : (8ull << 20) + 700 * s.tensors;
    const std::uint64_t expert_slot = round_up(std::size_t(s.expert_bytes), kPageAlign) + kPageAlign;
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
    // (4) expert cache slots: at least k + 1 to be a cache at all
    if (!o.expert_slots && c.moe_layer_count() > 0) {
        const std::size_t more = std::size_t(spare / expert_slot);
        const std::size_t total = std::min<std::size_t>(p.expert_slots + more, std::size_t(c.num_experts) * std::size_t(c.moe_layer_count()));
        if (total >= std::size_t(c.num_experts_per_token) + 1) {
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
        if (!p.pinned[l]) p.trunk_read_per_token += u.layer_matrix[l];
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

// ---------------------------------------------------------------------------------------------------
// 12.4 Packing the trunk: trunk.bin + trunk.json
// ---------------------------------------------------------------------------------------------------
// A 64-bit hash of bytes, used to verify the copy (FNV-1a over 8-byte words: simple, and fast enough to
// be no slower than the disk).
inline std::uint64_t hash_bytes(const std::byte* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        std::uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; ++i) h = (h ^ std::uint64_t(p[i])) * 1099511628211ull;
    return h;
}

struct TrunkLayer {
    std::uint64_t file_off = 0, nbytes = 0, hash = 0;  // the run in trunk.bin (4096-aligned start)
    std::uint64_t source_off = 0;                      // where the run starts in its shard
    std::string shard;
};
struct TrunkLayout {
    std::string dir;
    std::uint64_t file_bytes = 0;
    std::vector<TrunkLayer> layers;
    std::map<std::string, std::uint64_t> tensor_off;   // name -> absolute offset in trunk.bin
};

// The run of layer l's non-expert tensors in its shard: [lo, hi), refusing scattered layers.
inline std::pair<std::uint64_t, std::uint64_t> layer_run(const LayerTensors& lt) {
    std::uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
    const SafetensorsFile* file = lt.all.front()->file;
    for (const Checkpoint::Ref* r : lt.all) {
        if (r->file != file)
            fail(ErrorKind::format, "pack-trunk: layer " + std::to_string(lt.layer) + ": tensor '" + r->info->name + "' is in " +
                                        r->file->path() + ", not in " + file->path() + " with the rest of the layer");
        lo = std::min(lo, r->info->file_offset);
        hi = std::max(hi, r->info->file_offset + r->info->nbytes());
        sum += r->info->nbytes();
    }
    if (hi - lo != sum)
        fail(ErrorKind::format, "pack-trunk: layer " + std::to_string(lt.layer) + "'s non-expert tensors are not one contiguous run in " +
                                    file->path() + " (" + std::to_string(hi - lo - sum) + " foreign bytes between " +
                                    std::to_string(lo) + " and " + std::to_string(hi) + ")");
    return {lo, hi};
}

using Progress = std::function<void(const std::string& what, std::uint64_t done, std::uint64_t total)>;

inline TrunkLayout pack_trunk(const ModelTensors& m, const std::string& out_dir, const Progress& progress) {
    namespace fs = std::filesystem;
    fs::create_directories(out_dir);
    const std::string bin = out_dir + "/trunk.bin", json_path = out_dir + "/trunk.json";
    std::remove(json_path.c_str());  // first: an old trunk.json must never describe a half-written trunk.bin
    TrunkLayout t;
    t.dir = out_dir;
    std::uint64_t total = 0;
    for (const LayerTensors& lt : m.layers) {
        const auto [lo, hi] = layer_run(lt);
        TrunkLayer L;
        L.file_off = round_up(std::size_t(total), kPageAlign);
        L.nbytes = hi - lo;
        L.source_off = lo;
        L.shard = lt.all.front()->file->path();
        total = L.file_off + L.nbytes;
        t.layers.push_back(L);
        for (const Checkpoint::Ref* r : lt.all) t.tensor_off[r->info->name] = L.file_off + (r->info->file_offset - lo);
    }
    t.file_bytes = round_up(std::size_t(total), kPageAlign);
    const std::string tmp = bin + ".tmp";
    Fd out(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.get() < 0) fail(ErrorKind::runtime, tmp + ": cannot create: " + errno_text(errno));
    RemoveUnlessKept cleanup(tmp);  // a failed pack leaves no multi-GB trunk.bin.tmp behind
    if (::ftruncate(out.get(), off_t(t.file_bytes)) != 0) fail(ErrorKind::runtime, tmp + ": cannot size the file: " + errno_text(errno));
    AlignedBuffer buf(std::size_t(64) << 20);
    std::uint64_t done = 0;
    for (std::size_t l = 0; l < t.layers.size(); ++l) {
        TrunkLayer& L = t.layers[l];
        const SafetensorsFile* src = m.layers[l].all.front()->file;
        std::uint64_t h = 1469598103934665603ull;
        for (std::uint64_t at = 0; at < L.nbytes; at += buf.size()) {  // copy verbatim, hashing as we go
            const std::size_t n = std::size_t(std::min<std::uint64_t>(buf.size(), L.nbytes - at));
            pread_exact(src->fd(), buf.data(), n, L.source_off + at, src->path());
            h = hash_bytes(buf.data(), n, h);
            for (std::size_t w = 0; w < n;) {
                const ssize_t k = ::pwrite(out.get(), buf.data() + w, n - w, off_t(L.file_off + at + w));
                if (k < 0 && errno == EINTR) continue;
                if (k <= 0) fail(ErrorKind::runtime, tmp + ": write failed: " + errno_text(errno));
                w += std::size_t(k);
            }
            done += n;
            if (progress) progress("copy", done, total);
        }
        L.hash = h;
    }
    if (::fsync(out.get()) != 0) fail(ErrorKind::runtime, tmp + ": could not be flushed to disk: " + errno_text(errno));
    // drop the written pages from the page cache, so the verification reads the disk, not memory (advice:
    // a kernel may keep some; then this verifies less, never wrongly)
    ::posix_fadvise(out.get(), 0, 0, POSIX_FADV_DONTNEED);
    done = 0;
    for (std::size_t l = 0; l < t.layers.size(); ++l) {  // verify: read back what was written
        const TrunkLayer& L = t.layers[l];
        std::uint64_t h = 1469598103934665603ull;
        for (std::uint64_t at = 0; at < L.nbytes; at += buf.size()) {
            const std::size_t n = std::size_t(std::min<std::uint64_t>(buf.size(), L.nbytes - at));
            pread_exact(out.get(), buf.data(), n, L.file_off + at, tmp);
            h = hash_bytes(buf.data(), n, h);
            done += n;
            if (progress) progress("verify", done, total);
        }
        if (h != L.hash)
            fail(ErrorKind::io, tmp + ": layer " + std::to_string(l) + " reads back differently from what was written (disk error?)");
    }
    out.reset();
    if (std::rename(tmp.c_str(), bin.c_str()) != 0) fail(ErrorKind::runtime, bin + ": rename failed: " + errno_text(errno));
    cleanup.keep();
    nlohmann::ordered_json j;
    j["format"] = "kimik3-trunk";
    j["version"] = 1;
    j["align"] = kPageAlign;
    j["file_bytes"] = t.file_bytes;
    j["layers"] = nlohmann::ordered_json::array();
    for (std::size_t l = 0; l < t.layers.size(); ++l) {
        const TrunkLayer& L = t.layers[l];
        nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
        for (const Checkpoint::Ref* r : m.layers[l].all) {
            nlohmann::ordered_json shape = nlohmann::ordered_json::array();
            for (int i = 0; i < r->info->shape.rank; ++i) shape.push_back(r->info->shape[i]);
            tensors[r->info->name] = {{"off", t.tensor_off[r->info->name] - L.file_off},
                                      {"nbytes", r->info->nbytes()},
                                      {"dtype", dtype_name(r->info->dtype)},
                                      {"shape", shape}};
        }
        char hash[17];
        std::snprintf(hash, sizeof hash, "%016llx", (unsigned long long)L.hash);
        j["layers"].push_back({{"layer", l}, {"file_off", L.file_off}, {"nbytes", L.nbytes}, {"hash", hash}, {"tensors", tensors}});
    }
    const std::string text = j.dump(1) + "\n";
    SafetensorsWriter::write_text_atomic(json_path, text);
    return t;
}

// Opens a packed trunk and checks it against the checkpoint it claims to hold: every tensor of every
// layer present with the same dtype, shape and size, and trunk.bin exactly as long as recorded.
inline TrunkLayout load_trunk(const std::string& dir, const ModelTensors& m) {
    const std::string json_path = dir + "/trunk.json", bin = dir + "/trunk.bin";
    if (!path_present(json_path)) fail(ErrorKind::format, json_path + ": cannot open (run kimik3 pack-trunk first)");
    const nlohmann::json j = read_json_file(json_path, 64u << 20, "trunk.json");  // K3's is ~0.5 MB
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, json_path + ": " + what); };
    TrunkLayout t;
    t.dir = dir;
    try {  // a field of the wrong JSON type or a missing one (at() throws) is a malformed file, never a crash
        if (!j.is_object() || j.value("format", "") != "kimik3-trunk" || j.value("version", 0) != 1) bad("not a kimik3 trunk (format/version)");
        t.file_bytes = j.value("file_bytes", std::uint64_t(0));
        Fd fd = open_read(bin);
        if (file_size(fd.get(), bin) != t.file_bytes)
            bad("trunk.bin is " + std::to_string(file_size(fd.get(), bin)) + " bytes, trunk.json says " + std::to_string(t.file_bytes));
        const auto& layers = j.at("layers");
        if (!layers.is_array() || layers.size() != m.layers.size())
            bad("has " + std::to_string(layers.is_array() ? layers.size() : 0) + " layers, the checkpoint " + std::to_string(m.layers.size()));
        for (std::size_t l = 0; l < m.layers.size(); ++l) {
            const auto& L = layers.at(l);
            TrunkLayer tl;
            tl.file_off = L.value("file_off", std::uint64_t(0));
            tl.nbytes = L.value("nbytes", std::uint64_t(0));
            if (tl.file_off % kPageAlign || tl.file_off > t.file_bytes || tl.nbytes > t.file_bytes - tl.file_off)
                bad("layer " + std::to_string(l) + ": bad run");
            const auto& tensors = L.at("tensors");
            for (const Checkpoint::Ref* r : m.layers[l].all) {
                const std::string& name = r->info->name;
                if (!tensors.is_object() || !tensors.contains(name)) bad("layer " + std::to_string(l) + " has no tensor '" + name + "'");
                const auto& e = tensors.at(name);
                std::vector<std::int64_t> want_shape(r->info->shape.dims.begin(), r->info->shape.dims.begin() + r->info->shape.rank);
                const bool same_shape = e.contains("shape") && e["shape"].is_array() && e["shape"] == nlohmann::json(want_shape);
                if (e.value("nbytes", std::uint64_t(0)) != r->info->nbytes() || e.value("dtype", "") != dtype_name(r->info->dtype) || !same_shape)
                    bad("tensor '" + name + "' differs from the checkpoint's (size, dtype or shape): the trunk was packed from another model");
                const std::uint64_t off = e.value("off", std::uint64_t(0));
                if (off > tl.nbytes || r->info->nbytes() > tl.nbytes - off) bad("tensor '" + name + "' runs past its layer");
                t.tensor_off[name] = tl.file_off + off;
            }
            t.layers.push_back(tl);
        }
    } catch (const nlohmann::json::exception& e) {
        std::string what = e.what();
        if (const std::size_t at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
        bad("malformed (" + what + ")");
    }
    return t;
}

// ---------------------------------------------------------------------------------------------------
// 12.5 The trunk's weights: small tensors, pinned and streamed matrices, the embedding
// ---------------------------------------------------------------------------------------------------
// How a bound matrix tensor's elements are stored, for the kernels (chapter 04, 4.5): the release's
// BF16, or F16/F32 from a checkpoint saved at another precision (chapter 02 binds no other dtype).
inline WeightType weight_type(const TensorInfo& t) {
    if (t.dtype == DType::BF16) return WeightType::bf16;
    if (t.dtype == DType::F16) return WeightType::f16;
    if (t.dtype == DType::F32) return WeightType::f32;
    fail(ErrorKind::format, "tensor '" + t.name + "': dtype " + dtype_name(t.dtype) + " is not a matrix dtype (BF16, F16, F32)");
}

// A bound 2-D tensor as the kernels see it, given where its bytes are.
inline MatrixRef matrix_ref(const Checkpoint::Ref* r, const void* bytes) {
    return MatrixRef{bytes, nullptr, std::size_t(r->info->shape[0]), std::size_t(r->info->shape[1]), weight_type(*r->info)};
}

// One streamed matrix: its rows arrive through the ring in pieces of at most chunk_bytes.
class MatrixStream : public RowStream {
  public:
    MatrixStream(PieceRing& ring, std::uint32_t id, const PieceSource* src, std::uint64_t offset, std::size_t rows, std::size_t row_bytes,
                 std::uint64_t chunk_bytes)
        : ring_(ring), id_(id), src_(src), offset_(offset), rows_(rows), row_bytes_(row_bytes),
          chunk_rows_(std::max<std::size_t>(1, std::size_t(chunk_bytes / row_bytes))) {}
    void for_each_chunk(const std::function<void(std::size_t, std::size_t, const void*)>& f) override {
        for (std::size_t r0 = 0, c = 0; r0 < rows_; r0 += chunk_rows_, ++c) {
            const std::size_t r1 = std::min(rows_, r0 + chunk_rows_);
            const Piece p{id_, std::uint32_t(c), offset_ + r0 * row_bytes_, (r1 - r0) * row_bytes_, src_};
            const std::byte* bytes = ring_.acquire(p);
            struct Release {  // release even if the computation throws
                PieceRing& ring;
                const Piece& p;
                ~Release() { ring.release(p); }
            } release{ring_, p};
            f(r0, r1, bytes);
        }
    }

  private:
    PieceRing& ring_;
    std::uint32_t id_;
    const PieceSource* src_;
    std::uint64_t offset_;
    std::size_t rows_, row_bytes_, chunk_rows_;
};

struct TrunkStats {
    std::uint64_t startup_bytes = 0;   // pinned matrices, small tensors, embedding read at start
    std::uint64_t embed_rows = 0;
};

// Gives the forward pass (chapter 13) every non-expert weight as the plan says: small tensors and
// pinned matrices from memory, other matrices streamed through the ring, embedding rows on demand.
class TrunkWeights {
  public:
    TrunkWeights(const ModelTensors& m, const Plan& plan, const TrunkLayout* trunk, bool direct, const Progress& progress = {})
        : m_(m), plan_(plan) {
        // sources: every shard (and trunk.bin), buffered + O_DIRECT descriptors
        for (const auto& layer : m.layers)
            for (const Checkpoint::Ref* r : layer.all) source_for(r->file->path());
        for (const Checkpoint::Ref* r : {m.embed, m.lm_head}) source_for(r->file->path());
        if (trunk) trunk_src_ = &source_for(trunk->dir + "/trunk.bin"), trunk_ = trunk;
        if (direct)
            for (auto& [path, s] : sources_) s.direct_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (plan.ring_slots > 0) ring_ = std::make_unique<PieceRing>(plan.ring_slots, plan.chunk_bytes, plan.ring_slots > 0);
        // what is loaded at start: small tensors of every layer, pinned matrices, maybe the embedding
        std::uint64_t total = 0, done = 0;
        std::vector<std::pair<const Checkpoint::Ref*, bool>> load;  // (tensor, is a matrix)
        for (std::size_t l = 0; l < m.layers.size(); ++l)
            for (const Checkpoint::Ref* r : m.layers[l].all) {
                const bool mat = is_streamable_matrix(*r->info);
                if (!mat || plan.pinned[l]) load.push_back({r, mat}), total += r->info->nbytes();
            }
        for (const Checkpoint::Ref* r : {m.final_norm, m.out_res_norm, m.out_res_proj}) load.push_back({r, false}), total += r->info->nbytes();
        if (plan.lm_head_pinned) load.push_back({m.lm_head, true}), total += m.lm_head->info->nbytes();
        if (plan.embed_resident) load.push_back({m.embed, true}), total += m.embed->info->nbytes();
        for (auto [r, mat] : load) {  // O_DIRECT where possible: no second copy in the page cache
            const auto [src, off] = where(r);
            const std::uint64_t start = off / kPageAlign * kPageAlign;
            const std::size_t skew = std::size_t(off - start), need = skew + std::size_t(r->info->nbytes());
            Resident& res = resident_[r->info];
            res.buf.resize(round_up(need, kPageAlign));
            res.skew = skew;
            if (src->direct_fd < 0 || detail::pread_direct(src->direct_fd, src->fd, res.buf.data(), start, round_up(need, kPageAlign), need, *src->path) == 0)
                pread_exact(src->fd, res.buf.data() + skew, std::size_t(r->info->nbytes()), off, *src->path);
            res.skew = detail::align_piece(res.buf.data(), skew, std::size_t(r->info->nbytes()));
            if (!mat) require_finite(*r->info, res.data());  // norms, biases, decay parameters: checked once, here
            done += r->info->nbytes();
            if (progress) progress("load", done, total);
        }
        stats_.startup_bytes = total;
        // small tensors are kept widened to f32 (exactly; F32 ones as they are): the forward pass reads
        // every norm, conv tap and bias as f32 whatever dtype the checkpoint chose
        for (auto [r, mat] : load) {
            if (mat) continue;
            Resident& res = resident_.at(r->info);
            const std::size_t n = std::size_t(r->info->numel());
            res.f32.resize(n);
            const std::byte* bytes = res.data();
            if (r->info->dtype == DType::F32) {
                if (n) std::memcpy(res.f32.data(), bytes, n * 4);
            } else if (r->info->dtype == DType::BF16 || r->info->dtype == DType::F16) {
                const bool b = r->info->dtype == DType::BF16;
                for (std::size_t i = 0; i < n; ++i) {
                    std::uint16_t h;
                    std::memcpy(&h, bytes + 2 * i, 2);  // any alignment: a data section may start anywhere
                    res.f32[i] = b ? bf16_to_f32(h) : f16_to_f32(h);
                }
            } else {
                fail(ErrorKind::format, "tensor '" + r->info->name + "': dtype " + dtype_name(r->info->dtype) + " is not a float type");
            }
            res.buf = AlignedBuffer();  // the raw bytes are no longer needed
        }
        // one stream per unpinned matrix, ids in layer order
        for (std::size_t l = 0; l < m.layers.size(); ++l)
            if (!plan.pinned[l])
                for (const Checkpoint::Ref* r : m.layers[l].all)
                    if (is_streamable_matrix(*r->info)) add_stream(r);
        if (!plan.lm_head_pinned) add_stream(m.lm_head);
    }
    ~TrunkWeights() {
        // the ring's reader threads may still be reading ahead through these descriptors: stop and join
        // them first (the streams hold references to the ring), then close
        streams_.clear();
        ring_.reset();
        for (auto& [path, s] : sources_)
            if (s.direct_fd >= 0) ::close(s.direct_fd);
    }
    TrunkWeights(const TrunkWeights&) = delete;
    TrunkWeights& operator=(const TrunkWeights&) = delete;

    // A small tensor (norm, AttnRes vector, conv taps, A_log, dt_bias, router bias), widened to f32.
    const float* vec(const Checkpoint::Ref* r) const {
        auto it = resident_.find(r->info);
        if (it == resident_.end() || it->second.f32.size() != std::size_t(r->info->numel()))
            fail(ErrorKind::runtime, "tensor '" + r->info->name + "' is not a resident small tensor");
        return it->second.f32.data();
    }
    MatrixRef matrix(const Checkpoint::Ref* r) const {
        auto it = resident_.find(r->info);
        if (it != resident_.end()) return matrix_ref(r, it->second.data());
        MatrixRef m = matrix_ref(r, nullptr);
        m.stream = streams_.at(r->info).get();
        return m;
    }
    MatrixRef lm_head() const { return matrix(m_.lm_head); }

    // The embedding row of token `id`, widened to f32 (exact, whatever the table's float dtype).
    void embed_row(float* out, std::int64_t id) {  // out (D)
        const std::size_t D = std::size_t(m_.embed->info->shape[1]);
        if (id < 0 || id >= m_.embed->info->shape[0])
            fail(ErrorKind::usage, "token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(m_.embed->info->shape[0]) + ")");
        const WeightType type = weight_type(*m_.embed->info);
        const std::size_t row_bytes = D * weight_bytes(type);
        const std::byte* row;
        auto it = resident_.find(m_.embed->info);
        if (it != resident_.end()) {
            row = it->second.data() + std::size_t(id) * row_bytes;
        } else {
            row_.resize(row_bytes);
            const auto [src, off] = where(m_.embed);
            pread_exact(src->fd, row_.data(), row_bytes, off + std::uint64_t(id) * row_bytes, *src->path);
            row = row_.data();
            ++stats_.embed_rows;
        }
        for (std::size_t j = 0; j < D; ++j) out[j] = detail::widen(type, row, j);
    }

    RingStats ring_stats() const { return ring_ ? ring_->stats() : RingStats{}; }
    const TrunkStats& stats() const { return stats_; }

  private:
    PieceSource& source_for(const std::string& path) {
        auto it = sources_.find(path);
        if (it != sources_.end()) return it->second;
        fds_.push_back(open_read(path));
        PieceSource& s = sources_[path];
        s.fd = fds_.back().get();
        s.path = &sources_.find(path)->first;
        return s;
    }
    // The file and absolute offset of a tensor: trunk.bin when packed (layer tensors), else its shard.
    std::pair<const PieceSource*, std::uint64_t> where(const Checkpoint::Ref* r) const {
        if (trunk_) {
            auto it = trunk_->tensor_off.find(r->info->name);
            if (it != trunk_->tensor_off.end()) return {trunk_src_, it->second};
        }
        return {&sources_.at(r->file->path()), r->info->file_offset};
    }
    void add_stream(const Checkpoint::Ref* r) {
        const auto [src, off] = where(r);
        streams_[r->info] = std::make_unique<MatrixStream>(*ring_, std::uint32_t(streams_.size()), src, off,
                                                            std::size_t(r->info->shape[0]), matrix_ref(r, nullptr).row_bytes(), plan_.chunk_bytes);
    }

    const ModelTensors& m_;
    Plan plan_;
    const TrunkLayout* trunk_ = nullptr;
    const PieceSource* trunk_src_ = nullptr;
    std::map<std::string, PieceSource> sources_;
    std::deque<Fd> fds_;
    std::unique_ptr<PieceRing> ring_;
    struct Resident {  // a tensor read at start: its bytes begin `skew` into the (O_DIRECT-aligned) buffer
        AlignedBuffer buf;
        std::size_t skew = 0;
        std::vector<float> f32;  // small tensors: the values widened to f32 (then buf is released)
        const std::byte* data() const { return buf.data() + skew; }
    };
    std::map<const TensorInfo*, Resident> resident_;
    std::map<const TensorInfo*, std::unique_ptr<MatrixStream>> streams_;
    std::vector<std::byte> row_;
    TrunkStats stats_;
};

}  // namespace kimik3
