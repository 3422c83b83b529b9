// Tests for chapter 11: expert_cache. Section numbers match the chapter.
//
// File tests use a synthetic checkpoint whose every expert byte encodes (layer, expert, offset), laid out
// to hit each case: contiguous experts in non-id order, one at the very start of a file (its aligned
// read starts at byte 0), one at the very end (its aligned read runs past end of file), one with its
// parts stored in reverse order, one scattered with gaps, one split across two shards. Model tests use
// the tiny K3 and its reference inputs.
#include "../chapters/11_expert_cache.hpp"
#include "../chapters/11a_traces.hpp"

#include <fcntl.h>

#include <cstdlib>
#include <fstream>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "tiny_moe.hpp"

using namespace kimik3;

namespace {

using test::expect_error;
using test::moe_weights;
using test::TempDir;


// ---- the synthetic checkpoint ------------------------------------------------------------------------
// F = 64, L = 128: parts 4096, 256, 4096, 256, 4096, 256 bytes = 13,056 bytes per expert.
std::uint8_t pattern(int layer, int e, std::size_t offset) {  // never 255, so scales pass the NaN check
    std::uint64_t z = std::uint64_t(layer) << 40 ^ std::uint64_t(e) << 24 ^ offset;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return std::uint8_t((z ^ (z >> 31)) % 255);
}

struct Synthetic {
    TempDir dir;
    Config config;
    std::unique_ptr<Checkpoint> ck;
    ModelTensors m;
    std::array<Shape, 6> shapes;
    std::array<std::size_t, 6> part_start{};  // offset of part p inside the expert's bytes
    std::size_t expert_bytes = 0;

    explicit Synthetic(bool plant_bad_scale = false) {
        config.num_hidden_layers = 3;
        config.num_experts = 4;
        config.num_experts_per_token = 2;
        config.moe_intermediate_size = 64;       // F
        config.routed_expert_hidden_size = 128;  // L
        shapes = expert_part_shapes(config);
        for (std::size_t p = 0; p < 6; ++p) part_start[p] = expert_bytes, expert_bytes += std::size_t(shapes[p].numel());
        std::map<std::string, std::string> where;
        auto part = [&](SafetensorsWriter& w, const std::string& file, int l, int e, int p) {
            std::vector<std::uint8_t> bytes(std::size_t(shapes[std::size_t(p)].numel()));
            for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = pattern(l, e, part_start[std::size_t(p)] + i);
            if (plant_bad_scale && l == 1 && e == 3 && p == 3) bytes[7] = 255;
            w.add(expert_name(l, e, p), DType::U8, shapes[std::size_t(p)], bytes);
            where[expert_name(l, e, p)] = file;
        };
        auto filler = [&](SafetensorsWriter& w, const std::string& file, const std::string& name, std::int64_t n) {
            w.add(name, DType::U8, {n}, std::vector<std::uint8_t>(std::size_t(n), 0xFF));
            where[name] = file;
        };
        SafetensorsWriter a, b, c;
        // a: layer 1, contiguous, stored in the order 2, 0, 3, 1: expert 2 starts in the first page,
        //    expert 1 ends the file.
        for (int e : {2, 0, 3, 1})
            for (int p = 0; p < 6; ++p) part(a, "a.safetensors", 1, e, p);
        // b: layer 2 expert 0 scattered with gaps, expert 1 with its parts in reverse order (no gaps:
        //    contiguous), expert 2's first three parts.
        filler(b, "b.safetensors", "filler.0", 1000);
        for (int p = 0; p < 6; ++p) {
            part(b, "b.safetensors", 2, 0, p);
            filler(b, "b.safetensors", "filler.1." + std::to_string(p), 100 + 700 * p);
        }
        for (int p = 5; p >= 0; --p) part(b, "b.safetensors", 2, 1, p);
        for (int p = 0; p < 3; ++p) part(b, "b.safetensors", 2, 2, p);
        // c: expert 2's last three parts, then expert 3 contiguous to the end of the file.
        for (int p = 3; p < 6; ++p) part(c, "c.safetensors", 2, 2, p);
        filler(c, "c.safetensors", "filler.2", 3000);
        for (int p = 0; p < 6; ++p) part(c, "c.safetensors", 2, 3, p);
        a.write(dir.file("a.safetensors"));
        b.write(dir.file("b.safetensors"));
        c.write(dir.file("c.safetensors"));
        nlohmann::json index = {{"weight_map", where}};
        std::ofstream(dir.file("model.safetensors.index.json")) << index.dump();
        ck = std::make_unique<Checkpoint>(dir.path);
        // The binding of chapter 02's bind_tensors, for the experts only.
        m.experts.resize(3);
        m.expert_bytes = expert_bytes;
        for (int l : {1, 2})
            for (int e = 0; e < 4; ++e) {
                ExpertLocation loc;
                std::uint64_t lo = UINT64_MAX, hi = 0;
                bool same = true;
                for (int p = 0; p < 6; ++p) {
                    loc.parts[std::size_t(p)] = &ck->get(expert_name(l, e, p));
                    same = same && loc.parts[std::size_t(p)]->file == loc.parts[0]->file;
                    lo = std::min(lo, loc.parts[std::size_t(p)]->info->file_offset);
                    hi = std::max(hi, loc.parts[std::size_t(p)]->info->file_offset + loc.parts[std::size_t(p)]->info->nbytes());
                }
                loc.file = loc.parts[0]->file;
                loc.contiguous = same && hi - lo == expert_bytes;
                loc.span_offset = lo;
                loc.span_bytes = hi - lo;
                m.experts[std::size_t(l)].push_back(loc);
            }
    }
    const ExpertLocation& loc(int l, int e) const { return m.experts[std::size_t(l)][std::size_t(e)]; }

