// kimik3 chapter 11: expert_cache -- reading routed experts from disk, keeping a few, and measuring honestly.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   K3's routed experts are 1.45 TB: no ordinary computer holds them. The engine reads the experts a
//   token needs straight from the release's shards and keeps some in a fixed arena in case they come
//   back. This chapter builds that: an expert store (one aligned O_DIRECT read per expert), a cache of
//   whole-expert slots behind a small eviction-policy interface, a trace of every request, and a
//   simulator that replays a trace under LRU, LFU and Belady's optimum at any size. New since chapter
//   10: I/O inside the engine (direct I/O, alignment, parallel reads, reading the next group while this
//   one computes, failures that must never become weights), and measuring a cache honestly (retention
//   across steps, not raw hits).
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 2.2, 3.6; kimi-k3-in-c's measurements: its README,
//   CHANGELOG and PERFORMANCE.md at github.com/FareedKhan-dev/kimi-k3-in-c)
//   One expert = six U8 tensors stored back to back: 3 x (5,505,024 + 344,064) = 17,547,264 bytes
//   (= 4284 x 4096). 896 experts x 92 MoE layers = 82,432 experts. A token routes to 16 per layer:
//   16 x 17.5 MB = 281 MB per token-layer, 25.8 GB per token when nothing is kept.
//
//   Why a cache helps little for K3, from these numbers alone. A token walks the 92 MoE layers in order,
//   16 experts each: 16 x 92 = 1,472 requests (25.8 GB), and the next token walks the same cycle. An
//   expert of layer l is worth keeping only if the next token picks it again at layer l, 1,471 requests
//   later. With S < 1,472 slots, LRU has evicted it by then (every slot was reused in between): 0 hits.
//   Any policy holds at most S of the 82,432 experts, and with the load spread evenly (K3's router is
//   trained for that: the selection bias of chapter 10) a request finds its expert resident with
//   probability about S / 82,432: 887 slots (the server preset's 15.6 GB) keep at most ~1.1% of
//   requests, 2,050 slots (36 GB) ~2.5%, and every 1% more costs 824 slots = 14.5 GB, against 25.8 GB
//   read per token. The engine before us, kimi-k3-in-c (github.com/FareedKhan-dev/kimi-k3-in-c, its
//   PERFORMANCE.md), measured exactly that: its LRU cache retained 0% below ~36 GB of arena, and memory
//   did more good holding the trunk. A cache pays only where routing is skewed (a few experts per layer
//   taking most requests), so size it from a recorded trace (section 11.6) before giving it memory.
//   make run-11 replays K3-shaped traces with balanced and with skewed routing at 887, 1,472 and 2,944
//   slots to show both cases.
//
// CONCEPTS
//   slot          room for one whole expert: the largest aligned read of any expert, a multiple of 4096
//                 (K3: 17,551,360 = 4285 pages when an expert starts off a page boundary).
//   O_DIRECT      reads that bypass the page cache: the device writes straight into our buffer, so the
//                 buffer, the file offset and the length must be multiples of 4096. Buffered reads of a
//                 1.45 TB working set only churn the page cache (kimi-k3-in-c measured 1.9 GB/s buffered
//                 against 6.6 GB/s direct, in its published measurements).
//   widened read  the aligned range around an expert: [offset rounded down, end rounded up to 4096).
//                 The expert starts at offset % 4096 inside the slot; at the end of a file the read
//                 stops early, which is fine once the expert's last byte has arrived.
//   hit / miss    a requested expert found in a slot / read from disk into one.
//   step          begin_step() starts one: a decoded token or a prefill chunk.
//   retention     a hit on an expert loaded in an EARLIER step. A hit within the same step (an id twice
//                 in a batch, a layer run twice) says nothing about keeping experts across tokens; the
//                 raw "hits" kimi-k3-in-c reported (its PERFORMANCE.md) counted experts the
//                 same batch had just read.
//   trace         every (step, layer, expert) request in order. Routing never depends on the cache (the
//                 router sees activations, not residency), so replaying a trace under another policy or
//                 size gives exactly the requests that cache would have seen. A trace recorded with
//                 full-recompute decode (every step re-runs the whole prefix) repeats the prefix's experts
//                 each step and inflates reuse: record with incremental decode.
//   Belady (MIN)  evict the expert whose next use is farthest away: optimal, needs the future, so it lives
//                 only in the simulator, as the bound no policy can beat.
//   compulsory    the first request of each distinct expert misses at any size: 1 - distinct / requests
//                 is the ceiling of every policy's hit rate.
//
// TRACE FILE (.k3trace, all fields little-endian)
//     offset size  field                      offset size  field
//       0     8    magic "KIMIK3TR"             28     4    steps
//       8     4    version (1)                  32     8    expert bytes (17,547,264)
//      12     4    record bytes (8)             40     8    records N
//      16     4    layers (93)                  48    8N    records: step u32, layer u16, expert u16
//      20     4    experts per layer (896)
//      24     4    k, experts per token (16)
//
// CONTRACT
//   * An expert is read when requested and not resident, never speculatively: read-ahead (prefetch)
//     only reads the next group of experts the router has already chosen. A contiguous expert (the release)
//     is one read of its widened span; a scattered one, one read per part. Every read goes through
//     chapter 01's detail::pread_hook (appendix 01a). O_DIRECT per shard unless refused (open or read fails with
//     EINVAL: that shard is read buffered from then on, same bytes, same slot layout).
//   * A read error, or end of file before the expert's last byte, is Error(io) naming the expert, the
//     file, the offset and the size; a scale byte 255 is Error(format) naming the tensor; a trace file
//     that is missing or malformed is Error(format), one that cannot be written Error(runtime). After a
//     failed fetch no slot the batch was reading into stays resident (its hits stay as they were): the
//     next request for any of its misses reads again.
//   * fetch(layer, ids): hits first, then misses in request order into the lowest empty slot or the
//     policy's victim; a slot holding an expert of this batch is never the victim (so ids.size() <=
//     slots always fits). Misses are read in parallel (`readers` threads) in (shard path, offset) order.
//   * prefetch(layer, ids) admits the next group at once, exactly as its fetch would, except that the
//     current group's slots are busy (never victims), and reads its misses on a background thread
//     while the caller computes; the fetch of that group waits for them and throws their failures.
//     The simulator (11.6) replays the same groups with the same busy slots.
//   * Statistics (requests, hits, retained, misses, evictions, bytes_read) depend only on the requests
//     and the slot count, never on timing or threads; disk_bytes (widening), read_seconds and
//     wait_seconds (the part of the reads the caller waited for) may vary.
//   * LRU evicts the least recently requested; LFU the fewest requests since loaded, ties to LRU; Belady
//     the farthest next use, ties (never used again) to the lower slot. No policy or size changes a bit
//     of the model's output: the provider only decides where weights come from.
//
// LEAVES OUT  speculative prefetch of experts the router has not chosen yet (kimi-k3-in-c measured it
//   as a loss, in its published measurements), pinned hot experts, macOS F_NOCACHE. Chapter 12 decides
//   how much memory the cache gets.
//
// SOURCES  Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
//          Journal 5(2), 1966 (the optimum the simulator replays); Eliseev and Mazur, arXiv:2312.17238
//          (LRU expert offloading); FareedKhan-dev/kimi-k3-in-c (its README, CHANGELOG and
//          PERFORMANCE.md). docs/sources.md 11.
// USES     chapters 00 (Error), 01 (AlignedBuffer; appendix 01a: Fd, pread_exact, pread_direct, pread_hook;
//          appendix 01b: write_text_atomic), 02 (ExpertLocation,
//          human_bytes), 05 (check_e8m0_scales), 06 (ExpertWeights), 10 (ExpertProvider)
// RUN      make run-11      TEST   make test-11      BENCH   make bench (bench/bench_experts.hpp)
// CLI      kimik3 simulate-cache TRACE --sizes 17,64,256 [--svg FILE] [--disk-mbps 1300]
//
// SECTIONS
//   11.1 the expert store     11.2 eviction policies     11.3 the slot table
//   11.4 the cache            11.5 the trace             11.6 the simulator
// ====================================================================================================
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"
#include "01b_writer.hpp"  // APPENDIX: traces are written atomically
#include "02_config.hpp"
#include "05_mxfp4.hpp"
#include "06_situ_ffn.hpp"
#include "10_moe.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 11.1 The expert store: one aligned read per expert, straight from the shards
// ---------------------------------------------------------------------------------------------------
namespace detail {

// Bytes of the aligned read around [offset, offset + n): the slot room this range needs.
inline std::size_t widened_bytes(std::uint64_t offset, std::uint64_t n) {
    return round_up(std::size_t(offset % kPageAlign + n), kPageAlign);
}
}  // namespace detail

