// Tests for chapter 05: mxfp4. Section numbers match the chapter.
#include "../chapters/05_mxfp4.hpp"

#include "fixture.hpp"

using namespace kimik3;

namespace {

// The fast kernels this machine runs (5.8's table after the reference); the others are counted as skipped.
std::vector<Kernel<Mxfp4Matmul>> fast_paths() { return test::fast_kernels<Mxfp4Matmul>(kMxfp4Kernels, "MXFP4"); }
using MatmulFn = Mxfp4Matmul;

// Packs codes[r][c] (0..15) into compressed-tensors bytes: column 2j -> low nibble of byte j.
std::vector<std::uint8_t> pack(const std::vector<int>& codes, std::size_t rows, std::size_t cols) {
    std::vector<std::uint8_t> p(rows * cols / 2);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t j = 0; j < cols / 2; ++j)
            p[r * cols / 2 + j] = std::uint8_t(codes[r * cols + 2 * j] | (codes[r * cols + 2 * j + 1] << 4));
    return p;
}

}  // namespace

TEST_CASE("5.1 the 16 E2M1 codes decode from their bits (sign, 2-bit exponent, 1-bit mantissa)") {
    for (int code = 0; code < 16; ++code) {
        const int s = code >> 3, e = (code >> 1) & 3, m = code & 1;
        const double mag = e == 0 ? m * 0.5 : std::ldexp(1.0 + m * 0.5, e - 1);
        CHECK(double(kE2M1[std::size_t(code)]) == (s ? -mag : mag));
        CHECK(std::signbit(kE2M1[std::size_t(code)]) == bool(s));  // code 8 is -0
    }
}

TEST_CASE("5.2 all 256 E8M0 scales: 0 is the denormal 2^-127, 255 is refused naming the tensor") {
    for (int s = 0; s < 255; ++s) CHECK(double(e8m0_to_f32(std::uint8_t(s))) == std::ldexp(1.0, s - 127));
    CHECK(std::fpclassify(e8m0_to_f32(0)) == FP_SUBNORMAL);
    for (int s = 0; s < 256; ++s) CHECK(std::bit_cast<std::uint32_t>(kE8M0.value[s]) == std::bit_cast<std::uint32_t>(e8m0_to_f32(std::uint8_t(s))));
    std::vector<std::uint8_t> scales = {127, 3, 255, 9};
    CHECK_THROWS_WITH_AS(check_e8m0_scales(scales.data(), 4, "layers.1.experts.5.w2.weight_scale"),
                         "tensor 'layers.1.experts.5.w2.weight_scale': E8M0 scale byte 255 (NaN in OCP MX) at index 2", Error);
    scales[2] = 254;
    CHECK_NOTHROW(check_e8m0_scales(scales.data(), 4, "x"));
}

TEST_CASE("5.2 all 16 codes x all 255 valid scales decode exactly, in the reference and every fast path") {
    // One row of 32 per scale: codes 0..15 twice. Against x = one-hot e_c, y = W[c] exactly.
    std::vector<int> codes(32);
    for (int c = 0; c < 32; ++c) codes[std::size_t(c)] = c % 16;
    const auto packed = pack(codes, 1, 32);
    for (int s = 0; s < 255; ++s) {
        const std::uint8_t scale = std::uint8_t(s);
        for (int c = 0; c < 16; ++c) {
            const double want = double(kE2M1[std::size_t(c)]) * std::ldexp(1.0, s - 127);
            const float w = mxfp4_weight(packed.data(), &scale, std::size_t(c));
            REQUIRE(double(w) == (std::isinf(float(want)) ? double(float(want)) : want));  // exact (or the same Inf)
        }
        // every path, one-hot inputs: y = W[c], the reference's bits, and the exact value (a path that
        // decoded a scale or a code wrongly, or flushed the 2^-127 scale to zero, fails here)
        if (s >= 253) continue;  // 6 * 2^126 overflows to Inf, and Inf * 0 from the other columns is NaN
        std::vector<float> x(32, 0.0f), ref(1), got(1);
        for (int c = 0; c < 32; ++c) {
            std::fill(x.begin(), x.end(), 0.0f);
            x[std::size_t(c)] = 1.0f;
            matmul_mxfp4_ref(ref.data(), x.data(), packed.data(), &scale, 1, 1, 32);
            REQUIRE(double(ref[0]) == double(kE2M1[std::size_t(c % 16)]) * std::ldexp(1.0, s - 127));
            for (const auto& path : fast_paths()) {
                const char* name = path.name;  // (clang 14 cannot capture structured bindings)
                const MatmulFn fn = path.fn;
                fn(got.data(), x.data(), packed.data(), &scale, 1, 1, 32);
                CAPTURE(name);
                CAPTURE(s);
                CAPTURE(c);
                REQUIRE(std::bit_cast<std::uint32_t>(got[0]) == std::bit_cast<std::uint32_t>(ref[0]));
            }
        }
    }
}

