// Tests for chapter 04: matvec_bf16. Section numbers match the chapter.
#include "../chapters/04_matvec_bf16.hpp"

#include <algorithm>
#include <cmath>

#include "fixture.hpp"

using namespace kimik3;

TEST_CASE("4.1 matvec_bf16 worked by hand (2 x 16)") {
    // Row 0: w = 1.0 (bf16 0x3F80) everywhere, x = 0, 1, 2, ..., 15: y0 = 120 (all sums exact).
    // Row 1: w0 = 2.0 (0x4000), w15 = -0.5 (0xBF00), zeros elsewhere: y1 = 2*0 + (-0.5)*15 = -7.5.
    std::vector<bf16> w(32, 0);
    for (int i = 0; i < 16; ++i) w[std::size_t(i)] = 0x3F80;
    w[16] = 0x4000;
    w[31] = 0xBF00;
    std::vector<float> x(16), y(2);
    for (int i = 0; i < 16; ++i) x[std::size_t(i)] = float(i);
    matvec_bf16_ref(y.data(), x.data(), w.data(), 2, 16);
    CHECK(y[0] == 120.0f);
    CHECK(y[1] == -7.5f);
    matvec_bf16_simd(y.data(), x.data(), w.data(), 2, 16);
    CHECK(y[0] == 120.0f);
    CHECK(y[1] == -7.5f);
}

TEST_CASE("4.2 the even/odd register layout is a permutation of the 16 lanes") {
    std::vector<int> seen;
    for (int a = 0; a < simd::kBatchesPer16; ++a)
        for (int j = 0; j < simd::W; ++j) seen.push_back(detail::lane_of(a, j));
    std::sort(seen.begin(), seen.end());
    for (int l = 0; l < 16; ++l) CHECK(seen[std::size_t(l)] == l);
}

namespace {
// The fast kernels this machine runs (4.4's table after the reference); the others are counted as skipped.
std::vector<Kernel<Bf16Matmul>> fast_paths() { return test::fast_kernels<Bf16Matmul>(kBf16Kernels, "bf16"); }
}  // namespace

TEST_CASE("4.3 every fast path is bit-identical to the reference for every shape, T, and planted values") {
    test::Rng rng(41);
    int cases = 0;
    for (std::size_t rows : {1u, 3u, 4u, 5u, 64u, 333u})
        for (std::size_t cols : {1u, 15u, 16u, 17u, 31u, 32u, 33u, 48u, 64u, 168u, 1024u})
            for (std::size_t tokens : {1u, 2u, 3u, 4u, 5u, 9u, 17u}) {
                auto w = rng.bf16s(rows * cols, -2.0f, 2.0f);
                auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                w[0] = 0x8000;                          // -0
                w[rows * cols - 1] = f32_to_bf16(1e30f); // huge weight
                x[cols - 1] = 1e-38f;                   // denormal-adjacent input
                std::vector<float> a(tokens * rows), b(tokens * rows);
                matmul_bf16_ref(a.data(), x.data(), w.data(), tokens, rows, cols);
                for (const auto& path : fast_paths()) {
                    const char* name = path.name;  // (clang 14 cannot capture structured bindings)
                    path.fn(b.data(), x.data(), w.data(), tokens, rows, cols, 0);
                    CAPTURE(name);
                    CAPTURE(rows);
                    CAPTURE(cols);
                    CAPTURE(tokens);
                    CHECK_BITS_EQ(b, a);
                }
                ++cases;
            }
    CHECK(cases == 462);
}