    // Whether the file system under /tmp takes O_DIRECT at all (ext4 does; an old tmpfs does not).
    bool direct_available() const {
        const int fd = ::open(dir.file("a.safetensors").c_str(), O_RDONLY | O_DIRECT);
        if (fd >= 0) ::close(fd);
        if (fd < 0) MESSAGE("the file system under /tmp refuses O_DIRECT: the O_DIRECT cases check the fallback only");
        return fd >= 0;
    }

    // How many bytes of the six tensors differ from the pattern of (l, e).
    std::size_t mismatches(const ExpertWeights& w, int l, int e) const {
        const std::uint8_t* parts[6] = {w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed, w.w2_scale};
        std::size_t bad = 0;
        for (std::size_t p = 0; p < 6; ++p)
            for (std::size_t i = 0; i < std::size_t(shapes[p].numel()); ++i) bad += parts[p][i] != pattern(l, e, part_start[p] + i);
        return bad;
    }
};

// ---- pread hooks ---------------------------------------------------------------------------------------
struct ReadLog {
    bool direct;           // the descriptor had O_DIRECT
    std::uint64_t offset;  // file offset asked for
    std::size_t n;         // bytes asked for
    bool aligned_buffer;
    int fd;
};
std::mutex g_mutex;
std::vector<ReadLog> g_log;
std::uint64_t g_fail_offset = UINT64_MAX;  // fault hooks fail only reads that cover this file offset (all if MAX)

bool is_direct(int fd) { return (::fcntl(fd, F_GETFL) & O_DIRECT) != 0; }
bool targeted(std::size_t n, off_t off) {
    return g_fail_offset == UINT64_MAX || (std::uint64_t(off) <= g_fail_offset && g_fail_offset < std::uint64_t(off) + n);
}
ssize_t logging_pread(int fd, void* buf, std::size_t n, off_t off) {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_log.push_back({is_direct(fd), std::uint64_t(off), n, reinterpret_cast<std::uintptr_t>(buf) % 4096 == 0, fd});
    }
    return ::pread(fd, buf, n, off);
}
ssize_t einval_on_direct(int fd, void* buf, std::size_t n, off_t off) {
    if (is_direct(fd)) return errno = EINVAL, -1;
    return ::pread(fd, buf, n, off);
}
ssize_t eof_pread(int fd, void* buf, std::size_t n, off_t off) { return targeted(n, off) ? 0 : ::pread(fd, buf, n, off); }
ssize_t eio_pread(int fd, void* buf, std::size_t n, off_t off) {
    if (targeted(n, off)) return errno = EIO, -1;
    return ::pread(fd, buf, n, off);
}
ssize_t three_bytes_pread(int fd, void* buf, std::size_t n, off_t off) { return ::pread(fd, buf, std::min<std::size_t>(n, 3), off); }

struct Hook {
    explicit Hook(detail::PreadFn f) {
        g_log.clear();
        detail::pread_hook = f;
    }
    ~Hook() {
        detail::pread_hook = ::pread;
        g_fail_offset = UINT64_MAX;
    }
};

// ---- the tiny K3 ---------------------------------------------------------------------------------------
const std::vector<float>& mlp_input(int l) {  // layer.{l}.mlp_norm_out, (10, 128)
    static std::map<int, std::vector<float>> cache;
    auto it = cache.find(l);
    if (it == cache.end()) it = cache.emplace(l, test::layer_reference().f32("layer." + std::to_string(l) + ".mlp_norm_out")).first;
    return it->second;
}

// The 10 reference tokens one per step (incremental decode) through the 12 MoE layers: the recording
// that made fixtures/traces/tiny.k3trace. Returns every layer's outputs, (12, 10, 128).
std::vector<float> run_tokens(test::Tiny& tiny, ExpertProvider& experts) {
    const std::size_t T = 10, D = 128;
    std::vector<float> y(12 * T * D);
    for (std::size_t t = 0; t < T; ++t) {
        experts.begin_step();
        for (int l = 1; l <= 12; ++l)
            moe_forward(&y[(std::size_t(l - 1) * T + t) * D], &mlp_input(l)[t * D], 1, moe_weights(tiny, l), MoeDims::from(tiny.config, l),
                        experts);
    }
    return y;
}