// The most memory one slot can need for an expert of `expert_bytes` contiguous bytes, wherever it
// starts: its bytes widened to 4096-byte boundaries at both ends (what the planner and the simulator count).
inline std::uint64_t expert_slot_bound(std::uint64_t expert_bytes) {
    return round_up(std::size_t(expert_bytes), kPageAlign) + kPageAlign;
}

// Reads routed experts of a bound model (chapter 02) into caller-owned, 4096-aligned slots. Thread-safe:
// several reads may run at once. `m` must outlive the store.
class ExpertStore {
  public:
    explicit ExpertStore(const ModelTensors& m, bool direct = true) : m_(m) {
        std::map<std::string, const SafetensorsFile*> files;  // by path: the disk order of shards
        for (const auto& layer : m.experts)
            for (const ExpertLocation& x : layer) {
                std::size_t need = 0;
                for (const Checkpoint::Ref* p : x.parts) {
                    if (!p) fail(ErrorKind::usage, "ExpertStore: an expert location is missing a part");
                    files[p->file->path()] = p->file;
                    need += detail::widened_bytes(p->info->file_offset, p->info->nbytes());
                }
                if (x.contiguous) need = detail::widened_bytes(x.span_offset, x.span_bytes);
                slot_bytes_ = std::max(slot_bytes_, need);
            }
        if (slot_bytes_ == 0) fail(ErrorKind::usage, "ExpertStore: the model has no routed experts");
        for (const auto& [path, f] : files) {
            auto s = std::make_unique<Shard>();
            s->order = shards_.size();
            if (direct) {
                const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
                if (fd >= 0) s->direct_fd = Fd(fd), s->direct = true;
                else if (errno != EINVAL) fail(ErrorKind::format, path + ": cannot open with O_DIRECT: " + errno_text(errno));
            }
            by_file_[f] = s.get();
            shards_.push_back(std::move(s));
        }
    }

    std::size_t slot_bytes() const { return slot_bytes_; }  // room one expert's widened read needs
    std::size_t shards() const { return shards_.size(); }
    std::size_t direct_shards() const {  // how many shards are read with O_DIRECT now
        std::size_t n = 0;
        for (const auto& s : shards_) n += s->direct.load();
        return n;
    }

    const ExpertLocation& location(int layer, int e) const {
        if (layer < 0 || std::size_t(layer) >= m_.experts.size() || m_.experts[std::size_t(layer)].empty())
            fail(ErrorKind::usage, "layer " + std::to_string(layer) + " has no routed experts");
        if (e < 0 || std::size_t(e) >= m_.experts[std::size_t(layer)].size())
            fail(ErrorKind::usage, "no routed expert " + std::to_string(e) + " in layer " + std::to_string(layer));
        return m_.experts[std::size_t(layer)][std::size_t(e)];
    }

    // Where an expert starts on disk, for issuing a batch's reads in order: (shard rank, byte offset).
    std::pair<std::size_t, std::uint64_t> disk_order(int layer, int e) const {
        const ExpertLocation& x = location(layer, e);
        return {by_file_.at(x.parts[0]->file)->order, x.contiguous ? x.span_offset : x.parts[0]->info->file_offset};
    }

