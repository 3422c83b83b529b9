// Tests for chapter 04: matvec_bf16. Section numbers match the chapter.
#include "../chapters/04_matvec_bf16.hpp"

#include <algorithm>

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

TEST_CASE("4.3 matmul_bf16_simd is bit-identical to the reference for every shape, T, and planted values") {
    test::Rng rng(41);
    int cases = 0;
    for (std::size_t rows : {1u, 3u, 4u, 5u, 64u, 333u})
        for (std::size_t cols : {16u, 32u, 48u, 64u, 1024u})
            for (std::size_t tokens : {1u, 2u, 3u, 4u, 5u, 9u}) {
                auto w = rng.bf16s(rows * cols, -2.0f, 2.0f);
                auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                w[0] = 0x8000;                          // -0
                w[rows * cols - 1] = f32_to_bf16(1e30f); // huge weight
                x[cols - 1] = 1e-38f;                   // denormal-adjacent input
                std::vector<float> a(tokens * rows), b(tokens * rows);
                matmul_bf16_ref(a.data(), x.data(), w.data(), tokens, rows, cols);
                matmul_bf16_simd(b.data(), x.data(), w.data(), tokens, rows, cols);
                CAPTURE(rows);
                CAPTURE(cols);
                CAPTURE(tokens);
                CHECK_BITS_EQ(b, a);
                ++cases;
            }
    CHECK(cases == 180);
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

TEST_CASE("4.4 an input width that is not a multiple of 16 is refused") {
    std::vector<bf16> w(64, 0x3F80);
    std::vector<float> x(64, 1.0f), y(2);
    CHECK_THROWS_WITH_AS(matvec_bf16(y.data(), x.data(), w.data(), 2, 24), "matvec_bf16: in = 24 is not a multiple of 16", Error);
}

namespace {
// Delivers a resident matrix's rows in chunks of the given sizes (copied, so the kernel sees new memory).
struct ChunkedRows : RowStream {
    const bf16* w;
    std::size_t rows, cols, chunk;
    int chunks_seen = 0;
    ChunkedRows(const bf16* w_, std::size_t r, std::size_t c, std::size_t k) : w(w_), rows(r), cols(c), chunk(k) {}
    void for_each_chunk(const std::function<void(std::size_t, std::size_t, const bf16*)>& f) override {
        for (std::size_t r0 = 0; r0 < rows; r0 += chunk) {
            const std::size_t r1 = std::min(rows, r0 + chunk);
            std::vector<bf16> copy(w + r0 * cols, w + r1 * cols);
            f(r0, r1, copy.data());
            ++chunks_seen;
        }
    }
};
}  // namespace

TEST_CASE("4.5 a matrix streamed in row chunks of any size gives exactly the bits of the resident one") {
    test::Rng rng(45);
    const std::size_t rows = 301, cols = 256, tokens = 5;
    auto w = rng.bf16s(rows * cols);
    auto x = rng.floats(tokens * cols);
    std::vector<float> resident(tokens * rows), streamed(tokens * rows);
    linear(resident.data(), x.data(), tokens, MatrixRef{w.data(), nullptr, rows, cols});
    for (std::size_t chunk : {1u, 7u, 64u, 300u, 301u, 1000u}) {
        ChunkedRows s(w.data(), rows, cols, chunk);
        std::fill(streamed.begin(), streamed.end(), -1.0f);
        linear(streamed.data(), x.data(), tokens, MatrixRef{nullptr, &s, rows, cols});
        CAPTURE(chunk);
        CHECK(s.chunks_seen == int((rows + chunk - 1) / chunk));
        CHECK_BITS_EQ(streamed, resident);
    }
}
