// kimik3 chapter 00, APPENDIX a: instruction sets chosen at run time, and the one rule that picks a kernel.
// ====================================================================================================
//
// APPENDIX to chapter 00 (section 0.9). The lesson of chapter 00 is the lane rule; this appendix is the
// machinery that lets a few kernels be written for one instruction set each and still be one function
// to their callers. Read it when a chapter says "picked when the program runs (0.9)".
//
// WHAT IT PROVIDES
//   Isa            the instruction sets a kernel may be written for: xsimd (the shim of 0.4, whatever the
//                  build's -march gave), neon (arm64), avx2 and avx512 (x86-64).
//   cpu_has(i)     whether this CPU runs kernels for i (CPUID on x86-64; NEON is part of every arm64).
//   isa_enabled(i) cpu_has(i), capped by the environment variable KIMIK3_ISA.
//   Kernel<Fn>     one entry of a kernel family: its name, its instruction set, its function (nullptr
//                  when this build's architecture cannot compile it: an AVX-512 kernel on arm64).
//   choose_kernel  THE dispatch rule of every family, in one place: the reference under KIMIK3_SCALAR,
//                  else the last (widest) entry whose instruction set is enabled.
//
// The shim of 0.4 is fixed when the program is compiled: `-march=x86-64` gives SSE2 (W = 4) everywhere.
// The few kernels that move most bytes (the bf16 matvec of chapter 04, the MXFP4 one of chapter 05)
// also come as whole functions written for one instruction set, compiled into every build for their
// architecture with the compiler's `target` attribute whatever -march says, and picked when the
// program runs by what the CPU reports (CPUID, through the compiler's __builtin_cpu_supports, which also
// checks that the OS saves the wide registers). So one binary runs on an SSE2-only, an AVX2 and an
// AVX-512 machine and uses the widest kernels each has; all of them give the same bits (their tests
// say so, and count a kernel this machine cannot run as skipped).
//
//   avx2    AVX2: 8 floats per register (Haswell and later, Zen).
//   avx512  AVX-512 F + BW + DQ + VL: 16 floats per register, i.e. one register holds the 16 logical
//           lanes (Skylake-SP and later Xeons, Ice Lake, Zen 4, Zen 5).
//   neon    Advanced SIMD of arm64 (Apple silicon, Raspberry Pi 4/5, Graviton): 4 floats per register,
//           32 registers, and `tbl`, a byte table lookup.
//
// KIMIK3_ISA=xsimd|neon|avx2|avx512 caps the choice (never above what the CPU has): a benchmark can time
// each kernel in one binary, and a user can rule a kernel out. KIMIK3_SCALAR (0.4) still wins over it.
// ====================================================================================================
#pragma once

#include <span>
#include <string>
#include <vector>

#include "00_numerics.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 0.9 Instruction sets chosen at run time
// ---------------------------------------------------------------------------------------------------
enum class Isa : std::uint8_t { xsimd, neon, avx2, avx512 };  // ordered: the cap of KIMIK3_ISA keeps those up to it

inline const char* isa_name(Isa i) {
    return i == Isa::avx512 ? "avx512" : i == Isa::avx2 ? "avx2" : i == Isa::neon ? "neon" : "xsimd";
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KIMIK3_X86_KERNELS 1
#define KIMIK3_TARGET_AVX2 __attribute__((target("avx2")))
#define KIMIK3_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define KIMIK3_X86_KERNELS 0
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#define KIMIK3_NEON_KERNELS 1
#else
#define KIMIK3_NEON_KERNELS 0
#endif

// A kernel family's table names every kernel; the ones this architecture cannot compile are nullptr.
#if KIMIK3_X86_KERNELS
#define KIMIK3_X86_ONLY(f) f
#else
#define KIMIK3_X86_ONLY(f) nullptr
#endif
#if KIMIK3_NEON_KERNELS
#define KIMIK3_NEON_ONLY(f) f
#else
#define KIMIK3_NEON_ONLY(f) nullptr
#endif

// Around the AVX-512 kernels: g++ 12 warns that the `undefined` register inside its own AVX-512
// intrinsics "is (or may be) used uninitialized" when the file is not compiled with -mavx512f (GCC bug
// 105593); the warning is about the compiler's header, not the kernel.
#if defined(__GNUC__) && !defined(__clang__)
#define KIMIK3_AVX512_BEGIN                                                                       \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
        _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define KIMIK3_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define KIMIK3_AVX512_BEGIN
#define KIMIK3_AVX512_END
#endif

namespace detail {
// What the CPU reports, asked once. One definition per architecture (whole functions, no #if inside).
struct CpuCaps {
    bool avx2 = false, avx512 = false, neon = false;
    int amd_family = 0;  // the CPUID family of an AMD x86-64 CPU (25 = Zen 3/4, 26 = Zen 5), else 0
};
#if KIMIK3_X86_KERNELS
inline CpuCaps read_cpu_caps() {
    __builtin_cpu_init();
    CpuCaps c;
    if (__builtin_cpu_is("amd")) {
        unsigned eax, ebx, ecx, edx;
        __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1u), "c"(0u));
        const unsigned base = (eax >> 8) & 0xFu;  // family = base, plus the extended family when base is 15
        c.amd_family = int(base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base);
    }
    c.avx2 = __builtin_cpu_supports("avx2");
    c.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
    return c;
}
#elif KIMIK3_NEON_KERNELS
inline CpuCaps read_cpu_caps() { return CpuCaps{false, false, true}; }  // Advanced SIMD is mandatory on arm64
#else
inline CpuCaps read_cpu_caps() { return CpuCaps{}; }  // another architecture or compiler: the shim only
#endif
inline const CpuCaps& cpu_caps() {
    static const CpuCaps caps = read_cpu_caps();
    return caps;
}
}  // namespace detail

