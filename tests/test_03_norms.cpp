// Tests for chapter 03: norms. Section numbers match the chapter.
#include "../chapters/03_norms.hpp"

#include "fixture.hpp"

using namespace kimik3;

TEST_CASE("3.1 rmsnorm worked by hand") {
    // x = sixteen 4s: mean(x^2) = 16, sqrt(16 + 0) = 4, inv = 0.25, n(x) = all ones, y = gamma.
    std::vector<float> x(16, 4.0f), gamma(16), y(16);
    for (int i = 0; i < 16; ++i) gamma[std::size_t(i)] = 0.5f * float(i) - 3.0f;
    rmsnorm_ref(y.data(), x.data(), gamma.data(), 16, 0.0f);
    CHECK(y == gamma);
    // With eps: x = sixteen 1s, mean 1, eps 3 -> sqrt(4) = 2, inv 0.5: y = gamma / 2 (exact halving).
    std::vector<float> ones(16, 1.0f), half(16);
    rmsnorm_ref(y.data(), ones.data(), gamma.data(), 16, 3.0f);
    for (int i = 0; i < 16; ++i) half[std::size_t(i)] = gamma[std::size_t(i)] * 0.5f;
    CHECK(y == half);
}

TEST_CASE("3.1 rmsnorm_simd is bit-identical to rmsnorm_ref, in place too") {
    test::Rng rng(31);
    for (std::size_t n : {16u, 32u, 48u, 128u, 1536u, 3584u, 7168u}) {
        auto x = rng.floats(n, -5.0f, 5.0f), gamma = rng.floats(n, 0.5f, 1.5f);
        x[0] = -0.0f;
        x[n - 1] = 1e-30f;
        x[n / 3] = 3e4f;
        std::vector<float> a(n), b(n);
        rmsnorm_ref(a.data(), x.data(), gamma.data(), n, 1e-5f);
        rmsnorm_simd(b.data(), x.data(), gamma.data(), n, 1e-5f);
        CHECK_BITS_EQ(b, a);
        std::vector<float> c = x;
        rmsnorm(c.data(), c.data(), gamma.data(), n, 1e-5f);  // y may alias x
        CHECK_BITS_EQ(c, a);
    }
}

TEST_CASE("3.1 rmsnorm agrees with the float64 reference within 1e-6 relative") {
    test::Fixture f("fixtures/kernels/norms.safetensors");
    const auto x = f.f32("rms.x"), gamma = f.f32("rms.gamma"), want = f.f32("rms.y");
    for (std::size_t r = 0; r < 3; ++r) {
        std::vector<float> y(128), w(want.begin() + long(r * 128), want.begin() + long(r * 128 + 128));
        rmsnorm(y.data(), x.data() + r * 128, gamma.data(), 128, 1e-5f);
        CHECK_REL_WITHIN(y, w, 1e-6);
    }
}

TEST_CASE("3.2 l2norm: a zero head gives zeros, not NaN (eps inside the root); q scale applied once") {
    std::vector<float> zero(32, 0.0f), y(32, 7.0f);
    l2norm(y.data(), zero.data(), 32, 1.0f);
    for (float v : y) CHECK(v == 0.0f);
    // Worked by hand: x = (3, 4, 0, ...): sum of squares 25; 25 + 1e-6 rounds to 25 + 2^-19 in f32 (half
    // an ulp of 25 is 9.5e-7), and its square root rounds back to exactly 5, so c = 1/5 * scale, and
    // y = (0.6, 0.8) times the scale.
    std::vector<float> x(32, 0.0f);
    x[0] = 3.0f;
    x[1] = 4.0f;
    l2norm_ref(y.data(), x.data(), 32, 1.0f);
    CHECK(y[0] == 3.0f * (1.0f / 5.0f));
    CHECK(y[1] == 4.0f * (1.0f / 5.0f));
    l2norm_ref(y.data(), x.data(), 32, 0.5f);
    CHECK(y[1] == 4.0f * ((1.0f / 5.0f) * 0.5f));
}

TEST_CASE("3.2 l2norm_simd is bit-identical to l2norm_ref") {
    test::Rng rng(32);
    for (std::size_t n : {16u, 32u, 128u, 512u}) {
        auto x = rng.floats(n, -2.0f, 2.0f);
        std::vector<float> a(n), b(n);
        l2norm_ref(a.data(), x.data(), n, 0.08838834764f);
        l2norm_simd(b.data(), x.data(), n, 0.08838834764f);
        CHECK_BITS_EQ(b, a);
    }
}