TEST_CASE("4.3 every fast path is bit-identical to the reference on both sides of a plan's width switch (8192 columns)") {
    // (the AVX-512 Zen 5 kernel streams one token 16 rows at a time up to 8192 columns, 8 past them)
    test::Rng rng(43);
    for (std::size_t cols : {8176u, 8192u, 8193u, 8208u})
        for (std::size_t tokens : {1u, 2u}) {
            const std::size_t rows = 37;  // 2 x 16 + 5 or 4 x 8 + 5: the many-row loop, then the 1-row one
            auto w = rng.bf16s(rows * cols, -2.0f, 2.0f);
            auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
            std::vector<float> a(tokens * rows), b(tokens * rows);
            matmul_bf16_ref(a.data(), x.data(), w.data(), tokens, rows, cols);
            for (const auto& path : fast_paths()) {
                const char* name = path.name;
                path.fn(b.data(), x.data(), w.data(), tokens, rows, cols, 0);
                CAPTURE(name);
                CAPTURE(cols);
                CAPTURE(tokens);
                CHECK_BITS_EQ(b, a);
            }
        }
}

TEST_CASE("4.3 T tokens at once give, row by row, exactly the bits of T single matvecs") {
    test::Rng rng(42);
    const std::size_t rows = 96, cols = 7168, tokens = 7;
    auto w = rng.bf16s(rows * cols);
    auto x = rng.floats(tokens * cols);
    std::vector<float> all(tokens * rows), one(rows);
    matmul_bf16(all.data(), x.data(), w.data(), tokens, rows, cols);
    for (std::size_t t = 0; t < tokens; ++t) {
        matvec_bf16(one.data(), x.data() + t * cols, w.data(), rows, cols);
        CHECK_BITS_EQ(std::span<const float>(all.data() + t * rows, rows), one);
    }
}

TEST_CASE("4.3 T tokens, one read: every token's row is its own matvec's, T = 1..33, uneven rows, 1 and 2 threads") {
    // 4.3's plan: blocks of 8 rows (here 1, 7 and 37 rows: partial blocks and a lone last row), panels
    // of up to 256 columns (600 and 1040: partial panels, and a tail of 8 columns past the last chunk),
    // token groups of at most 5 and narrower panels past 16 tokens. Each token's row must be, bit for
    // bit, the same path's matvec on that token alone and the reference's.
    test::Rng rng(44);
    const int threads_before = max_threads();
    int cases = 0;
    for (std::size_t rows : {1u, 7u, 37u})
        for (std::size_t cols : {600u, 1040u})
            for (std::size_t tokens : {1u, 2u, 3u, 4u, 7u, 16u, 33u}) {
                auto w = rng.bf16s(rows * cols, -2.0f, 2.0f);
                w[rows * cols - 1] = 0x8000;  // -0 in the last tail column
                const auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                std::vector<float> ref(tokens * rows), got(tokens * rows), one(rows);
                matmul_bf16_ref(ref.data(), x.data(), w.data(), tokens, rows, cols);
                for (const auto& path : fast_paths()) {
                    const char* name = path.name;
                    CAPTURE(name);
                    CAPTURE(rows);
                    CAPTURE(cols);
                    CAPTURE(tokens);
                    for (int threads : {1, 2}) {
                        CAPTURE(threads);
                        set_threads(threads);
                        path.fn(got.data(), x.data(), w.data(), tokens, rows, cols, 0);
                        CHECK_BITS_EQ(got, ref);
                        for (std::size_t t = 0; t < tokens; ++t) {
                            path.fn(one.data(), x.data() + t * cols, w.data(), 1, rows, cols, 0);
                            CHECK_BITS_EQ(std::span<const float>(got.data() + t * rows, rows), one);
                        }
                    }
                }
                ++cases;
            }
    set_threads(threads_before);
    CHECK(cases == 42);
}

namespace {
// 4a.1's tree in registers, on 16 lanes from memory; 0 where this build has no AVX-512 kernels (never called there).
#if KIMIK3_X86_KERNELS
KIMIK3_AVX512_BEGIN
KIMIK3_TARGET_AVX512 float hsum16_in_registers(const float* a) { return detail::hsum16_avx512(_mm512_loadu_ps(a)); }
KIMIK3_AVX512_END
#else
float hsum16_in_registers(const float*) { return 0.0f; }
#endif
}  // namespace