    // Reads expert (layer, e) into `slot` (slot_bytes(), 4096-aligned) and returns its six tensors inside
    // it. Adds the bytes transferred to *disk_bytes. Throws; never returns unchecked weights.
    ExpertWeights read(int layer, int e, std::byte* slot, std::uint64_t* disk_bytes = nullptr) const {
        const ExpertLocation& x = location(layer, e);
        if (reinterpret_cast<std::uintptr_t>(slot) % kPageAlign != 0) fail(ErrorKind::usage, "ExpertStore::read: slot is not 4096-aligned");
        std::array<const std::uint8_t*, 6> part{};
        std::uint64_t disk = 0;
        auto u8 = [](const std::byte* p) { return reinterpret_cast<const std::uint8_t*>(p); };
        try {
            if (x.contiguous) {  // the release: one read; part p sits at its file offset minus the span's
                const std::byte* base = read_range(*x.file, x.span_offset, x.span_bytes, slot, disk);
                for (std::size_t p = 0; p < 6; ++p) part[p] = u8(base + (x.parts[p]->info->file_offset - x.span_offset));
            } else {  // scattered: one read per part, each in its own aligned room, one after another
                std::byte* room = slot;
                for (std::size_t p = 0; p < 6; ++p) {
                    const TensorInfo& t = *x.parts[p]->info;
                    part[p] = u8(read_range(*x.parts[p]->file, t.file_offset, t.nbytes(), room, disk));
                    room += detail::widened_bytes(t.file_offset, t.nbytes());
                }
            }
        } catch (const Error& err) {
            fail(err.kind, "routed expert " + std::to_string(e) + " of layer " + std::to_string(layer) + ": " + err.what());
        }
        for (std::size_t p : {1, 3, 5}) check_e8m0_scales(part[p], x.parts[p]->info->nbytes(), x.parts[p]->info->name);
        if (disk_bytes) *disk_bytes += disk;
        return ExpertWeights{part[0], part[1], part[2], part[3], part[4], part[5]};
    }

  private:
    struct Shard {
        std::size_t order = 0;          // rank of the path among the shards
        Fd direct_fd;                   // the second descriptor, opened with O_DIRECT
        std::atomic<bool> direct{false};
    };

    // File bytes [offset, offset + n) land at dst + offset % 4096 whichever way they are read.
    const std::byte* read_range(const SafetensorsFile& f, std::uint64_t offset, std::uint64_t n, std::byte* dst,
                                std::uint64_t& disk) const {
        Shard& s = *by_file_.at(&f);
        const std::uint64_t start = offset / kPageAlign * kPageAlign;
        const std::size_t lead = std::size_t(offset - start);
        if (s.direct.load()) {
            const std::size_t got = detail::pread_direct(s.direct_fd.get(), f.fd(), dst, start, detail::widened_bytes(offset, n),
                                                         lead + std::size_t(n), f.path());
            if (got > 0) return disk += got, dst + lead;
            s.direct = false;  // EINVAL: this file system refuses O_DIRECT; read this shard buffered from now on
        }
        pread_exact(f.fd(), dst + lead, std::size_t(n), offset, f.path());
        disk += n;
        return dst + lead;
    }

    const ModelTensors& m_;
    std::size_t slot_bytes_ = 0;
    std::vector<std::unique_ptr<Shard>> shards_;
    std::unordered_map<const SafetensorsFile*, Shard*> by_file_;
};

// ---------------------------------------------------------------------------------------------------
// 11.2 Eviction policies
// ---------------------------------------------------------------------------------------------------
// A policy sees which slot each request used and picks a victim when a miss finds no empty slot.
// `pos` is the request's number over the cache's life (= its index in the trace): all LRU needs for
// recency, all Belady needs to look up the future.
class EvictionPolicy {
  public:
    virtual ~EvictionPolicy() = default;
    virtual void used(std::size_t slot, std::uint64_t pos, bool loaded) = 0;  // loaded: a miss just filled it
    // The slot to empty among those with eligible[slot] != 0 (there is at least one).
    virtual std::size_t victim(const std::vector<std::uint8_t>& eligible) const = 0;
};

enum class PolicyKind { lru, lfu, belady };
inline const char* policy_name(PolicyKind k) { return k == PolicyKind::lru ? "LRU" : k == PolicyKind::lfu ? "LFU" : "Belady"; }
inline constexpr std::uint64_t kNeverAgain = UINT64_MAX;

// The three policies differ only in a score kept per slot: the victim is the eligible slot with the
// lowest (score, tie-break), and the lower slot on a full tie.
//   LRU     (last request number, -)                           least recently used
//   LFU     (requests since loaded, last request number)       in-cache LFU: the count restarts on load
//   Belady  (kNeverAgain - next request number, -)             farthest next use; never-again ties -> lower slot
class ScoredPolicy : public EvictionPolicy {
  public:
    ScoredPolicy(PolicyKind kind, std::size_t slots, const std::vector<std::uint64_t>* next_use)
        : kind_(kind), score_(slots), next_use_(next_use) {}
    void used(std::size_t slot, std::uint64_t pos, bool loaded) override {
        auto& [first, second] = score_[slot];
        if (kind_ == PolicyKind::lru) first = pos;
        if (kind_ == PolicyKind::lfu) first = loaded ? 1 : first + 1, second = pos;
        if (kind_ == PolicyKind::belady) first = kNeverAgain - next_use_->at(std::size_t(pos));
    }
    std::size_t victim(const std::vector<std::uint8_t>& eligible) const override {
        std::size_t best = SIZE_MAX;
        for (std::size_t s = 0; s < score_.size(); ++s)
            if (eligible[s] && (best == SIZE_MAX || score_[s] < score_[best])) best = s;
        return best;
    }

  private:
    PolicyKind kind_;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> score_;  // (slots)
    const std::vector<std::uint64_t>* next_use_;                  // (requests) Belady: next request for the same expert
};

inline std::unique_ptr<EvictionPolicy> make_policy(PolicyKind k, std::size_t slots, const std::vector<std::uint64_t>* next_use = nullptr) {
    if (k == PolicyKind::belady && !next_use) fail(ErrorKind::usage, "Belady's policy needs the future: it runs only in the simulator");
    return std::make_unique<ScoredPolicy>(k, slots, next_use);
}