TEST_CASE("5.3 hand-worked 2x32: low nibble = even column, and a swapped order would be caught") {
    // See the chapter's top block. Row 0: scale 128 (x2), byte 0 = 0x72: col 0 = 1.0*2, col 1 = 6.0*2.
    // Row 1: scale 126 (x0.5), byte 15 = 0x9A: col 30 = -1.0*0.5, col 31 = -0.5*0.5.
    std::vector<std::uint8_t> packed(32, 0), scales = {128, 126};
    packed[0] = 0x72;
    packed[16 + 15] = 0x9A;
    std::vector<float> x(32, 0.0f), y(2);
    x[0] = 1.0f, x[1] = 1.0f, x[30] = 4.0f, x[31] = 8.0f;
    matmul_mxfp4_ref(y.data(), x.data(), packed.data(), scales.data(), 1, 2, 32);
    CHECK(y[0] == 14.0f);   // 2*1 + 12*1
    CHECK(y[1] == -4.0f);   // -0.5*4 + -0.25*8; the swapped nibble order would give -0.25*4 + -0.5*8 = -5
    for (const auto& path : fast_paths()) {
        const char* name = path.name;  // (clang 14 cannot capture structured bindings)
        const MatmulFn fn = path.fn;
        fn(y.data(), x.data(), packed.data(), scales.data(), 1, 2, 32);
        CAPTURE(name);
        CHECK(y[0] == 14.0f);
        CHECK(y[1] == -4.0f);
    }
    // Positional: the high nibble of byte 0 is column 1, and only column 1.
    std::vector<std::uint8_t> one(16, 0), s1 = {127};
    one[0] = 0x50;  // column 1 = code 5 = 3.0, column 0 = 0
    std::vector<float> e0(32, 0.0f), e1(32, 0.0f), r(1);
    e0[0] = 1.0f;
    e1[1] = 1.0f;
    matvec_mxfp4(r.data(), e0.data(), one.data(), s1.data(), 1, 32);
    CHECK(r[0] == 0.0f);
    matvec_mxfp4(r.data(), e1.data(), one.data(), s1.data(), 1, 32);
    CHECK(r[0] == 3.0f);
}

TEST_CASE("5.4 matvec_mxfp4 has exactly the bits of an f32 matvec over the dequantized matrix") {
    test::Rng rng(51);
    const std::size_t rows = 37, cols = 256;
    std::vector<std::uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
    for (auto& b : packed) b = std::uint8_t(rng.bits());
    for (auto& s : scales) s = std::uint8_t(110 + rng.bits() % 30);
    auto x = rng.floats(cols, -2.0f, 2.0f);
    std::vector<float> w(rows * cols), y(rows), z(rows);
    dequantize_mxfp4(w.data(), packed.data(), scales.data(), rows, cols);
    matvec_mxfp4(y.data(), x.data(), packed.data(), scales.data(), rows, cols);
    for (std::size_t r = 0; r < rows; ++r) z[r] = dot_ref(w.data() + r * cols, x.data(), cols);
    CHECK_BITS_EQ(y, z);
}