TEST_CASE("4a.1 the tree in AVX-512 registers adds chapter 00's pairs in chapter 00's order (hsum16's bits)") {
    if (!KIMIK3_X86_KERNELS || !cpu_has(Isa::avx512)) return test::skip("hsum16_avx512", "this machine runs no AVX-512 kernels");
    test::Rng rng(45);
    int order_matters = 0;  // lanes whose left-to-right sum differs from the tree: the test can tell trees apart
    for (int c = 0; c < 20000; ++c) {
        float a[kLanes];
        for (float& v : a) v = std::ldexp(rng.floats(1, -1.0f, 1.0f)[0], int(rng.bits() % 60) - 30);  // wide exponents
        if (c % 7 == 0) a[rng.bits() % 16] = -0.0f;
        if (c % 11 == 0) for (float& v : a) v = (rng.bits() % 2) ? 0.0f : -0.0f;  // signed zeros only
        if (c % 13 == 0) a[rng.bits() % 16] = 3e38f, a[rng.bits() % 16] = 3e38f;  // an overflow to inf
        if (c % 17 == 0) a[rng.bits() % 16] = INFINITY, a[rng.bits() % 16] = -INFINITY;  // NaN
        const float want = hsum16(a), got = hsum16_in_registers(a);
        float seq = 0.0f;
        for (float v : a) seq += v;
        order_matters += std::bit_cast<std::uint32_t>(seq) != std::bit_cast<std::uint32_t>(want);
        if (std::isnan(want)) REQUIRE(std::isnan(got));
        else REQUIRE(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want));
    }
    CHECK(order_matters > 1000);
}

TEST_CASE("4.3 one thread and two threads give the same bits") {
    test::Rng rng(43);
    const std::size_t rows = 1001, cols = 512;
    auto w = rng.bf16s(rows * cols);
    auto x = rng.floats(3 * cols);
    std::vector<float> a(3 * rows), b(3 * rows), c(rows), d(rows);
    set_threads(1);
    matmul_bf16(a.data(), x.data(), w.data(), 3, rows, cols);
    matvec_bf16(c.data(), x.data(), w.data(), rows, cols);
    set_threads(2);
    matmul_bf16(b.data(), x.data(), w.data(), 3, rows, cols);
    matvec_bf16(d.data(), x.data(), w.data(), rows, cols);
    CHECK_BITS_EQ(b, a);
    CHECK_BITS_EQ(d, c);
    for (const auto& path : fast_paths()) {
        const char* name = path.name;
        CAPTURE(name);
        for (int threads : {1, 2}) {
            set_threads(threads);
            path.fn(b.data(), x.data(), w.data(), 3, rows, cols, 0);
            path.fn(d.data(), x.data(), w.data(), 1, rows, cols, 0);
            CHECK_BITS_EQ(b, a);
            CHECK_BITS_EQ(d, c);
        }
    }
}

TEST_CASE("4.4 matvec_bf16 agrees with the float64 reference within 1e-6 relative") {
    test::Fixture f("fixtures/kernels/matvec_bf16.safetensors");
    const Tensor w = f.raw("w");
    const auto x = f.f32("x"), want = f.f32("y");
    REQUIRE(f.shape("w") == Shape{48, 64});
    std::vector<float> y(3 * 48);
    matmul_bf16(y.data(), x.data(), view_as<bf16>(w, DType::BF16).data, 3, 48, 64);
    CHECK_REL_WITHIN(y, want, 1e-6);
}