// ---------------------------------------------------------------------------------------------------
// 11.3 The slot table: which expert is in which slot, batch admission, statistics
// ---------------------------------------------------------------------------------------------------
// Shared by the cache (11.4) and the simulator (11.6), so the simulator replays exactly what the cache
// does: the same admission order, the same victims, the same counts.
struct CacheStats {
    std::uint64_t requests = 0;    // experts asked for
    std::uint64_t hits = 0;        // found resident (raw: includes experts loaded in this same step)
    std::uint64_t retained = 0;    // found resident from an EARLIER step: what keeping experts bought
    std::uint64_t misses = 0;      // read from disk
    std::uint64_t evictions = 0;   // resident experts dropped to make room
    std::uint64_t bytes_read = 0;  // misses x expert bytes
    std::uint64_t steps = 0;       // steps that made requests
    std::uint64_t disk_bytes = 0;  // bytes transferred (O_DIRECT widening included; cache only)
    double read_seconds = 0;       // wall time of the reads (cache only; not deterministic)
    double wait_seconds = 0;       // time fetch kept its caller waiting: reads not hidden by a read-ahead
};

// The requests themselves, as the cache (11.4) records them; 11.5 writes and reads them.
struct ExpertRequest {
    std::uint32_t step;
    std::uint16_t layer, expert;
};
static_assert(sizeof(ExpertRequest) == 8, "a trace record is 8 bytes: step u32, layer u16, expert u16");

struct Trace {
    std::uint32_t layers = 0, experts = 0, k = 0, steps = 0;  // num_hidden_layers, num_experts, K, steps
    std::uint64_t expert_bytes = 0;
    std::vector<ExpertRequest> requests;  // in request order
};

inline std::uint64_t expert_key(int layer, int e) { return std::uint64_t(std::uint32_t(layer)) << 32 | std::uint32_t(e); }

class SlotTable {
  public:
    static constexpr std::uint64_t kEmpty = UINT64_MAX;
    struct Placement {
        std::size_t slot;
        bool load;  // a miss: the caller must read the expert into the slot
    };

    SlotTable(std::size_t slots, std::unique_ptr<EvictionPolicy> policy, std::uint64_t expert_bytes)
        : key_(slots, kEmpty), loaded_step_(slots, 0), eligible_(slots, 0), policy_(std::move(policy)), expert_bytes_(expert_bytes) {
        if (slots == 0) fail(ErrorKind::usage, "an expert cache needs at least 1 slot");
        for (std::size_t s = 0; s < slots; ++s) free_.insert(s);
    }
    std::size_t slots() const { return key_.size(); }
    std::uint32_t step() const { return step_; }
    const CacheStats& stats() const { return stats_; }
    CacheStats& stats() { return stats_; }
    bool resident(std::uint64_t key) const { return where_.count(key) != 0; }

    // A new step starts only if the current one made requests: empty steps are not counted.
    void begin_step() {
        if (in_step_) ++step_, in_step_ = false;
    }

    // Admits one batch (keys.size() + busy.size() <= slots). out[i]: the slot of keys[i] and whether it
    // must be read. `busy`: slots still in use by the previous group (read-ahead): never victims here.
    void admit(std::span<const std::uint64_t> keys, std::vector<Placement>& out, std::span<const std::size_t> busy = {}) {
        if (keys.size() + busy.size() > slots())
            fail(ErrorKind::usage, std::to_string(keys.size()) + " experts at once" +
                                       (busy.empty() ? std::string() : " beside " + std::to_string(busy.size()) + " in use") +
                                       ", but the cache has " + std::to_string(slots()) + " slots");
        for (std::size_t s : busy) eligible_[s] = 0;
        const std::uint64_t pos0 = stats_.requests;
        out.assign(keys.size(), Placement{SIZE_MAX, true});
        in_step_ = in_step_ || !keys.empty();
        stats_.requests += keys.size();
        stats_.steps = step_ + (in_step_ ? 1 : 0);
        for (std::size_t i = 0; i < keys.size(); ++i)  // pass 1: hits (pinned: not evictable by this batch)
            if (auto it = where_.find(keys[i]); it != where_.end()) hit(out[i], it->second, pos0 + i);
        for (std::size_t i = 0; i < keys.size(); ++i) {  // pass 2: misses, in request order
            if (out[i].slot != SIZE_MAX) continue;
            if (auto it = where_.find(keys[i]); it != where_.end()) {  // the same id earlier in this batch
                hit(out[i], it->second, pos0 + i);
                continue;
            }
            std::size_t s;
            if (!free_.empty()) {
                s = *free_.begin();  // the lowest empty slot
                free_.erase(free_.begin());
            } else {
                s = policy_->victim(eligible_);
                where_.erase(key_[s]);
                ++stats_.evictions;
            }
            key_[s] = keys[i];
            where_[keys[i]] = s;
            loaded_step_[s] = step_;
            eligible_[s] = 0;
            ++stats_.misses;
            stats_.bytes_read += expert_bytes_;
            policy_->used(s, pos0 + i, true);
            out[i] = Placement{s, true};
        }
        for (const Placement& p : out) eligible_[p.slot] = key_[p.slot] != kEmpty;  // unpin
        for (std::size_t s : busy) eligible_[s] = key_[s] != kEmpty;
    }

    // The read into `slot` failed: it holds nothing valid, so it becomes empty again.
    void forget(std::size_t slot) {
        if (key_[slot] == kEmpty) return;
        where_.erase(key_[slot]);
        key_[slot] = kEmpty;
        eligible_[slot] = 0;
        free_.insert(slot);
    }

  private:
    void hit(Placement& p, std::size_t slot, std::uint64_t pos) {
        ++stats_.hits;
        if (loaded_step_[slot] < step_) ++stats_.retained;
        eligible_[slot] = 0;
        policy_->used(slot, pos, false);
        p = Placement{slot, false};
    }

    std::vector<std::uint64_t> key_;          // (slots) expert_key held, or kEmpty
    std::vector<std::uint32_t> loaded_step_;  // (slots) step in which the expert was read
    std::vector<std::uint8_t> eligible_;      // (slots) 1 = occupied and not pinned by the current batch
    std::set<std::size_t> free_;              // empty slots, lowest first
    std::unordered_map<std::uint64_t, std::size_t> where_;  // expert_key -> slot
    std::unique_ptr<EvictionPolicy> policy_;
    std::uint64_t expert_bytes_;
    std::uint32_t step_ = 0;
    bool in_step_ = false;
    CacheStats stats_;
};

