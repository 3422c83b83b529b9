// kimik3 chapter 00: numerics -- the bit layouts, the rounding rules, and the one way we add numbers up.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Before any weight of Kimi K3 is read we fix how numbers are stored and how they are summed, because
//   the whole course promises one thing: the engine's output does not depend on the SIMD width, the
//   thread count or the memory budget. That promise is kept here, once, and every later chapter uses it.
//   New concepts: float32 and bfloat16 bit layouts, round-to-nearest-even, the 16-lane accumulation with
//   its fixed pairwise tree `hsum16`, the thin SIMD shim over xsimd, the row split over a thread team, and why the
//   build forbids fused multiply-add.
//
// WHERE THIS SITS IN KIMI K3
//   Every dense weight of K3 ships as bf16 (2.35 B embedding/head parameters, ~36 B attention
//   parameters); the routed experts are MXFP4 (chapter 05). Activations in this engine are float32.
//   A forward pass of the real model performs ~1e11 multiply-adds per token (~104 B active parameters); all of them go through
//   the accumulation rule below.
//
// CONCEPTS (glossary)
//   f32        IEEE-754 binary32: 1 sign, 8 exponent, 23 mantissa bits.
//   bf16       "brain float": the top 16 bits of an f32 (1 sign, 8 exponent, 7 mantissa bits). Same range
//              as f32, 3 decimal digits of precision. bf16 -> f32 is exact (append 16 zero bits).
//   RNE        round to nearest, ties to even: what f32 -> bf16 does here and what IEEE hardware does.
//   lane       one of 16 running partial sums. Element i of a reduction is added into lane i % 16.
//   hsum16     the fixed pairwise tree that adds the 16 lanes at the end (section 0.5).
//   W          the number of floats in one SIMD register of the chosen architecture (4 or 8 here).
//   FMA        fused multiply-add a*b+c with ONE rounding. Forbidden in this project: see 0.6.
//
// BIT LAYOUTS
//
//      f32:  31 30      23 22                                  0
//           +--+----------+-------------------------------------+
//           |s | exponent |             mantissa (23)           |     value = (-1)^s 2^(e-127) 1.m
//           +--+----------+-------------------------------------+
//      bf16: 15 14       7 6      0
//           +--+----------+--------+
//           |s | exponent |mant(7) |     = the upper half of the f32 above
//           +--+----------+--------+
//
//   f32 -> bf16 keeps the upper 16 bits after rounding on the lower 16: add 0x7FFF plus the lowest kept
//   bit (the "ties to even" bit), then shift. A NaN must not round into Inf (NaN payloads can sit only in
//   the dropped bits), so NaNs keep their sign and top payload bits and get the quiet bit 0x0040 forced.
//
// NUMERICS CONTRACT (the promise the tests hold every chapter to)
//   1. Every pinned reduction (dot products, sums of squares, softmax denominators, router sums) adds
//      element i into lane i % 16, lanes start at +0.0f, each addition is `lane = lane + (a * b)`
//      (multiply rounded, then add rounded), and the 16 lanes are finished by `hsum16`.
//      Reference code keeps `float acc[16]`; SIMD code keeps 16/W batches whose lanes are a fixed
//      permutation of the 16 logical lanes. Then the result is the same bits for every W. Any n
//      works: SIMD code runs the whole chunks of 16 in registers and adds the last n % 16 elements
//      into their lanes in plain code (`finish_tail`), exactly as the reference does.
//   2. No FMA anywhere: the build uses -ffp-contract=off and never -ffast-math; the canary test
//      (test 0.6) fails if a compiler flag lets `a*b+c` fuse.
//   3. Transcendentals are scalar functions of this chapter (exp_f32, tanh_f32, section 0.7: plain
//      IEEE arithmetic, not the C library's, so every CPU gives the same bits), called by the reference
//      and the SIMD path alike; sqrt is IEEE's, correctly rounded everywhere.
//   4. Threads split independent outputs only (rows, heads, experts): no reduction is split, so any
//      thread count gives the same bits.
//   5. f32 -> bf16 is RNE; NaN stays NaN (quiet). bf16 -> f32 is exact. Denormals are kept (we never
//      set flush-to-zero: E8M0 scale 0 in chapter 05 IS a denormal, 2^-127).
//   6. SIMD width: the shim picks AVX2 (W = 8), else SSE2/NEON (W = 4), when the program is compiled;
//      its W stays capped at 8. AVX-512 and NEON are used by whole kernels written for them (chapters
//      04 and 05), chosen when the program runs (0.9, in the appendix 00a_isa.hpp): there one 16-float
//      AVX-512 register holds the 16 logical lanes, and the same rule gives the same bits.
//
// DIMENSION LEGEND (used in every shape comment of the project)
//   T tokens   D hidden (7168)   H heads (96)   Dh head dim (128)   C MLA latent (512 + 64)
//   E experts (896)   K experts per token (16)   F expert FFN width (3072)   L latent MoE width (3584)
//   V vocab (163840)   P = H * Dh (12288)   I dense FFN width (33792)
//   A shape comment `// (E, D)` means a row-major buffer of E rows of D elements.
//
// USES     <bit>, <atomic>, <thread>, xsimd 8.1 (only here).
// RUN      make run-00        (example: bit layouts, RNE cases, lanes and hsum16, the SIMD arch in use)
// TEST     make test-00       (exhaustive bf16 patterns, RNE against a slow oracle, the FMA canary)
//
// SECTIONS
//   0.1 errors            0.2 bf16 <-> f32            0.3 shape checks          0.4 the SIMD shim
//   0.5 16-lane sums      0.6 the FMA canary          0.7 scalar transcendentals 0.8 threads
//   0.9 instruction sets chosen at run time (AVX2, AVX-512, NEON): the appendix chapters/00a_isa.hpp
// ====================================================================================================
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <xsimd/xsimd.hpp>

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 0.1 Errors
// ---------------------------------------------------------------------------------------------------
// One exception type for the whole project. The message always names what was wrong (file, tensor,
// field, value); `kind` lets the command-line driver map it to an exit code without parsing text.
enum class ErrorKind {
    usage,     // a bad argument or a shape that breaks a kernel's contract (exit code 2)
    format,    // a file or config that is missing, malformed or refused (exit code 2)
    io,        // a read that failed once the file was open: short read, EIO (exit code 4)
    budget,    // a memory budget below the floor (exit code 3)
    runtime,   // anything else: a failed write, a computation that cannot go on (exit code 1)
};

