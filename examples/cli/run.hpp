// kimik3 run MODEL_DIR: the full model at a memory budget, with a report of what it cost.
#pragma once

#include <sys/resource.h>

#include <chrono>
#include <fstream>

#include "common.hpp"
#include "options.hpp"

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
    "  --think-effort E    with --think: low, high or max (default max, as K3's encoder), or none\n"
    "generation:\n"
    "  --gen N             tokens to generate (default 16). With --ids and --gen 0: teacher forcing, the\n"
    "                      logits of every position of the given ids\n"
    "  --temperature T     sampling temperature (default 0: greedy); --top-k K, --top-p P, --seed S (the token\n"
    "                      at position p is drawn with output p of the seed's stream, whatever --speculate is)\n"
    "  --recompute         recompute the whole sequence for every token (default: incremental decode)\n"
    "  --speculate N       speculative decoding: each step drafts up to N tokens (1-32) from the sequence itself\n"
    "                      (what followed the most recent earlier match of its last 4..2 tokens) and verifies\n"
    "                      them all in one forward step. The output is the same, bit for bit, in fewer steps.\n"
    "                      It pays when a step is bound by reading the trunk (a budget well below the trunk's\n"
    "                      size: a step reads it once whatever N is) and the text repeats itself (code, lists,\n"
    "                      quoting). Rejected drafts still cost their experts' reads; with the trunk resident a\n"
    "                      step is bound by compute, which grows with the tokens verified. Which N reads the\n"
    "                      least depends on the model: 16-32 for the little K3 at its floor, about 8 projected\n"
    "                      for K3, whose verify steps read more distinct experts (make bench-speculate)\n"
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
    std::uint64_t trunk = 0, experts = 0, embed_rows = 0;
    double trunk_wait = 0, trunk_read = 0, expert_read = 0, expert_wait = 0;
    CacheStats cache;
};
inline IoSnapshot io_snapshot(Model& m) {
    IoSnapshot s;
    const RingStats r = m.trunk().ring_stats();
    s.embed_rows = m.trunk().stats().embed_rows;
    s.trunk = r.bytes + s.embed_rows * std::uint64_t(m.config.hidden_size) * 2;
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

// "fixtures/little-k3: 14.03 M parameters (5.01 M in 256 routed experts), made by tools/train_little_k3.py":
// what the model is, from its tensors and the `generator` its shards record (when they record one).
inline std::string model_summary(const Model& model, const std::string& dir) {
    std::uint64_t params = 0, expert_params = 0;
    for (const auto& [name, ref] : model.checkpoint.tensors()) {
        if (name.rfind("language_model.", 0) != 0) continue;
        const bool packed = name.size() > 14 && name.compare(name.size() - 14, 14, ".weight_packed") == 0;
        const bool scale = name.size() > 13 && name.compare(name.size() - 13, 13, ".weight_scale") == 0;
        if (scale) continue;  // one E8M0 scale per 32 weights: part of the weights' encoding, not parameters
        const std::uint64_t n = packed ? 2 * ref.info->numel() : ref.info->numel();  // MXFP4: two weights per byte
        params += n;
        if (name.find(".experts.") != std::string::npos) expert_params += n;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.2f M parameters (%.2f M in %llu routed experts)", double(params) / 1e6, double(expert_params) / 1e6,
                  (unsigned long long)model.census.expert_count);
    std::string s = dir + ": " + buf;
    for (const auto& shard : model.checkpoint.shards()) {
        const auto it = shard->header().metadata.find("generator");
        if (it != shard->header().metadata.end()) return s + ", made by " + it->second;
    }
    return s;
}

// One row of the per-step table (and of --out's "steps").
struct StepRow {
    std::size_t step, tokens;            // step: the first token it yielded; tokens: fed (a prompt chunk, 1, 1 + drafts)
    std::int64_t token;                  // the (first) token the step yielded
    double seconds, io_wait;             // io_wait: time the computation waited on reads
    std::uint64_t bytes, retained, requests;
    std::vector<double> layers;          // seconds per layer
    double head;                         // embedding + final mix + lm_head
    std::uint64_t trunk_bytes, expert_bytes, embed_rows;
    std::size_t drafted, accepted, yielded;  // speculation (a plain step: 0, 0, 1)
};

// What a run produced, for the report and the output files.
struct RunResult {
    std::vector<float> logits;  // (positions, V)
    std::vector<std::int64_t> ids, out_ids;
    std::vector<StepRow> rows;
    std::int64_t stop_token = -1;  // the stop token that ended the generation (-1: none, --gen reached)
    bool teacher_forcing = false;
    double load_seconds = 0, run_seconds = 0, wall = 0;
};

// ---- kimik3 run: parse, build, run, report ----------------------------------------------------------
struct RunArgs {
    std::string dir, ids, prompt, prompt_file, dump, trace, out;
    ModelArgs model;
    SamplingParams sampling;
    ThinkArgs think;
    std::size_t gen = 16, chunk = 32, speculate = 0;
    bool recompute = false, raw = false, quiet = false;
};

// Every option, checked before anything is read; every output known writable.
inline RunArgs parse_run(std::vector<std::string> args) {
    Options o(std::move(args), kRunUsage);
    RunArgs r;
    r.ids = o.text("--ids").value_or(""), r.prompt = o.text("--prompt").value_or(""), r.prompt_file = o.text("--prompt-file").value_or("");
    r.gen = std::size_t(o.count("--gen", 0, std::uint64_t(kMaxPositions)).value_or(16));
    r.chunk = std::size_t(o.count("--prefill-chunk", 1, 1ull << 40).value_or(32));
    r.dump = o.text("--dump-logits").value_or(""), r.trace = o.text("--trace-experts").value_or(""), r.out = o.text("--out").value_or("");
    r.sampling = sampling_args(o);
    r.speculate = speculate_arg(o);
    r.model = model_args(o);
    r.think = think_args(o);
    r.recompute = o.flag("--recompute"), r.raw = o.flag("--raw"), r.quiet = o.flag("--quiet");
    r.dir = o.positional(1, "MODEL_DIR")[0];
    if (!r.ids.empty() + !r.prompt.empty() + !r.prompt_file.empty() != 1) o.refuse("give exactly one of --ids, --prompt, --prompt-file");
    if (r.model.threads > 0) set_threads(r.model.threads);
    if (r.speculate && r.recompute) o.refuse("--speculate and --recompute do not go together (--recompute starts every token afresh)");
    if (r.speculate && r.gen == 0) o.refuse("--speculate needs tokens to generate (--gen 1 or more)");
    require_writable(r.dump, "--dump-logits", kRunUsage);
    require_writable(r.out, "--out", kRunUsage);
    require_writable(r.trace, "--trace-experts", kRunUsage);
    if (!r.trace.empty()) require_writable(r.trace + ".csv", "--trace-experts", kRunUsage);
    return r;
}

// The ids to run: --ids as given, or the prompt's text through the tokenizer (as one user turn of the
// chat format unless --raw). `tok` is loaded when there is text.
inline std::vector<std::int64_t> run_input(const RunArgs& a, std::optional<Tokenizer>& tok) {
    std::vector<std::int64_t> ids;
    if (!a.ids.empty()) return parse_ids(a.ids);
    tok = Tokenizer::load(a.dir);
    // a prompt file is a regular file of at most 64 MiB (a directory, a FIFO or a device is refused)
    const std::string text = a.prompt_file.empty() ? a.prompt : read_file_capped(a.prompt_file, 64u << 20, "prompt file");
    std::vector<std::uint32_t> enc;
    if (a.raw) enc = tok->encode(text);
    else {
        const ChatMessage user{"user", text};
        ChatOptions co;
        co.thinking = a.think.think;
        co.thinking_effort = a.think.effort;
        enc = render_chat(*tok, std::span<const ChatMessage>(&user, 1), co);
    }
    return {enc.begin(), enc.end()};
}

// The output files (--dump-logits, --trace-experts, --out) and the report on stderr.
inline void report_run(Model& model, const RunArgs& a, const std::optional<Tokenizer>& tok, const RunResult& r) {
    const std::size_t V = std::size_t(model.config.vocab_size);
    const std::string &dir = a.dir, &dump = a.dump, &trace_path = a.trace, &out_path = a.out;
    const std::size_t gen = a.gen, speculate = a.speculate;
    const bool recompute = a.recompute, teacher_forcing = r.teacher_forcing;
    const std::vector<float>& logits = r.logits;
    const std::vector<std::int64_t>&ids = r.ids, &out_ids = r.out_ids;
    const std::vector<StepRow>& rows = r.rows;
    const std::int64_t stop_token = r.stop_token;
    const double load_seconds = r.load_seconds, run_seconds = r.run_seconds, wall = r.wall;
    // outputs and the report
    if (!dump.empty()) write_npy(dump, logits, logits.size() / V, V);
    if (!trace_path.empty() && model.experts()) {
        write_trace(trace_path, model.experts()->trace());
        write_trace_histogram(trace_path + ".csv", model.experts()->trace());
    }
    const IoSnapshot io = io_snapshot(model);
    const std::uint64_t rss = peak_rss_bytes();
    const double blocked = io.trunk_wait + io.expert_wait;
    std::fprintf(stderr, "report\n  model %s\n", model_summary(model, dir).c_str());
    std::fprintf(stderr, "  kernels: bf16 %s, MXFP4 %s, %d threads (this CPU runs %s; KIMIK3_ISA=xsimd|neon|avx2|avx512 caps the choice)\n",
                 bf16_kernel_name(), mxfp4_kernel_name(), max_threads(), isa_name(cpu_isa()));
    if (!teacher_forcing) {
        if (stop_token >= 0)
            std::fprintf(stderr, "  stopped at the stop token %s (id %lld) after %zu generated tokens (--gen %zu not reached)\n",
                         [&] { const std::uint32_t u = std::uint32_t(stop_token); return tok->decode(std::span<const std::uint32_t>(&u, 1)); }().c_str(), (long long)stop_token, out_ids.size() - 1, gen);
        else
            std::fprintf(stderr, "  stopped after --gen %zu tokens (no stop token)\n", gen);
    }
    std::fprintf(stderr, "  peak RSS %s (getrusage: quote this, not the plan; the plan expected %s)\n", human_bytes(double(rss)).c_str(),
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
    // decode: every step after the prefill (which yielded the first token), from the engine's counters
    struct DecodeTotals {
        std::size_t steps = 0, yielded = 0, drafted = 0, accepted = 0;
        std::uint64_t trunk = 0, experts = 0, embed_rows = 0;
        double seconds = 0;
    } dec;
    for (std::size_t i = 1; i < rows.size() && !teacher_forcing && !recompute; ++i)
        dec.steps++, dec.yielded += rows[i].yielded, dec.drafted += rows[i].drafted, dec.accepted += rows[i].accepted,
            dec.trunk += rows[i].trunk_bytes, dec.experts += rows[i].expert_bytes, dec.embed_rows += rows[i].embed_rows,
            dec.seconds += rows[i].seconds;
    if (dec.steps) {
        const double per = 1.0 / double(dec.yielded);
        std::fprintf(stderr, "  decode: %zu steps yielded %zu tokens (%.2f per step), %.3f s per token; read per token: trunk %s + experts %s = %s\n",
                     dec.steps, dec.yielded, double(dec.yielded) / double(dec.steps), dec.seconds * per, human_bytes(double(dec.trunk) * per).c_str(),
                     human_bytes(double(dec.experts) * per).c_str(), human_bytes(double(dec.trunk + dec.experts) * per).c_str());
        if (speculate) {
            // one-token steps read the same trunk pieces every step, and one embedding row per token
            const double row = double(model.config.hidden_size) * 2;
            const double plain_trunk = (double(dec.trunk) - double(dec.embed_rows) * row) / double(dec.steps) + (dec.embed_rows ? row : 0.0);
            std::fprintf(stderr, "  speculation (--speculate %zu): drafted %zu, accepted %zu (%.0f%%); one-token steps would read per token:\n"
                                 "    trunk %s (this run's pieces per step) + experts up to %s (%d per MoE layer, fewer with cache hits)\n",
                         speculate, dec.drafted, dec.accepted, dec.drafted ? 100.0 * double(dec.accepted) / double(dec.drafted) : 0.0,
                         human_bytes(plain_trunk).c_str(), human_bytes(double(model.plan.expert_read_per_token)).c_str(),
                         model.config.num_experts_per_token);
        }
    }
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
                                  {"expert_requests", r.requests}, {"layer_seconds", r.layers}, {"head_seconds", r.head},
                                  {"trunk_bytes", r.trunk_bytes}, {"expert_bytes", r.expert_bytes}, {"drafted", r.drafted},
                                  {"accepted", r.accepted}, {"yielded", r.yielded}});
        j["decode"] = {{"steps", dec.steps}, {"tokens", dec.yielded}, {"seconds", dec.seconds}, {"trunk_bytes", dec.trunk},
                       {"expert_bytes", dec.experts}, {"speculate", speculate}, {"drafted", dec.drafted}, {"accepted", dec.accepted}};
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
}

