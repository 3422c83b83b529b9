// kimik3 run MODEL_DIR: the full model at a memory budget, with a report of what it cost.
#pragma once

#include <sys/resource.h>

#include <chrono>
#include <fstream>

#include "common.hpp"

namespace kimik3::cli {

inline const char* kRunUsage =
    "usage: kimik3 run MODEL_DIR (--ids 1,2,3 | --prompt TEXT | --prompt-file PATH) [options]\n"
    "\n"
    "Runs Kimi K3 (or any checkpoint in its release layout) on the CPU at a memory budget. The output does\n"
    "not depend on the budget, the thread count or the SIMD width: only the speed does.\n"
    "\n"
    "input (exactly one):\n"
    "  --ids LIST          token ids, comma-separated\n"
    "  --prompt TEXT       text, rendered as one user turn of K3's chat format (needs the tokenizer files)\n"
    "  --prompt-file PATH  the same, read from a file\n"
    "  --raw               encode the prompt text as is, without the chat format\n"
    "  --think             chat format with thinking on (default: off)\n"
    "generation:\n"
    "  --gen N             tokens to generate (default 16). With --ids and --gen 0: teacher forcing, the\n"
    "                      logits of every position of the given ids\n"
    "  --temperature T     sampling temperature (default 0: greedy); --top-k K, --top-p P, --seed S\n"
    "  --recompute         recompute the whole sequence for every token (default: incremental decode)\n"
    "  --prefill-chunk N   prompt tokens per forward step (default 32): each expert is read once per chunk\n"
    "memory and I/O:\n"
    "  --budget SIZE       memory budget, e.g. 8G, 512M, 40M, or floor (the smallest that runs; default:\n"
    "                      --preset auto)\n"
    "  --preset NAME       laptop (8G), desktop (32G), server (128G), auto (90% of MemAvailable)\n"
    "  --context N         positions the MLA cache holds (default: prompt + generated tokens)\n"
    "  --trunk DIR         read the trunk from DIR/trunk.bin (kimik3 pack-trunk) instead of the shards\n"
    "  --no-direct         buffered reads instead of O_DIRECT\n"
    "  --threads N         worker threads (default: all cores)\n"
    "output:\n"
    "  --dump-logits FILE  float32 .npy [positions, vocab]: every teacher-forced position or generated step\n"
    "  --trace-experts FILE  the routed-expert trace (kimik3 simulate-cache reads it) and FILE.csv histogram\n"
    "  --out FILE.json     ids, timings, memory, I/O\n"
    "  --quiet             no per-step table on stderr\n"
    "\n"
    "Generated text (or ids) goes to stdout as it is produced; the plan, a per-step table and the final report\n"
    "go to stderr. Exit codes: 0 ok, 1 runtime failure, 2 usage error or refused config/checkpoint, 3 budget\n"
    "refused, 4 a weight read failed (nothing is printed after the failure).\n";

inline std::vector<std::int64_t> parse_ids(const std::string& s, const std::string& name = "--ids", const char* usage = kRunUsage) {
    std::vector<std::int64_t> ids;
    std::size_t i = 0;
    while (i <= s.size()) {
        const std::size_t j = std::min(s.find(',', i), s.size());
        const std::string part = s.substr(i, j - i);
        ids.push_back(parse_count(part, name, usage));
        i = j + 1;
    }
    return ids;
}

// A float32 .npy file [rows, cols] (NumPy format 1.0), written atomically.
inline void write_npy(const std::string& path, const std::vector<float>& v, std::size_t rows, std::size_t cols) {
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " + std::to_string(cols) + "), }";
    const std::size_t total = round_up(10 + header.size() + 1, 64);
    header.resize(total - 10 - 1, ' ');
    header += '\n';
    std::string out = "\x93NUMPY";
    out += char(1), out += char(0), out += char(header.size() & 0xFF), out += char(header.size() >> 8);
    out += header;
    out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    SafetensorsWriter::write_text_atomic(path, out);
}

