// kimik3-bench: measurements at Kimi K3's real sizes, reported against this machine's own limits.
//
//   make bench                       all sections
//   make bench BENCH_ARGS="--reps 9" more repetitions (the median is reported)
//   build/g++/kimik3-bench --help
//
// Every figure is the MEDIAN of several runs (the machine is shared and noisy), and every speed is
// also given as a ratio to a limit measured in the same run: the plain memory-read bandwidth of one
// thread and of all threads (for a kernel that streams its weights, a plain read of those same bytes
// just before it). Nothing here asserts a time: benchmarks measure, tests check.
#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "../kimik3.hpp"
#include "../tests/rng.hpp"
#include "bench_experts.hpp"
#include "bench_headers.hpp"
#include "bench_kda.hpp"
#include "bench_mla.hpp"
#include "bench_tokenizer.hpp"
#include "timing.hpp"

using namespace kimik3;

namespace {

int g_reps = 5;

using bench::median_seconds;

// The kernels of a family this machine runs (chapter 00's 0.9), widest first.
template <class Fn> std::vector<Kernel<Fn>> runnable(std::span<const Kernel<Fn>> family) {
    std::vector<Kernel<Fn>> out;
    for (const auto& k : family)
        if (k.fn != nullptr && cpu_has(k.isa)) out.insert(out.begin(), k);
    return out;
}

// The machine's limit: bytes per second a plain read of `bytes` at `data` achieves (no compute: four
// SIMD registers XOR the words in, a bitwise operation, so weights' bit patterns read as fast as any),
// with `threads` threads, each over its own contiguous part.
//
// Which memory is read, and when, matters on a shared virtual machine: on this project's Zen 5 guest
// one process read its 512 MB buffer at 25-27 GB/s and the next one, seconds later, at 33-35 (one
// thread, the same loop and binary, each steady within its own run), and a buffer of weights read at
// 40-45 while a fresh one read at 33. Held to another buffer's read, a kernel's ratio could pass 1.3.
// So a kernel's streamed rows are held to a read of the very bytes that kernel streams, measured just
// before it; the fresh buffer read at the start only describes the machine.
double read_bandwidth(const void* data, std::size_t bytes, int threads) {
    set_threads(threads);
    const auto* words = static_cast<const std::uint32_t*>(data);
    const std::size_t n = bytes / 4;
    volatile std::uint32_t sink = 0;
    const double sec = median_seconds(g_reps, [&] {
        std::uint32_t partial[64] = {};
        run_on_threads(threads, [&](int ti, int nti) {
            const std::size_t t = std::size_t(ti), nt = std::size_t(nti);
            const std::size_t b = n * t / nt / 64 * 64, e = t + 1 == nt ? n : n * (t + 1) / nt / 64 * 64;
            simd::u32 a0 = simd::splat_u32(0), a1 = a0, a2 = a0, a3 = a0;
            for (std::size_t i = b; i + 4 * simd::W <= e; i += 4 * simd::W) {
                a0 = a0 ^ simd::load_u32(words + i);
                a1 = a1 ^ simd::load_u32(words + i + simd::W);
                a2 = a2 ^ simd::load_u32(words + i + 2 * simd::W);
                a3 = a3 ^ simd::load_u32(words + i + 3 * simd::W);
            }
            alignas(64) std::uint32_t lanes[8];
            ((a0 ^ a1) ^ (a2 ^ a3)).store_unaligned(lanes);
            for (int j = 0; j < simd::W; ++j) partial[t % 64] ^= lanes[j];
        });
        std::uint32_t total = 0;
        for (std::uint32_t p : partial) total ^= p;
        sink = total;
    });
    (void)sink;
    return double(n * 4) / sec;
}

// The last-level cache, from sysfs (0 when unknown). A working set meant to come from memory must be
// several times larger: some servers have 100s of MB of L3 (one machine here reports 480 MiB).
std::size_t llc_bytes() {
    std::size_t best = 0;
    for (int i = 0; i < 8; ++i) {
        const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
        std::FILE* f = std::fopen((dir + "size").c_str(), "r");
        if (!f) continue;
        char unit = 0;
        unsigned long v = 0;
        if (std::fscanf(f, "%lu%c", &v, &unit) >= 1) {
            std::size_t b = v;
            if (unit == 'K') b <<= 10;
            else if (unit == 'M') b <<= 20;
            best = std::max(best, b);
        }
        std::fclose(f);
    }
    return best;
}

// Bytes a "streamed" working set spans: at least `floor`, and at least 4x the last-level cache.
std::size_t stream_bytes(std::size_t floor) { return std::max(floor, 4 * llc_bytes()); }

struct Limits {
    double bw1 = 0, bw2 = 0;  // memory read, 1 and 2 threads
    double l2 = 0;            // one thread reading a 256 kB buffer over and over (it stays in L2)
    double pairs = 0;         // one thread's float multiply-then-add pairs per second (no decode, no loads)
    double pairs512 = 0;      // the same with AVX-512 registers (0 where the kernels run none)
    double pairs_for(const char* kernel) const {  // the rate at the width the named kernel works in
        return pairs512 > 0 && std::string(kernel).rfind("avx512", 0) == 0 ? pairs512 : pairs;
    }
};

// The compute limit of the T-token tables: every (row, token, column) is one multiply and one add,
// rounded apart (no FMA: chapter 00), and every add of a sum waits for the one before it, so the best a
// kernel can do is this loop: independent sums of registers already loaded, each with its own multiply
// and add per step. (Sharing one product among the sums would measure the adds alone: an earlier version
// of this loop did, and so understated what a core whose multiplies and adds issue side by side can do.)
// T tokens over an n-weight matrix take at least T * n / pairs seconds, however seldom the weights are
// decoded. The rate is measured at the shim's width and, where the kernels use them, with AVX-512
// registers: on a Zen 5 a 512-bit multiply or add costs what a 256-bit one does, on a Zen 4 twice.
double pair_rate(int reps) {  // the shim's registers: 8 sums, 8 weights, x (17 registers; AVX2 has 16: one is reloaded)
    set_threads(1);
    constexpr int N = 8;
    const long steps = 2000000;
    volatile float sink = 0;
    const double sec = median_seconds(reps, [&] {
        simd::f32 acc[N], w[N], x = simd::splat(1e-3f);
        for (int k = 0; k < N; ++k) acc[k] = w[k] = simd::splat(1.0f + float(k));
        for (long i = 0; i < steps; ++i) {
            KIMIK3_UNROLL for (int k = 0; k < N; ++k) acc[k] = acc[k] + w[k] * x;
            x = detail::keep_loaded(x);  // (so no product is hoisted out of the loop)
        }
        for (int k = 1; k < N; ++k) acc[0] = acc[0] + acc[k];  // (every sum is used: none is dead code)
        float lanes[8 * 4];
        simd::store(lanes, acc[0]);
        sink = lanes[0];
    });
    return double(N) * double(steps) * simd::W / sec;
}

#if KIMIK3_X86_KERNELS
KIMIK3_TARGET_AVX512 double pair_rate_avx512(int reps) {  // 12 sums, 12 weights, x: 25 of the 32 registers
    set_threads(1);
    constexpr int N = 12;
    const long steps = 2000000;
    volatile float sink = 0;
    const double sec = median_seconds(reps, [&]() KIMIK3_TARGET_AVX512 {
        __m512 acc[N], w[N], x = _mm512_set1_ps(1e-3f);
        for (int k = 0; k < N; ++k) acc[k] = w[k] = _mm512_set1_ps(1.0f + float(k));
        for (long i = 0; i < steps; ++i) {
            KIMIK3_UNROLL for (int k = 0; k < N; ++k) acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(w[k], x));
            x = detail::keep_in_register(x);
        }
        for (int k = 1; k < N; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
        sink = _mm512_cvtss_f32(acc[0]);
    });
    return double(N) * double(steps) * 16 / sec;
}
#endif

double l2_bandwidth(int reps) {
    set_threads(1);
    std::vector<float> buf(std::size_t(64) << 10, 1.0f);  // 256 kB
    const int passes = 400;
    volatile float sink = 0;
    const double sec = median_seconds(reps, [&] {
        simd::f32 a0 = simd::splat(0), a1 = a0, a2 = a0, a3 = a0;
        for (int p = 0; p < passes; ++p)
            for (std::size_t i = 0; i + 4 * simd::W <= buf.size(); i += 4 * simd::W) {
                a0 = a0 + simd::load(&buf[i]);
                a1 = a1 + simd::load(&buf[i + simd::W]);
                a2 = a2 + simd::load(&buf[i + 2 * simd::W]);
                a3 = a3 + simd::load(&buf[i + 3 * simd::W]);
            }
        float lanes[8];
        simd::store(lanes, (a0 + a1) + (a2 + a3));
        sink = lanes[0];
    });
    (void)sink;
    return double(buf.size() * sizeof(float)) * passes / sec;
}

// One streamed matvec row: `read_bw` is a read of the kernel's own weights just before it (read_bandwidth).
void row(const char* kernel, const char* path, int threads, double weights, double bytes, double sec, double read_bw) {
    const double bw = bytes / sec;
    std::printf("  %-34s %-6s %2d  %9.3f ms  %7.2f Gw/s  %7.2f GB/s  %5.2f of read bw (%.1f GB/s)\n", kernel, path, threads, sec * 1e3,
                weights / sec / 1e9, bw / 1e9, bw / read_bw, read_bw / 1e9);
    std::fflush(stdout);
}

// The token counts of the T-token tables, and one row of them: time per call, weights per second, the
// ratio to T = 1 of the same kernel, weights and threads, and the same-run limits (`read_bw`: a read of
// the streamed weights just before the kernel's table; L2; the pair limit).
constexpr std::size_t kTokenCounts[] = {1, 2, 4, 8, 16};
void token_row(std::size_t T, const char* kernel, bool hot, int threads, double sec, double weights, double bytes, double t1,
               const Limits& lim, double read_bw) {
    char label[16];
    std::snprintf(label, sizeof label, "T = %zu", T);
    const double bw = bytes / sec, floor = double(T) * weights / (lim.pairs_for(kernel) * threads);
    std::printf("  %-8s %-9s %-7s %2d  %9.3f ms  %7.2f Gw/s  %8.2fx   %5.2f of read bw, %5.3f of L2 read (in weight bytes), %4.2f of the pair limit\n",
                label, kernel, hot ? "hot" : "stream", threads, sec * 1e3, weights / sec / 1e9, sec / t1, bw / read_bw,
                bw / lim.l2, floor / sec);
    std::fflush(stdout);
}

void bench_bf16(const Limits& lim) {
    const std::size_t matrix = std::size_t(12288) * 7168 * 2, copies = std::max<std::size_t>(1, (stream_bytes(matrix) + matrix - 1) / matrix);
    std::printf("\n4.x bf16 matvec at K3 size (weights streamed from memory: %zu copies of each 176 MB matrix, called in turn)\n", copies);
    std::printf("  %-34s %-6s %2s  %12s  %12s  %12s  %s\n", "kernel", "path", "th", "median", "weights", "bytes", "ratio");
    test::Rng rng(7);
    struct Shape {
        const char* name;
        std::size_t rows, cols;
    };
    const auto paths = runnable(std::span<const Kernel<Bf16Matmul>>(kBf16Kernels));
    const auto w = rng.bf16s(copies * matrix / 2);
    for (const Shape& s : {Shape{"KDA q_proj 7168 -> 12288", 12288, 7168}, Shape{"KDA o_proj 12288 -> 7168", 7168, 12288}}) {
        const auto x = rng.floats(s.cols);
        std::vector<float> y(s.rows);
        const double weights = double(s.rows * s.cols), bytes = weights * 2;
        for (int threads : {1, 2}) {
            set_threads(threads);
            for (const auto& k : paths) {
                std::size_t call = 0;  // each call reads the next copy
                const int reps = std::string(k.name) == "reference" ? std::min(g_reps, 3) : g_reps;
                const double read_bw = read_bandwidth(w.data(), w.size() * sizeof(w[0]), threads);
                const double sec = median_seconds(reps, [&] {
                    k.fn(y.data(), x.data(), w.data() + (call++ % copies) * s.rows * s.cols, 1, s.rows, s.cols, s.rows);
                });
                row(s.name, k.name, threads, weights, bytes, sec, read_bw);
            }
        }
    }
    // T tokens per read of the weights: each weight read and widened once for all T tokens. Streamed: q_proj
    // 7168 -> 12288, the copies in turn; hot: its first rows (a quarter of the last-level cache) again and again.
    const std::size_t rows = 12288, cols = 7168, Tmax = 16;
    const std::size_t hot_rows = std::clamp<std::size_t>(llc_bytes() / 4 / (2 * cols) / 16 * 16, 16, rows);
    std::printf("\n4.x bf16 matmul, T tokens per read of the weights (KDA q_proj 7168 -> 12288; hot: its first %zu rows)\n", hot_rows);
    std::printf("  %-8s %-9s %-7s %2s  %12s  %12s  %10s  %s\n", "T", "kernel", "weights", "th", "median/call", "weights", "vs T = 1",
                "ratio to limits");
    const auto xs = rng.floats(Tmax * cols);
    std::vector<float> yT(Tmax * rows);
    for (int threads : {1, 2}) {
        set_threads(threads);
        for (const auto& k : paths) {
            if (std::string(k.name) == "reference") continue;
            const double read_bw = read_bandwidth(w.data(), w.size() * sizeof(w[0]), threads);
            for (const bool hot : {false, true}) {
                const std::size_t n = hot ? hot_rows : rows, calls = hot ? std::max(copies, rows / hot_rows) : copies;  // per repetition
                double t1 = 0;
                for (const std::size_t T : kTokenCounts) {
                    std::size_t call = 0;
                    const double sec = median_seconds(g_reps, [&] {
                        for (std::size_t c = 0; c < calls; ++c)
                            k.fn(yT.data(), xs.data(), w.data() + (hot ? 0 : (call++ % copies) * rows * cols), T, n, cols, n);
                    }) / double(calls);
                    if (T == 1) t1 = sec;
                    token_row(T, k.name, hot, threads, sec, double(n * cols), double(n * cols * 2), t1, lim, read_bw);
                }
            }
        }
    }
}

void bench_mxfp4(const Limits& lim) {
    const std::size_t F = 3072, L = 3584;
    const std::size_t p13 = F * L / 2, s13 = F * L / 32;  // w1/w3: [3072, 3584]
    const std::size_t p2 = L * F / 2, s2 = L * F / 32;    // w2:    [3584, 3072]
    const std::size_t expert_bytes = 3 * (p13 + s13);
    const std::size_t E = std::max<std::size_t>(16, (stream_bytes(0) + expert_bytes - 1) / expert_bytes);  // distinct experts
    std::printf("\n5.x MXFP4 matvec at K3 size (%zu distinct experts: %.0f MB, called in turn, so reads come from memory)\n", E,
                double(E * expert_bytes) / 1e6);
    std::printf("  %-34s %-6s %2s  %12s  %12s  %12s  %s\n", "kernel", "path", "th", "median/call", "weights", "weight bytes", "ratio");
    std::printf("  one expert = 3 x (%zu + %zu) = %zu bytes (K3: 17,547,264)\n", p13, s13, expert_bytes);
    // expert e: w1 packed, w1 scale, w3 packed, w3 scale, w2 packed, w2 scale (back to back)
    std::vector<std::uint8_t> arena(E * expert_bytes);
    test::Rng rng(8);
    for (std::size_t i = 0; i < arena.size(); ++i) arena[i] = std::uint8_t(rng.bits());
    for (std::size_t e = 0; e < E; ++e)
        for (std::size_t m = 0; m < 3; ++m) {
            std::uint8_t* sc = arena.data() + e * expert_bytes + m * (p13 + s13) + p13;
            for (std::size_t i = 0; i < s13; ++i) sc[i] = std::uint8_t(118 + rng.bits() % 10);
        }
    auto mat = [&](std::size_t e, std::size_t m) { return arena.data() + e * expert_bytes + m * (p13 + s13); };
    const auto xL = rng.floats(L), xF = rng.floats(F);
    std::vector<float> yF(F), yL(L);
    const auto paths = runnable(std::span<const Kernel<Mxfp4Matmul>>(kMxfp4Kernels));
    for (int threads : {1, 2}) {
        set_threads(threads);
        for (const auto& k : paths) {
            const char* name = k.name;
            const Mxfp4Matmul fn = k.fn;
            const int reps = std::string(name) == "reference" ? std::min(g_reps, 3) : g_reps;
            const double w13 = double(F * L), b13 = double(p13 + s13);
            const double read_bw = read_bandwidth(arena.data(), arena.size(), threads);  // (for this kernel's three rows)
            // w1/w3 shape, one call per distinct expert: time per call
            double sec = median_seconds(reps, [&] {
                for (std::size_t e = 0; e < E; ++e) fn(yF.data(), xL.data(), mat(e, 0), mat(e, 0) + p13, 1, F, L);
            }) / double(E);
            row("expert w1/w3 3584 -> 3072", name, threads, w13, b13, sec, read_bw);
            sec = median_seconds(reps, [&] {
                for (std::size_t e = 0; e < E; ++e) fn(yL.data(), xF.data(), mat(e, 2), mat(e, 2) + p2, 1, L, F);
            }) / double(E);
            row("expert w2 3072 -> 3584", name, threads, double(L * F), double(p2 + s2), sec, read_bw);
            std::size_t next = 0;  // each repetition takes the next 16 experts
            sec = median_seconds(reps, [&] {
                for (std::size_t k = 0; k < 16; ++k) {
                    const std::size_t e = next++ % E;
                    fn(yF.data(), xL.data(), mat(e, 0), mat(e, 0) + p13, 1, F, L);
                    fn(yF.data(), xL.data(), mat(e, 1), mat(e, 1) + p13, 1, F, L);
                    fn(yL.data(), xF.data(), mat(e, 2), mat(e, 2) + p2, 1, L, F);
                }
            });
            row("16 experts back to back (w1,w3,w2)", name, threads, 16.0 * 3 * w13, double(16 * expert_bytes), sec, read_bw);
        }
    }

    // T tokens against one read of the weights (chunked prefill, speculative verification): each weight
    // is decoded once (in registers for up to 4 tokens on AVX2, else into chapter 04's tile, 4.3) and used by every token. Streamed: the w1 matrices of
    // the distinct experts in turn; hot: one expert's w1 again and again (5.85 MB: in the last-level cache).
    std::printf("\n5.x MXFP4 matmul, T tokens per read of the weights (w1 3584 -> 3072)\n");
    std::printf("  %-8s %-9s %-7s %2s  %12s  %12s  %10s  %s\n", "T", "kernel", "weights", "th", "median/call", "weights", "vs T = 1",
                "ratio to limits");
    const std::size_t Tmax = 16;
    const auto xs = rng.floats(Tmax * L);
    std::vector<float> yT(Tmax * F), y1(F);
    bool same = true;
    for (int threads : {1, 2}) {
        set_threads(threads);
        for (const auto& k : paths) {
            if (std::string(k.name) == "reference" || std::string(k.name) == "xsimd") continue;
            const double read_bw = read_bandwidth(arena.data(), arena.size(), threads);
            for (const bool hot : {false, true}) {
                double t1 = 0;
                for (const std::size_t T : kTokenCounts) {
                    const double sec = median_seconds(g_reps, [&] {
                        for (std::size_t e = 0; e < E; ++e) {
                            const std::size_t m = hot ? 0 : e;
                            k.fn(yT.data(), xs.data(), mat(m, 0), mat(m, 0) + p13, T, F, L);
                        }
                    }) / double(E);
                    if (T == 1) t1 = sec;
                    token_row(T, k.name, hot, threads, sec, double(F * L), double(p13 + s13), t1, lim, read_bw);
                    // each token's row must be the matvec's, bit for bit
                    for (std::size_t t = 0; t < T; ++t) {
                        k.fn(y1.data(), xs.data() + t * L, mat(hot ? 0 : E - 1, 0), mat(hot ? 0 : E - 1, 0) + p13, 1, F, L);
                        same = same && std::equal(y1.begin(), y1.end(), yT.begin() + long(t * F), [](float a, float b) {
                                   return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
                               });
                    }
                }
            }
        }
    }
    std::printf("  every token's row of the T-token matmul equals its matvec bit for bit: %s\n", same ? "yes" : "NO");
}

}  // namespace

