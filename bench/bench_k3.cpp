// kimik3-bench-k3: the engine at Kimi K3's real widths on this machine, against this machine's limits.
//
//   make bench-k3                      (writes build/k3-shaped once with kimik3 synth, ~14 GB)
//   build/g++/kimik3-bench-k3 --help
//
// Runs `kimik3 run` on the K3-shaped checkpoint (real widths, 4 layers: dense+KDA, MoE+KDA, MoE+KDA,
// MoE+MLA, 64 experts per MoE layer) at three budgets (the floor, a middle one, everything resident),
// several times each, and measures in the same run:
//   * the disk: a `dd iflag=direct` read of the same shard files (the bandwidth everything is compared to);
//   * decode time per layer kind, resident and streamed (from the run's per-layer timings);
//   * trunk streaming MB/s and expert fetch MB/s, against dd and against a plain read of the same experts
//     at the engine's queue depth, and the share of expert read time the decode did not wait for
//     (read-ahead: the next group read while this one computes);
//   * the overlap ratio at the floor: wall time per token / max(I/O time, compute time), where I/O time =
//     bytes read per token / dd bandwidth, compute time = the resident run's time per token;
//   * peak RSS (getrusage, from the run's JSON) against the plan at each budget;
//   * the projected full-K3 seconds per token (93 layers from the per-kind times) at the floor and the
//     laptop and server presets, next to the disk floor = bytes read per token / dd bandwidth, and the
//     full K3's compute alone (every layer resident, no reads: what the kernels cost a token).
// Every figure is a median; results also go to a JSON file and an SVG chart (I/O and compute per token).
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../examples/cli/sizes.hpp"
#include "../kimik3.hpp"
#include "timing.hpp"

using namespace kimik3;
using nlohmann::json;

