// kimik3 chapter 11, APPENDIX: traces -- recording what the router asked for, and replaying it.
// ====================================================================================================
//
// APPENDIX to chapter 11 (11_expert_cache.hpp, sections 11.5 and 11.6 in its index). The lesson's cache
// records every (step, layer, expert) request in a Trace; this writes and reads that trace as a file,
// counts requests per expert, and replays a trace under LRU, LFU and Belady's optimum at any number of
// slots through the same SlotTable the cache uses, so a replay gives exactly the counts the cache would
// have (test 11.6). That is how to size a cache before giving it memory.
//
// WHY A TRACE BEFORE A CACHE (the numbers of chapter 11's top block)
//   Why a cache helps little for K3, from these numbers alone. A token walks the 92 MoE layers in order,
//   16 experts each: 16 x 92 = 1,472 requests (25.8 GB), and the next token walks the same cycle. An
//   expert of layer l is worth keeping only if the next token picks it again at layer l, 1,471 requests
//   later. With S < 1,472 slots, LRU has evicted it by then (every slot was reused in between): 0 hits.
//   Any policy holds at most S of the 82,432 experts, and with the load spread evenly (K3's router is
//   trained for that: the selection bias of chapter 10) a request finds its expert resident with
//   probability about S / 82,432: 887 slots (the server preset's 15.6 GB) keep at most ~1.1% of
//   requests, 2,050 slots (36 GB) ~2.5%, and every 1% more costs 824 slots = 14.5 GB, against 25.8 GB
//   read per token. The engine before us, kimi-k3-in-c (github.com/FareedKhan-dev/kimi-k3-in-c, its
//   PERFORMANCE.md), measured exactly that: its LRU cache retained 0% below ~36 GB of arena, and memory
//   did more good holding the trunk. A cache pays only where routing is skewed (a few experts per layer
//   taking most requests), so size it from a recorded trace (section 11.6) before giving it memory.
//   make run-11 replays K3-shaped traces with balanced and with skewed routing at 887, 1,472 and 2,944
//   slots to show both cases.
//
// CONCEPTS
//   trace         every (step, layer, expert) request in order. Routing never depends on the cache (the
//                 router sees activations, not residency), so replaying a trace under another policy or
//                 size gives exactly the requests that cache would have seen. A trace recorded with
//                 full-recompute decode (every step re-runs the whole prefix) repeats the prefix's experts
//                 each step and inflates reuse: record with incremental decode.
//   Belady (MIN)  evict the expert whose next use is farthest away: optimal, needs the future, so it lives
//                 only in the simulator, as the bound no policy can beat.
//   compulsory    the first request of each distinct expert misses at any size: 1 - distinct / requests
//                 is the ceiling of every policy's hit rate.
//
// TRACE FILE (.k3trace, all fields little-endian)
//     offset size  field                      offset size  field
//       0     8    magic "KIMIK3TR"             28     4    steps
//       8     4    version (1)                  32     8    expert bytes (17,547,264)
//      12     4    record bytes (8)             40     8    records N
//      16     4    layers (93)                  48    8N    records: step u32, layer u16, expert u16
//      20     4    experts per layer (896)
//      24     4    k, experts per token (16)
//
// CONTRACT
//   * A trace file that is missing or malformed (size, magic, version, record size, a record out of
//     range or out of step order) is Error(format) naming the file; one that cannot be written is
//     Error(runtime) and leaves nothing behind (appendix 01b's atomic writer).
//   * replay_trace gives the same statistics (requests, hits, retained, misses, evictions, bytes_read)
//     as the cache that recorded the trace, at the same slot count and policy.
//
// USES     chapter 11 (Trace, SlotTable, policies, expert_group_size via chapter 10), appendix 01b
// RUN      make run-11      TEST   make test-11 (tests "11.5 ..." and "11.6 ...")
// CLI      kimik3 simulate-cache TRACE --sizes 17,64,256 [--svg FILE] [--disk-mbps 1300]
// ====================================================================================================
#pragma once

#include <cmath>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "01b_writer.hpp"  // APPENDIX: traces are written atomically
#include "11_expert_cache.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 11.5 The trace file (layout in the top block) and the per-expert histogram
// ---------------------------------------------------------------------------------------------------
inline constexpr char kTraceMagic[8] = {'K', 'I', 'M', 'I', 'K', '3', 'T', 'R'};
inline constexpr std::uint32_t kTraceVersion = 1;
inline constexpr std::size_t kTraceHeaderBytes = 48, kTraceRecordBytes = sizeof(ExpertRequest);