struct Error : std::runtime_error {
    ErrorKind kind;
    Error(ErrorKind k, const std::string& what) : std::runtime_error(what), kind(k) {}
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string& what) { throw Error(kind, what); }

// ---------------------------------------------------------------------------------------------------
// 0.2 bf16 <-> f32
// ---------------------------------------------------------------------------------------------------
// bf16 values travel as raw uint16_t bit patterns: there is no arithmetic on bf16 in this engine,
// only exact widening to f32 (weights) and rounding from f32 (when we write bf16 files or compare).
using bf16 = std::uint16_t;

// Exact: the bf16 pattern becomes the upper half of an f32, the lower 16 bits are zero.
inline float bf16_to_f32(bf16 b) { return std::bit_cast<float>(std::uint32_t(b) << 16); }

// Round to nearest, ties to even. Worked example: 1 + 2^-8 is exactly halfway between the bf16
// neighbours 1.0 (mantissa ...0, even) and 1 + 2^-7 (mantissa ...1): bits 0x3F808000; lower half 0x8000,
// kept lowest bit 0, so 0x3F808000 + 0x7FFF + 0 = 0x3F80FFFF -> 0x3F80 = 1.0 (the even one).
inline bf16 f32_to_bf16(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)                        // NaN: keep sign and top payload,
        return bf16((u >> 16) | 0x0040u);                        // force quiet so it stays NaN
    const std::uint32_t lsb = (u >> 16) & 1u;                    // the bit that decides ties
    return bf16((u + 0x7FFFu + lsb) >> 16);                      // may carry into Inf: correct RNE
}

