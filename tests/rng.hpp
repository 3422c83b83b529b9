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
};

}  // namespace kimik3::test