namespace detail {
inline void put_le(std::string& out, std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xFF);
}
inline std::uint64_t get_le(const std::string& in, std::size_t at, int bytes) {
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = v << 8 | std::uint8_t(in[at + std::size_t(i)]);
    return v;
}
}  // namespace detail

inline std::string trace_bytes(const Trace& t) {
    std::string out(kTraceMagic, 8);
    for (std::uint32_t v : {kTraceVersion, std::uint32_t(kTraceRecordBytes), t.layers, t.experts, t.k, t.steps}) detail::put_le(out, v, 4);
    detail::put_le(out, t.expert_bytes, 8);
    detail::put_le(out, t.requests.size(), 8);
    for (const ExpertRequest& r : t.requests) detail::put_le(out, r.step, 4), detail::put_le(out, r.layer, 2), detail::put_le(out, r.expert, 2);
    return out;
}

inline void write_trace(const std::string& path, const Trace& t) { SafetensorsWriter::write_text_atomic(path, trace_bytes(t)); }

// Reads and validates a trace: size, magic, version, record size, then every record's ranges.
inline Trace read_trace(const std::string& path) {
    Fd fd = open_read(path);
    std::string in(std::size_t(file_size(fd.get(), path)), '\0');
    pread_exact(fd.get(), in.data(), in.size(), 0, path);
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, path + ": " + what); };
    if (in.size() < kTraceHeaderBytes)
        bad(std::to_string(in.size()) + " bytes is shorter than the 48-byte header of a kimik3 expert trace");
    if (in.compare(0, 8, kTraceMagic, 8) != 0) {
        std::string magic;  // printable: other bytes as \xNN
        for (char ch : in.substr(0, 8)) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "\\x%02X", unsigned(std::uint8_t(ch)));
            magic += ch >= 0x20 && ch < 0x7F && ch != '"' && ch != '\\' ? std::string(1, ch) : std::string(hex);
        }
        bad("not a kimik3 expert trace (magic \"" + magic + "\", expected \"KIMIK3TR\"); HINT: record one with ExpertCache::trace() "
            "and write_trace()");
    }
    const std::uint64_t version = detail::get_le(in, 8, 4), record = detail::get_le(in, 12, 4);
    if (version != kTraceVersion) bad("trace version " + std::to_string(version) + " is not supported (this reader knows version 1)");
    if (record != kTraceRecordBytes) bad("record size " + std::to_string(record) + " is not 8");
    Trace t;
    t.layers = std::uint32_t(detail::get_le(in, 16, 4));
    t.experts = std::uint32_t(detail::get_le(in, 20, 4));
    t.k = std::uint32_t(detail::get_le(in, 24, 4));
    t.steps = std::uint32_t(detail::get_le(in, 28, 4));
    t.expert_bytes = detail::get_le(in, 32, 8);
    const std::uint64_t n = detail::get_le(in, 40, 8);
    if (n > (in.size() - kTraceHeaderBytes) / kTraceRecordBytes || in.size() != kTraceHeaderBytes + n * kTraceRecordBytes)
        bad("truncated or padded: the header promises " + std::to_string(n) + " records (" +
            (n > UINT64_MAX / 16 ? std::string("too many") : std::to_string(kTraceHeaderBytes + n * kTraceRecordBytes)) +
            " bytes) but the file holds " + std::to_string(in.size()) + " bytes");
    if (t.k == 0 || t.k > t.experts || t.layers > 65535 || t.experts > 65535)
        bad("header fields out of range: layers " + std::to_string(t.layers) + ", experts " + std::to_string(t.experts) + ", k " +
            std::to_string(t.k));
    t.requests.resize(std::size_t(n));
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t at = kTraceHeaderBytes + i * kTraceRecordBytes;
        ExpertRequest& r = t.requests[i];
        r = {std::uint32_t(detail::get_le(in, at, 4)), std::uint16_t(detail::get_le(in, at + 4, 2)), std::uint16_t(detail::get_le(in, at + 6, 2))};
        if (r.layer >= t.layers || r.expert >= t.experts || r.step >= t.steps || (i > 0 && r.step < t.requests[i - 1].step))
            bad("record " + std::to_string(i) + " (step " + std::to_string(r.step) + ", layer " + std::to_string(r.layer) + ", expert " +
                std::to_string(r.expert) + ") is out of range or out of step order");
    }
    return t;
}