// F16 (IEEE half) -> f32, exact: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Every F16 value is
// an f32 value (more exponent range, more mantissa), so a checkpoint may store any float tensor as F16
// and lose nothing in the widening; the engine never narrows to F16.
inline float f16_to_f32(std::uint16_t h) {
    const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // Inf / NaN
    if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
    const float sub = float(mant) * 0x1p-24f;  // subnormal: mant * 2^-24, exact in f32
    return sign ? -sub : sub;
}

// ---------------------------------------------------------------------------------------------------
// 0.3 Shape checks
// ---------------------------------------------------------------------------------------------------
// Reductions take any length: element i goes into lane i % 16 whatever n is (0.5), so a width that is
// not a multiple of 16 (K3's are; a checkpoint saved from Moonshot's module need not be) only leaves a
// short last chunk. Only a number FORMAT fixes a multiple: MXFP4 stores 32 weights per scale (chapter
// 05). A width that breaks such a contract is refused at the entry with the function's name.
inline void require_multiple(const char* where, const char* what, std::size_t value, std::size_t m) {
    if (value % m != 0)
        fail(ErrorKind::usage, std::string(where) + ": " + what + " = " + std::to_string(value) +
                                   " is not a multiple of " + std::to_string(m));
}

// ---------------------------------------------------------------------------------------------------
// 0.4 The SIMD shim: the few xsimd operations the project uses, and nothing else includes xsimd
// ---------------------------------------------------------------------------------------------------
// Why a shim: xsimd 8.1 (Debian's) has traps for an exact engine. `xsimd::fma` is fused on AVX2 and
// on scalar targets but not on AVX-512 under -ffp-contract=off; `xsimd::hadd` reduces in a different
// tree on each architecture; there is no dynamic table lookup. Routing every use through these few
// names makes it obvious that none of those appear.
//
// KIMIK3_SCALAR does not change the shim (the _simd functions still compile so tests can compare them);
// it makes every dispatcher pick the _ref function (see `use_simd`: a build flag or an environment variable).
namespace simd {

#if XSIMD_WITH_AVX2
using arch = xsimd::avx2;      // 8 floats per register
#elif XSIMD_WITH_SSE2
using arch = xsimd::sse2;      // 4 floats per register
#elif XSIMD_WITH_NEON64
using arch = xsimd::neon64;    // 4 floats per register
#else
#error "kimik3 needs SSE2, AVX2 or NEON64 for its SIMD path (x86-64 and arm64 have them)"
#endif

using f32 = xsimd::batch<float, arch>;            // W floats
using u32 = xsimd::batch<std::uint32_t, arch>;    // W 32-bit unsigned integers
inline constexpr int W = int(f32::size);
static_assert(W == 4 || W == 8, "the 16-lane contract is implemented for 4- and 8-wide registers");
inline constexpr int kBatchesPer16 = 16 / W;      // batches that hold the 16 logical lanes

inline const char* arch_name() { return arch::name(); }

// Loads and stores. Unaligned everywhere: aligned loads buy nothing measurable on current cores and
// would put an alignment precondition on every caller.
inline f32 load(const float* p) { return f32::load_unaligned(p); }
inline u32 load_u32(const void* p) { return u32::load_unaligned(static_cast<const std::uint32_t*>(p)); }
inline void store(float* p, f32 v) { v.store_unaligned(p); }
inline f32 splat(float v) { return f32(v); }
inline u32 splat_u32(std::uint32_t v) { return u32(v); }

// Reinterpret the bits of a batch (no conversion), as std::bit_cast does for one value.
inline f32 as_f32(u32 v) { return xsimd::bitwise_cast<f32>(v); }

// Arithmetic comes from xsimd's operators: +, -, * on f32; &, |, ^, <<, >> on u32. Each is one IEEE
// operation per lane with its own rounding, exactly like the scalar code.

}  // namespace simd

// Fully unroll a short loop with a compile-time trip count, so that arrays of SIMD registers indexed by
// its counter stay in registers (both g++ and clang++ honour this pragma). A speed hint, never a
// change of order: the loop body runs in the same sequence either way.
#define KIMIK3_UNROLL _Pragma("GCC unroll 16")