// KIMIK3_TEST_STALL_READS_AFTER=N: every weight read after the first N never returns (a hung disk), to check
// that kimik3-mpi's watchdog ends the job.
inline ssize_t stalling_pread(int fd, void* buf, std::size_t n, off_t off) {
    if (g_reads_left.fetch_sub(1) <= 0)
        for (;;) ::pause();
    return ::pread(fd, buf, n, off);
}

inline int cmd_run(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kRunUsage, stdout), kExitOk;
    if (const char* n = std::getenv("KIMIK3_TEST_FAIL_READS_AFTER")) g_reads_left = std::atol(n), detail::pread_hook = failing_pread;
    if (const char* n = std::getenv("KIMIK3_TEST_STALL_READS_AFTER")) g_reads_left = std::atol(n), detail::pread_hook = stalling_pread;
    const RunArgs a = parse_run(std::move(args));
    const std::string &dir = a.dir, &ids_arg = a.ids, &trunk = a.model.trunk, &dump = a.dump;
    const bool recompute = a.recompute, no_direct = !a.model.direct, quiet = a.quiet;
    [[maybe_unused]] const bool raw = a.raw, think = a.think.think;
    const std::size_t gen = a.gen, chunk = a.chunk, speculate = a.speculate;
    const std::uint64_t budget = a.model.budget;
    const SamplingParams sp = a.sampling;
    const auto t_start = std::chrono::steady_clock::now();

    // the input: ids, or text through the tokenizer (and the chat format)
    std::optional<Tokenizer> tok;
    const std::vector<std::int64_t> ids = run_input(a, tok);
    if (ids.empty()) throw Usage("the prompt is empty\n");
    const bool teacher_forcing = gen == 0;
    if (teacher_forcing && ids_arg.empty()) throw Usage(std::string("--gen 0 (teacher forcing) needs --ids\n\n") + kRunUsage);

    // the model at the budget
    ModelOptions mo;
    mo.budget = budget;
    mo.on_plan = show_and_check_plan;
    mo.plan.context = a.model.context.value_or(ids.size() + gen);
    if (mo.plan.context < ids.size() + gen)
        throw Usage("--context " + std::to_string(mo.plan.context) + " is smaller than the " + std::to_string(ids.size() + gen) +
                    " positions this run needs\n");
    mo.trunk_dir = trunk;
    mo.direct = !no_direct;
    // --budget bounds the whole process: the plan counts what is resident when it is made, and the threads
    // this run starts (the compute team's workers, the expert readers and their read-ahead)
    mo.plan.measure_baseline = resident_bytes;
    mo.plan.workers = max_threads() - 1;
    mo.plan.readers = mo.expert_readers + 1;
    // every position's logits are kept (teacher forcing, generate), and --dump-logits copies them into the file's bytes
    mo.plan.kept_logits = (ids.size() + gen) * (dump.empty() ? 1 : 2);
    mo.plan.trace_positions = (ids.size() + gen) * (recompute ? gen + 1 : 1);  // --recompute re-runs the prefix every step
    std::uint64_t last_shown = 0;
    mo.progress = [&](const std::string& what, std::uint64_t done, std::uint64_t total) {
        if (total > (64u << 20) && (done == total || done - last_shown > total / 20))
            last_shown = done, std::fprintf(stderr, "\r%s %5.1f%% of %s", what.c_str(), 100.0 * double(done) / double(total), human_bytes(double(total)).c_str()),
            std::fputs(done == total ? "\n" : "", stderr);
    };
    if (tok) mo.on_plan = [&](const Plan& p, const Config& c) {  // before any weight is read
        require_same_vocabulary(*tok, c, dir);
        show_and_check_plan(p, c);
    };
    Model model(dir, mo);
    const std::size_t V = std::size_t(model.config.vocab_size);
    for (std::int64_t id : ids)
        if (id < 0 || std::size_t(id) >= V) throw Usage("token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(V) + ")\n");
    const double load_seconds = seconds_since(t_start);

    // the run
    std::vector<float> logits;  // (positions, V)
    std::vector<std::int64_t> out_ids;
    std::vector<StepRow> rows;
    std::int64_t stop_token = -1;  // the stop token that ended the generation (-1: none, --gen reached)
    std::optional<ReplyReader> reply;  // the reply's text: never the chat format's markup (--raw: every token)
    if (tok) reply.emplace(*tok, !raw, think);
    StepTimes times;                   // where each forward step's time went (the step table's layer columns)
    const StopTokens stops = tok ? stop_tokens(*tok) : StopTokens{};
    IoSnapshot prev = io_snapshot(model);
    auto t_step = std::chrono::steady_clock::now();
    const auto t_run = t_step;
    auto record = [&](std::size_t step, std::int64_t token, std::size_t tokens, DecodeStep spec = {0, 0, 0, 1}) {
        const IoSnapshot now = io_snapshot(model);
        rows.push_back({step, tokens, token, seconds_since(t_step),
                        (now.trunk_wait - prev.trunk_wait) + (now.expert_wait - prev.expert_wait),
                        (now.trunk - prev.trunk) + (now.experts - prev.experts), now.cache.retained - prev.cache.retained,
                        now.cache.requests - prev.cache.requests, times.layers, times.head, now.trunk - prev.trunk,
                        now.experts - prev.experts, now.embed_rows - prev.embed_rows, spec.drafted, spec.accepted, spec.yielded});
        if (!quiet) {
            const StepRow& r = rows.back();
            if (speculate) {
                if (rows.size() == 1)
                    std::fprintf(stderr, "%6s %5s %7s %8s %7s %8s %9s %17s %10s\n", "step", "fed", "drafted", "accepted", "yielded", "token",
                                 "seconds", "experts retained", "MB read");
                std::fprintf(stderr, "%6zu %5zu %7zu %8zu %7zu %8lld %9.3f %8llu/%-8llu %10.2f\n", r.step, r.tokens, r.drafted, r.accepted,
                             r.yielded, (long long)r.token, r.seconds, (unsigned long long)r.retained, (unsigned long long)r.requests,
                             double(r.bytes) / 1e6);
            } else {
                if (rows.size() == 1) std::fprintf(stderr, "%6s %8s %9s %17s %10s\n", "step", "token", "seconds", "experts retained", "MB read");
                std::fprintf(stderr, "%6zu %8lld %9.3f %8llu/%-8llu %10.2f\n", r.step, (long long)r.token, r.seconds,
                             (unsigned long long)r.retained, (unsigned long long)r.requests, double(r.bytes) / 1e6);
            }
        }
        prev = now;
        t_step = std::chrono::steady_clock::now();
    };
    try {  // a computation that fails names its step (forward names the position: non-finite logits, ...)
        if (teacher_forcing) {
            Session s(model.config, mo.plan.context);
            logits.reserve(ids.size() * V);  // once: growing by doubling would hold up to twice what is kept
            for (std::size_t t0 = 0; t0 < ids.size(); t0 += chunk) {
                const std::size_t n = std::min(chunk, ids.size() - t0);
                logits.resize((t0 + n) * V);
                forward(&logits[t0 * V], model, s, {&ids[t0], n}, {.rows = Rows::all, .times = &times});
                record(t0, ids[t0 + n - 1], n);
            }
            for (std::size_t t = 0; t < ids.size(); ++t) std::printf("%s%lld", t ? "," : "", (long long)argmax(&logits[t * V], V));
            std::printf("\n");
        } else {
            // the token at position p is chosen from its logits (sampled with output p of the seed's stream)
            auto choose = [&](std::span<const float> l, std::uint64_t position) -> std::int64_t {
                return sp.temperature > 0 ? std::int64_t(sample(l, sp, position)) : argmax(l.data(), l.size());
            };
            auto show = [&](std::size_t step, std::int64_t id) {  // false at a stop token
                if (tok) {
                    if (stops.contains(std::uint32_t(id))) {
                        stop_token = id;
                        return false;
                    }
                    const ReplyReader::Delta d = reply->push(std::uint32_t(id));
                    std::printf("%s%s", d.reasoning.c_str(), d.content.c_str());
                } else {
                    std::printf("%s%lld", step ? "," : "", (long long)id);
                }
                std::fflush(stdout);
                return true;
            };
            // chapter 13's decode loop; with --speculate, chapter 16's prompt lookup guesses
            Session s(model.config, mo.plan.context);
            PromptLookup drafter{.max_draft = speculate};
            DecodeHooks hooks{.token = [&](std::int64_t id) { return out_ids.push_back(id), show(out_ids.size() - 1, id); },
                              .step =
                                  [&](const DecodeStep& st) {
                                      const std::size_t first = out_ids.size() - st.yielded;  // the rows name a step's first token
                                      record(first, out_ids[first], st.fed, st);
                                  },
                              .times = &times,
                              .logits = &logits};
            if (speculate) hooks.draft = [&](std::span<const std::int64_t> seq, std::size_t room) { return drafter(seq, room); };
            decode(model, s, ids, {.max_new = gen, .chunk = chunk, .recompute = recompute}, choose, hooks);
            const ReplyReader::Delta d = reply ? reply->finish() : ReplyReader::Delta{};
            std::printf("%s%s\n", d.reasoning.c_str(), d.content.c_str());
        }
    } catch (const Error& e) {
        if (e.kind != ErrorKind::runtime) throw;
        fail(ErrorKind::runtime, "step " + std::to_string(rows.size()) + ": " + e.what());
    }
    const double run_seconds = seconds_since(t_run), wall = seconds_since(t_start);
    const RunResult result{std::move(logits), ids, std::move(out_ids), std::move(rows), stop_token, teacher_forcing, load_seconds, run_seconds, wall};
    report_run(model, a, tok, result);
    return kExitOk;
}

}  // namespace kimik3::cli
