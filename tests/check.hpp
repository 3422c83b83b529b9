// Shared assertion helpers for the chapter tests.
//
// Two kinds of comparison, never mixed:
//   CHECK_BITS_EQ(got, want)        bit patterns equal (so -0 != +0 and NaN payloads count). For claims of
//                                   bit-identity: _simd vs _ref, 1 vs 2 threads, prefill vs stepping.
//   CHECK_REL_WITHIN(got, want, t)  max_i |got_i - want_i| / max_i |want_i| <= t, for agreement with the
//                                   PyTorch reference; the tolerance is named in the test's title.
// On failure both print how many elements differ and the first few with index, hex, value and the
// distance in units in the last place (ulp).
#pragma once

#include <doctest/doctest.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "../chapters/00a_isa.hpp"
#include "rng.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

namespace kimik3::test {

// Skipped kernel checks. A test that loops over a kernel family checks every kernel this machine can
// run; each one it cannot (an ISA the CPU lacks, or one this architecture cannot compile) is SKIPPED:
// said with the reason, once per test case and kernel, and counted. tests/main.cpp owns the count and
// prints it in the binary's closing line ("P passed, F failed, S skipped"), which tests/run.sh sums.
int& skipped_count();              // (tests/main.cpp)
const std::string& current_test(); // the running test case's name (tests/main.cpp)

inline void skip(const std::string& what, const std::string& why) {
    static std::vector<std::string> said;
    const std::string key = current_test() + "\n" + what;
    if (std::find(said.begin(), said.end(), key) != said.end()) return;
    said.push_back(key);
    ++skipped_count();
    std::printf("skipped: %s in \"%s\": %s\n", what.c_str(), current_test().c_str(), why.c_str());
}

// The fast kernels of a family (every entry after the reference) that this machine runs; the others
// are skipped and counted (above).
template <class Fn> std::vector<Kernel<Fn>> fast_kernels(std::span<const Kernel<Fn>> family, const char* family_name) {
    std::vector<Kernel<Fn>> run;
    for (std::size_t i = 1; i < family.size(); ++i) {
        const std::string why = why_not_runnable(family[i]);
        if (why.empty()) run.push_back(family[i]);
        else skip(std::string("the ") + family[i].name + " " + family_name + " kernel", why);
    }
    return run;
}

// Chapter 00's dispatch rule (0.9) seen from outside, for one family: `chosen` (the entry the family's
// dispatcher returns, by reference into `family`) names itself, is the reference under KIMIK3_SCALAR,
// else is compiled in and enabled with no later entry the rule could have taken; and the one entry tuned
// for a CPU, "avx512_zen5", is chosen exactly on AMD family 26 with AVX-512 enabled.
template <class Fn> void check_dispatch(std::span<const Kernel<Fn>> family, const Kernel<Fn>& chosen, const char* reported) {
    CHECK(std::string(reported) == chosen.name);
    if (!use_simd) CHECK(std::string(chosen.name) == "reference");
    else {
        CHECK((chosen.fn != nullptr));
        CHECK(isa_enabled(chosen.isa));
        bool after = false;  // no later (wider) entry of the table is one this machine could run
        for (const auto& e : family) {
            if (after) CHECK_FALSE((e.fn != nullptr && isa_enabled(e.isa) && (e.preferred == nullptr || e.preferred())));
            after = after || &e == &chosen;
        }
    }
    const bool zen5_choice = use_simd && isa_enabled(Isa::avx512) && cpu_amd_family() == 26;
    CHECK((std::string(chosen.name) == "avx512_zen5") == zen5_choice);
}

// Path of a file under the repository root, so tests run from any working directory.
inline std::string source_path(const std::string& rel) { return std::string(KIMIK3_SOURCE_DIR) + "/" + rel; }

// Distance in ulps between two floats of the same sign (monotone integer mapping of the bit patterns).
inline std::int64_t ulp_distance(float a, float b) {
    auto key = [](float f) {
        const std::int32_t i = std::bit_cast<std::int32_t>(f);
        return i < 0 ? std::int64_t(std::int32_t(0x80000000u) - i) : std::int64_t(i);
    };
    const std::int64_t d = key(a) - key(b);
    return d < 0 ? -d : d;
}

struct Comparison {
    std::size_t mismatches = 0;
    double max_error = 0.0;  // for tolerance comparisons: the measured relative error
    std::string detail;
};

inline std::string describe_element(std::size_t i, float got, float want) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "  [%zu] got %08x (%.9g) want %08x (%.9g), %lld ulp\n", i,
                  std::bit_cast<std::uint32_t>(got), double(got), std::bit_cast<std::uint32_t>(want),
                  double(want), (long long)ulp_distance(got, want));
    return buf;
}