// Every dispatcher reads this: true unless the reference path is forced, at build time (-DKIMIK3_SCALAR)
// or at run time (the environment variable KIMIK3_SCALAR set to anything but "" or "0", read once at
// start-up). The run-time switch lets one build check itself: the same binary, both paths, same bits.
#ifdef KIMIK3_SCALAR
inline constexpr bool use_simd = false;
#else
inline const bool use_simd = [] {
    const char* e = std::getenv("KIMIK3_SCALAR");
    return e == nullptr || e[0] == '\0' || (e[0] == '0' && e[1] == '\0');
}();
#endif

// ---------------------------------------------------------------------------------------------------
// 0.5 The 16-lane accumulation and hsum16
// ---------------------------------------------------------------------------------------------------
// Why 16 lanes: the result of a float sum depends on the order of additions. If the order followed the
// register width, an AVX2 build and an SSE build would give different bits. Fixing the order to "16
// interleaved partial sums, then one tree" makes it a property of the program, not of the machine:
// 16 is a multiple of every width we run (4, 8) and wide enough to keep the adders busy.
inline constexpr int kLanes = 16;

// The tree, fixed once. Pairs lane i with lane i+8, then i+4, i+2, i+1 (the natural halving order of a
// register, so SIMD code could do it in registers; we do it in scalar code from a stored float[16],
// which costs 15 additions per output and keeps one definition):
//
//   a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 a11 a12 a13 a14 a15
//   s8[i]  = a[i] + a[i+8]          (8 sums)
//   s4[i]  = s8[i] + s8[i+4]        (4 sums)
//   s2[i]  = s4[i] + s4[i+2]        (2 sums)
//   result = s2[0] + s2[1]
inline float hsum16(const float a[kLanes]) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    const float s2_0 = s4[0] + s4[2];
    const float s2_1 = s4[1] + s4[3];
    return s2_0 + s2_1;
}

// The canonical dot product, reference form: element i into lane i % 16, for any n.
inline float dot_ref(const float* a, const float* b, std::size_t n) {  // a (n), b (n)
    float acc[kLanes] = {};
    for (std::size_t i = 0; i < n; ++i) acc[i % kLanes] = acc[i % kLanes] + a[i] * b[i];
    return hsum16(acc);
}

// Every SIMD reduction of the project ends the same way: its 16 lanes stored in logical order, the
// elements of a last, partial chunk (n % 16 of them, at most 15) added into lanes 0, 1, ... in plain
// code, then the tree. The reference adds those same elements to the same lanes after the same full
// chunks, so the tail costs at most 15 scalar additions per output and never a bit of difference.
// (Padding the tail with zeros and adding it in registers would also be exact, since a lane that
// starts at +0 can never become -0, but "the same additions, in the same order" needs no argument.)
template <class Product>
inline float finish_tail(float lanes[kLanes], std::size_t full, std::size_t n, Product&& product) {
    for (std::size_t i = full; i < n; ++i) lanes[i % kLanes] = lanes[i % kLanes] + product(i);
    return hsum16(lanes);
}

// The largest multiple of 16 not above n: where the SIMD loops stop and the tail begins.
inline constexpr std::size_t full_chunks(std::size_t n) { return n / kLanes * kLanes; }

// SIMD form. Bit-identical to dot_ref: batch j holds logical lanes j*W .. j*W+W-1, and every lane
// receives the same products in the same order. The one structural difference: the 16 partial sums
// live in 16/W registers instead of an array (then finish_tail).
inline float dot_simd(const float* a, const float* b, std::size_t n) {  // a (n), b (n)
    simd::f32 acc[simd::kBatchesPer16];
    for (auto& v : acc) v = simd::splat(0.0f);
    const std::size_t full = full_chunks(n);
    for (std::size_t i = 0; i < full; i += kLanes)
        for (int j = 0; j < simd::kBatchesPer16; ++j)
            acc[j] = acc[j] + simd::load(a + i + j * simd::W) * simd::load(b + i + j * simd::W);
    float lanes[kLanes];
    for (int j = 0; j < simd::kBatchesPer16; ++j) simd::store(lanes + j * simd::W, acc[j]);
    return finish_tail(lanes, full, n, [&](std::size_t i) { return a[i] * b[i]; });
}

inline float dot(const float* a, const float* b, std::size_t n) {  // a (n), b (n)
    return use_simd ? dot_simd(a, b, n) : dot_ref(a, b, n);
}

