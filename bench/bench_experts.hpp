// Chapter 11's benchmark: reading K3-size experts from disk through the store and the cache, against
// plain reads of the same bytes, and computing one expert. Called from bench/bench.cpp:
//   #include "bench_experts.hpp"   ...   kimik3::bench_experts(stdout, g_reps);
// It writes a scratch checkpoint of 48 K3-size experts (48 x 17,547,264 B = 842 MB) under /tmp (the
// same disk), checks the free space first, and removes it at the end. Every figure is the median of
// `reps` timed runs after one untimed warm-up. Nothing is asserted: this measures.
//
// Rows: (1) plain O_DIRECT reads of all 48 experts in 3 random batches of 16 (the very requests the store
// makes, no cache machinery), in request order and sorted by disk offset, vs (2) ExpertCache cold fetches
// of the same batches (16 slots: every fetch misses), at queue depth 1 and 16, runs alternating so all
// see the same conditions; (3) the same into ONE buffer vs a 1-slot cache fetching one expert at a time;
// (4) the sequential read of the file, into rotating buffers and into one; (5) one expert's FFN.
// ratio = time of the first row of the group / time of this row (above 1: faster than plain reads).
#pragma once

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../chapters/11_expert_cache.hpp"
#include "../tests/rng.hpp"
#include "timing.hpp"

namespace kimik3 {

inline void bench_experts(std::FILE* out, int reps) {
    constexpr int kExperts = 48, kBatch = 16;
    Config c;  // one MoE layer (layer 1) of 48 experts at K3's widths
    c.num_hidden_layers = 2;
    c.num_experts = kExperts;
    c.num_experts_per_token = kBatch;
    c.moe_intermediate_size = 3072;       // F
    c.routed_expert_hidden_size = 3584;   // L
    const auto shapes = expert_part_shapes(c);
    std::uint64_t S = 0;
    for (const Shape& s : shapes) S += std::uint64_t(s.numel());  // 17,547,264
    std::fprintf(out, "\n== 11 expert store and cache: %d K3-size experts of %llu B in a scratch file, median of %d\n", kExperts,
                 (unsigned long long)S, reps);

    // ---- the scratch checkpoint: the release's layout (six parts back to back, experts in a shuffled order)
    char tmpl[] = "/tmp/kimik3-bench-experts-XXXXXX";
    if (!::mkdtemp(tmpl)) return (void)std::fprintf(out, "  skipped: cannot create a directory under /tmp\n");
    const std::string dir = tmpl;
    struct Cleanup {
        std::string dir;
        ~Cleanup() { std::filesystem::remove_all(dir); }
    } cleanup{dir};
    struct statvfs fs {};
    const std::uint64_t need = std::uint64_t(kExperts) * S + (std::uint64_t(1) << 30);  // plus 1 GiB to spare
    if (::statvfs(dir.c_str(), &fs) != 0 || std::uint64_t(fs.f_bavail) * fs.f_frsize < need)
        return (void)std::fprintf(out, "  skipped: %s has %.2f GB free, the scratch file needs %.2f GB (with 1 GiB to spare)\n", dir.c_str(),
                                  double(std::uint64_t(fs.f_bavail) * fs.f_frsize) / 1e9, double(need) / 1e9);
    std::vector<int> file_order(kExperts);
    std::iota(file_order.begin(), file_order.end(), 0);
    std::shuffle(file_order.begin(), file_order.end(), std::mt19937(11));
    SafetensorsWriter w;
    for (int e : file_order)
        for (int p = 0; p < 6; ++p) w.add_sparse(expert_name(1, e, p), DType::U8, shapes[std::size_t(p)]);
    const std::string path = dir + "/model.safetensors";
    w.write(path);  // the header and a hole of the right size
    {
        AlignedBuffer expert(S);  // random codes, scales 118..127 (values near 1: the FFN stays finite)
        test::Rng rng(11);
        std::uint8_t* b = expert.as<std::uint8_t>();
        std::uint64_t at = 0;
        for (std::size_t p = 0; p < 6; ++p) {
            const std::size_t n = std::size_t(shapes[p].numel());
            for (std::size_t i = 0; i < n; ++i) b[at + i] = p % 2 ? std::uint8_t(118 + rng.bits() % 10) : std::uint8_t(rng.bits());
            at += n;
        }
        SafetensorsFile f(path);
        const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
        bool ok = fd >= 0;
        for (int e = 0; e < kExperts && ok; ++e) {
            std::memcpy(b, &e, sizeof e);  // make each expert's bytes its own
            const std::uint64_t off = f.get(expert_name(1, e, 0)).file_offset;
            for (std::uint64_t done = 0; done < S && ok;) {
                const ssize_t n = ::pwrite(fd, b + done, S - done, off_t(off + done));
                ok = n > 0;
                done += ok ? std::uint64_t(n) : 0;
            }
        }
        ok = ok && ::fsync(fd) == 0;
        if (fd >= 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), ::close(fd);
        if (!ok) return (void)std::fprintf(out, "  skipped: writing the scratch file failed: %s\n", errno_text(errno).c_str());
    }
    Checkpoint ck(dir);
    ModelTensors m;
    m.experts.resize(2);
    m.expert_bytes = S;
    for (int e = 0; e < kExperts; ++e) {
        ExpertLocation x;
        for (std::size_t p = 0; p < 6; ++p) x.parts[p] = &ck.get(expert_name(1, e, int(p)));
        x.file = x.parts[0]->file;
        x.contiguous = true;  // written back to back above
        x.span_offset = x.parts[0]->info->file_offset;
        x.span_bytes = S;
        m.experts[1].push_back(x);
    }
    const std::uint64_t file_bytes = ck.shards()[0]->size();

    if (const int probe = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT); probe >= 0) ::close(probe);
    else return (void)std::fprintf(out, "  skipped: the file system under /tmp refuses O_DIRECT\n");
    std::fprintf(out, "  %-52s %7s %10s %8s %8s\n", "measurement", "readers", "median s", "GB/s", "ratio");
    auto row = [&](const char* what, int readers, double sec, double bytes, const char* ratio) {
        std::fprintf(out, "  %-52s %7d %10.4f %8.2f %8s\n", what, readers, sec, bytes / sec / 1e9, ratio);
        std::fflush(out);
    };