TEST_CASE("4.4 the dispatcher names the bf16 kernel it runs: the Zen 5 prefetch on AMD family 26, never a kernel this CPU lacks") {
    const Kernel<Bf16Matmul>& k = bf16_kernel();
    test::check_dispatch<Bf16Matmul>(kBf16Kernels, k, bf16_kernel_name());
    if (use_simd && isa_enabled(Isa::avx512) && cpu_amd_family() != 26) CHECK(std::string(k.name) == "avx512");
    // A kernel compiled in for an instruction set this CPU lacks refuses to run, naming itself.
    std::vector<bf16> w(32, 0x3F80);
    std::vector<float> x(32), y(1);
    for (const auto& e : kBf16Kernels)
        if (e.fn != nullptr && !cpu_has(e.isa)) {
            const std::string msg = test::error_of([&] { e.fn(y.data(), x.data(), w.data(), 1, 1, 32, 1); });
            CHECK(msg.find(std::string("matmul_bf16_") + e.name + ": this CPU has no") == 0);
        }
}

TEST_CASE("4.4 an input width off the 16 lanes (24) worked by hand: columns 16..23 go into lanes 0..7") {
    // w = 1 everywhere (bf16 0x3F80), x_i = 2^20 for i = 0 and 16, 1 for i = 1 and 17, 0 elsewhere.
    //   lane 0: 2^20 + 2^20 = 2^21; lane 1: 1 + 1 = 2; the tree: 2^21 + 2 (exact). A tail added into
    //   lane 16 % 16 = 0 after element 0 is the contract; any other lane would give the same value
    //   here, so the second row plants a sum where the lane matters: x_0 = 2^24, x_16 = 1, x_8 = 1:
    //   lane 0: 2^24 + 1 -> 2^24 (tie to even); lane 8: 1; tree: s8[0] = 2^24 + 1 -> 2^24 ... = 2^24.
    //   Had element 16 gone into lane 8 with x_8, lane 8 = 2 and the tree 2^24 + 2.
    std::vector<bf16> w(48, 0x3F80);
    std::vector<float> x(48, 0.0f), y(2);
    x[0] = x[16] = 0x1p20f, x[1] = x[17] = 1.0f;
    x[24] = 0x1p24f, x[24 + 16] = 1.0f, x[24 + 8] = 1.0f;
    auto kernels = fast_paths();
    kernels.push_back(kBf16Kernels[0]);  // the reference
    for (const auto& path : kernels) {
        const char* name = path.name;
        CAPTURE(name);
        path.fn(y.data(), x.data(), w.data(), 2, 1, 24, 1);  // token 0 and token 1 (x rows of 24)
        CHECK(y[0] == 0x1p21f + 2.0f);
        CHECK(y[1] == 0x1p24f);
    }
}

namespace {
// Delivers a resident matrix's rows in chunks of the given sizes (copied, so the kernel sees new memory).
struct ChunkedRows : RowStream {
    const std::byte* w;
    std::size_t rows, row_bytes, chunk;
    int chunks_seen = 0;
    ChunkedRows(const void* w_, std::size_t r, std::size_t rb, std::size_t k)
        : w(static_cast<const std::byte*>(w_)), rows(r), row_bytes(rb), chunk(k) {}
    void for_each_chunk(const std::function<void(std::size_t, std::size_t, const void*)>& f) override {
        for (std::size_t r0 = 0; r0 < rows; r0 += chunk) {
            const std::size_t r1 = std::min(rows, r0 + chunk);
            std::vector<std::byte> copy(w + r0 * row_bytes, w + r1 * row_bytes);
            f(r0, r1, copy.data());
            ++chunks_seen;
        }
    }
};
}  // namespace