// Sum of squares: the same lanes, the product is x*x.
inline float sum_squares_ref(const float* x, std::size_t n) { return dot_ref(x, x, n); }    // x (n)
inline float sum_squares_simd(const float* x, std::size_t n) { return dot_simd(x, x, n); }  // x (n)
inline float sum_squares(const float* x, std::size_t n) { return dot(x, x, n); }            // x (n)

// ---------------------------------------------------------------------------------------------------
// 0.6 The FMA canary
// ---------------------------------------------------------------------------------------------------
// Worked by hand: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24. Near 1.0 an f32 has a spacing of 2^-23, so the
// exact square sits exactly halfway between 1 + 2^-11 and its upper neighbour; ties go to the even
// mantissa, which is 1 + 2^-11. Hence, with c = 1 + 2^-11:
//     unfused (round a*a, then subtract):   (1 + 2^-11) - c  = 0            <- what this project computes
//     fused   (one rounding of a*a - c):    2^-24                           <- what FMA contraction gives
// A canary is easy to word backwards ("must be exactly 2^-24 computed unfused"): 2^-24 is the FUSED
// value, so the test asserts 0 and names 2^-24 as the failure it guards against. `volatile` stops the
// compiler from folding the constants at compile time, which would hide the flag's effect.
inline float fma_canary() {
    volatile float a = 1.0f + 0x1p-12f;
    volatile float c = 1.0f + 0x1p-11f;
    const float x = a, y = c;
    return x * x - y;  // unfused: 0.0f; if the compiler contracts this into an FMA: 2^-24
}

// ---------------------------------------------------------------------------------------------------
// 0.7 Scalar transcendentals, computed here (the same function in every path and on every CPU)
// ---------------------------------------------------------------------------------------------------
// These are O(D) per token, far from the hot path, so the reference and the SIMD paths call the same
// scalar functions: then their bits cannot differ between paths. They are not the C library's. The C
// library promises an accurate expf or tanhf, not the same bits everywhere: glibc's tanhf and expm1f
// give other bits on arm64 than on x86-64 (its arm64 build fuses multiply-adds), and on x86-64 it
// picks an FMA or a plain version of expf by CPU at load time. So exp and tanh are written out below
// with plain IEEE operations (+, -, *, / on doubles, rounded as the standard says, never fused), which
// give the same bits on every CPU and compiler that keep chapter 00's rules.
//
// exp(x), worked in double: write x = k ln2 + r with k the nearest integer to x / ln2, so |r| <= ln2/2;
// then e^x = 2^k e^r. ln2 is split into a head with 21 zero low bits (k * head is exact for |k| < 2^21)
// and a tail, so r keeps ~60 good bits. e^r is its Taylor series to r^13; the first term left out is under (ln2/2)^14 / 14! = 4e-18 of the sum. 2^k is built
// from its bits. The double is then rounded once to float: the result is the correctly rounded expf
// except within ~1e-15 of a tie (then one ulp off, the same ulp everywhere).
// tanh(x) = (e^2|x| - 1) / (e^2|x| + 1) with the sign of x, in double; below 2^-12 tanh(x) rounds to
// x itself (the next term, x^3/3, is under a third of an ulp), at 10 and above to +-1.
namespace detail {
inline constexpr auto kExpTaylor = [] {  // 1/k!, k = 0..13 (k! is exact in a double)
    std::array<double, 14> c{};
    double f = 1.0;
    for (int k = 0; k < 14; ++k) f *= k > 0 ? double(k) : 1.0, c[std::size_t(k)] = 1.0 / f;
    return c;
}();
inline double exp_f64(double x) {  // |x| <= 104 (enough for every float exp that is not 0 or Inf)
    const double k = std::nearbyint(x * 0x1.71547652b82fep0);  // x / ln2, to the nearest integer
    const double r = (x - k * 0x1.62e42fee00000p-1) - k * 0x1.a39ef35793c76p-33;  // ln2 = head + tail
    // Estrin's scheme: the 14 terms in pairs c_2i + c_2i+1 r, then pairs of pairs with r^2, r^4, r^8
    // (four rounds of independent products instead of Horner's chain of 13: 2.5x faster here).
    const auto& c = kExpTaylor;
    const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    const double p01 = c[0] + c[1] * r, p23 = c[2] + c[3] * r, p45 = c[4] + c[5] * r, p67 = c[6] + c[7] * r;
    const double p89 = c[8] + c[9] * r, pab = c[10] + c[11] * r, pcd = c[12] + c[13] * r;
    const double p0_3 = p01 + r2 * p23, p4_7 = p45 + r2 * p67, p8_b = p89 + r2 * pab;
    const double p = (p0_3 + r4 * p4_7) + r8 * (p8_b + r4 * pcd);
    return p * std::bit_cast<double>(std::uint64_t(std::int64_t(k) + 1023) << 52);  // * 2^k
}
}  // namespace detail