inline Comparison compare_bits(std::span<const float> got, std::span<const float> want) {
    Comparison c;
    if (got.size() != want.size()) {
        c.mismatches = std::max(got.size(), want.size());
        c.detail = "sizes differ: got " + std::to_string(got.size()) + " want " + std::to_string(want.size());
        return c;
    }
    std::string first;
    for (std::size_t i = 0; i < got.size(); ++i)
        if (std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(want[i]))
            if (++c.mismatches <= 5) first += describe_element(i, got[i], want[i]);
    c.detail = std::to_string(c.mismatches) + " of " + std::to_string(got.size()) + " elements differ in bits\n" + first;
    return c;
}

inline Comparison compare_bits(std::span<const std::uint16_t> got, std::span<const std::uint16_t> want) {
    Comparison c;
    if (got.size() != want.size()) {
        c.mismatches = std::max(got.size(), want.size());
        c.detail = "sizes differ";
        return c;
    }
    std::string first;
    for (std::size_t i = 0; i < got.size(); ++i)
        if (got[i] != want[i] && ++c.mismatches <= 5) {
            char buf[96];
            std::snprintf(buf, sizeof buf, "  [%zu] got %04x want %04x\n", i, got[i], want[i]);
            first += buf;
        }
    c.detail = std::to_string(c.mismatches) + " of " + std::to_string(got.size()) + " bf16 elements differ\n" + first;
    return c;
}

// Relative error against the largest magnitude of the expected vector: robust to elements near zero.
inline Comparison compare_rel(std::span<const float> got, std::span<const float> want, double tol) {
    Comparison c;
    if (got.size() != want.size()) {
        c.mismatches = std::max(got.size(), want.size());
        c.detail = "sizes differ: got " + std::to_string(got.size()) + " want " + std::to_string(want.size());
        c.max_error = INFINITY;
        return c;
    }
    double scale = 0.0;
    for (float w : want) scale = std::max(scale, std::fabs(double(w)));
    if (scale == 0.0) scale = 1.0;
    std::string first;
    for (std::size_t i = 0; i < got.size(); ++i) {
        const double e = std::fabs(double(got[i]) - double(want[i])) / scale;
        if (!(e <= tol)) {  // also catches NaN
            if (++c.mismatches <= 5) first += describe_element(i, got[i], want[i]);
        }
        if (!(e <= c.max_error)) c.max_error = std::isnan(e) ? INFINITY : e;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "max relative error %.3g (tolerance %.3g, scale %.6g); %zu of %zu elements outside\n",
                  c.max_error, tol, scale, c.mismatches, got.size());
    c.detail = buf + first;
    return c;
}

// ---- errors and temporary files ----------------------------------------------------------------------

// Runs f, which must throw a kimik3::Error whose message contains every one of `parts` (and, when
// `kind` is given, whose kind is that).
template <class F, class Parts = std::initializer_list<std::string>>
void expect_error(F&& f, const ErrorKind* kind, const Parts& parts) {
    try {
        f();
        FAIL("expected an error containing: " << *parts.begin());
    } catch (const Error& e) {
        const std::string msg = e.what();
        INFO("message: " << msg);
        if (kind) CHECK(int(e.kind) == int(*kind));
        for (const auto& part : parts) CHECK(msg.find(part) != std::string::npos);
    }
}
template <class F, class Parts = std::initializer_list<std::string>> void expect_error(F&& f, const Parts& parts) {
    expect_error(f, nullptr, parts);
}
template <class F, class Parts = std::initializer_list<std::string>> void expect_error(F&& f, ErrorKind kind, const Parts& parts) {
    expect_error(f, &kind, parts);
}

// The message of the kimik3::Error f throws, or "(no error)".
template <class F> std::string error_of(F&& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "(no error)";
}

// A fresh temporary directory per test case, removed at the end.
struct TempDir {
    std::string path;
    TempDir() {
        char tmpl[] = "/tmp/kimik3-test-XXXXXX";
        const char* p = ::mkdtemp(tmpl);
        REQUIRE(p != nullptr);
        path = p;
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    ~TempDir() { std::filesystem::remove_all(path); }
    std::string file(const std::string& name) const { return path + "/" + name; }
};

}  // namespace kimik3::test

#define CHECK_BITS_EQ(got, want)                                                          \
    do {                                                                                  \
        const auto kimik3_cmp_ = ::kimik3::test::compare_bits((got), (want));            \
        INFO(kimik3_cmp_.detail);                                                         \
        CHECK(kimik3_cmp_.mismatches == 0);                                               \
    } while (0)

#define CHECK_REL_WITHIN(got, want, tol)                                                  \
    do {                                                                                  \
        const auto kimik3_cmp_ = ::kimik3::test::compare_rel((got), (want), (tol));      \
        INFO(kimik3_cmp_.detail);                                                         \
        CHECK(kimik3_cmp_.mismatches == 0);                                               \
    } while (0)
