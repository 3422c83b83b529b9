// Seeded, portable random inputs for tests and benchmarks (no doctest dependency).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "../chapters/00_numerics.hpp"

namespace kimik3::test {

// Seeded random floats (std::mt19937 is specified bit for bit by the C++ standard; the distribution is
// ours, not std::uniform_real_distribution, whose algorithm is implementation-defined).
struct Rng {
    std::mt19937 gen;
    explicit Rng(std::uint32_t seed) : gen(seed) {}
    float uniform(float lo, float hi) { return lo + (hi - lo) * float(gen() >> 8) * 0x1p-24f; }
    std::uint32_t bits() { return gen(); }
    std::vector<float> floats(std::size_t n, float lo = -1.0f, float hi = 1.0f) {
        std::vector<float> v(n);
        for (auto& x : v) x = uniform(lo, hi);
        return v;
    }
    std::vector<std::uint16_t> bf16s(std::size_t n, float lo = -1.0f, float hi = 1.0f) {
        std::vector<std::uint16_t> v(n);
        for (auto& x : v) x = f32_to_bf16(uniform(lo, hi));
        return v;
    }
    // F16 bit patterns: random sign and mantissa, exponents 2^-14 .. 2^1 (subnormals included when the
    // exponent field is 0), never Inf or NaN.
    std::vector<std::uint16_t> f16s(std::size_t n) {
        std::vector<std::uint16_t> v(n);
        for (auto& x : v) {
            const std::uint32_t b = gen();
            x = std::uint16_t((b & 0x83FFu) | ((b >> 16) % 17u) << 10);
        }
        return v;
    }
};

}  // namespace kimik3::test