inline float exp_f32(float x) {
    if (std::isnan(x)) return x;
    if (x > 89.0f) return INFINITY;  // e^88.73 is above the largest float already
    if (x < -104.0f) return 0.0f;    // e^-103.98 is below half the smallest subnormal
    return float(detail::exp_f64(double(x)));
}

inline float tanh_f32(float x) {
    const double a = std::fabs(double(x));
    if (std::isnan(x) || a < 0x1p-12) return x;
    if (a >= 10.0) return std::copysign(1.0f, x);
    const double e = detail::exp_f64(2.0 * a);
    return std::copysign(float((e - 1.0) / (e + 1.0)), x);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_f32(-x)); }
inline float silu(float x) { return x * sigmoid(x); }

// ---------------------------------------------------------------------------------------------------
// 0.8 Threads: the row split, on a team that sleeps when it waits
// ---------------------------------------------------------------------------------------------------
// Threads only ever split independent outputs. `parallel_rows(n, work_per_row, f)` calls
// f(begin, end) on contiguous row ranges, one per thread, and runs single-threaded when the whole job is
// too small to repay waking the team (~256k multiply-adds, about 50 microseconds of work). Which thread
// computes a row never changes that row's bits, so the split can be anything; a static, contiguous one
// is simplest.
//
// Why our own team and not `#pragma omp parallel`: between two parallel regions libgomp's idle threads
// busy-wait (by default a few hundred thousand spins) for the next one. On an idle machine that is
// free; on a loaded 2-core machine a spinning thread takes the core from the thread that has the work,
// and a 1.4 ms two-thread matvec was measured at 13-16 ms. This team spins for a few microseconds at
// most, then sleeps on a futex (C++20 std::atomic::wait), both while idle and while the caller waits for
// the last worker, so a busy machine costs a wake-up per job, never a stolen time slice.
//
// The team: thread 0 is the caller; workers 1..n-1 start on first use and live until exit. A job is
// published by bumping `generation`; every worker runs its part (or nothing) and counts `pending` down.
// One job at a time: a second caller thread that finds the team busy (or a kernel called from inside a
// job) runs its job alone, on its own thread, which gives the same bits.
namespace detail {

// A spinning worker tells the core it is waiting (x86's PAUSE); elsewhere it just spins.
#if defined(__x86_64__) || defined(__i386__)
inline void cpu_relax() { __builtin_ia32_pause(); }
#else
inline void cpu_relax() {}
#endif

class Team {
public:
    static Team& get() {
        static Team team;
        return team;
    }
    int threads() const { return threads_.load(std::memory_order_relaxed); }
    void set_threads(int n) { threads_.store(n, std::memory_order_relaxed); }