TEST_CASE("5.5-5.7 every fast path is bit-identical to the reference over shapes, T, and planted scales") {
    test::Rng rng(52);
    int cases = 0;
    for (std::size_t rows : {1u, 3u, 4u, 5u, 40u, 301u})
        for (std::size_t cols : {32u, 64u, 96u, 3584u})
            for (std::size_t tokens : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 9u}) {
                std::vector<std::uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
                for (auto& b : packed) b = std::uint8_t(rng.bits());
                for (auto& s : scales) s = std::uint8_t(100 + rng.bits() % 41);
                scales[0] = 0;                              // the denormal scale
                packed[0] = 0x88;                           // two -0 weights
                auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                x[0] = 1e30f;                               // a huge input on a -0 weight: the product is -0
                std::vector<float> ref(tokens * rows), got(tokens * rows);
                matmul_mxfp4_ref(ref.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
                for (const auto& path : fast_paths()) {
                    const char* name = path.name;  // (clang 14 cannot capture structured bindings)
                    const MatmulFn fn = path.fn;
                    fn(got.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
                    CAPTURE(name);
                    CAPTURE(rows);
                    CAPTURE(cols);
                    CAPTURE(tokens);
                    CHECK_BITS_EQ(got, ref);
                }
                ++cases;
            }
    CHECK(cases == 192);
}

TEST_CASE("5.8 one thread and two threads give the same bits on every path; T tokens equal T single matvecs") {
    test::Rng rng(53);
    const std::size_t rows = 3072 / 8 + 3, cols = 3584, tokens = 6;  // 387 rows: the 4-row blocks leave 3
    std::vector<std::uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
    for (auto& b : packed) b = std::uint8_t(rng.bits());
    for (auto& s : scales) s = std::uint8_t(115 + rng.bits() % 15);
    auto x = rng.floats(tokens * cols);
    std::vector<float> a(tokens * rows), b(tokens * rows), one(rows);
    set_threads(1);
    matmul_mxfp4(a.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
    set_threads(2);
    matmul_mxfp4(b.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
    CHECK_BITS_EQ(b, a);
    for (std::size_t t = 0; t < tokens; ++t) {
        matvec_mxfp4(one.data(), x.data() + t * cols, packed.data(), scales.data(), rows, cols);
        CHECK_BITS_EQ(std::span<const float>(a.data() + t * rows, rows), one);
    }
    for (const auto& path : fast_paths()) {
        const char* name = path.name;
        const MatmulFn fn = path.fn;
        CAPTURE(name);
        for (int threads : {1, 2}) {
            set_threads(threads);
            fn(b.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
            CHECK_BITS_EQ(b, a);
        }
    }
}

TEST_CASE("5.5-5.7 T tokens, one decode: every token's row is its own matvec's, T = 1..33, uneven rows, 1 and 2 threads") {
    // The T-token paths decode each weight once for all T tokens (in registers up to 4 tokens on AVX2,
    // through 4.3's tiles past that: blocks of 8 rows, panels of up to 256 columns, narrower past 16
    // tokens). Rows that leave partial blocks and row pairs, widths that leave a partial panel, and T
    // that leave partial token groups: each token's row must be, bit for bit, the same path's matvec on
    // that token alone and the reference's.
    test::Rng rng(54);
    const int threads_before = max_threads();
    int cases = 0;
    for (std::size_t rows : {1u, 7u, 37u})
        for (std::size_t cols : {96u, 544u})
            for (std::size_t tokens : {1u, 2u, 3u, 4u, 7u, 16u, 33u}) {
                std::vector<std::uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
                for (auto& b : packed) b = std::uint8_t(rng.bits());
                for (auto& s : scales) s = std::uint8_t(100 + rng.bits() % 41);
                scales.back() = 0;  // the denormal scale, in the last block of the last row
                const auto x = rng.floats(tokens * cols, -3.0f, 3.0f);
                std::vector<float> ref(tokens * rows), got(tokens * rows), one(rows);
                matmul_mxfp4_ref(ref.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
                for (const auto& path : fast_paths()) {
                    const char* name = path.name;
                    const MatmulFn fn = path.fn;
                    CAPTURE(name);
                    CAPTURE(rows);
                    CAPTURE(cols);
                    CAPTURE(tokens);
                    for (int threads : {1, 2}) {
                        CAPTURE(threads);
                        set_threads(threads);
                        fn(got.data(), x.data(), packed.data(), scales.data(), tokens, rows, cols);
                        CHECK_BITS_EQ(got, ref);
                        for (std::size_t t = 0; t < tokens; ++t) {
                            fn(one.data(), x.data() + t * cols, packed.data(), scales.data(), 1, rows, cols);
                            CHECK_BITS_EQ(std::span<const float>(got.data() + t * rows, rows), one);
                        }
                    }
                }
                ++cases;
            }
    set_threads(threads_before);
    CHECK(cases == 42);
}

TEST_CASE("5.8 the dispatcher names the kernel it runs, and never one this CPU lacks") {
    // The one CPU-dependent choice: the 8-row AVX-512 kernel on AMD family 26 (Zen 5), the 4-row one elsewhere.
    test::check_dispatch<Mxfp4Matmul>(kMxfp4Kernels, mxfp4_kernel(), mxfp4_kernel_name());
    CHECK(kernel_isa() <= cpu_isa());
    // A kernel compiled in for an instruction set this CPU lacks refuses to run, naming itself.
    std::vector<std::uint8_t> p(16), s(1, 127);
    std::vector<float> x(32), y(1);
    for (const auto& e : kMxfp4Kernels)
        if (e.fn != nullptr && !cpu_has(e.isa)) {
            const std::string msg = test::error_of([&] { e.fn(y.data(), x.data(), p.data(), s.data(), 1, 1, 32); });
            CHECK(msg.find(std::string("matmul_mxfp4_") + e.name + ": this CPU has no") == 0);
        }
}

TEST_CASE("5.7 matvec_mxfp4 agrees with the float64 reference within 1e-6 relative; dequantization is exact") {
    test::Fixture f("fixtures/kernels/mxfp4.safetensors");
    const Tensor packed = f.raw("packed"), scale = f.raw("scale");
    REQUIRE(f.shape("packed") == Shape{40, 48});
    REQUIRE(f.shape("scale") == Shape{40, 3});
    const auto* p = view_as<std::uint8_t>(packed, DType::U8).data;
    const auto* s = view_as<std::uint8_t>(scale, DType::U8).data;
    std::vector<float> w(40 * 96);
    dequantize_mxfp4(w.data(), p, s, 40, 96);
    CHECK_BITS_EQ(w, f.f32("w"));
    const auto x = f.f32("x"), want = f.f32("y");
    std::vector<float> y(2 * 40);
    matmul_mxfp4(y.data(), x.data(), p, s, 2, 40, 96);
    // One tolerance on the whole output's scale (row 1's 2^-127-scaled block is checked bit for bit
    // through w above, and at every scale through every path in 5.2).
    CHECK_REL_WITHIN(y, want, 1e-6);
}

TEST_CASE("5.7 an input width that is not a multiple of 32 is refused") {
    std::vector<std::uint8_t> p(64), s(4, 127);
    std::vector<float> x(64, 1.0f), y(2);
    CHECK_THROWS_WITH_AS(matvec_mxfp4(y.data(), x.data(), p.data(), s.data(), 2, 48), "matvec_mxfp4: in = 48 is not a multiple of 32", Error);
}