// ---------------------------------------------------------------------------------------------------
// 11.4 The cache: an arena of slots, batch fetches with parallel reads, read-ahead, an ExpertProvider
// ---------------------------------------------------------------------------------------------------
struct ExpertCacheOptions {
    bool direct = true;                   // O_DIRECT reads (each shard falls back to buffered if refused)
    int readers = 16;                     // parallel reads per batch: the disk's queue depth (16 = K3's k;
                                          // random 17.55 MB O_DIRECT reads on this project's 2-vCPU VM: 0.94 GB/s at
                                          // depth 1, 1.37 at 16)
    PolicyKind policy = PolicyKind::lru;  // lru or lfu (Belady needs the future: simulator only)
};

class ExpertCache : public ExpertProvider {
  public:
    ExpertCache(const ModelTensors& m, const Config& c, std::size_t slots, ExpertCacheOptions o = {})
        : store_(m, o.direct), slot_bytes_(checked_slot_bytes(store_, slots, c)),
          table_(slots, make_policy(o.policy, slots), m.expert_bytes), options_(o), weights_(slots) {
        arena_.resize(slots * slot_bytes_);  // (slots, slot_bytes), 4096-aligned; pages arrive on first read
        trace_ = Trace{std::uint32_t(c.num_hidden_layers), std::uint32_t(c.num_experts), std::uint32_t(c.num_experts_per_token), 0,
                       m.expert_bytes, {}};
    }

    // How many slots `bytes` of arena hold; refuses fewer than K + 1 (a whole token-layer plus one).
    static std::size_t slots_for_budget(std::uint64_t bytes, const ModelTensors& m, const Config& c) {
        const std::uint64_t slot = ExpertStore(m, false).slot_bytes(), need = slot * std::uint64_t(c.num_experts_per_token + 1);
        if (bytes < need)
            fail(ErrorKind::budget, "expert cache budget of " + std::to_string(bytes) + " bytes (" + human_bytes(double(bytes)) +
                                        ") is below the minimum of " + std::to_string(c.num_experts_per_token + 1) + " slots (k + 1) x " +
                                        std::to_string(slot) + " bytes = " + std::to_string(need) + " bytes (" +
                                        human_bytes(double(need)) + ")");
        return std::size_t(bytes / slot);
    }

    std::size_t capacity() const override { return table_.slots(); }
    std::size_t slot_bytes() const { return slot_bytes_; }
    const CacheStats& stats() const { return table_.stats(); }
    const Trace& trace() const { return trace_; }
    void clear_trace() { trace_.requests.clear(); }  // a long-running program (kimik3 serve) keeps it bounded
    const ExpertStore& store() const { return store_; }
    bool resident(int layer, int e) const { return table_.resident(expert_key(layer, e)); }
    void begin_step() override {
        finish_ahead();  // a read-ahead nobody fetched (an exception in between): keep what it read
        table_.begin_step();
    }
    ~ExpertCache() override { finish_ahead(); }  // a read in flight writes into arena_: wait for it
    ExpertCache(const ExpertCache&) = delete;
    ExpertCache& operator=(const ExpertCache&) = delete;

    void fetch(int layer, std::span<const int> ids, ExpertWeights* out) override {
        const auto t0 = std::chrono::steady_clock::now();
        if (ahead_.pending && ahead_.layer == layer && std::equal(ids.begin(), ids.end(), ahead_.ids.begin(), ahead_.ids.end())) {
            if (ahead_.thread.joinable()) ahead_.thread.join();  // the read-ahead of exactly this group: admitted already
            current_ = std::move(ahead_);
            ahead_ = Batch{};
        } else {
            finish_ahead();
            admit(layer, ids, {}, current_);  // the previous group is done with: its slots may be taken
            read_batch(current_);
        }
        table_.stats().wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        settle(current_, true);
        for (std::size_t i = 0; i < ids.size(); ++i) out[i] = weights_[current_.placed[i].slot];
    }

    bool reads_ahead() const override { return true; }

    // Admits `ids` now, exactly as the next fetch would (same trace, counts and victims, except that
    // the current group's slots are busy), and reads the misses on a background thread. The matching
    // fetch waits for them and reports their failures.
    void prefetch(int layer, std::span<const int> ids) override {
        finish_ahead();
        std::vector<std::size_t> busy;
        for (const SlotTable::Placement& p : current_.placed) busy.push_back(p.slot);
        admit(layer, ids, busy, ahead_);
        ahead_.pending = true;
        if (!ahead_.misses.empty()) ahead_.thread = std::thread([this] { read_batch(ahead_); });
    }

  private:
    // One group: its ids, where they went, which must be read (in disk order), and how the reads went.
    struct Batch {
        int layer = 0;
        std::vector<int> ids;
        std::vector<SlotTable::Placement> placed;
        std::vector<std::size_t> misses;        // indices into ids, in (shard path, offset) order
        std::vector<std::exception_ptr> errors;  // per miss
        std::uint64_t disk_bytes = 0;
        double read_seconds = 0;
        std::thread thread;                     // a read-ahead's reads in flight
        bool pending = false;                   // a read-ahead no fetch has collected yet
        bool settled = true;                    // its counts merged and its failures handled
    };

    // Refuses a dense layer, a bad id, or more ids than fit beside `busy` before anything changes.
    void admit(int layer, std::span<const int> ids, std::span<const std::size_t> busy, Batch& b) {
        keys_.clear();
        for (int id : ids) {
            store_.location(layer, id);
            keys_.push_back(expert_key(layer, id));
        }
        table_.admit(keys_, b.placed, busy);  // checks the count first
        b.layer = layer;
        b.ids.assign(ids.begin(), ids.end());
        for (int id : ids) trace_.requests.push_back({table_.step(), std::uint16_t(layer), std::uint16_t(id)});
        trace_.steps = std::uint32_t(table_.stats().steps);
        b.misses.clear();
        for (std::size_t i = 0; i < ids.size(); ++i)
            if (b.placed[i].load) b.misses.push_back(i);
        std::sort(b.misses.begin(), b.misses.end(),
                  [&](std::size_t x, std::size_t y) { return store_.disk_order(layer, b.ids[x]) < store_.disk_order(layer, b.ids[y]); });
        b.errors.assign(b.misses.size(), nullptr);
        b.disk_bytes = 0;
        b.read_seconds = 0;
        b.settled = false;
    }