inline std::uint64_t peak_rss_bytes() {
    struct rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    return std::uint64_t(ru.ru_maxrss) * 1024;  // Linux reports kB
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes read so far from disk by the trunk (pieces, embedding rows) and the experts.
struct IoSnapshot {
    std::uint64_t trunk = 0, experts = 0;
    double trunk_wait = 0, trunk_read = 0, expert_read = 0, expert_wait = 0;
    CacheStats cache;
};
inline IoSnapshot io_snapshot(Model& m) {
    IoSnapshot s;
    const RingStats r = m.trunk().ring_stats();
    s.trunk = r.bytes + m.trunk().stats().embed_rows * std::uint64_t(m.config.hidden_size) * 2;
    s.trunk_wait = r.wait_seconds;
    s.trunk_read = r.read_seconds;
    if (m.experts()) s.cache = m.experts()->stats(), s.experts = s.cache.bytes_read, s.expert_read = s.cache.read_seconds, s.expert_wait = s.cache.wait_seconds;
    return s;
}

// For tests only: KIMIK3_TEST_FAIL_READS_AFTER=N makes every weight read after the first N fail with EIO
// (through chapter 01's pread_hook), to check that a failed read ends the run with exit code 4 and that
// nothing is printed after it.
inline std::atomic<long> g_reads_left{-1};
inline ssize_t failing_pread(int fd, void* buf, std::size_t n, off_t off) {
    if (g_reads_left.fetch_sub(1) <= 0) {
        errno = EIO;
        return -1;
    }
    return ::pread(fd, buf, n, off);
}

inline int cmd_run(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kRunUsage, stdout), kExitOk;
    if (const char* n = std::getenv("KIMIK3_TEST_FAIL_READS_AFTER")) g_reads_left = std::atol(n), detail::pread_hook = failing_pread;
    const std::string ids_arg = take_option(args, "--ids", kRunUsage), prompt = take_option(args, "--prompt", kRunUsage),
                      prompt_file = take_option(args, "--prompt-file", kRunUsage);
    const std::string gen_arg = take_option(args, "--gen", kRunUsage), budget_arg = take_option(args, "--budget", kRunUsage),
                      preset = take_option(args, "--preset", kRunUsage), context_arg = take_option(args, "--context", kRunUsage),
                      trunk = take_option(args, "--trunk", kRunUsage), threads_arg = take_option(args, "--threads", kRunUsage),
                      chunk_arg = take_option(args, "--prefill-chunk", kRunUsage), dump = take_option(args, "--dump-logits", kRunUsage),
                      trace_path = take_option(args, "--trace-experts", kRunUsage), out_path = take_option(args, "--out", kRunUsage),
                      temp_arg = take_option(args, "--temperature", kRunUsage), topk_arg = take_option(args, "--top-k", kRunUsage),
                      topp_arg = take_option(args, "--top-p", kRunUsage), seed_arg = take_option(args, "--seed", kRunUsage);
    const bool recompute = take_flag(args, "--recompute"), raw = take_flag(args, "--raw"), think = take_flag(args, "--think"),
               no_direct = take_flag(args, "--no-direct"), quiet = take_flag(args, "--quiet");
    if (args.size() != 1 || args[0].rfind("-", 0) == 0)
        throw Usage((args.empty() ? std::string("run needs MODEL_DIR") : "unexpected argument '" + (args.size() > 1 ? args[1] : args[0]) + "'") +
                    "\n\n" + kRunUsage);
    const std::string dir = args[0];
    if ((!ids_arg.empty()) + (!prompt.empty()) + (!prompt_file.empty()) != 1)
        throw Usage(std::string("give exactly one of --ids, --prompt, --prompt-file\n\n") + kRunUsage);
    const std::uint64_t budget = budget_bytes(budget_arg, preset, kRunUsage);
    const std::size_t gen = gen_arg.empty() ? 16 : std::size_t(parse_count(gen_arg, "--gen", kRunUsage, kMaxPositions));
    const std::size_t chunk = chunk_arg.empty() ? 32 : std::size_t(parse_count(chunk_arg, "--prefill-chunk", kRunUsage));
    if (chunk == 0) throw Usage(std::string("--prefill-chunk must be at least 1\n\n") + kRunUsage);
    if (!threads_arg.empty()) set_threads(int(parse_count(threads_arg, "--threads", kRunUsage)));
    SamplingParams sp;
    sp.temperature = temp_arg.empty() ? 0.0f : parse_real(temp_arg, "--temperature", kRunUsage, 0.0f, 100.0f);
    sp.top_k = topk_arg.empty() ? 0 : int(parse_count(topk_arg, "--top-k", kRunUsage, 1 << 30));
    sp.top_p = topp_arg.empty() ? 1.0f : parse_real(topp_arg, "--top-p", kRunUsage, 0.0f, 1.0f);
    SplitMix64 rng(seed_arg.empty() ? 0 : std::uint64_t(parse_count(seed_arg, "--seed", kRunUsage)));
    const auto t_start = std::chrono::steady_clock::now();

    // the input: ids, or text through the tokenizer (and the chat format)
    std::optional<Tokenizer> tok;
    std::vector<std::int64_t> ids;
    if (!ids_arg.empty()) {
        ids = parse_ids(ids_arg);
    } else {
        tok = Tokenizer::load(dir);
        std::string text = prompt;
        if (!prompt_file.empty()) {
            std::ifstream f(prompt_file, std::ios::binary);
            if (!f) throw Usage("--prompt-file: cannot open '" + prompt_file + "'\n");
            text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
        }
        std::vector<std::uint32_t> enc;
        if (raw) enc = tok->encode(text);
        else {
            const ChatMessage user{"user", text};
            ChatOptions co;
            co.thinking = think;
            enc = render_chat(*tok, std::span<const ChatMessage>(&user, 1), co);
        }
        ids.assign(enc.begin(), enc.end());
    }
    if (ids.empty()) throw Usage("the prompt is empty\n");
    const bool teacher_forcing = gen == 0;
    if (teacher_forcing && ids_arg.empty()) throw Usage(std::string("--gen 0 (teacher forcing) needs --ids\n\n") + kRunUsage);

    // the model at the budget
    ModelOptions mo;
    mo.budget = budget;
    mo.on_plan = show_and_check_plan;
    mo.plan.context = context_arg.empty() ? ids.size() + gen : std::uint64_t(parse_count(context_arg, "--context", kRunUsage, kMaxPositions));
    if (mo.plan.context < ids.size() + gen)
        throw Usage("--context " + std::to_string(mo.plan.context) + " is smaller than the " + std::to_string(ids.size() + gen) +
                    " positions this run needs\n");
    mo.trunk_dir = trunk;
    mo.direct = !no_direct;
    std::uint64_t last_shown = 0;
    mo.progress = [&](const std::string& what, std::uint64_t done, std::uint64_t total) {
        if (total > (64u << 20) && (done == total || done - last_shown > total / 20))
            last_shown = done, std::fprintf(stderr, "\r%s %5.1f%% of %s", what.c_str(), 100.0 * double(done) / double(total), human_bytes(double(total)).c_str()),
            std::fputs(done == total ? "\n" : "", stderr);
    };
    Model model(dir, mo);
    const std::size_t V = std::size_t(model.config.vocab_size);
    for (std::int64_t id : ids)
        if (id < 0 || std::size_t(id) >= V) throw Usage("token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(V) + ")\n");
    const double load_seconds = seconds_since(t_start);

    // the run
    std::vector<float> logits;  // (positions, V)
    std::vector<std::int64_t> out_ids;
    struct StepRow {
        std::size_t step, tokens;            // tokens: fed in this forward step (a prompt chunk or 1)
        std::int64_t token;
        double seconds, io_wait;             // io_wait: time the computation waited on reads
        std::uint64_t bytes, retained, requests;
        std::vector<double> layers;          // seconds per layer
        double head;                         // embedding + final mix + lm_head
    };
    std::vector<StepRow> rows;
    Utf8Stream utf8;
    const StopTokens stops = tok ? stop_tokens(*tok) : StopTokens{};
    IoSnapshot prev = io_snapshot(model);
    auto t_step = std::chrono::steady_clock::now();
    const auto t_run = t_step;
    auto record = [&](std::size_t step, std::int64_t token, std::size_t tokens) {
        const IoSnapshot now = io_snapshot(model);
        rows.push_back({step, tokens, token, seconds_since(t_step),
                        (now.trunk_wait - prev.trunk_wait) + (now.expert_wait - prev.expert_wait),
                        (now.trunk - prev.trunk) + (now.experts - prev.experts), now.cache.retained - prev.cache.retained,
                        now.cache.requests - prev.cache.requests, model.layer_seconds, model.head_seconds});
        if (!quiet) {
            if (rows.size() == 1) std::fprintf(stderr, "%6s %8s %9s %17s %10s\n", "step", "token", "seconds", "experts retained", "MB read");
            const StepRow& r = rows.back();
            std::fprintf(stderr, "%6zu %8lld %9.3f %8llu/%-8llu %10.2f\n", r.step, (long long)r.token, r.seconds,
                         (unsigned long long)r.retained, (unsigned long long)r.requests, double(r.bytes) / 1e6);
        }
        prev = now;
        t_step = std::chrono::steady_clock::now();
    };
    if (teacher_forcing) {
        Session s(model.config, mo.plan.context);
        for (std::size_t t0 = 0; t0 < ids.size(); t0 += chunk) {
            const std::size_t n = std::min(chunk, ids.size() - t0);
            logits.resize((t0 + n) * V);
            forward(&logits[t0 * V], model, s, &ids[t0], n, true);
            record(t0, ids[t0 + n - 1], n);
        }
        for (std::size_t t = 0; t < ids.size(); ++t) std::printf("%s%lld", t ? "," : "", (long long)argmax(&logits[t * V], V));
        std::printf("\n");
    } else {
        const Generation g = generate(
            model, ids, gen, chunk, recompute, mo.plan.context,
            [&](std::span<const float> l) -> std::int64_t { return sp.temperature > 0 ? std::int64_t(sample(l, sp, rng)) : argmax(l.data(), l.size()); },
            [&](std::size_t step, std::int64_t id) {
                record(step, id, step == 0 || recompute ? ids.size() + step : 1);
                if (tok) {
                    if (stops.contains(std::uint32_t(id))) return false;
                    const std::uint32_t u = std::uint32_t(id);
                    std::printf("%s", utf8.push(tok->decode(std::span<const std::uint32_t>(&u, 1))).c_str());
                } else {
                    std::printf("%s%lld", step ? "," : "", (long long)id);
                }
                std::fflush(stdout);
                return true;
            });
        std::printf("%s\n", tok ? utf8.finish().c_str() : "");
        out_ids = g.ids;
        logits = g.logits;
    }
    const double run_seconds = seconds_since(t_run), wall = seconds_since(t_start);

    // outputs and the report
    if (!dump.empty()) write_npy(dump, logits, logits.size() / V, V);
    if (!trace_path.empty() && model.experts()) {
        write_trace(trace_path, model.experts()->trace());
        write_trace_histogram(trace_path + ".csv", model.experts()->trace());
    }
    const IoSnapshot io = io_snapshot(model);
    const std::uint64_t rss = peak_rss_bytes();
    const double blocked = io.trunk_wait + io.expert_wait;
    std::fprintf(stderr, "report\n  peak RSS %s (getrusage: quote this, not the plan; the plan expected %s)\n", human_bytes(double(rss)).c_str(),
                 human_bytes(double(model.plan.total())).c_str());
    std::fprintf(stderr, "  wall %.3f s (load %.3f s, run %.3f s); waiting on I/O %.3f s = %.0f%% of the run\n", wall, load_seconds, run_seconds,
                 blocked, run_seconds > 0 ? 100.0 * blocked / run_seconds : 0.0);
    std::fprintf(stderr, "  trunk: %s read at start, %s streamed (%.0f MB/s while reading)\n",
                 human_bytes(double(model.trunk().stats().startup_bytes)).c_str(), human_bytes(double(io.trunk)).c_str(),
                 io.trunk_read > 0 ? double(io.trunk) / 1e6 / io.trunk_read : 0.0);
    if (model.experts() && model.experts()->slot_uses > model.experts()->experts_requested)
        std::fprintf(stderr, "  chunked prefill: %llu (token, expert) uses served by %llu expert fetches: %s of expert reads saved\n",
                     (unsigned long long)model.experts()->slot_uses, (unsigned long long)model.experts()->experts_requested,
                     human_bytes(double(model.experts()->slot_uses - model.experts()->experts_requested) * double(model.census.expert_bytes)).c_str());
    if (model.experts())
        std::fprintf(stderr, "  experts: %llu requests, %llu hits (%llu retained from earlier steps), %llu misses, %llu evictions; %s read (%.0f MB/s)\n",
                     (unsigned long long)io.cache.requests, (unsigned long long)io.cache.hits, (unsigned long long)io.cache.retained,
                     (unsigned long long)io.cache.misses, (unsigned long long)io.cache.evictions, human_bytes(double(io.experts)).c_str(),
                     io.expert_read > 0 ? double(io.experts) / 1e6 / io.expert_read : 0.0);
    if (!out_path.empty()) {
        nlohmann::ordered_json j;
        j["model"] = dir;
        j["prompt_ids"] = ids;
        j["generated_ids"] = out_ids;
        j["teacher_forcing"] = teacher_forcing;
        j["plan"] = {{"budget_bytes", model.plan.budget}, {"floor_bytes", model.plan.floor}, {"expected_bytes", model.plan.total()},
                     {"pinned_layers", model.plan.pinned_layers()}, {"lm_head_pinned", model.plan.lm_head_pinned},
                     {"ring_slots", model.plan.ring_slots}, {"chunk_bytes", model.plan.chunk_bytes}, {"expert_slots", model.plan.expert_slots},
                     {"context", model.plan.context}};
        j["timings"] = {{"wall_seconds", wall}, {"load_seconds", load_seconds}, {"run_seconds", run_seconds}};
        j["steps"] = nlohmann::ordered_json::array();
        for (const StepRow& r : rows)
            j["steps"].push_back({{"step", r.step}, {"tokens_fed", r.tokens}, {"token", r.token}, {"seconds", r.seconds},
                                  {"io_wait_seconds", r.io_wait}, {"bytes_read", r.bytes}, {"experts_retained", r.retained},
                                  {"expert_requests", r.requests}, {"layer_seconds", r.layers}, {"head_seconds", r.head}});
        j["memory"] = {{"peak_rss_bytes", rss}, {"plan_bytes", model.plan.total()}};
        j["io"] = {{"trunk_bytes_streamed", io.trunk}, {"trunk_bytes_at_start", model.trunk().stats().startup_bytes},
                   {"expert_bytes", io.experts}, {"blocked_on_io_seconds", blocked}, {"expert_requests", io.cache.requests},
                   {"expert_hits", io.cache.hits}, {"expert_retained", io.cache.retained}, {"expert_misses", io.cache.misses},
                   {"expert_evictions", io.cache.evictions},
                   {"expert_slot_uses", model.experts() ? model.experts()->slot_uses : 0},
                   {"expert_fetches_requested", model.experts() ? model.experts()->experts_requested : 0},
                   {"trunk_read_seconds", io.trunk_read}, {"expert_read_seconds", io.expert_read}, {"expert_wait_seconds", io.expert_wait}};
        SafetensorsWriter::write_text_atomic(out_path, j.dump(2) + "\n");
    }
    return kExitOk;
}

}  // namespace kimik3::cli