TEST_CASE("4.6 a matrix streamed in row chunks of any size gives exactly the bits of the resident one") {
    test::Rng rng(45);
    const std::size_t rows = 301, cols = 256, tokens = 5;
    auto w = rng.bf16s(rows * cols);
    auto x = rng.floats(tokens * cols);
    std::vector<float> resident(tokens * rows), streamed(tokens * rows);
    linear(resident.data(), x.data(), tokens, MatrixRef{w.data(), nullptr, rows, cols});
    for (std::size_t chunk : {1u, 7u, 64u, 300u, 301u, 1000u}) {
        ChunkedRows s(w.data(), rows, cols * 2, chunk);
        std::fill(streamed.begin(), streamed.end(), -1.0f);
        linear(streamed.data(), x.data(), tokens, MatrixRef{nullptr, &s, rows, cols});
        CAPTURE(chunk);
        CHECK(s.chunks_seen == int((rows + chunk - 1) / chunk));
        CHECK_BITS_EQ(streamed, resident);
    }
}

TEST_CASE("4.5 F32 and F16 matrices: SIMD = reference bit for bit, and = the same values as F32 (so BF16 = widened F32 too)") {
    test::Rng rng(46);
    int cases = 0;
    for (std::size_t rows : {1u, 4u, 7u, 33u})
        for (std::size_t cols : {1u, 15u, 16u, 17u, 48u, 168u})
            for (std::size_t tokens : {1u, 3u}) {
                const auto h = rng.f16s(rows * cols);
                const auto b = rng.bf16s(rows * cols, -2.0f, 2.0f);
                auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                x[0] = 1e-39f;  // a denormal input
                std::vector<float> hf(rows * cols), bf(rows * cols);  // the same values as F32 weights
                for (std::size_t i = 0; i < rows * cols; ++i) hf[i] = f16_to_f32(h[i]), bf[i] = bf16_to_f32(b[i]);
                std::vector<float> ref(tokens * rows), got(tokens * rows), as_f32(tokens * rows);
                CAPTURE(rows);
                CAPTURE(cols);
                CAPTURE(tokens);
                for (WeightType t : {WeightType::f16, WeightType::f32}) {
                    const void* w = t == WeightType::f16 ? static_cast<const void*>(h.data()) : static_cast<const void*>(hf.data());
                    matmul_typed_ref(t, ref.data(), x.data(), w, tokens, rows, cols);
                    matmul_typed_simd(t, got.data(), x.data(), w, tokens, rows, cols);
                    CHECK_BITS_EQ(got, ref);
                }
                matmul_typed_ref(WeightType::f32, as_f32.data(), x.data(), hf.data(), tokens, rows, cols);
                matmul_typed_simd(WeightType::f16, got.data(), x.data(), h.data(), tokens, rows, cols);
                CHECK_BITS_EQ(got, as_f32);  // F16 weights = their F32 values, bit for bit
                matmul_typed_simd(WeightType::f32, as_f32.data(), x.data(), bf.data(), tokens, rows, cols);
                matmul_typed_simd(WeightType::bf16, got.data(), x.data(), b.data(), tokens, rows, cols);
                CHECK_BITS_EQ(got, as_f32);  // the bf16 kernel = the f32 kernel on the widened values
                ++cases;
            }
    CHECK(cases == 48);
}

TEST_CASE("4.6 an F16 or F32 matrix streamed in row chunks gives the bits of the resident one") {
    test::Rng rng(47);
    const std::size_t rows = 37, cols = 40, tokens = 3;
    const auto h = rng.f16s(rows * cols);
    const auto f = rng.floats(rows * cols);
    const auto x = rng.floats(tokens * cols);
    for (WeightType t : {WeightType::f16, WeightType::f32}) {
        const void* w = t == WeightType::f16 ? static_cast<const void*>(h.data()) : static_cast<const void*>(f.data());
        std::vector<float> resident(tokens * rows), streamed(tokens * rows);
        linear(resident.data(), x.data(), tokens, MatrixRef{w, nullptr, rows, cols, t});
        ChunkedRows s(w, rows, cols * weight_bytes(t), 5);
        linear(streamed.data(), x.data(), tokens, MatrixRef{nullptr, &s, rows, cols, t});
        CHECK(s.chunks_seen == 8);
        CHECK_BITS_EQ(streamed, resident);
    }
}