// Whether this CPU runs kernels written for `i` (xsimd: always, it is what the build compiled for).
inline bool cpu_has(Isa i) {
    const detail::CpuCaps& c = detail::cpu_caps();
    return i == Isa::xsimd || (i == Isa::neon && c.neon) || (i == Isa::avx2 && c.avx2) || (i == Isa::avx512 && c.avx512);
}

// The CPUID family of an AMD x86-64 CPU (0 elsewhere): the one place a kernel choice may look at the
// CPU's make, never at its name string (5.8 prefers an 8-row AVX-512 MXFP4 kernel on family 26, Zen 5).
inline int cpu_amd_family() { return detail::cpu_caps().amd_family; }
inline bool cpu_is_zen5() { return cpu_amd_family() == 26; }

// The widest set this CPU runs (for the programs' banners).
inline Isa cpu_isa() {
    for (Isa i : {Isa::avx512, Isa::avx2, Isa::neon})
        if (cpu_has(i)) return i;
    return Isa::xsimd;
}

// The cap KIMIK3_ISA sets (avx512, i.e. none, when unset). Read once; a bad value is refused naming it
// (the first kernel call throws; the CLI turns that into exit code 2).
inline Isa isa_cap() {
    static const Isa cap = [] {
        const char* e = std::getenv("KIMIK3_ISA");
        if (e == nullptr || e[0] == '\0') return Isa::avx512;
        const std::string v = e;
        for (Isa i : {Isa::xsimd, Isa::neon, Isa::avx2, Isa::avx512})
            if (v == isa_name(i)) return i;
        fail(ErrorKind::usage, "KIMIK3_ISA=" + v + ": expected xsimd, neon, avx2 or avx512");
    }();
    return cap;
}

// True when the kernels may use `i`: the CPU has it and KIMIK3_ISA does not rule it out.
inline bool isa_enabled(Isa i) { return cpu_has(i) && i <= isa_cap(); }

// The widest enabled set (what KIMIK3_ISA left of the CPU's).
inline Isa kernel_isa() {
    for (Isa i : {Isa::avx512, Isa::avx2, Isa::neon})
        if (isa_enabled(i)) return i;
    return Isa::xsimd;
}

// One kernel of a family. Every family lists its kernels narrowest first, the reference at index 0,
// the shim's kernel at index 1: {reference, xsimd, then the ISA-specific ones}.
template <class Fn> struct Kernel {
    const char* name;             // "reference", "xsimd", "avx2", "avx512", "neon", ...
    Isa isa;                      // what the CPU must run (the reference and xsimd: Isa::xsimd)
    Fn fn;                        // nullptr when this build's architecture cannot compile it
    bool (*preferred)() = nullptr;  // when set: chosen only on CPUs where it says true (tuned for one)
};

// Why `k` cannot run here ("" when it can): for the tests, which count such a kernel as skipped.
template <class Fn> std::string why_not_runnable(const Kernel<Fn>& k) {
    if (k.fn == nullptr) return std::string("not compiled for this architecture (") + isa_name(k.isa) + " kernels are " +
                                (k.isa == Isa::neon ? "arm64" : "x86-64") + " code)";
    if (!cpu_has(k.isa)) return std::string("this CPU has no ") + isa_name(k.isa);
    return "";
}

// THE dispatch rule of every kernel family: the reference when KIMIK3_SCALAR forces it (or `reference`
// asks for it), else the last entry that is compiled in, whose instruction set is enabled, and that
// is not tuned for another CPU. (Every entry the CPU can run is tested, preferred here or not.)
template <class Fn> const Kernel<Fn>& choose_kernel(std::span<const Kernel<Fn>> family, bool reference = !use_simd) {
    if (reference) return family[0];
    for (std::size_t i = family.size(); i-- > 1;)
        if (family[i].fn != nullptr && isa_enabled(family[i].isa) && (family[i].preferred == nullptr || family[i].preferred()))
            return family[i];
    return family[1];
}

namespace detail {
// Scratch for an input permuted into a kernel's register order (chapter 04's even/odd order, chapter
// 05's AVX-512 order), one per calling thread. A kernel fills it before forking and reads it until it
// returns; no kernel calls another meanwhile, so they can share it.
inline std::vector<float>& permuted_scratch(std::size_t n) {
    thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    return buf;
}
}  // namespace detail

}  // namespace kimik3