// CSV "layer,expert,requests": every expert of every layer that appears in the trace, zeros included
// (an expert never asked for is as telling as a hot one).
inline std::string trace_histogram_csv(const Trace& t) {
    std::map<std::uint32_t, std::vector<std::uint64_t>> counts;  // layer -> (experts)
    for (const ExpertRequest& r : t.requests) {
        auto& c = counts[r.layer];
        c.resize(t.experts, 0);
        ++c[r.expert];
    }
    std::string out = "layer,expert,requests\n";
    for (const auto& [layer, c] : counts)
        for (std::size_t e = 0; e < c.size(); ++e) out += std::to_string(layer) + "," + std::to_string(e) + "," + std::to_string(c[e]) + "\n";
    return out;
}
inline void write_trace_histogram(const std::string& path, const Trace& t) { SafetensorsWriter::write_text_atomic(path, trace_histogram_csv(t)); }

// ---------------------------------------------------------------------------------------------------
// 11.6 The simulator: replay a trace under a policy and a size
// ---------------------------------------------------------------------------------------------------
// For each request, the number of the next request for the same expert (kNeverAgain if none).
inline std::vector<std::uint64_t> next_uses(const Trace& t) {
    std::vector<std::uint64_t> next(t.requests.size(), kNeverAgain);
    std::unordered_map<std::uint64_t, std::uint64_t> later;  // expert_key -> nearest later request
    for (std::size_t i = t.requests.size(); i-- > 0;) {
        const std::uint64_t key = expert_key(t.requests[i].layer, t.requests[i].expert);
        if (auto it = later.find(key); it != later.end()) next[i] = it->second;
        later[key] = i;
    }
    return next;
}

// Replays `t` as moe_forward would have asked a cache of `slots` slots: per (step, layer) run of
// requests, groups of expert_group_size(slots, reads ahead, run length) in trace order, each admitted
// with the previous group of its run busy (read-ahead), begin_step() where the step changes.
inline CacheStats replay_trace(const Trace& t, std::size_t slots, PolicyKind kind, const std::vector<std::uint64_t>* next_use = nullptr) {
    std::vector<std::uint64_t> own;
    if (kind == PolicyKind::belady && !next_use) own = next_uses(t), next_use = &own;
    SlotTable table(slots, make_policy(kind, slots, next_use), t.expert_bytes);
    std::vector<std::uint64_t> keys;
    std::vector<SlotTable::Placement> placed;
    std::vector<std::size_t> busy;
    for (std::size_t i = 0, j; i < t.requests.size(); i = j) {
        if (i > 0 && t.requests[i].step != t.requests[i - 1].step) table.begin_step();
        for (j = i; j < t.requests.size() && t.requests[j].step == t.requests[i].step && t.requests[j].layer == t.requests[i].layer;) ++j;
        const std::size_t group = expert_group_size(slots, true, j - i);
        busy.clear();
        for (std::size_t b = i; b < j; b += group) {
            keys.clear();
            for (std::size_t r = b; r < std::min(j, b + group); ++r) keys.push_back(expert_key(t.requests[r].layer, t.requests[r].expert));
            table.admit(keys, placed, busy);
            busy.clear();
            if (2 * group <= slots)  // moe_forward reads ahead only with room for two groups
                for (const SlotTable::Placement& p : placed) busy.push_back(p.slot);
        }
    }
    return table.stats();
}

struct SimResult {
    std::size_t slots = 0;
    PolicyKind policy = PolicyKind::lru;
    CacheStats stats;
};

inline std::size_t distinct_experts(const Trace& t) {
    std::set<std::uint64_t> keys;
    for (const ExpertRequest& r : t.requests) keys.insert(expert_key(r.layer, r.expert));
    return keys.size();
}

// Every size under LRU, LFU and Belady, in that order.
inline std::vector<SimResult> simulate_cache(const Trace& t, std::span<const std::size_t> sizes) {
    const std::vector<std::uint64_t> next = next_uses(t);
    std::vector<SimResult> out;
    for (std::size_t s : sizes)
        for (PolicyKind k : {PolicyKind::lru, PolicyKind::lfu, PolicyKind::belady}) out.push_back({s, k, replay_trace(t, s, k, &next)});
    return out;
}

inline double percent(std::uint64_t part, std::uint64_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0.0; }