namespace {

using bench::median;

// Runs a shell command, returns its stdout (stderr goes to the terminal); a failure ends the benchmark.
std::string sh(const std::string& cmd) {
    std::FILE* p = ::popen(cmd.c_str(), "r");
    if (!p) fail(ErrorKind::runtime, "cannot run: " + cmd);
    std::string out;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int rc = ::pclose(p);
    if (rc != 0) fail(ErrorKind::runtime, "command failed (" + std::to_string(rc) + "): " + cmd);
    return out;
}

// dd iflag=direct of a whole file: bytes per second.
double dd_direct(const std::string& path) {
    const std::uint64_t bytes = std::filesystem::file_size(path);
    const auto t0 = std::chrono::steady_clock::now();
    sh("dd if='" + path + "' of=/dev/null bs=64M iflag=direct 2>/dev/null");
    return double(bytes) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct RunResult {
    json j;
    double decode_seconds = 0, decode_io_wait = 0, decode_bytes = 0;
    std::vector<double> layer_seconds;  // median over decode steps, per layer
    double head_seconds = 0;
};

RunResult run_engine(const std::string& kimik3, const std::string& dir, const std::string& budget, int gen, const std::string& out) {
    std::string cmd = kimik3 + " run '" + dir + "' --ids 100,2000,30000,4000,50000,600,7000,80000 --gen " + std::to_string(gen) +
                      " --quiet --out '" + out + "'" + (budget.empty() ? "" : " --budget " + budget) + " > /dev/null 2>&1";
    sh(cmd);
    RunResult r;
    std::ifstream f(out);
    r.j = json::parse(f);
    std::vector<double> secs, waits, bytes, head;
    std::vector<std::vector<double>> layers;
    for (const json& s : r.j["steps"]) {
        if (s["tokens_fed"].get<int>() != 1) continue;  // decode steps only
        secs.push_back(s["seconds"]);
        waits.push_back(s["io_wait_seconds"]);
        bytes.push_back(s["bytes_read"].get<double>());
        head.push_back(s["head_seconds"]);
        const auto ls = s["layer_seconds"].get<std::vector<double>>();
        layers.resize(ls.size());
        for (std::size_t l = 0; l < ls.size(); ++l) layers[l].push_back(ls[l]);
    }
    r.decode_seconds = median(secs), r.decode_io_wait = median(waits), r.decode_bytes = median(bytes), r.head_seconds = median(head);
    for (auto& l : layers) r.layer_seconds.push_back(median(l));
    return r;
}

// A plain read of the same experts at the engine's queue depth: `qd` threads, each reading whole expert
// spans with O_DIRECT into its own buffer. Returns bytes per second.
double plain_expert_read(const ModelTensors& m, int qd) {
    std::vector<const ExpertLocation*> all;
    for (const auto& layer : m.experts)
        for (const ExpertLocation& x : layer) all.push_back(&x);
    std::atomic<std::size_t> next{0};
    std::atomic<std::uint64_t> bytes{0};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < qd; ++t)
        pool.emplace_back([&] {
            AlignedBuffer buf(std::size_t(m.expert_bytes) + 2 * kPageAlign);
            std::map<std::string, int> fds;
            for (std::size_t i; (i = next.fetch_add(1)) < all.size();) {
                const ExpertLocation& x = *all[i];
                int& fd = fds[x.file->path()];
                if (!fd) fd = ::open(x.file->path().c_str(), O_RDONLY | O_DIRECT);
                const std::uint64_t start = x.span_offset / kPageAlign * kPageAlign;
                const std::size_t n = round_up(std::size_t(x.span_offset - start + x.span_bytes), kPageAlign);
                if (::pread(fd, buf.data(), n, off_t(start)) > 0) bytes += x.span_bytes;
            }
            for (auto& [p, fd] : fds) ::close(fd);
        });
    for (auto& th : pool) th.join();
    return double(bytes) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string svg_chart(const std::vector<std::tuple<std::string, double, double>>& bars) {  // (label, io s, compute s)
    double top = 0;
    for (auto& [l, io, c] : bars) top = std::max(top, io + c);
    const int W = 760, H = 60 + int(bars.size()) * 50, left = 260, right = 60;
    std::string s = "<svg xmlns='http://www.w3.org/2000/svg' width='" + std::to_string(W) + "' height='" + std::to_string(H) +
                    "' font-family='sans-serif' font-size='13'>\n<text x='10' y='22' font-size='15'>seconds per token: I/O (blue) and "
                    "compute not hidden behind it (orange)</text>\n";
    int y = 45;
    for (auto& [label, io, c] : bars) {
        const double scale = double(W - left - right) / std::max(top, 1e-9);
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "<text x='10' y='%d'>%s</text><rect x='%d' y='%d' width='%.1f' height='26' fill='#4a7ebb'/>"
                      "<rect x='%.1f' y='%d' width='%.1f' height='26' fill='#e8913a'/><text x='%.1f' y='%d'>%.2f s</text>\n",
                      y + 18, label.c_str(), left, y, io * scale, left + io * scale, y, c * scale, left + (io + c) * scale + 6, y + 18, io + c);
        s += buf;
        y += 50;
    }
    return s + "</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
    std::string kimik3 = "build/g++/kimik3", dir = "build/k3-shaped", json_path, svg_path;
    int reps = 3, gen = 4;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
        if (a == "--kimik3") kimik3 = value();
        else if (a == "--dir") dir = value();
        else if (a == "--reps") reps = std::max(1, std::atoi(value().c_str()));
        else if (a == "--gen") gen = std::max(2, std::atoi(value().c_str()));
        else if (a == "--json") json_path = value();
        else if (a == "--svg") svg_path = value();
        else {
            std::printf("usage: kimik3-bench-k3 [--kimik3 BIN] [--dir K3_SHAPED_DIR] [--reps N] [--gen N] [--json FILE] [--svg FILE]\n"
                        "  Measures the engine on a K3-shaped checkpoint (made with kimik3 synth if DIR has none) against\n"
                        "  this machine's disk and memory, and projects a full 93-layer K3 token. Medians of N runs (3).\n");
            return a == "--help" ? 0 : 2;
        }
    }
    if (json_path.empty()) json_path = dir + "/bench-k3.json";
    if (svg_path.empty()) svg_path = dir + "/bench-k3.svg";
    try {
        if (!std::filesystem::exists(dir + "/config.json")) {
            std::printf("no K3-shaped checkpoint in %s: writing one (kimik3 synth, ~14 GB)\n", dir.c_str());
            sh(kimik3 + " synth '" + dir + "' >&2");
        }
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        const Census census = take_census(ck, c, m);
        std::printf("kimik3-bench-k3: %s (%s), %d layers %s, %d experts per MoE layer; medians of %d runs, %d tokens each\n\n",
                    dir.c_str(), human_bytes(double(census.bytes)).c_str(), c.num_hidden_layers, c.schedule_string().c_str(), c.num_experts,
                    reps, gen);
        // budgets: the floor (+2%), a middle one (two layers pinned), everything resident
        const Plan floor_plan = make_plan(c, census, 0, PlanOptions{8 + std::uint64_t(gen)});
        const std::uint64_t floor_budget = floor_plan.floor / 100 * 102;
        const std::uint64_t middle_budget = floor_plan.floor + census.layer_trunk_bytes[1] + census.layer_trunk_bytes[2] + (64ull << 20);
        struct Budget {
            const char* name;
            std::string arg;
        };
        // resident: every matrix and expert in memory (the embedding's rows still read on demand: 14 kB a token)
        const Plan all = make_plan(c, census, 1ull << 50, PlanOptions{8 + std::uint64_t(gen)});
        const std::uint64_t resident_budget = all.total() - all.embed_bytes;
        const std::vector<Budget> budgets = {{"floor", std::to_string(floor_budget)}, {"middle", std::to_string(middle_budget)},
                                             {"resident", std::to_string(resident_budget)}};

        std::vector<double> dd;
        std::map<std::string, std::vector<RunResult>> runs;
        for (int rep = 0; rep < reps; ++rep) {
            for (const auto& sh_ : ck.shards()) dd.push_back(dd_direct(sh_->path()));  // the disk, in the same run
            for (const Budget& b : budgets) {
                runs[b.name].push_back(run_engine(kimik3, dir, b.arg, gen, dir + "/bench-run.json"));
                std::printf("  run %d/%d at %-8s %.2f s per decoded token\n", rep + 1, reps, b.name, runs[b.name].back().decode_seconds);
                std::fflush(stdout);
            }
        }
        const double disk = median(dd);
        auto med = [&](const char* b, auto f) {
            std::vector<double> v;
            for (const RunResult& r : runs[b]) v.push_back(f(r));
            return median(v);
        };
        std::printf("\nthe disk: dd iflag=direct bs=64M of the shards: %.0f MB/s (median of %zu)\n", disk / 1e6, dd.size());

        // per layer kind
        const char* kinds[] = {"KDA + dense FFN (layer 0)", "KDA + latent MoE (layer 1)", "KDA + latent MoE (layer 2)", "MLA + latent MoE (layer 3)"};
        std::printf("\ndecode time per layer (one token)        resident    streamed at the floor\n");
        std::vector<double> res_layer(4), floor_layer(4);
        for (int l = 0; l < 4 && l < c.num_hidden_layers; ++l) {
            res_layer[std::size_t(l)] = med("resident", [&](const RunResult& r) { return r.layer_seconds[std::size_t(l)]; });
            floor_layer[std::size_t(l)] = med("floor", [&](const RunResult& r) { return r.layer_seconds[std::size_t(l)]; });
            std::printf("  %-38s %7.1f ms  %9.1f ms\n", kinds[l], res_layer[std::size_t(l)] * 1e3, floor_layer[std::size_t(l)] * 1e3);
        }
        const double res_head = med("resident", [](const RunResult& r) { return r.head_seconds; });
        const double floor_head = med("floor", [](const RunResult& r) { return r.head_seconds; });
        std::printf("  %-38s %7.1f ms  %9.1f ms\n", "embedding + final mix + lm_head", res_head * 1e3, floor_head * 1e3);

        // streaming rates
        auto io = [](const RunResult& r, const char* k) { return r.j["io"][k].get<double>(); };
        const double trunk_rate = med("floor", [&](const RunResult& r) { return io(r, "trunk_bytes_streamed") / std::max(io(r, "trunk_read_seconds"), 1e-9); });
        const double expert_rate = med("floor", [&](const RunResult& r) { return io(r, "expert_bytes") / std::max(io(r, "expert_read_seconds"), 1e-9); });
        const int qd = int(std::min<std::size_t>(expert_group_size(floor_plan.expert_slots, true, std::size_t(c.num_experts_per_token)), 8));  // reads in flight: one group
        const double plain = plain_expert_read(m, qd);
        std::printf("\nI/O at the floor\n  trunk streaming %8.0f MB/s  = %.2f of dd\n", trunk_rate / 1e6, trunk_rate / disk);
        std::printf("  expert fetches  %8.0f MB/s  = %.2f of a plain O_DIRECT read of the same experts at queue depth %d (%.0f MB/s)\n",
                    expert_rate / 1e6, expert_rate / plain, qd, plain / 1e6);
        // read-ahead: the share of expert read time the decode did not wait for (hidden behind compute)
        const double hidden = med("floor", [&](const RunResult& r) {
            return 1.0 - io(r, "expert_wait_seconds") / std::max(io(r, "expert_read_seconds"), 1e-9);
        });
        std::printf("  expert reads hidden behind compute by read-ahead: %.1f%% of their time\n", 100.0 * hidden);

        // overlap at the floor
        const double wall = med("floor", [](const RunResult& r) { return r.decode_seconds; });
        const double bytes = med("floor", [](const RunResult& r) { return r.decode_bytes; });
        const double compute = med("resident", [](const RunResult& r) { return r.decode_seconds; });
        const double io_time = bytes / disk;
        const double overlap = wall / std::max(io_time, compute);
        std::printf("\noverlap at the floor: %.2f s per token / max(I/O %.2f s = %s / dd, compute %.2f s) = %.3f\n", wall, io_time,
                    human_bytes(bytes).c_str(), compute, overlap);

        // memory against the plan
        std::printf("\npeak RSS against the plan\n");
        json rss = json::object();
        for (const Budget& b : budgets) {
            const double peak = med(b.name, [](const RunResult& r) { return r.j["memory"]["peak_rss_bytes"].get<double>(); });
            const double plan = med(b.name, [](const RunResult& r) { return r.j["memory"]["plan_bytes"].get<double>(); });
            std::printf("  %-8s plan %10s  measured %10s  (%+.1f%%)\n", b.name, human_bytes(plan).c_str(), human_bytes(peak).c_str(), 100 * (peak / plan - 1));
            rss[b.name] = {{"plan_bytes", plan}, {"peak_rss_bytes", peak}};
        }

        // the projection: the real 93-layer K3 from the per-kind times
        const Config k3 = load_config(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json");
        const Census s3 = config_census(k3);
        json projections = json::object();
        std::vector<std::tuple<std::string, double, double>> bars = {
            {"K3-shaped, floor (measured)", io_time, std::max(0.0, wall - io_time)}, {"K3-shaped, resident (measured)", 0.0, compute}};
        for (const char* preset : {"floor", "laptop", "server"}) {
            const std::uint64_t budget = std::string(preset) == "floor" ? make_plan(k3, s3, 0, PlanOptions{}).floor : cli::preset_bytes(preset);
            const Plan p = make_plan(k3, s3, budget, PlanOptions{});
            double t = 0;
            for (int l = 0; l < k3.num_hidden_layers; ++l) {
                const bool moe = k3.layers[std::size_t(l)].ffn == FfnKind::MoE, mla = k3.layers[std::size_t(l)].attn == AttnKind::MLA;
                const int kind = !moe ? 0 : mla ? 3 : 1;  // layer 0 / KDA + MoE / MLA + MoE
                const double streamed = kind == 1 ? (floor_layer[1] + floor_layer[2]) / 2 : floor_layer[std::size_t(kind)];
                const double resident = kind == 1 ? (res_layer[1] + res_layer[2]) / 2 : res_layer[std::size_t(kind)];
                // a pinned MoE layer still reads its k experts (the resident run kept them all: no reads)
                const double expert_reads = moe ? double(k3.num_experts_per_token) * double(s3.expert_bytes) / expert_rate : 0.0;
                t += p.pinned[std::size_t(l)] ? resident + expert_reads : streamed;
            }
            t += p.lm_head_pinned ? res_head : floor_head;
            const double read = double(p.trunk_read_per_token + p.expert_read_per_token);
            const double disk_floor = read / disk;
            std::printf("\nprojected full K3 at %-6s (plan: %d layers pinned%s): %.1f s per token; disk floor %.1f s (%s / dd) -> %.3f x\n",
                        preset, p.pinned_layers(), p.lm_head_pinned ? " + lm_head" : "", t, disk_floor, human_bytes(read).c_str(), t / disk_floor);
            projections[preset] = {{"seconds_per_token", t}, {"disk_floor_seconds", disk_floor}, {"bytes_read_per_token", read}, {"ratio", t / disk_floor}};
            bars.push_back({std::string("full K3 at ") + preset + " (projected)", disk_floor, std::max(0.0, t - disk_floor)});
        }
        std::printf("  (streamed layers take their measured floor time; pinned ones the resident time plus reading their\n"
                    "   16 experts at the measured expert fetch rate, with no cache hits; the lm_head likewise)\n");
        // the compute alone: every layer resident and every expert in memory (the kernels' share of a token)
        double compute_k3 = res_head;
        for (int l = 0; l < k3.num_hidden_layers; ++l) {
            const bool moe = k3.layers[std::size_t(l)].ffn == FfnKind::MoE, mla = k3.layers[std::size_t(l)].attn == AttnKind::MLA;
            compute_k3 += !moe ? res_layer[0] : mla ? res_layer[3] : (res_layer[1] + res_layer[2]) / 2;
        }
        std::printf("\nprojected full K3 compute per token, everything in memory (no reads): %.2f s on %d threads\n", compute_k3, max_threads());
        projections["compute_resident"] = {{"seconds_per_token", compute_k3}};

        json out = {{"checkpoint", dir},
                    {"disk_bytes_per_second", disk},
                    {"layers", {{"resident_seconds", res_layer}, {"floor_seconds", floor_layer}, {"head_resident", res_head}, {"head_floor", floor_head}}},
                    {"trunk_streaming_bytes_per_second", trunk_rate},
                    {"trunk_vs_dd", trunk_rate / disk},
                    {"expert_fetch_bytes_per_second", expert_rate},
                    {"plain_expert_read_bytes_per_second", plain},
                    {"expert_vs_plain", expert_rate / plain},
                    {"expert_read_hidden_share", hidden},
                    {"overlap", {{"wall", wall}, {"io", io_time}, {"compute", compute}, {"ratio", overlap}}},
                    {"rss", rss},
                    {"projection", projections}};
        SafetensorsWriter::write_text_atomic(json_path, out.dump(2) + "\n");
        SafetensorsWriter::write_text_atomic(svg_path, svg_chart(bars));
        std::printf("\nwrote %s and %s\n", json_path.c_str(), svg_path.c_str());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kimik3-bench-k3: %s\n", e.what());
        return 1;
    }
    return 0;
}
