// Tests for chapter 00: numerics. Section numbers match the chapter.
#include "../chapters/00_numerics.hpp"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "check.hpp"

using namespace kimik3;

// A slow, obviously-correct oracle for f32 -> bf16 round-to-nearest-even, working in double on the two
// bf16 neighbours of x. The neighbour above the largest finite bf16 is 2^128, which rounds to Inf.
static std::uint16_t bf16_oracle(float x) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    const std::uint32_t sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
    const std::uint32_t lo = mag & 0xFFFF0000u;  // truncation toward zero
    if (lo == mag) return std::uint16_t((sign | lo) >> 16);
    auto value = [](std::uint32_t bits) {
        return bits >= 0x7F800000u ? std::ldexp(1.0, 128) : double(std::bit_cast<float>(bits));
    };
    const double v = double(std::bit_cast<float>(mag)), a = value(lo), b = value(lo + 0x10000u);
    std::uint32_t pick;
    if (v - a < b - v) pick = lo;
    else if (v - a > b - v) pick = lo + 0x10000u;
    else pick = ((lo >> 16) & 1u) ? lo + 0x10000u : lo;  // tie: the even mantissa
    return std::uint16_t((sign | pick) >> 16);
}

TEST_CASE("0.4 the reference path is forced by KIMIK3_SCALAR (build flag or environment), and only then") {
    const char* e = std::getenv("KIMIK3_SCALAR");
    const bool forced = e != nullptr && std::string(e) != "" && std::string(e) != "0";
#ifdef KIMIK3_SCALAR
    CHECK_FALSE(use_simd);
#else
    CHECK(use_simd == !forced);  // make test-scalar sets KIMIK3_SCALAR=1: this proves its run took the reference path
#endif
    MESSAGE("dispatchers run the " << std::string(use_simd ? "SIMD" : "reference") << " path in this run");
}

TEST_CASE("0.2 bf16 -> f32 is exact for all 65,536 patterns") {
    for (std::uint32_t b = 0; b < 65536; ++b)
        REQUIRE(std::bit_cast<std::uint32_t>(bf16_to_f32(bf16(b))) == b << 16);
}

TEST_CASE("0.2 f32 -> bf16 -> f32 round-trips every bf16 pattern; NaNs stay NaN") {
    int nans = 0;
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const float f = bf16_to_f32(bf16(b));
        const bf16 back = f32_to_bf16(f);
        if (std::isnan(f)) {
            ++nans;
            REQUIRE(std::isnan(bf16_to_f32(back)));
            REQUIRE((back & 0x8000) == (b & 0x8000));  // sign kept
        } else {
            REQUIRE(back == b);
        }
    }
    CHECK(nans == 2 * 127);  // exponent all ones, mantissa non-zero, both signs
}

TEST_CASE("0.2 f32 -> bf16 rounds to nearest even: all 65,536 upper halves x the deciding lower halves") {
    // The lower half decides the rounding: below, at and above the halfway point 0x8000, and the ends.
    const std::uint32_t lows[] = {0x0000, 0x0001, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF};
    for (std::uint32_t hi = 0; hi < 65536; ++hi)
        for (std::uint32_t lo : lows) {
            const float x = std::bit_cast<float>(hi << 16 | lo);
            if (std::isnan(x)) {
                REQUIRE(std::isnan(bf16_to_f32(f32_to_bf16(x))));
                continue;
            }
            REQUIRE(f32_to_bf16(x) == bf16_oracle(x));
        }
}

TEST_CASE("0.2 f32 -> bf16 worked by hand: ties go to the even mantissa") {
    // 1 + 2^-8 lies halfway between 1.0 (0x3F80, even) and 1 + 2^-7 (0x3F81): goes down to 0x3F80.
    CHECK(f32_to_bf16(1.0f + 0x1p-8f) == 0x3F80);
    // 1 + 3*2^-8 lies halfway between 0x3F81 (odd) and 0x3F82 (even): goes up to 0x3F82.
    CHECK(f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3F82);
    // Just above halfway always goes up.
    CHECK(f32_to_bf16(std::bit_cast<float>(0x3F808001u)) == 0x3F81);
    // The largest f32 rounds to Inf in bf16 (it is above 0x7F7F plus half an ulp).
    CHECK(f32_to_bf16(std::bit_cast<float>(0x7F7FFFFFu)) == 0x7F80);
    // -0 stays -0.
    CHECK(f32_to_bf16(-0.0f) == 0x8000);
}

TEST_CASE("0.3 require_multiple refuses a width a format fixes, naming the function (MXFP4's 32, chapter 05)") {
    CHECK_NOTHROW(require_multiple("f", "in", 64, 32));
    CHECK_THROWS_WITH_AS(require_multiple("matvec_mxfp4", "in", 48, 32), "matvec_mxfp4: in = 48 is not a multiple of 32", Error);
}