    // The fetch pattern: all 48 experts in a random order, in 3 batches of 16. Each run first takes the 32
    // experts the cache does not hold, then the 16 it held before (evicted by then), so every fetch misses.
    struct Orders {
        std::mt19937 rng{12};
        std::vector<int> held;  // what a 16-slot cache holds after the previous run
        std::vector<int> next() {
            if (held.empty())
                for (int e = kExperts - kBatch; e < kExperts; ++e) held.push_back(e);
            std::vector<int> order;
            for (int e = 0; e < kExperts; ++e)
                if (std::find(held.begin(), held.end(), e) == held.end()) order.push_back(e);
            std::shuffle(order.begin(), order.end(), rng);
            std::shuffle(held.begin(), held.end(), rng);
            order.insert(order.end(), held.begin(), held.end());
            return order;
        }
    };
    auto seconds = [](const std::function<void()>& f) {
        const auto t0 = std::chrono::steady_clock::now();
        f();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const double payload = double(kExperts) * double(S);

    // Plain O_DIRECT reads of the experts of `order`, `depth` at a time, each into `dst(j)` for the j-th
    // expert of its batch of 16: no cache, no checks, the same requests the store makes; `sorted` issues
    // each batch in disk-offset order, as the cache does.
    auto plain_reads = [&](std::vector<int> order, int depth, const std::function<std::byte*(int)>& dst, bool sorted) {
        const int dfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        for (int b0 = 0; b0 < kExperts; b0 += kBatch) {
            if (sorted)  // what the cache does with a batch's misses
                std::sort(order.begin() + b0, order.begin() + b0 + kBatch,
                          [&](int a, int b) { return m.experts[1][std::size_t(a)].span_offset < m.experts[1][std::size_t(b)].span_offset; });
            std::atomic<int> next{0};
            auto work = [&] {
                for (int j; (j = next.fetch_add(1)) < kBatch;) {
                    const ExpertLocation& x = m.experts[1][std::size_t(order[std::size_t(b0 + j)])];
                    const std::uint64_t start = x.span_offset / 4096 * 4096;
                    const std::size_t len = detail::widened_bytes(x.span_offset, S);
                    for (std::size_t got = 0; got < len;) {
                        const ssize_t n = ::pread(dfd, dst(j) + got, len - got, off_t(start + got));
                        if (n <= 0) break;
                        got += std::size_t(n);
                    }
                }
            };
            std::vector<std::thread> pool;
            for (int t = 1; t < depth; ++t) pool.emplace_back(work);
            work();
            for (std::thread& th : pool) th.join();
        }
        ::close(dfd);
    };
    const std::size_t slot = std::size_t(S) + 4096;
    AlignedBuffer arena(kBatch * slot);  // the plain reads' 16 rotating buffers, laid out like the cache's slots

    // ---- 1. plain reads into 16 rotating buffers vs 2. the same fetches through ExpertCache (16 slots: every
    //      fetch misses), at queue depth 1 and 16. Runs alternate so both see the same conditions.
    for (const int depth : {1, kBatch}) {
        Orders plain_orders, sorted_orders, cache_orders;
        ExpertCache cache(m, c, kBatch, ExpertCacheOptions{true, depth, PolicyKind::lru});
        std::vector<ExpertWeights> got(kBatch);
        auto rotating = [&](int j) { return arena.data() + std::size_t(j) * slot; };
        auto plain = [&] { plain_reads(plain_orders.next(), depth, rotating, false); };
        auto plain_sorted = [&] { plain_reads(sorted_orders.next(), depth, rotating, true); };
        auto cached = [&] {
            const std::vector<int> order = cache_orders.next();
            for (int b0 = 0; b0 < kExperts; b0 += kBatch) cache.fetch(1, std::span<const int>(&order[std::size_t(b0)], kBatch), got.data());
        };
        std::vector<double> tp, ts, tc;
        for (int r = 0; r <= std::max(1, reps); ++r) {  // run 0 warms up (and touches every page)
            const double a = seconds(plain), b = seconds(plain_sorted), d = seconds(cached);
            if (r > 0) tp.push_back(a), ts.push_back(b), tc.push_back(d);
        }
        const double sp = bench::median(tp), ss = bench::median(ts), sc = bench::median(tc);
        char r1[32], r2[32];
        std::snprintf(r1, sizeof r1, "%.2f", sp / ss);
        std::snprintf(r2, sizeof r2, "%.2f", sp / sc);
        const bool one = depth == 1;
        row(one ? "plain O_DIRECT expert reads, 16 rotating buffers" : "  the same, 16 in parallel", depth, sp, payload, "1.00");
        row(one ? "  ... each batch sorted by disk offset" : "  ... each batch sorted by disk offset", depth, ss, payload, r1);
        row(one ? "ExpertCache cold fetches, 16 slots, batches of 16" : "ExpertCache, the same, 16 in parallel", depth, sc, payload, r2);
        const std::uint64_t runs = std::uint64_t(std::max(1, reps) + 1);
        if (cache.stats().hits != 0 || cache.stats().misses != runs * kExperts)
            std::fprintf(out, "  (warning: %llu hits; the fetches were not all cold)\n", (unsigned long long)cache.stats().hits);
        if (cache.store().direct_shards() == 0) std::fprintf(out, "  (warning: O_DIRECT was refused: buffered reads)\n");
    }

    // ---- 3. every read into the SAME buffer: plain reads into one buffer vs a 1-slot cache fetching expert
    //      by expert (the smallest cache there is). On the 2-vCPU development VM (a Firecracker guest), reusing
    //      one destination buffer alone made O_DIRECT reads ~3x slower than rotating through 16.
    {
        Orders plain_orders, cache_orders;
        ExpertCache cache(m, c, 1, ExpertCacheOptions{true, 1, PolicyKind::lru});
        ExpertWeights one;
        auto plain = [&] { plain_reads(plain_orders.next(), 1, [&](int) { return arena.data(); }, false); };
        auto cached = [&] {
            for (int e : cache_orders.next()) cache.fetch(1, std::span<const int>(&e, 1), &one);
        };
        std::vector<double> tp, tc;
        for (int r = 0; r <= std::max(1, reps); ++r) {
            const double a = seconds(plain), b = seconds(cached);
            if (r > 0) tp.push_back(a), tc.push_back(b);
        }
        const double sp = bench::median(tp), sc = bench::median(tc);
        char ratio[32];
        std::snprintf(ratio, sizeof ratio, "%.2f", sp / sc);
        row("plain O_DIRECT expert reads, all into one buffer", 1, sp, payload, "1.00");
        row("ExpertCache cold fetches, 1 slot, one at a time", 1, sc, payload, ratio);
    }

    // ---- 4. the disk's sequential speed: one reader, 16 MiB O_DIRECT reads from byte 0 to the end, into
    //      16 rotating 16 MiB buffers (in the expert arena), then all into one buffer
    for (const bool rotate : {true, false}) {
        const int dfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        const std::size_t chunk = std::size_t(16) << 20;
        const double sec = bench::median_seconds(reps, [&] {
            std::size_t i = 0;
            for (std::uint64_t off = 0; off < file_bytes; ++i) {
                const ssize_t n = ::pread(dfd, arena.data() + (rotate ? (i % kBatch) * chunk : 0), chunk, off_t(off));
                if (n <= 0) break;
                off += std::uint64_t(n);
            }
        });
        ::close(dfd);
        row(rotate ? "sequential O_DIRECT read, 16 MiB, rotating buffers" : "sequential O_DIRECT read, 16 MiB, one buffer", 1, sec,
            double(file_bytes), "-");
    }

    // ---- 5. one expert's FFN at K3 size, weights in memory
    {
        const std::size_t F = 3072, L = 3584;
        AlignedBuffer expert(S);
        test::Rng rng(13);
        std::uint8_t* b = expert.as<std::uint8_t>();
        std::array<const std::uint8_t*, 6> part{};
        std::uint64_t at = 0;
        for (std::size_t p = 0; p < 6; ++p) {
            part[p] = b + at;
            for (std::size_t i = 0; i < std::size_t(shapes[p].numel()); ++i)
                b[at + i] = p % 2 ? std::uint8_t(118 + rng.bits() % 10) : std::uint8_t(rng.bits());
            at += std::uint64_t(shapes[p].numel());
        }
        const ExpertWeights ew{part[0], part[1], part[2], part[3], part[4], part[5]};
        const std::vector<float> z = rng.floats(L);
        std::vector<float> y(L);
        const int threads_before = max_threads();
        for (int threads : {1, 2}) {
            set_threads(threads);
            const double sec = bench::median_seconds(reps, [&] { expert_ffn(y.data(), z.data(), 1, ew, F, L, Situ{}); });
            std::fprintf(out, "  %-52s %7s %10.4f %8.2f %8s   (%d thread%s; x16 = %.1f ms per token-layer)\n", "expert FFN, F 3072, L 3584, 1 token",
                         "-", sec, double(S) / sec / 1e9, "-", threads, threads > 1 ? "s" : "", 16 * sec * 1e3);
        }
        set_threads(threads_before);
    }
}

}  // namespace kimik3
