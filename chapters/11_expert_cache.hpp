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
//   A cache helps little for K3: a token makes 1,472 expert requests (92 layers x 16) before the next
//   token comes back to layer l, so LRU with fewer slots keeps nothing, and with balanced routing any
//   policy finds about S / 82,432 of requests resident (887 slots, 15.6 GB: ~1.1%). It pays only where
//   routing is skewed, so size it from a recorded trace first: appendix 11a works this out and replays it,
//   and make run-11 replays a real trace of the trained little K3 (LRU gets about its share, a few points more).
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
//   trace         every (step, layer, expert) request in order, recorded by the cache; written, read and
//                 replayed under other policies and sizes in appendix 11a (11.5, 11.6).
//
// CONTRACT
//   * An expert is read when requested and not resident, never speculatively: read-ahead (prefetch)
//     only reads the next group of experts the router has already chosen. A contiguous expert (the release)
//     is one read of its widened span; a scattered one, one read per part. Every read goes through
//     chapter 01's detail::pread_hook (appendix 01a). O_DIRECT per shard unless refused (open or read fails with
//     EINVAL: that shard is read buffered from then on, same bytes, same slot layout).
//   * A read error, or end of file before the expert's last byte, is Error(io) naming the expert, the
//     file, the offset and the size; a scale byte 255 is Error(format) naming the tensor. After a failed fetch no slot the batch was reading into stays resident (its hits stay as they were): the
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
//   * Policies and their ties as in 11.2. No policy or size changes a bit of the model's output: the
//     provider only decides where weights come from.
//
// LEAVES OUT  speculative prefetch of experts the router has not chosen yet (kimi-k3-in-c measured it
//   as a loss, in its published measurements), pinned hot experts, macOS F_NOCACHE. Chapter 12 decides
//   how much memory the cache gets.
//
// SOURCES  Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
//          Journal 5(2), 1966 (the optimum the simulator replays); Eliseev and Mazur, arXiv:2312.17238
//          (LRU expert offloading); FareedKhan-dev/kimi-k3-in-c (its README, CHANGELOG and
//          PERFORMANCE.md). docs/sources.md 11.
// USES     chapters 00 (Error), 01 (AlignedBuffer; appendix 01a: Fd, pread_exact, pread_direct, pread_hook),
//          02 (ExpertLocation, human_bytes), 05 (check_e8m0_scales), 06 (ExpertWeights), 10 (ExpertProvider)
// RUN      make run-11      TEST   make test-11      BENCH   make bench (bench/bench_experts.hpp)
//
// SECTIONS
//   11.1 the expert store     11.2 eviction policies     11.3 the slot table
//   11.4 the cache
//   APPENDIX 11a_traces.hpp: 11.5 the trace file and the histogram     11.6 the simulator
// ====================================================================================================
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
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
#include "02_config.hpp"
#include "05_mxfp4.hpp"
#include "06_situ_ffn.hpp"
#include "10_moe.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 11.1 The expert store: one aligned read per expert, straight from the shards
// ---------------------------------------------------------------------------------------------------
// Each expert is read with its range widened to 4096-byte boundaries (detail::widened_bytes, appendix
// 01a): the slot's room. widened_bound(expert_bytes) is the most one expert can need wherever it starts.
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

}  // namespace kimik3