TEST_CASE("0.5 a tail worked by hand: n = 18 puts elements 16 and 17 into lanes 0 and 1, after 0 and 1") {
    // b = ones; a0 = 2^24, a16 = 1, a17 = 1, a1 = 1: lane 0 = (2^24 + 1) -> 2^24 (tie to even), lane 1 = 2,
    // exactly as for n = 32 with zeros after element 17: the tail is the same additions, in the same lanes.
    std::vector<float> a(18, 0.0f), b(18, 1.0f);
    a[0] = 0x1p24f;
    a[1] = a[16] = a[17] = 1.0f;
    CHECK(dot_ref(a.data(), b.data(), 18) == 0x1p24f + 2.0f);
    CHECK(dot_simd(a.data(), b.data(), 18) == 0x1p24f + 2.0f);
}

TEST_CASE("0.4 the SIMD shim picks a 4- or 8-wide architecture") {
    CHECK((simd::W == 4 || simd::W == 8));
    CHECK(std::string(simd::arch_name()).size() > 0);
    // bit casts are bit casts, not conversions
    const simd::u32 one_bits = simd::splat_u32(0x3F800000u);
    float out[8];
    simd::store(out, simd::as_f32(one_bits));
    CHECK(out[0] == 1.0f);
}

TEST_CASE("0.5 hsum16 worked by hand: the tree, not the sequential order") {
    // a0 = 2^24 and the other fifteen lanes 1. Exact sum 2^24 + 15.
    //   step 1: s8[0] = 2^24 + a8 = 2^24 + 1 -> 2^24 (a tie at spacing 2, goes to even); s8[1..7] = 2.
    //   step 2: s4[0] = 2^24 + s8[4] = 2^24 + 2; s4[1..3] = 4.
    //   step 3: s2_0 = (2^24 + 2) + s4[2] = 2^24 + 6; s2_1 = 4 + 4 = 8.
    //   step 4: 2^24 + 14.
    // A left-to-right sum would lose every 1 and give 2^24: the tree is part of the contract.
    float a[16];
    for (float& x : a) x = 1.0f;
    a[0] = 0x1p24f;
    CHECK(hsum16(a) == 0x1p24f + 14.0f);
    float seq = 0.0f;
    for (float x : a) seq += x;
    CHECK(seq == 0x1p24f);
}

TEST_CASE("0.5 dot: element i goes into lane i % 16 (worked by hand)") {
    // 32 elements, b = all ones; a0 = 2^24 and a1 = a16 = a17 = 1. Exact sum 2^24 + 3.
    //   lane 0 receives a0 then a16: 2^24 + 1 -> 2^24 (tie, to even); lane 1 receives a1 then a17: 2.
    //   hsum16: s8 = (2^24, 2, 0...), s4 = (2^24, 2, 0, 0), s2 = (2^24, 2), result 2^24 + 2.
    // A left-to-right sum would lose all three ones (2^24); the contract pins 2^24 + 2.
    std::vector<float> a(32, 0.0f), b(32, 1.0f);
    a[0] = 0x1p24f;
    a[1] = a[16] = a[17] = 1.0f;
    CHECK(dot_ref(a.data(), b.data(), 32) == 0x1p24f + 2.0f);
    CHECK(dot_simd(a.data(), b.data(), 32) == 0x1p24f + 2.0f);
}

TEST_CASE("0.5 dot_simd is bit-identical to dot_ref on seeded random inputs and planted edge values") {
    test::Rng rng(1234);
    for (std::size_t n : {1u, 2u, 7u, 8u, 9u, 15u, 16u, 17u, 24u, 31u, 32u, 33u, 47u, 48u, 64u, 100u, 128u, 168u, 1008u, 4095u,
                          4096u, 7168u}) {
        auto a = rng.floats(n, -2.0f, 2.0f), b = rng.floats(n, -3.0f, 3.0f);
        // planted: -0, a denormal, and one product near 2^23 whose ulp (1) is coarse next to the other
        // terms (|a b| < 6), so every other term's place in the order of additions shows in the last bits
        // (a product large enough to swamp the rest, or to overflow sum_squares, would hide the order)
        CAPTURE(n);
        a[0] = -0.0f;
        a[n / 2] = 3000.0f;
        b[n / 2] = 2900.0f;
        if (n > 2) a[n - 1] = std::bit_cast<float>(0x00000003u);
        std::vector<float> got = {dot_simd(a.data(), b.data(), n)}, want = {dot_ref(a.data(), b.data(), n)};
        CHECK_BITS_EQ(got, want);
        std::vector<float> g2 = {sum_squares_simd(a.data(), n)}, w2 = {sum_squares_ref(a.data(), n)};
        CHECK_BITS_EQ(g2, w2);
    }
}

TEST_CASE("0.6 the FMA canary: (1+2^-12)^2 - (1+2^-11) is 0 unfused (2^-24 would mean FMA contraction)") {
    const float r = fma_canary();
    INFO("got ", r, "; 2^-24 = ", 0x1p-24f, " means the build contracts a*b+c into an FMA");
    CHECK(std::bit_cast<std::uint32_t>(r) == 0u);
}