int main(int argc, char** argv) {
    std::string only;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--reps" && i + 1 < argc) g_reps = std::max(1, std::atoi(argv[++i]));
        else if (a == "--only" && i + 1 < argc) only = argv[++i];
        else {
            std::printf("usage: kimik3-bench [--reps N] [--only bf16|mxfp4|kda|mla|experts|tokenizer|headers]\n"
                        "  Measures kernels at Kimi K3's sizes; reports medians of N runs (default 5)\n"
                        "  and ratios to the memory-read bandwidth measured in the same run.\n");
            return a == "--help" || a == "-h" ? 0 : 2;
        }
    }
    std::printf("kimik3-bench: SIMD %s (%d floats), %d threads available, median of %d runs\n", simd::arch_name(), simd::W,
                max_threads(), g_reps);
    std::printf("  this CPU runs %s kernels; in use: %s (bf16), %s (MXFP4); last-level cache %.0f MiB\n", isa_name(cpu_isa()),
                bf16_kernel_name(), mxfp4_kernel_name(), double(llc_bytes()) / double(1 << 20));
    const std::size_t read_bytes = stream_bytes(std::size_t(512) << 20);
    std::printf("\nmachine limits, measured now: plain read of a fresh %.0f MB buffer (memory; streamed kernels are held to a read of\n  their own weights, see read_bandwidth), and of 256 kB (L2); multiplies and adds\n", double(read_bytes) / 1e6);
    Limits lim;
    const std::vector<float> read_buf(read_bytes / sizeof(float), 1.0f);
    lim.bw1 = read_bandwidth(read_buf.data(), read_bytes, 1);
    lim.bw2 = read_bandwidth(read_buf.data(), read_bytes, 2);
    lim.l2 = l2_bandwidth(g_reps);
    lim.pairs = pair_rate(g_reps);