// The table: per size and policy, hit and retention rates, bytes read per step (token) and, given a
// disk speed in MB/s, the seconds per token those reads cost.
inline void print_simulation(std::FILE* out, const Trace& t, const std::vector<SimResult>& results, double disk_mbps = 0) {
    const std::size_t n = t.requests.size(), distinct = distinct_experts(t);
    std::fprintf(out, "trace: %zu requests in %u steps; top-%u of %u experts; %s per expert\n", n, t.steps, t.k, t.experts,
                 human_bytes(double(t.expert_bytes)).c_str());
    std::fprintf(out, "compulsory misses: %zu distinct experts, so no policy at any size hits more than %.1f%%\n", distinct,
                 100.0 - percent(distinct, n));
    std::fprintf(out, "  %6s %10s  %-7s %6s %10s %10s %12s", "slots", "memory", "policy", "hit %", "retained %", "evictions", "read/step");
    if (disk_mbps > 0) std::fprintf(out, "  s/step @ %.0f MB/s", disk_mbps);
    std::fprintf(out, "\n");
    for (const SimResult& r : results) {
        const double per_step = t.steps ? double(r.stats.bytes_read) / double(t.steps) : 0.0;
        std::fprintf(out, "  %6zu %10s  %-7s %6.1f %10.1f %10llu %12s", r.slots, human_bytes(double(r.slots * widened_bound(t.expert_bytes))).c_str(),
                     policy_name(r.policy), percent(r.stats.hits, r.stats.requests), percent(r.stats.retained, r.stats.requests),
                     (unsigned long long)r.stats.evictions, human_bytes(per_step).c_str());
        if (disk_mbps > 0) std::fprintf(out, "  %10.4g", per_step / (disk_mbps * 1e6));
        std::fprintf(out, "\n");
    }
}

// A hand-written SVG: hit rate (%) against cache size (slots, log scale), one polyline per policy, and
// the compulsory-miss ceiling dashed.
inline std::string simulation_svg(const Trace& t, const std::vector<SimResult>& results, const std::string& title) {
    std::set<std::size_t> sizes;
    for (const SimResult& r : results) sizes.insert(r.slots);
    if (sizes.empty()) fail(ErrorKind::usage, "simulation_svg: no results to plot");
    const double left = 70, right = 590, top = 50, bottom = 370;  // plot area in a 760 x 440 canvas
    const double lo = std::log(double(*sizes.begin())), hi = std::log(double(*sizes.rbegin()));
    auto X = [&](std::size_t s) { return hi > lo ? left + (right - left) * (std::log(double(s)) - lo) / (hi - lo) : (left + right) / 2; };
    auto Y = [&](double pct) { return bottom - (bottom - top) * pct / 100.0; };
    std::string esc;
    for (char ch : title) esc += ch == '&' ? "&amp;" : ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : std::string(1, ch);
    std::string svg;
    char b[512];
    auto add = [&](const char* fmt, auto... v) { std::snprintf(b, sizeof b, fmt, v...), svg += b; };
    svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\"440\" viewBox=\"0 0 760 440\" "
           "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"760\" height=\"440\" fill=\"white\"/>\n";
    svg += "<text x=\"70\" y=\"28\" font-size=\"15\">" + esc + "</text>\n";
    for (int pct = 0; pct <= 100; pct += 20)
        add("<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%d%%</text>\n",
            left, Y(pct), right, Y(pct), left - 6, Y(pct) + 4, pct);
    for (std::size_t s : sizes)
        add("<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#000\"/><text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%zu</text>\n",
            X(s), bottom, X(s), bottom + 5, X(s), bottom + 19, s);
    add("<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#000\"/><line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#000\"/>\n", left,
        bottom, right, bottom, left, top, left, bottom);
    add("<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">cache size (expert slots, log scale)</text>\n", (left + right) / 2, bottom + 42);
    add("<text transform=\"translate(22 %g) rotate(-90)\" text-anchor=\"middle\">hit rate (%%)</text>\n", (top + bottom) / 2);
    const double ceiling = 100.0 - percent(distinct_experts(t), t.requests.size());
    add("<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"6 4\"/>\n", left, Y(ceiling), right, Y(ceiling));
    add("<text x=\"%g\" y=\"%.1f\" fill=\"#888\">compulsory ceiling %.1f%%</text>\n", right + 10, Y(ceiling) + 4, ceiling);
    const char* colour[3] = {"#1f77b4", "#ff7f0e", "#2ca02c"};
    for (PolicyKind k : {PolicyKind::lru, PolicyKind::lfu, PolicyKind::belady}) {
        const char* c = colour[int(k)];
        std::string points;
        for (const SimResult& r : results)
            if (r.policy == k) {
                const double x = X(r.slots), y = Y(percent(r.stats.hits, r.stats.requests));
                char p[48];
                std::snprintf(p, sizeof p, "%.1f,%.1f ", x, y);
                points += p;
                add("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", x, y, c);
            }
        svg += "<polyline fill=\"none\" stroke=\"" + std::string(c) + "\" stroke-width=\"2\" points=\"" + points + "\"/>\n";
        add("<text x=\"%g\" y=\"%d\" fill=\"%s\">%s</text>\n", right + 10, 70 + 18 * int(k), c, policy_name(k));
    }
    return svg + "</svg>\n";
}

}  // namespace kimik3