TEST_CASE("3.2 l2norm agrees with the float64 reference within 1e-6 relative (sum, not mean; eps 1e-6)") {
    test::Fixture f("fixtures/kernels/norms.safetensors");
    const auto x = f.f32("l2.x"), want = f.f32("l2.y");
    for (std::size_t h = 0; h < 4; ++h) {
        std::vector<float> y(32), w(want.begin() + long(h * 32), want.begin() + long(h * 32 + 32));
        l2norm(y.data(), x.data() + h * 32, 32, 1.0f / std::sqrt(32.0f));
        CHECK_REL_WITHIN(y, w, 1e-6);
    }
}

TEST_CASE("3.3 gated head norm: a zero gate halves the normalised head; each head is normalised alone") {
    // Head 0 = sixteen 2s, head 1 = sixteen 8s: both normalise to all ones (rms 2 and 8, eps 0).
    std::vector<float> o(32), g(32, 0.0f), w(16, 1.0f), y(32);
    for (int i = 0; i < 16; ++i) o[std::size_t(i)] = 2.0f, o[std::size_t(16 + i)] = 8.0f;
    gated_head_norm_ref(y.data(), o.data(), g.data(), w.data(), 2, 16, 0.0f);
    for (float v : y) CHECK(v == 0.5f);  // 1 * 1 * sigmoid(0)
}

TEST_CASE("3.3 gated_head_norm_simd is bit-identical to gated_head_norm_ref") {
    test::Rng rng(33);
    for (std::size_t heads : {1u, 4u, 96u}) {
        const std::size_t dh = heads == 96 ? 128 : 32;
        auto o = rng.floats(heads * dh, -3.0f, 3.0f), g = rng.floats(heads * dh, -8.0f, 8.0f), w = rng.floats(dh, 0.5f, 1.5f);
        std::vector<float> a(heads * dh), b(heads * dh);
        gated_head_norm_ref(a.data(), o.data(), g.data(), w.data(), heads, dh, 1e-5f);
        gated_head_norm_simd(b.data(), o.data(), g.data(), w.data(), heads, dh, 1e-5f);
        CHECK_BITS_EQ(b, a);
    }
}

TEST_CASE("3.3 gated head norm agrees with the float64 reference within 1e-6 relative") {
    test::Fixture f("fixtures/kernels/norms.safetensors");
    const auto o = f.f32("gated.o"), g = f.f32("gated.g"), w = f.f32("gated.w"), want = f.f32("gated.y");
    std::vector<float> y(o.size());
    gated_head_norm(y.data(), o.data(), g.data(), w.data(), 4, 32, 1e-5f);
    CHECK_REL_WITHIN(y, want, 1e-6);
}

TEST_CASE("3.x any width: every norm's SIMD path equals its reference at n = 1 .. 33, 48, 168 (the tails)") {
    test::Rng rng(314);
    for (std::size_t n = 1; n <= 170; n += (n < 34 ? 1 : 67)) {  // 1..33, 34, 101, 168
        auto x = rng.floats(3 * n, -4.0f, 4.0f), gamma = rng.floats(n, 0.5f, 1.5f), g = rng.floats(3 * n, -3.0f, 3.0f);
        x[n - 1] = -0.0f;
        std::vector<float> a(3 * n), b(3 * n);
        CAPTURE(n);
        rmsnorm_ref(a.data(), x.data(), gamma.data(), n, 1e-5f);
        rmsnorm_simd(b.data(), x.data(), gamma.data(), n, 1e-5f);
        CHECK_BITS_EQ(b, a);
        l2norm_ref(a.data(), x.data(), n, 0.3f);
        l2norm_simd(b.data(), x.data(), n, 0.3f);
        CHECK_BITS_EQ(b, a);
        gated_head_norm_ref(a.data(), x.data(), g.data(), gamma.data(), 3, n, 1e-5f);
        gated_head_norm_simd(b.data(), x.data(), g.data(), gamma.data(), 3, n, 1e-5f);
        CHECK_BITS_EQ(b, a);
    }
}