    // Runs part(t, nt) for t = 0..nt-1, part 0 on this thread; false (nothing run) if the team is busy.
    template <class Part>
    bool run(int nt, Part& part) {
        std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
        if (!lock.owns_lock() || inside_job()) return false;
        grow(nt - 1);
        call_ = [](void* p, int t, int n) { (*static_cast<Part*>(p))(t, n); };
        ctx_ = const_cast<void*>(static_cast<const void*>(&part));
        nt_ = nt;
        const int workers = int(workers_.size());
        pending_.store(workers, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
        generation_.notify_all();
        inside_job() = true;
        std::exception_ptr failed;  // part 0 may throw: the workers still use `part`, so wait for them first
        try {
            part(0, nt);
        } catch (...) {
            failed = std::current_exception();
        }
        inside_job() = false;
        for (int spin = 0; spin < kSpin && pending_.load(std::memory_order_acquire) != 0; ++spin) cpu_relax();
        for (int left; (left = pending_.load(std::memory_order_acquire)) != 0;) pending_.wait(left, std::memory_order_acquire);
        if (failed) std::rethrow_exception(failed);
        return true;
    }

    static bool& inside_job() {
        thread_local bool inside = false;
        return inside;
    }
    static int& thread_index() {
        thread_local int index = 0;
        return index;
    }

    ~Team() {
        stop_.store(true, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
        generation_.notify_all();
        for (std::thread& w : workers_) w.join();
    }

private:
    static constexpr int kSpin = 4000;  // ~10-40 microseconds of pause before sleeping

    Team() {
        unsigned n = std::thread::hardware_concurrency();
        if (const char* env = std::getenv("OMP_NUM_THREADS")) n = unsigned(std::strtoul(env, nullptr, 10));
        threads_.store(n > 0 ? int(n) : 1, std::memory_order_relaxed);
    }

    void grow(int workers) {
        while (int(workers_.size()) < workers) {
            const int index = int(workers_.size()) + 1;
            workers_.emplace_back([this, index, seen = generation_.load()] { work(index, seen); });
        }
    }

    void work(int index, std::uint64_t seen) {
        thread_index() = index;
        inside_job() = true;
        for (;;) {
            std::uint64_t g = generation_.load(std::memory_order_acquire);
            for (int spin = 0; spin < kSpin && g == seen; ++spin) cpu_relax(), g = generation_.load(std::memory_order_acquire);
            while (g == seen) generation_.wait(seen, std::memory_order_acquire), g = generation_.load(std::memory_order_acquire);
            seen = g;
            if (stop_.load(std::memory_order_relaxed)) return;
            if (index < nt_) call_(ctx_, index, nt_);
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
        }
    }

    std::atomic<int> threads_{1};
    std::mutex busy_;
    std::vector<std::thread> workers_;
    std::atomic<std::uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
    void (*call_)(void*, int, int) = nullptr;
    void* ctx_ = nullptr;
    int nt_ = 1;
};

}  // namespace detail

// The thread count kernels split over (default: the machine's cores, or OMP_NUM_THREADS when set).
inline int max_threads() { return detail::Team::get().threads(); }
inline void set_threads(int n) {
    if (n > 0) detail::Team::get().set_threads(n);
}

// Already inside a job (a kernel called per head): run here, do not nest a team.
inline bool in_parallel() { return detail::Team::inside_job(); }

// Which team member this is (0 = the calling thread): for tests and examples that show the split.
inline int thread_index() { return detail::Team::thread_index(); }

// Runs part(t, nt) on nt threads at once, part 0 on the caller (nt = 1, or a busy team: all here).
template <class Part>
void run_on_threads(int nt, Part&& part) {
    if (nt > 1 && !in_parallel() && detail::Team::get().run(nt, part)) return;
    for (int t = 0; t < nt; ++t) part(t, nt);
}

// The smallest job (rows x work per row) worth waking the team for. The tests set it to 1, so that
// even the tiny model's small matrices are split and "the same bits at 1 and 2 threads" is tested.
inline std::size_t& parallel_min_work() {
    static std::size_t min_work = std::size_t(1) << 18;
    return min_work;
}

template <class F>
void parallel_rows(std::size_t n_rows, std::size_t work_per_row, F&& f) {
    if (n_rows == 0) return;
    const int nt = int(std::min<std::size_t>(std::size_t(max_threads()), n_rows));
    if (nt <= 1 || n_rows * work_per_row < parallel_min_work() || in_parallel()) {
        f(std::size_t(0), n_rows);
        return;
    }
    auto part = [&](int t, int n) {
        const std::size_t begin = n_rows * std::size_t(t) / std::size_t(n), end = n_rows * std::size_t(t + 1) / std::size_t(n);
        if (begin < end) f(begin, end);
    };
    run_on_threads(nt, part);
}

}  // namespace kimik3