    // Reads a batch's misses with up to `readers` threads, each taking the next miss in disk order.
    // Touches only the batch and its slots (never the table), so it may run on a background thread.
    void read_batch(Batch& b) noexcept {
        const std::size_t n = b.misses.size();
        if (n == 0) return;
        std::vector<std::uint64_t> disk(n, 0);
        std::atomic<std::size_t> next{0};
        auto work = [&] {
            for (std::size_t j; (j = next.fetch_add(1)) < n;) {
                const std::size_t slot = b.placed[b.misses[j]].slot;
                try {
                    weights_[slot] = store_.read(b.layer, b.ids[b.misses[j]], arena_.data() + slot * slot_bytes_, &disk[j]);
                } catch (...) {
                    b.errors[j] = std::current_exception();
                }
            }
        };
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> pool;
        const std::size_t threads = std::min<std::size_t>(n, std::size_t(std::max(1, options_.readers)));
        try {
            for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
        } catch (...) {  // no thread to spare: the readers that started, and this one, do the rest
        }
        work();  // this thread is a reader too
        for (std::thread& th : pool) th.join();
        b.read_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (std::uint64_t x : disk) b.disk_bytes += x;
    }

    // Merges a finished batch's counts. Any failure empties every slot of the batch's misses (no
    // half-trusted data); `rethrow`: then throws the first failure in disk order, whatever thread saw it.
    void settle(Batch& b, bool rethrow) {
        if (b.settled) return;
        b.settled = true;
        CacheStats& s = table_.stats();
        s.read_seconds += b.read_seconds;
        s.disk_bytes += b.disk_bytes;
        for (const std::exception_ptr& e : b.errors)
            if (e) {
                for (std::size_t i : b.misses) table_.forget(b.placed[i].slot);
                b.placed.clear();  // nothing of this batch is in use any more
                if (rethrow) std::rethrow_exception(e);
                return;
            }
    }

    // Waits for a read-ahead that no fetch will collect, keeping what it read (a failure is dropped with
    // its slots: whoever asks for those experts reads them again).
    void finish_ahead() {
        if (ahead_.thread.joinable()) ahead_.thread.join();
        settle(ahead_, false);
        ahead_.pending = false;
    }

    // Checked before anything is sized by `slots`: a count that overflows memory, or ids the trace's
    // 16-bit fields cannot hold, is refused with the numbers rather than failing inside an allocation.
    static std::size_t checked_slot_bytes(const ExpertStore& store, std::size_t slots, const Config& c) {
        const std::size_t slot = store.slot_bytes();
        if (slots > SIZE_MAX / slot / 2)
            fail(ErrorKind::budget, "expert cache: " + std::to_string(slots) + " slots of " + std::to_string(slot) + " bytes overflow memory");
        if (c.num_hidden_layers > 65535 || c.num_experts > 65535)
            fail(ErrorKind::usage, "expert cache: the trace stores layer and expert ids in 16 bits, but the model has " +
                                       std::to_string(c.num_hidden_layers) + " layers and " + std::to_string(c.num_experts) +
                                       " experts (K3: 93 and 896)");
        return slot;
    }

    ExpertStore store_;
    std::size_t slot_bytes_;
    SlotTable table_;
    ExpertCacheOptions options_;
    AlignedBuffer arena_;                   // (slots, slot_bytes)
    std::vector<ExpertWeights> weights_;    // (slots) the six tensors inside each slot
    Trace trace_;
    std::vector<std::uint64_t> keys_;       // scratch of one admission
    Batch current_;                         // the group the last fetch returned (its slots are busy)
    Batch ahead_;                           // the group being read ahead, if any
};

// ---------------------------------------------------------------------------------------------------
// 11.5 The trace file (layout in the top block) and the per-expert histogram
// ---------------------------------------------------------------------------------------------------
inline constexpr char kTraceMagic[8] = {'K', 'I', 'M', 'I', 'K', '3', 'T', 'R'};
inline constexpr std::uint32_t kTraceVersion = 1;
inline constexpr std::size_t kTraceHeaderBytes = 48, kTraceRecordBytes = sizeof(ExpertRequest);

namespace detail {
inline void put_le(std::string& out, std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xFF);
}
inline std::uint64_t get_le(const std::string& in, std::size_t at, int bytes) {
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = v << 8 | std::uint8_t(in[at + std::size_t(i)]);
    return v;
}
}  // namespace detail

inline std::string trace_bytes(const Trace& t) {
    std::string out(kTraceMagic, 8);
    for (std::uint32_t v : {kTraceVersion, std::uint32_t(kTraceRecordBytes), t.layers, t.experts, t.k, t.steps}) detail::put_le(out, v, 4);
    detail::put_le(out, t.expert_bytes, 8);
    detail::put_le(out, t.requests.size(), 8);
    for (const ExpertRequest& r : t.requests) detail::put_le(out, r.step, 4), detail::put_le(out, r.layer, 2), detail::put_le(out, r.expert, 2);
    return out;
}

inline void write_trace(const std::string& path, const Trace& t) { SafetensorsWriter::write_text_atomic(path, trace_bytes(t)); }