#if KIMIK3_X86_KERNELS
    if (cpu_has(Isa::avx512) && isa_enabled(Isa::avx512)) lim.pairs512 = pair_rate_avx512(g_reps);
#endif
    std::printf("  1 thread  %6.2f GB/s\n  2 threads %6.2f GB/s\n  L2 (256 kB, 1 thread) %6.2f GB/s\n", lim.bw1 / 1e9, lim.bw2 / 1e9, lim.l2 / 1e9);
    std::printf("  float multiply+add pairs, 1 thread: %.1f G/s with %d-float registers", lim.pairs / 1e9, simd::W);
    if (lim.pairs512 > 0) std::printf(", %.1f G/s with AVX-512's 16", lim.pairs512 / 1e9);
    std::printf("\n  (the T-token tables' \"pair limit\": T x weights / the rate at the kernel's width, x threads)\n");
    if (only.empty() || only == "bf16") bench_bf16(lim);
    if (only.empty() || only == "mxfp4") bench_mxfp4(lim);
    if (only.empty() || only == "kda") {
        std::printf("\n7.x KDA decode step\n");
        bench_kda(stdout, g_reps, lim.bw1);
    }
    if (only.empty() || only == "mla") bench_mla(stdout, g_reps, lim.bw1);
    if (only.empty() || only == "experts") bench_experts(stdout, g_reps);
    if (only.empty() || only == "tokenizer") {
        std::printf("\n14.x tokenizer\n");
        bench_tokenizer(stdout);
    }
    if (only.empty() || only == "headers") {
        std::printf("\n1.3 safetensors headers and the index, parsed and validated from memory\n");
        bench_headers(stdout, g_reps);
    }
    return 0;
}