// The hand-worked trace of 11.6: one layer, one request per step, experts A A B C A B C (0 0 1 2 0 1 2).
Trace hand_trace(std::uint64_t expert_bytes) {
    Trace t{2, 3, 1, 7, expert_bytes, {}};
    const int seq[7] = {0, 0, 1, 2, 0, 1, 2};
    for (std::uint32_t i = 0; i < 7; ++i) t.requests.push_back({i, 1, std::uint16_t(seq[i])});
    return t;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

// =======================================================================================================
// 11.1 the expert store
// =======================================================================================================
TEST_CASE("11.1 the store reads contiguous, reordered, scattered and split experts byte for byte, O_DIRECT and buffered") {
    Synthetic s;
    REQUIRE(s.expert_bytes == 13056);
    // The layout the file cases need (chapter 02's definition of contiguous: six parts, no gaps, one file).
    for (int e = 0; e < 4; ++e) CHECK(s.loc(1, e).contiguous);
    CHECK(!s.loc(2, 0).contiguous);  // gaps
    CHECK(s.loc(2, 1).contiguous);   // parts reversed, back to back
    CHECK(!s.loc(2, 2).contiguous);  // split across b and c
    CHECK(s.loc(2, 3).contiguous);
    // The slot: the largest aligned read of any expert, computed here the other way round (pages touched).
    std::size_t want_slot = 0;
    auto pages = [](std::uint64_t off, std::uint64_t n) { return std::size_t(((off + n + 4095) / 4096 - off / 4096) * 4096); };
    for (int l : {1, 2})
        for (int e = 0; e < 4; ++e) {
            const ExpertLocation& x = s.loc(l, e);
            std::size_t need = 0;
            for (auto* p : x.parts) need += pages(p->info->file_offset, p->info->nbytes());
            want_slot = std::max(want_slot, x.contiguous ? pages(x.span_offset, x.span_bytes) : need);
        }
    const bool direct_ok = s.direct_available();
    for (bool direct : {true, false}) {
        CAPTURE(direct);
        ExpertStore store(s.m, direct);
        CHECK(store.shards() == 3);
        CHECK(store.direct_shards() == (direct && direct_ok ? 3u : 0u));
        CHECK(store.slot_bytes() == want_slot);
        AlignedBuffer slot(store.slot_bytes());
        Hook hook(logging_pread);
        for (int l : {1, 2})
            for (int e = 0; e < 4; ++e) {
                CAPTURE(l);
                CAPTURE(e);
                std::memset(slot.data(), 0xAA, slot.size());
                std::uint64_t disk = 0;
                const ExpertWeights w = store.read(l, e, slot.data(), &disk);
                CHECK(s.mismatches(w, l, e) == 0);
                CHECK(disk >= s.expert_bytes);
                if (!(direct && direct_ok)) CHECK(disk == s.expert_bytes);
            }
        // one read per contiguous expert (6 of them), one per part for the two others: 6 + 12
        CHECK(g_log.size() == 18);
        for (const ReadLog& r : g_log) {
            CHECK(r.direct == (direct && direct_ok));
            if (r.direct) CHECK((r.offset % 4096 == 0 && r.n % 4096 == 0 && r.aligned_buffer));
        }
    }
}

TEST_CASE("11.1 widened reads at the start of a file (from byte 0) and at its end (past end of file)") {
    Synthetic s;
    if (!s.direct_available()) return;
    ExpertStore store(s.m, true);
    AlignedBuffer slot(store.slot_bytes());
    const std::uint64_t size_a = s.loc(1, 2).file->size();
    REQUIRE(s.loc(1, 2).span_offset < 4096);                                  // expert (1, 2) starts in page 0
    REQUIRE(s.loc(1, 1).span_offset + s.loc(1, 1).span_bytes == size_a);      // expert (1, 1) ends the file
    REQUIRE(size_a % 4096 != 0);                                              // ... not on a page boundary
    Hook hook(logging_pread);
    CHECK(s.mismatches(store.read(1, 2, slot.data()), 1, 2) == 0);
    REQUIRE(g_log.size() == 1);
    CHECK(g_log[0].offset == 0);
    CHECK(g_log[0].n == 16384);  // [0, 16384) covers header + expert: 4 pages
    g_log.clear();
    std::uint64_t disk = 0;
    CHECK(s.mismatches(store.read(1, 1, slot.data(), &disk), 1, 1) == 0);
    REQUIRE(g_log.size() == 1);
    CHECK(g_log[0].offset + g_log[0].n > size_a);  // asked past end of file ...
    CHECK(disk == size_a - g_log[0].offset);       // ... and got exactly what the file holds
    // expert (2, 3) ends file c the same way
    CHECK(s.mismatches(store.read(2, 3, slot.data()), 2, 3) == 0);
}

TEST_CASE("11.1 a file system that refuses O_DIRECT (EINVAL) is read buffered: same bytes, same layout") {
    Synthetic s;
    if (!s.direct_available()) return;
    ExpertStore store(s.m, true);
    REQUIRE(store.direct_shards() == 3);
    AlignedBuffer slot(store.slot_bytes());
    Hook hook(einval_on_direct);
    for (int l : {1, 2})
        for (int e = 0; e < 4; ++e) {
            CAPTURE(l);
            CAPTURE(e);
            CHECK(s.mismatches(store.read(l, e, slot.data()), l, e) == 0);
        }
    CHECK(store.direct_shards() == 0);  // each shard fell back once and stays buffered
}

TEST_CASE("11.1 read faults surface as io errors naming the expert, file, offset and size; odd-sized reads still complete") {
    Synthetic s;
    for (bool direct : {true, false}) {
        CAPTURE(direct);
        ExpertStore store(s.m, direct);
        AlignedBuffer slot(store.slot_bytes());
        {
            Hook hook(eof_pread);  // the device returns 0 bytes: end of file before the expert's end
            expect_error([&] { store.read(1, 0, slot.data()); }, ErrorKind::io,
                         {"routed expert 0 of layer 1: ", s.dir.file("a.safetensors"), "unexpected end of file", "bytes at offset "});
        }
        {
            Hook hook(eio_pread);
            expect_error([&] { store.read(2, 0, slot.data()); }, ErrorKind::io,
                         {"routed expert 0 of layer 2: ", "b.safetensors", "failed: Input/output error", "bytes at offset "});
        }
        {
            Hook hook(three_bytes_pread);  // a device that returns at most 3 bytes per call
            for (int e = 0; e < 4; ++e) CHECK(s.mismatches(store.read(2, e, slot.data()), 2, e) == 0);
        }
    }
}

TEST_CASE("11.1 a scale byte 255 (NaN in OCP MX) is refused, naming the tensor") {
    Synthetic s(true);
    ExpertStore store(s.m, true);
    AlignedBuffer slot(store.slot_bytes());
    expect_error([&] { store.read(1, 3, slot.data()); }, ErrorKind::format,
                 {"tensor '" + expert_name(1, 3, 3) + "'", "E8M0 scale byte 255", "at index 7"});
    ExpertCache cache(s.m, s.config, 3);
    const int ids[2] = {2, 3};
    ExpertWeights got[2];
    CHECK_THROWS_AS(cache.fetch(1, ids, got), Error);
    CHECK(!cache.resident(1, 3));
    CHECK(!cache.resident(1, 2));  // read fine, but part of a failed batch: not kept
}

// =======================================================================================================
// 11.3 / 11.4 the cache
// =======================================================================================================
TEST_CASE("11.3 a scripted request sequence gives exactly these LRU hits, retentions, misses and evictions") {
    // Layer 1, 3 slots. pos = request number, "last" = the pos of a slot's latest request.
    //   step 0  [0 1 2]  pos 0-2   3 misses into empty slots 0, 1, 2                   h0 r0 m3 e0
    //   step 1  [1 3]    pos 3-4   1 hit (loaded in step 0: retained); 3 misses: victim among the
    //                              unpinned {e0 last 0, e2 last 2} is e0 (slot 0)        h1 r1 m1 e1
    //   step 1  [3 0]    pos 5-6   3 hit, but loaded in THIS step: not retained; 0 misses: victim
    //                              among {e1 last 3, e2 last 2} is e2 (slot 2)           h1 r0 m1 e1
    //   step 2  [2 2]    pos 7-8   2 misses: victim among {e3 last 5, e1 last 3, e0 last 6} is e1
    //                              (slot 1); the second 2 is a hit within the batch      h1 r0 m1 e1
    //   step 3  [0 1 3]  pos 9-11  0 and 3 hit (loaded in step 1: retained); 1 misses: the only
    //                              unpinned slot holds e2 (slot 1)                       h2 r2 m1 e1
    // Totals: 12 requests, 5 hits, 3 retained, 7 misses, 4 evictions, 4 steps.
    Synthetic s;
    ExpertCache cache(s.m, s.config, 3, ExpertCacheOptions{true, 2, PolicyKind::lru});
    struct Batch {
        int step_calls;  // begin_step() calls before the batch
        std::vector<int> ids;
        std::uint64_t hits, retained, misses, evictions;
        std::set<int> resident_after;
    };
    const std::vector<Batch> script = {
        {1, {0, 1, 2}, 0, 0, 3, 0, {0, 1, 2}}, {1, {1, 3}, 1, 1, 1, 1, {1, 2, 3}}, {0, {3, 0}, 1, 0, 1, 1, {0, 1, 3}},
        {2, {2, 2}, 1, 0, 1, 1, {0, 2, 3}},    {1, {0, 1, 3}, 2, 2, 1, 1, {0, 1, 3}},
    };
    CacheStats before;
    for (const Batch& b : script) {
        CAPTURE(b.ids.size());
        for (int i = 0; i < b.step_calls; ++i) cache.begin_step();  // a second call in a row starts no empty step
        std::vector<ExpertWeights> got(b.ids.size());
        cache.fetch(1, b.ids, got.data());
        for (std::size_t i = 0; i < b.ids.size(); ++i) CHECK(s.mismatches(got[i], 1, b.ids[i]) == 0);
        const CacheStats& now = cache.stats();
        CHECK(now.hits - before.hits == b.hits);
        CHECK(now.retained - before.retained == b.retained);
        CHECK(now.misses - before.misses == b.misses);
        CHECK(now.evictions - before.evictions == b.evictions);
        for (int e = 0; e < 4; ++e) CHECK(cache.resident(1, e) == (b.resident_after.count(e) == 1));
        before = now;
    }
    const CacheStats& t = cache.stats();
    CHECK(t.requests == 12);
    CHECK(t.hits == 5);
    CHECK(t.retained == 3);
    CHECK(t.misses == 7);
    CHECK(t.evictions == 4);
    CHECK(t.steps == 4);
    CHECK(t.bytes_read == 7 * 13056);
    std::vector<std::uint32_t> steps;
    for (const ExpertRequest& r : cache.trace().requests) steps.push_back(r.step);
    CHECK(steps == std::vector<std::uint32_t>{0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3});
}

TEST_CASE("11.3 an expert of the current batch is never the victim, even one the policy would pick (LFU)") {
    // 2 slots, LFU. Experts 0 and 1 are each requested twice (count 2). Batch [2 3]: 2 misses and evicts
    // expert 0 (counts tie at 2, LRU breaks the tie); 3 misses, and the policy's favourite is expert 2
    // (count 1 < 2), but 2 belongs to this batch: the victim must be expert 1.
    Synthetic s;
    ExpertCache cache(s.m, s.config, 2, ExpertCacheOptions{false, 2, PolicyKind::lfu});
    ExpertWeights got[2];
    for (int id : {0, 0, 1, 1}) {
        cache.begin_step();
        cache.fetch(1, std::span<const int>(&id, 1), got);
    }
    const int batch[2] = {2, 3};
    cache.fetch(1, batch, got);
    CHECK(s.mismatches(got[0], 1, 2) == 0);
    CHECK(s.mismatches(got[1], 1, 3) == 0);
    CHECK(cache.resident(1, 2));
    CHECK(cache.resident(1, 3));
    CHECK(cache.stats().evictions == 2);
}

TEST_CASE("11.4 a failed read leaves none of its batch's misses resident, and the next fetch reads again") {
    Synthetic s;
    ExpertCache cache(s.m, s.config, 4, ExpertCacheOptions{true, 2, PolicyKind::lru});
    ExpertWeights got[2];
    const int first[2] = {0, 1}, second[2] = {2, 3};
    cache.fetch(1, first, got);
    for (detail::PreadFn fault : {eof_pread, eio_pread}) {
        {
            Hook hook(fault);
            g_fail_offset = s.loc(1, 3).span_offset + 100;  // only expert 3's read fails; expert 2 reads fine
            CHECK_THROWS_AS(cache.fetch(1, second, got), Error);
        }
        CHECK(!cache.resident(1, 2));
        CHECK(!cache.resident(1, 3));
        CHECK(cache.resident(1, 0));  // earlier batches are untouched
        CHECK(cache.resident(1, 1));
    }
    const std::uint64_t misses = cache.stats().misses;
    cache.fetch(1, second, got);
    CHECK(cache.stats().misses == misses + 2);  // read again, not served from the failed slots
    CHECK(s.mismatches(got[0], 1, 2) == 0);
    CHECK(s.mismatches(got[1], 1, 3) == 0);
}

// A gate for read-ahead tests: a read covering g_fail_offset waits (in whatever thread runs it) until
// the test opens the gate, so the test can act while that read is provably still in flight.
std::mutex g_gate_mutex;
std::condition_variable g_gate_cv;
bool g_gate_open = false, g_gate_timed_out = false;
int g_gate_waiting = 0;
ssize_t gated_pread(int fd, void* buf, std::size_t n, off_t off) {
    if (targeted(n, off)) {
        std::unique_lock<std::mutex> lk(g_gate_mutex);
        ++g_gate_waiting;
        g_gate_cv.notify_all();
        if (!g_gate_cv.wait_for(lk, std::chrono::seconds(20), [] { return g_gate_open; })) g_gate_timed_out = true;
    }
    return ::pread(fd, buf, n, off);
}

TEST_CASE("11.4 read-ahead: prefetch returns while its read is in flight, and the current group is never a victim (LFU)") {
    // 4 slots, LFU. Experts 2 and 3 of layer 1 are requested twice (count 2), then the current group
    // [0 1] (count 1). Read-ahead of layer 2's [0 1]: LFU's favourite victims are layer 1's 0 and 1, but
    // they are the group being computed: the victims must be 2 and 3.
    Synthetic s;
    ExpertCache cache(s.m, s.config, 4, ExpertCacheOptions{true, 2, PolicyKind::lfu});
    ExpertWeights cur[2], next[2];
    for (int id : {2, 3, 2, 3}) {
        cache.begin_step();
        cache.fetch(1, std::span<const int>(&id, 1), cur);
    }
    const int group[2] = {0, 1};
    cache.fetch(1, group, cur);
    g_gate_open = g_gate_timed_out = false;
    g_gate_waiting = 0;
    {
        Hook hook(gated_pread);
        g_fail_offset = s.loc(2, 0).span_offset + 100;  // layer 2 expert 0's read waits at the gate
        cache.prefetch(2, group);                        // must return with that read still waiting
        {
            std::unique_lock<std::mutex> lk(g_gate_mutex);
            CHECK(g_gate_cv.wait_for(lk, std::chrono::seconds(20), [] { return g_gate_waiting > 0; }));
            CHECK(!g_gate_open);  // the read is in flight on another thread while this one goes on
        }
        CHECK(s.mismatches(cur[0], 1, 0) == 0);  // the current group's bytes are intact meanwhile
        CHECK(s.mismatches(cur[1], 1, 1) == 0);
        CHECK(cache.resident(1, 0));
        CHECK(cache.resident(1, 1));
        CHECK(!cache.resident(1, 2));  // the victims
        CHECK(!cache.resident(1, 3));
        {
            std::lock_guard<std::mutex> lk(g_gate_mutex);
            g_gate_open = true;
        }
        g_gate_cv.notify_all();
        cache.fetch(2, group, next);  // waits for the read-ahead; admits nothing again
    }
    CHECK(!g_gate_timed_out);
    CHECK(s.mismatches(next[0], 2, 0) == 0);
    CHECK(s.mismatches(next[1], 2, 1) == 0);
    const CacheStats& t = cache.stats();
    CHECK(t.requests == 8);
    CHECK(t.misses == 6);
    CHECK(t.evictions == 2);
}

TEST_CASE("11.4 a failed read-ahead throws from its group's fetch; one nobody fetches is kept and counted once") {
    Synthetic s;
    ExpertCache cache(s.m, s.config, 4, ExpertCacheOptions{true, 2, PolicyKind::lru});
    ExpertWeights cur[2], next[2];
    const int first[2] = {0, 1}, second[2] = {2, 3};
    cache.fetch(1, first, cur);
    for (detail::PreadFn fault : {eof_pread, eio_pread}) {
        {
            Hook hook(fault);
            g_fail_offset = s.loc(1, 3).span_offset + 100;  // only expert 3's read fails
            cache.prefetch(1, second);                       // the failure waits for its fetch
            expect_error([&] { cache.fetch(1, second, next); }, ErrorKind::io, {"expert 3", "layer 1"});
        }
        CHECK(!cache.resident(1, 2));  // none of the failed batch's misses stays
        CHECK(!cache.resident(1, 3));
        CHECK(cache.resident(1, 0));  // the current group is untouched
        CHECK(cache.resident(1, 1));
        CHECK(s.mismatches(cur[0], 1, 0) == 0);
    }
    // A read-ahead that the next fetch does not ask for: its reads finish, its experts stay resident,
    // and it was admitted (counted) once.
    const std::uint64_t requests = cache.stats().requests, misses = cache.stats().misses;
    cache.prefetch(1, second);
    const int other = 0;
    cache.fetch(2, std::span<const int>(&other, 1), next);
    CHECK(cache.stats().requests == requests + 3);
    CHECK(cache.stats().misses == misses + 3);
    CHECK(cache.resident(1, 2));
    CHECK(cache.resident(1, 3));
    cache.fetch(1, second, next);  // two hits now, bytes intact
    CHECK(cache.stats().misses == misses + 3);
    CHECK(s.mismatches(next[0], 1, 2) == 0);
    CHECK(s.mismatches(next[1], 1, 3) == 0);
}

TEST_CASE("11.4 every expert from the cache is bit-identical to the same expert read directly (tiny K3)") {
    test::Tiny tiny;
    ExpertCache cache(tiny.tensors, tiny.config, 5);  // O_DIRECT, 16 readers: the defaults
    const auto shapes = expert_part_shapes(tiny.config);
    for (int l = 1; l <= 12; ++l)
        for (int e0 = 0; e0 < 16; e0 += 4) {
            const int ids[4] = {e0 + 3, e0 + 1, e0, e0 + 2};
            ExpertWeights got[4];
            cache.fetch(l, ids, got);
            for (int i = 0; i < 4; ++i) {
                const ExpertWeights want = tiny.expert(l, ids[i]);
                const std::uint8_t* g[6] = {got[i].w1_packed, got[i].w1_scale, got[i].w3_packed, got[i].w3_scale, got[i].w2_packed, got[i].w2_scale};
                const std::uint8_t* w[6] = {want.w1_packed, want.w1_scale, want.w3_packed, want.w3_scale, want.w2_packed, want.w2_scale};
                for (std::size_t p = 0; p < 6; ++p) REQUIRE(std::memcmp(g[p], w[p], std::size_t(shapes[p].numel())) == 0);
            }
        }
    CHECK(cache.stats().misses == 192);
    CHECK(cache.stats().evictions == 187);
}

TEST_CASE("11.4 the tiny K3's MoE output has the same bits at every cache size from 1 to 16 slots as ResidentExperts") {
    test::Tiny tiny;
    const std::size_t T = 10, D = 128;
    ResidentExperts all(tiny.tensors);
    std::vector<std::vector<float>> want(13);
    for (int l = 1; l <= 12; ++l) {
        want[std::size_t(l)].resize(T * D);
        moe_forward(want[std::size_t(l)].data(), mlp_input(l).data(), T, moe_weights(tiny, l), MoeDims::from(tiny.config, l), all);
    }
    for (std::size_t slots = 1; slots <= 16; ++slots) {
        CAPTURE(slots);
        ExpertCache cache(tiny.tensors, tiny.config, slots, ExpertCacheOptions{false, 3, slots % 2 ? PolicyKind::lru : PolicyKind::lfu});
        std::vector<float> y(T * D);
        for (int l = 1; l <= 12; ++l) {
            moe_forward(y.data(), mlp_input(l).data(), T, moe_weights(tiny, l), MoeDims::from(tiny.config, l), cache);
            CHECK_BITS_EQ(y, want[std::size_t(l)]);
        }
    }
    // One token per step, as a decoder runs: the same bits again.
    ExpertCache small(tiny.tensors, tiny.config, 5, ExpertCacheOptions{false, 2, PolicyKind::lru});
    const std::vector<float> stepped = run_tokens(tiny, small);
    for (int l = 1; l <= 12; ++l) CHECK_BITS_EQ(std::span<const float>(&stepped[std::size_t(l - 1) * T * D], T * D), want[std::size_t(l)]);
}

TEST_CASE("11.4 a budget gives whole slots and is refused below k + 1 slots with the minimum in bytes") {
    test::Tiny tiny;
    ExpertCache probe(tiny.tensors, tiny.config, 1);
    const std::size_t slot = probe.slot_bytes();
    CHECK(slot % 4096 == 0);
    CHECK(slot >= 6528);
    const std::uint64_t min = 5 * slot;  // k = 4, so 5 slots
    CHECK(ExpertCache::slots_for_budget(min, tiny.tensors, tiny.config) == 5);
    CHECK(ExpertCache::slots_for_budget(min + slot - 1, tiny.tensors, tiny.config) == 5);
    CHECK(ExpertCache::slots_for_budget(100 * slot, tiny.tensors, tiny.config) == 100);
    expect_error([&] { ExpertCache::slots_for_budget(min - 1, tiny.tensors, tiny.config); }, ErrorKind::budget,
                 {"expert cache budget of " + std::to_string(min - 1) + " bytes",
                  "below the minimum of 5 slots (k + 1) x " + std::to_string(slot) + " bytes = " + std::to_string(min) + " bytes"});
    expect_error([&] { ExpertCache c(tiny.tensors, tiny.config, 0); }, ErrorKind::usage, {"at least 1 slot"});
}

TEST_CASE("11.4 fetch refuses more ids than slots, a dense layer and an unknown id, and changes nothing") {
    test::Tiny tiny;
    ExpertCache cache(tiny.tensors, tiny.config, 2);
    ExpertWeights got[3];
    const int three[3] = {0, 1, 2}, bad_id[2] = {0, 16}, ok[1] = {5};
    expect_error([&] { cache.fetch(1, three, got); }, ErrorKind::usage, {"3 experts at once, but the cache has 2 slots"});
    expect_error([&] { cache.fetch(0, ok, got); }, ErrorKind::usage, {"layer 0 has no routed experts"});
    expect_error([&] { cache.fetch(13, ok, got); }, ErrorKind::usage, {"layer 13 has no routed experts"});
    expect_error([&] { cache.fetch(1, bad_id, got); }, ErrorKind::usage, {"no routed expert 16 in layer 1"});
    CHECK(cache.stats().requests == 0);
    CHECK(cache.trace().requests.empty());
    CHECK(!cache.resident(1, 0));
}

// =======================================================================================================
// 11.5 the trace
// =======================================================================================================
TEST_CASE("11.5 a trace survives a write/read round trip; the histogram lists every expert of each layer") {
    TempDir dir;
    Trace t{13, 3, 2, 2, 6528, {{0, 1, 2}, {0, 1, 0}, {0, 4, 2}, {1, 1, 2}, {1, 4, 1}}};
    write_trace(dir.file("t.k3trace"), t);
    const std::string bytes = read_file(dir.file("t.k3trace"));
    CHECK(bytes.size() == 48 + 5 * 8);
    CHECK(bytes.substr(0, 8) == "KIMIK3TR");
    CHECK(bytes.substr(48, 8) == std::string("\0\0\0\0\1\0\2\0", 8));  // step 0 LE, layer 1 LE, expert 2 LE
    const Trace back = read_trace(dir.file("t.k3trace"));
    CHECK(back.layers == 13);
    CHECK(back.experts == 3);
    CHECK(back.k == 2);
    CHECK(back.steps == 2);
    CHECK(back.expert_bytes == 6528);
    CHECK(trace_bytes(back) == bytes);
    CHECK(trace_histogram_csv(t) == "layer,expert,requests\n1,0,1\n1,1,0\n1,2,2\n4,0,0\n4,1,1\n4,2,1\n");
    write_trace_histogram(dir.file("h.csv"), t);
    CHECK(read_file(dir.file("h.csv")) == trace_histogram_csv(t));
}

TEST_CASE("11.5 a bad trace file is refused with what is wrong: magic, version, size, records") {
    TempDir dir;
    const Trace t{13, 16, 4, 2, 6528, {{0, 1, 2}, {1, 1, 3}}};
    const std::string good = trace_bytes(t);
    auto check = [&](const std::string& what, std::string bytes, std::initializer_list<std::string> parts) {
        CAPTURE(what);
        const std::string path = dir.file(what + ".k3trace");
        std::ofstream(path, std::ios::binary) << bytes;
        expect_error([&] { read_trace(path); }, ErrorKind::format, parts);
    };
    std::string s = good;
    s[0] = 'X';
    check("magic", s, {"not a kimik3 expert trace (magic \"XIMIK3TR\", expected \"KIMIK3TR\")", "HINT"});
    check("short", good.substr(0, 10), {"10 bytes is shorter than the 48-byte header"});
    s = good, s[8] = 2;
    check("version", s, {"trace version 2 is not supported (this reader knows version 1)"});
    check("truncated", good.substr(0, good.size() - 3), {"truncated or padded: the header promises 2 records (64 bytes) but the file holds 61 bytes"});
    check("padded", good + "x", {"truncated or padded"});
    s = good, s[48 + 8 + 4] = 20;  // record 1's layer = 20 >= 13 layers
    check("layer", s, {"record 1 (step 1, layer 20, expert 3) is out of range"});
    s = good, s[48] = 1, s[56] = 0;  // steps 1 then 0
    check("order", s, {"record 1 (step 0, layer 1, expert 3)", "out of step order"});
    expect_error([&] { read_trace(dir.file("missing.k3trace")); }, ErrorKind::format, {"missing.k3trace", "cannot open"});
    expect_error([&] { write_trace(dir.file("no/such/dir.k3trace"), t); }, ErrorKind::runtime, {"no/such/dir.k3trace.tmp", "cannot create", "No such file or directory"});
}

TEST_CASE("11.5 the committed trace fixture equals a fresh recording (a regression pin made by our own C++)") {
    test::Tiny tiny;
    ExpertCache cache(tiny.tensors, tiny.config, 6, ExpertCacheOptions{false, 2, PolicyKind::lru});
    run_tokens(tiny, cache);
    const Trace& t = cache.trace();
    CHECK(t.requests.size() == 10 * 12 * 4);
    CHECK(t.steps == 10);
    CHECK(trace_bytes(t) == read_file(test::source_path("fixtures/traces/tiny.k3trace")));
}

// =======================================================================================================
// 11.6 the simulator
// =======================================================================================================
TEST_CASE("11.6 the simulator on a hand-worked trace: LRU 1, LFU 2, Belady 3 hits of 7") {
    // One layer, 2 slots, one request per step: A A B C A B C (experts 0 0 1 2 0 1 2, pos 0..6).
    //   LRU:    A miss, A hit, B miss, C miss evicts A (last 1 < B's 2), A miss evicts B (2 < C's 3),
    //           B miss evicts C (3 < A's 4), C miss evicts A (4 < B's 5).      1 hit, 6 misses, 4 evictions
    //   LFU:    A miss, A hit (count 2), B miss (1), C miss evicts B (1 < 2), A hit (3), B miss evicts
    //           C (1 < 3), C miss evicts B (1 < 3).                             2 hits, 5 misses, 3 evictions
    //   Belady: A miss, A hit, B miss, C miss: next A at 4, next B at 5 -> evict B; A hit (next: never);
    //           B miss: A never again, C next at 6 -> evict A; C hit.           3 hits, 4 misses, 2 evictions
    //   Compulsory: 3 distinct experts, so at most 4 of 7 hits at any size.
    const Trace t = hand_trace(1000);
    const std::size_t sizes[2] = {2, 3};
    const std::vector<SimResult> r = simulate_cache(t, sizes);
    REQUIRE(r.size() == 6);
    const std::uint64_t want[3][3] = {{1, 6, 4}, {2, 5, 3}, {3, 4, 2}};  // hits, misses, evictions
    for (int p = 0; p < 3; ++p) {
        CAPTURE(policy_name(r[std::size_t(p)].policy));
        CHECK(r[std::size_t(p)].slots == 2);
        CHECK(r[std::size_t(p)].stats.hits == want[p][0]);
        CHECK(r[std::size_t(p)].stats.retained == want[p][0]);  // one request per step: every hit is from an earlier step
        CHECK(r[std::size_t(p)].stats.misses == want[p][1]);
        CHECK(r[std::size_t(p)].stats.evictions == want[p][2]);
        CHECK(r[std::size_t(p)].stats.bytes_read == want[p][1] * 1000);
        CHECK(r[std::size_t(3 + p)].stats.hits == 4);  // 3 slots hold all three: only compulsory misses
    }
    CHECK(distinct_experts(t) == 3);
}

TEST_CASE("11.6 replaying the recorded tiny K3 trace gives the live cache's exact counts at every size and policy") {
    test::Tiny tiny;
    const Trace t = read_trace(test::source_path("fixtures/traces/tiny.k3trace"));
    for (std::size_t slots : {1u, 2u, 3u, 4u, 5u, 7u, 16u, 48u, 100u, 192u})
        for (PolicyKind k : {PolicyKind::lru, PolicyKind::lfu}) {
            CAPTURE(slots);
            CAPTURE(policy_name(k));
            ExpertCache cache(tiny.tensors, tiny.config, slots, ExpertCacheOptions{false, 2, k});
            run_tokens(tiny, cache);
            const CacheStats live = cache.stats(), sim = replay_trace(t, slots, k);
            CHECK(live.requests == sim.requests);
            CHECK(live.hits == sim.hits);
            CHECK(live.retained == sim.retained);
            CHECK(live.misses == sim.misses);
            CHECK(live.evictions == sim.evictions);
            CHECK(live.steps == sim.steps);
        }
    // Belady bounds both policies; nobody beats the compulsory ceiling; a cache that holds every expert
    // reaches it.
    const std::size_t distinct = distinct_experts(t);
    std::vector<std::size_t> sizes;
    for (std::size_t s = 1; s <= 200; s += 7) sizes.push_back(s);
    const std::vector<SimResult> r = simulate_cache(t, sizes);
    for (std::size_t i = 0; i < r.size(); i += 3) {
        CAPTURE(r[i].slots);
        CHECK(r[i + 2].stats.hits >= r[i].stats.hits);
        CHECK(r[i + 2].stats.hits >= r[i + 1].stats.hits);
        CHECK(r[i + 2].stats.hits <= t.requests.size() - distinct);
        if (r[i].slots >= distinct)
            for (int p = 0; p < 3; ++p) CHECK(r[i + std::size_t(p)].stats.misses == distinct);
    }
}

TEST_CASE("11.6 the table and the SVG plot") {
    const Trace t = hand_trace(1000000);
    const std::size_t sizes[2] = {2, 3};
    const std::vector<SimResult> r = simulate_cache(t, sizes);
    char* buf = nullptr;
    std::size_t len = 0;
    std::FILE* mem = ::open_memstream(&buf, &len);
    print_simulation(mem, t, r, 1000);
    std::fclose(mem);
    const std::string table(buf, len);
    std::free(buf);
    INFO(table);
    CHECK(table.find("compulsory misses: 3 distinct experts, so no policy at any size hits more than 57.1%") != std::string::npos);
    // Belady at 2 slots: 3 of 7 hits, 4 misses x 1 MB over 7 steps = 571 kB per step, 0.571 ms at 1000 MB/s (%.4g seconds)
    // (memory: 2 slots of 1,000,000 bytes widened to pages, 1,007,616 bytes each, as the cache allocates them)
    CHECK(table.find("      2    2.02 MB  Belady    42.9       42.9          2    571.43 kB   0.0005714") != std::string::npos);
    const std::string svg = simulation_svg(t, r, "tiny <trace>");
    CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
    CHECK(svg.find("tiny &lt;trace&gt;") != std::string::npos);
    std::size_t polylines = 0;
    for (std::size_t at = 0; (at = svg.find("<polyline", at)) != std::string::npos; ++at) ++polylines;
    CHECK(polylines == 3);
    CHECK(svg.find("compulsory ceiling 57.1%") != std::string::npos);
    CHECK(svg.find("cache size (expert slots, log scale)") != std::string::npos);
    CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
}