// Reads and validates a trace: size, magic, version, record size, then every record's ranges.
inline Trace read_trace(const std::string& path) {
    Fd fd = open_read(path);
    std::string in(std::size_t(file_size(fd.get(), path)), '\0');
    pread_exact(fd.get(), in.data(), in.size(), 0, path);
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, path + ": " + what); };
    if (in.size() < kTraceHeaderBytes)
        bad(std::to_string(in.size()) + " bytes is shorter than the 48-byte header of a kimik3 expert trace");
    if (in.compare(0, 8, kTraceMagic, 8) != 0) {
        std::string magic;  // printable: other bytes as \xNN
        for (char ch : in.substr(0, 8)) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "\\x%02X", unsigned(std::uint8_t(ch)));
            magic += ch >= 0x20 && ch < 0x7F && ch != '"' && ch != '\\' ? std::string(1, ch) : std::string(hex);
        }
        bad("not a kimik3 expert trace (magic \"" + magic + "\", expected \"KIMIK3TR\"); HINT: record one with ExpertCache::trace() "
            "and write_trace()");
    }
    const std::uint64_t version = detail::get_le(in, 8, 4), record = detail::get_le(in, 12, 4);
    if (version != kTraceVersion) bad("trace version " + std::to_string(version) + " is not supported (this reader knows version 1)");
    if (record != kTraceRecordBytes) bad("record size " + std::to_string(record) + " is not 8");
    Trace t;
    t.layers = std::uint32_t(detail::get_le(in, 16, 4));
    t.experts = std::uint32_t(detail::get_le(in, 20, 4));
    t.k = std::uint32_t(detail::get_le(in, 24, 4));
    t.steps = std::uint32_t(detail::get_le(in, 28, 4));
    t.expert_bytes = detail::get_le(in, 32, 8);
    const std::uint64_t n = detail::get_le(in, 40, 8);
    if (n > (in.size() - kTraceHeaderBytes) / kTraceRecordBytes || in.size() != kTraceHeaderBytes + n * kTraceRecordBytes)
        bad("truncated or padded: the header promises " + std::to_string(n) + " records (" +
            (n > UINT64_MAX / 16 ? std::string("too many") : std::to_string(kTraceHeaderBytes + n * kTraceRecordBytes)) +
            " bytes) but the file holds " + std::to_string(in.size()) + " bytes");
    if (t.k == 0 || t.k > t.experts || t.layers > 65535 || t.experts > 65535)
        bad("header fields out of range: layers " + std::to_string(t.layers) + ", experts " + std::to_string(t.experts) + ", k " +
            std::to_string(t.k));
    t.requests.resize(std::size_t(n));
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t at = kTraceHeaderBytes + i * kTraceRecordBytes;
        ExpertRequest& r = t.requests[i];
        r = {std::uint32_t(detail::get_le(in, at, 4)), std::uint16_t(detail::get_le(in, at + 4, 2)), std::uint16_t(detail::get_le(in, at + 6, 2))};
        if (r.layer >= t.layers || r.expert >= t.experts || r.step >= t.steps || (i > 0 && r.step < t.requests[i - 1].step))
            bad("record " + std::to_string(i) + " (step " + std::to_string(r.step) + ", layer " + std::to_string(r.layer) + ", expert " +
                std::to_string(r.expert) + ") is out of range or out of step order");
    }
    return t;
}

// CSV "layer,expert,requests": every expert of every layer that appears in the trace, zeros included
// (an expert never asked for is as telling as a hot one).
inline std::string trace_histogram_csv(const Trace& t) {
    std::map<std::uint32_t, std::vector<std::uint64_t>> counts;  // layer -> (experts)
    for (const ExpertRequest& r : t.requests) {
        auto& c = counts[r.layer];
        c.resize(t.experts, 0);
        ++c[r.expert];
    }
    std::string out = "layer,expert,requests\n";
    for (const auto& [layer, c] : counts)
        for (std::size_t e = 0; e < c.size(); ++e) out += std::to_string(layer) + "," + std::to_string(e) + "," + std::to_string(c[e]) + "\n";
    return out;
}
inline void write_trace_histogram(const std::string& path, const Trace& t) { SafetensorsWriter::write_text_atomic(path, trace_histogram_csv(t)); }

// ---------------------------------------------------------------------------------------------------
// 11.6 The simulator: replay a trace under a policy and a size
// ---------------------------------------------------------------------------------------------------
// For each request, the number of the next request for the same expert (kNeverAgain if none).
inline std::vector<std::uint64_t> next_uses(const Trace& t) {
    std::vector<std::uint64_t> next(t.requests.size(), kNeverAgain);
    std::unordered_map<std::uint64_t, std::uint64_t> later;  // expert_key -> nearest later request
    for (std::size_t i = t.requests.size(); i-- > 0;) {
        const std::uint64_t key = expert_key(t.requests[i].layer, t.requests[i].expert);
        if (auto it = later.find(key); it != later.end()) next[i] = it->second;
        later[key] = i;
    }
    return next;
}

// Replays `t` as moe_forward would have asked a cache of `slots` slots: per (step, layer) run of
// requests, groups of expert_group_size(slots, reads ahead, run length) in trace order, each admitted
// with the previous group of its run busy (read-ahead), begin_step() where the step changes.
inline CacheStats replay_trace(const Trace& t, std::size_t slots, PolicyKind kind, const std::vector<std::uint64_t>* next_use = nullptr) {
    std::vector<std::uint64_t> own;
    if (kind == PolicyKind::belady && !next_use) own = next_uses(t), next_use = &own;
    SlotTable table(slots, make_policy(kind, slots, next_use), t.expert_bytes);
    std::vector<std::uint64_t> keys;
    std::vector<SlotTable::Placement> placed;
    std::vector<std::size_t> busy;
    for (std::size_t i = 0, j; i < t.requests.size(); i = j) {
        if (i > 0 && t.requests[i].step != t.requests[i - 1].step) table.begin_step();
        for (j = i; j < t.requests.size() && t.requests[j].step == t.requests[i].step && t.requests[j].layer == t.requests[i].layer;) ++j;
        const std::size_t group = expert_group_size(slots, true, j - i);
        busy.clear();
        for (std::size_t b = i; b < j; b += group) {
            keys.clear();
            for (std::size_t r = b; r < std::min(j, b + group); ++r) keys.push_back(expert_key(t.requests[r].layer, t.requests[r].expert));
            table.admit(keys, placed, busy);
            busy.clear();
            if (2 * group <= slots)  // moe_forward reads ahead only with room for two groups
                for (const SlotTable::Placement& p : placed) busy.push_back(p.slot);
        }
    }
    return table.stats();
}

struct SimResult {
    std::size_t slots = 0;
    PolicyKind policy = PolicyKind::lru;
    CacheStats stats;
};

