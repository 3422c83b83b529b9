// kimik3 simulate-cache TRACE: replay a recorded expert trace under LRU, LFU and Belady at several cache
// sizes (chapter 11.6), print the table, and plot hit rate against size as an SVG.
#pragma once

#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "../../chapters/11_expert_cache.hpp"
#include "common.hpp"

namespace kimik3::cli {

inline const char* kSimulateCacheUsage =
    "usage: kimik3 simulate-cache TRACE [--sizes N,N,...] [--svg FILE] [--disk-mbps N] [--histogram FILE]\n"
    "\n"
    "Replays TRACE, a .k3trace file of (step, layer, expert) requests recorded by the expert cache\n"
    "(chapter 11), through caches of each size (in whole-expert slots) under LRU, LFU and Belady's\n"
    "optimum, and prints per size and policy: the hit rate, the retention (hits on experts kept from an\n"
    "earlier step), evictions, and the bytes read per step (one step = one token when decoding).\n"
    "Routing never depends on the cache, so a replay is exactly what that cache would have seen; record\n"
    "with incremental decode (a full-recompute trace repeats the prefix's experts and inflates reuse).\n"
    "\n"
    "  --sizes N,N,...   cache sizes in slots (default: k+1, then 2k, 4k, ... up to the distinct experts)\n"
    "  --svg FILE        where to write the hit-rate plot (default: TRACE.svg)\n"
    "  --disk-mbps N     also print the seconds per step those reads take at N MB/s\n"
    "  --histogram FILE  also write the requests per expert as CSV (layer,expert,requests)\n";

inline int cmd_simulate_cache(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kSimulateCacheUsage, stdout), kExitOk;
    const std::string sizes_arg = take_option(args, "--sizes", kSimulateCacheUsage);
    std::string svg_path = take_option(args, "--svg", kSimulateCacheUsage);
    const std::string mbps_arg = take_option(args, "--disk-mbps", kSimulateCacheUsage);
    const std::string histogram_path = take_option(args, "--histogram", kSimulateCacheUsage);
    for (const std::string& a : args)
        if (a.rfind("-", 0) == 0) throw Usage("unknown option '" + a + "'\n\n" + kSimulateCacheUsage);
    if (args.size() != 1) throw Usage(std::string("simulate-cache takes one TRACE file\n\n") + kSimulateCacheUsage);
    const std::string path = args[0];

    double mbps = 0;
    if (!mbps_arg.empty()) {
        char* end = nullptr;
        errno = 0;
        mbps = std::strtod(mbps_arg.c_str(), &end);
        if (*end != '\0' || errno != 0 || !(mbps > 0) || !std::isfinite(mbps))
            throw Usage("--disk-mbps: '" + mbps_arg + "' is not a positive number of MB/s\n\n" + kSimulateCacheUsage);
    }
    if (!std::filesystem::is_regular_file(path)) throw Usage("TRACE '" + path + "' is not a file\n\n" + kSimulateCacheUsage);
    Trace trace;
    try {
        trace = read_trace(path);
    } catch (const Error& e) {
        throw Error(e.kind == ErrorKind::io ? ErrorKind::format : e.kind, e.what());  // a bad trace is not a weight read: exit 2
    }

    std::vector<std::size_t> sizes;
    if (!sizes_arg.empty()) {
        for (std::size_t p = 0, q; p <= sizes_arg.size(); p = q + 1) {
            q = std::min(sizes_arg.find(',', p), sizes_arg.size());
            const long long n = parse_count(sizes_arg.substr(p, q - p), "--sizes", kSimulateCacheUsage);
            if (n < 1 || n > (1 << 24))
                throw Usage("--sizes: " + std::to_string(n) + " is not a cache size (1 to 16777216 slots)\n\n" + kSimulateCacheUsage);
            sizes.push_back(std::size_t(n));
        }
    } else {  // k+1, 2k, 4k, ... and finally the size that holds every distinct expert
        const std::size_t distinct = std::max<std::size_t>(distinct_experts(trace), 1);
        sizes.push_back(trace.k + 1);
        for (std::size_t s = 2 * std::size_t(trace.k); s < distinct; s *= 2) sizes.push_back(s);
        if (sizes.back() < distinct) sizes.push_back(distinct);
    }

    const std::vector<SimResult> results = simulate_cache(trace, sizes);
    if (svg_path.empty()) svg_path = path + ".svg";
    const std::string title = "expert cache hit rate: " + std::filesystem::path(path).filename().string() + " (" +
                              thousands(trace.requests.size()) + " requests, " + thousands(trace.steps) + " steps)";
    SafetensorsWriter::write_text_atomic(svg_path, simulation_svg(trace, results, title));  // a failed write: exit 1
    if (!histogram_path.empty()) write_trace_histogram(histogram_path, trace);
    print_simulation(stdout, trace, results, mbps);
    std::printf("plot: %s\n", svg_path.c_str());
    if (!histogram_path.empty()) std::printf("histogram: %s\n", histogram_path.c_str());
    return kExitOk;
}

}  // namespace kimik3::cli
