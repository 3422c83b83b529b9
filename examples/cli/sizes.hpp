// Sizes and memory presets for the command line: "8G" -> bytes, the named budgets, MemAvailable.
// The engine (chapter 12's planner) takes bytes; turning what a user types into bytes is the CLI's job.
// Used by the commands (common.hpp), example 12 and the benchmarks; tested by tests/test_12 ("12.1").
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "../../chapters/00_numerics.hpp"

namespace kimik3::cli {

// "8G", "40M", "1.5G", "123456" (bytes). K, M, G, T (or KB, MB, GB, TB) are decimal, as every size this
// program prints (human_bytes); KiB, MiB, GiB, TiB are binary.
inline std::uint64_t parse_size(const std::string& s) {
    std::size_t end = 0;
    double v = 0;
    try {
        v = std::stod(s, &end);
    } catch (...) {
        end = 0;
    }
    static const std::map<std::string, double> units = {
        {"", 1},          {"B", 1},         {"K", 1e3},       {"KB", 1e3},      {"M", 1e6},       {"MB", 1e6},
        {"G", 1e9},       {"GB", 1e9},      {"T", 1e12},      {"TB", 1e12},     {"KiB", 1024.0},  {"MiB", 1048576.0},
        {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    const auto unit = units.find(s.substr(end));
    if (end == 0 || unit == units.end() || !(v >= 0) || v * unit->second > 1e18)
        fail(ErrorKind::usage, "size '" + s + "' is not a size (examples: 8G, 512M, 40M, 1.5G, 16GiB)");
    return std::uint64_t(v * unit->second);
}

// MemAvailable from /proc/meminfo, in bytes (0 when unknown).
inline std::uint64_t mem_available() {
    std::ifstream f("/proc/meminfo");
    std::string key;
    std::uint64_t kb = 0;
    std::string unit;
    while (f >> key >> kb >> unit)
        if (key == "MemAvailable:") return kb * 1024;
    return 0;
}

// This process's resident bytes now: VmRSS from /proc/self/status (0 when unknown). The planner adds it to
// the plan (PlanOptions::measure_baseline), so that a budget bounds the peak RSS of the whole process.
inline std::uint64_t resident_bytes() {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
    return 0;
}

// The named presets for the real K3 (the budgets of kimi-k3-in-c's laptop/desktop/server presets, about 8, 32 and
// 128 GB: github.com/FareedKhan-dev/kimi-k3-in-c), and `auto`: 90% of MemAvailable.
inline std::uint64_t preset_bytes(const std::string& name) {
    if (name == "laptop") return parse_size("8G");
    if (name == "desktop") return parse_size("32G");
    if (name == "server") return parse_size("128G");
    if (name == "auto") {
        const std::uint64_t a = mem_available();
        if (a == 0) fail(ErrorKind::usage, "preset auto: MemAvailable is unknown on this system; give --budget");
        return a / 10 * 9;
    }
    fail(ErrorKind::usage, "unknown preset '" + name + "' (laptop 8G, desktop 32G, server 128G, auto)");
}

}  // namespace kimik3::cli