inline std::size_t distinct_experts(const Trace& t) {
    std::set<std::uint64_t> keys;
    for (const ExpertRequest& r : t.requests) keys.insert(expert_key(r.layer, r.expert));
    return keys.size();
}

// Every size under LRU, LFU and Belady, in that order.
inline std::vector<SimResult> simulate_cache(const Trace& t, std::span<const std::size_t> sizes) {
    const std::vector<std::uint64_t> next = next_uses(t);
    std::vector<SimResult> out;
    for (std::size_t s : sizes)
        for (PolicyKind k : {PolicyKind::lru, PolicyKind::lfu, PolicyKind::belady}) out.push_back({s, k, replay_trace(t, s, k, &next)});
    return out;
}

inline double percent(std::uint64_t part, std::uint64_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0.0; }

// The table: per size and policy, hit and retention rates, bytes read per step (token) and, given a
// disk speed in MB/s, the seconds per token those reads cost.
inline void print_simulation(std::FILE* out, const Trace& t, const std::vector<SimResult>& results, double disk_mbps = 0) {
    const std::size_t n = t.requests.size(), distinct = distinct_experts(t);
    std::fprintf(out, "trace: %zu requests in %u steps; top-%u of %u experts; %s per expert\n", n, t.steps, t.k, t.experts,
                 human_bytes(double(t.expert_bytes)).c_str());
    std::fprintf(out, "compulsory misses: %zu distinct experts, so no policy at any size hits more than %.1f%%\n", distinct,
                 100.0 - percent(distinct, n));
    std::fprintf(out, "  %6s %10s  %-7s %6s %10s %10s %12s", "slots", "memory", "policy", "hit %", "retained %", "evictions", "read/step");
    if (disk_mbps > 0) std::fprintf(out, "  s/step @ %.0f MB/s", disk_mbps);
    std::fprintf(out, "\n");
    for (const SimResult& r : results) {
        const double per_step = t.steps ? double(r.stats.bytes_read) / double(t.steps) : 0.0;
        std::fprintf(out, "  %6zu %10s  %-7s %6.1f %10.1f %10llu %12s", r.slots, human_bytes(double(r.slots * expert_slot_bound(t.expert_bytes))).c_str(),
                     policy_name(r.policy), percent(r.stats.hits, r.stats.requests), percent(r.stats.retained, r.stats.requests),
                     (unsigned long long)r.stats.evictions, human_bytes(per_step).c_str());
        if (disk_mbps > 0) std::fprintf(out, "  %10.4g", per_step / (disk_mbps * 1e6));
        std::fprintf(out, "\n");
    }
}

// A hand-written SVG: hit rate (%) against cache size (slots, log scale), one polyline per policy, and
// the compulsory-miss ceiling dashed.
inline std::string simulation_svg(const Trace& t, const std::vector<SimResult>& results, const std::string& title) {
    std::set<std::size_t> sizes;
    for (const SimResult& r : results) sizes.insert(r.slots);
    if (sizes.empty()) fail(ErrorKind::usage, "simulation_svg: no results to plot");
    const double left = 70, right = 590, top = 50, bottom = 370;  // plot area in a 760 x 440 canvas
    const double lo = std::log(double(*sizes.begin())), hi = std::log(double(*sizes.rbegin()));
    auto X = [&](std::size_t s) { return hi > lo ? left + (right - left) * (std::log(double(s)) - lo) / (hi - lo) : (left + right) / 2; };
    auto Y = [&](double pct) { return bottom - (bottom - top) * pct / 100.0; };
    std::string esc;
    for (char ch : title) esc += ch == '&' ? "&amp;" : ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : std::string(1, ch);
    std::string svg;
    char b[512];
    auto add = [&](const char* fmt, auto... v) { std::snprintf(b, sizeof b, fmt, v...), svg += b; };
    svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\"440\" viewBox=\"0 0 760 440\" "
           "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"760\" height=\"440\" fill=\"white\"/>\n";
    svg += "<text x=\"70\" y=\"28\" font-size=\"15\">" + esc + "</text>\n";
    for (int pct = 0; pct <= 100; pct += 20)
        add("<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%d%%</text>\n",
            left, Y(pct), right, Y(pct), left - 6, Y(pct) + 4, pct);
    for (std::size_t s : sizes)
        add("<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#000\"/><text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%zu</text>\n",
            X(s), bottom, X(s), bottom + 5, X(s), bottom + 19, s);
    add("<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#000\"/><line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#000\"/>\n", left,
        bottom, right, bottom, left, top, left, bottom);
    add("<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">cache size (expert slots, log scale)</text>\n", (left + right) / 2, bottom + 42);
    add("<text transform=\"translate(22 %g) rotate(-90)\" text-anchor=\"middle\">hit rate (%%)</text>\n", (top + bottom) / 2);
    const double ceiling = 100.0 - percent(distinct_experts(t), t.requests.size());
    add("<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"6 4\"/>\n", left, Y(ceiling), right, Y(ceiling));
    add("<text x=\"%g\" y=\"%.1f\" fill=\"#888\">compulsory ceiling %.1f%%</text>\n", right + 10, Y(ceiling) + 4, ceiling);
    const char* colour[3] = {"#1f77b4", "#ff7f0e", "#2ca02c"};
    for (PolicyKind k : {PolicyKind::lru, PolicyKind::lfu, PolicyKind::belady}) {
        const char* c = colour[int(k)];
        std::string points;
        for (const SimResult& r : results)
            if (r.policy == k) {
                const double x = X(r.slots), y = Y(percent(r.stats.hits, r.stats.requests));
                char p[48];
                std::snprintf(p, sizeof p, "%.1f,%.1f ", x, y);
                points += p;
                add("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", x, y, c);
            }
        svg += "<polyline fill=\"none\" stroke=\"" + std::string(c) + "\" stroke-width=\"2\" points=\"" + points + "\"/>\n";
        add("<text x=\"%g\" y=\"%d\" fill=\"%s\">%s</text>\n", right + 10, 70 + 18 * int(k), c, policy_name(k));
    }
    return svg + "</svg>\n";
}

}  // namespace kimik3