TEST_CASE("0.7 scalar transcendentals: sigmoid(0) = 0.5 and SiLU(0) = 0 exactly") {
    CHECK(sigmoid(0.0f) == 0.5f);
    CHECK(silu(0.0f) == 0.0f);
    // exp(100) = 2.7e43 overflows f32 to Inf, and 1/(1+Inf) is a clean 0, never NaN.
    CHECK(sigmoid(-100.0f) == 0.0f);
    CHECK(sigmoid(100.0f) == 1.0f);
}

TEST_CASE("0.7 exp_f32 and tanh_f32: within one ulp of the exact value, and the same bits on every CPU") {
    // Every 4099th float: against the double-precision C library rounded once to float (its error is far
    // below a float's ulp), exp_f32 is within one ulp everywhere and tanh_f32 too.
    auto ulps = [](float a, float b) {
        const auto ia = std::int64_t(std::bit_cast<std::int32_t>(a)), ib = std::int64_t(std::bit_cast<std::int32_t>(b));
        return ia > ib ? ia - ib : ib - ia;
    };
    std::int64_t worst_exp = 0, worst_tanh = 0, differ = 0;
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the results' bits: pinned below
    auto mix = [&](float v) {
        const std::uint32_t b = std::bit_cast<std::uint32_t>(v);
        for (int i = 0; i < 4; ++i) h = (h ^ ((b >> (8 * i)) & 0xFFu)) * 1099511628211ull;
    };
    for (std::uint64_t bits = 0; bits < (1ull << 32); bits += 4099) {
        const float x = std::bit_cast<float>(std::uint32_t(bits));
        if (!std::isfinite(x)) continue;
        const float e = exp_f32(x), t = tanh_f32(x);
        if (std::fabs(x) < 110.0f) worst_exp = std::max(worst_exp, ulps(e, float(std::exp(double(x)))));
        worst_tanh = std::max(worst_tanh, ulps(t, float(std::tanh(double(x)))));
        differ += t != std::tanh(x);
        mix(e), mix(t);
    }
    CHECK(worst_exp <= 1);
    CHECK(worst_tanh <= 1);
    MESSAGE("glibc's tanhf gives other bits than tanh_f32 on ", differ, " of the inputs swept (it is not correctly rounded)");
    char got[17];
    std::snprintf(got, sizeof got, "%016llx", (unsigned long long)h);
    INFO("the bits of exp_f32/tanh_f32 over the sweep hash to ", got, ": a CPU or compiler that gives other bits breaks rule 3");
    CHECK(std::string(got) == "6387e1b518696903");
    // The edges: NaN stays NaN, overflow is Inf, underflow 0, tanh saturates and keeps the sign of 0.
    CHECK(std::isnan(exp_f32(NAN)));
    CHECK(exp_f32(89.0f) == INFINITY);
    CHECK(exp_f32(-104.0f) == 0.0f);
    CHECK(exp_f32(0.0f) == 1.0f);
    CHECK(tanh_f32(20.0f) == 1.0f);
    CHECK(tanh_f32(-20.0f) == -1.0f);
    CHECK(std::signbit(tanh_f32(-0.0f)));
    CHECK(tanh_f32(1e-30f) == 1e-30f);
}

TEST_CASE("0.8 parallel_rows visits every row exactly once, for any thread count") {
    for (int threads : {1, 2, 3}) {
        set_threads(threads);
        for (std::size_t n : {1u, 2u, 7u, 100u, 4096u}) {
            std::vector<std::atomic<int>> seen(n);
            parallel_rows(n, 1u << 20, [&](std::size_t b, std::size_t e) {
                for (std::size_t r = b; r < e; ++r) seen[r]++;
            });
            for (std::size_t r = 0; r < n; ++r) REQUIRE(seen[r].load() == 1);
        }
    }
    set_threads(2);
    // tests/main.cpp lowers the threshold to 1, so even 8 rows of one multiply-add each are split: a
    // "1 thread vs 2 threads" test elsewhere really compares two different splits.
    REQUIRE(parallel_min_work() == 1);
    std::vector<int> owner(8, -1);
    parallel_rows(owner.size(), 1, [&](std::size_t b, std::size_t e) {
        for (std::size_t r = b; r < e; ++r) owner[r] = thread_index();
    });
    CHECK(owner.front() == 0);
    CHECK(owner.back() == 1);
    // A part that throws on the calling thread: the exception comes out after the workers are done with
    // the job, and the team runs the next job as before.
    CHECK_THROWS_AS(parallel_rows(8, 1, [&](std::size_t b, std::size_t) {
                        if (b == 0) fail(ErrorKind::runtime, "row 0 failed");
                    }),
                    Error);
    std::vector<int> again(8, 0);
    parallel_rows(again.size(), 1, [&](std::size_t b, std::size_t e) {
        for (std::size_t r = b; r < e; ++r) again[r] = 1;
    });
    CHECK(std::count(again.begin(), again.end(), 1) == 8);
}
