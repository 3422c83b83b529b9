// kimik3-bench-speculate: what speculative decoding (chapter 16) buys and what it costs, measured.
//
//   kimik3-bench-speculate rollback [--reps N]
//       The two ways to roll the KDA states back over rejected drafts, at the tiny K3's and at K3's real
//       sizes: per-token snapshots against chapter 16's scratch copy + replay, time and memory per layer,
//       projected to K3's 69 KDA layers.
//   kimik3-bench-speculate compare MODEL_DIR [--prompts DIR]... [--budget floor|resident|SIZE] [--gen N]
//                                 [--draft 2,8,16,32] [--length adaptive|fixed|both] [--ngram MIN:MAX] [--chat] [--reps N] [--json FILE]
//       One token per step against speculation, side by side in one process, over sets of prompts (a
//       directory of text files, one prompt each, less the file's final line break; default:
//       bench/prompts/repetitive): acceptance, tokens per step, trunk and expert bytes per generated token
//       (the engine's own counters), wall time per token, and a check that every run's ids and logits
//       equal the plain run's (exit 1 if not).
//   kimik3-bench-speculate verify-cost K3_SHAPED_DIR [--sizes 1,2,3,5,9,17,33] [--reps N] [--acceptance FILE]
//                                     [--json FILE]
//       On the K3-shaped checkpoint (make bench-k3 writes it) at the floor: a verify step of T tokens
//       against a one-token step (trunk bytes, the union of routed experts, compute), projected to the
//       93-layer K3 and, with the acceptance measured by `compare` (its JSON), the full K3's seconds per
//       generated token next to the one-token disk floor.
//
// Every figure is a median over --reps runs (the machine is shared); speeds are never asserted.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../examples/cli/sizes.hpp"
#include "../kimik3.hpp"
#include "../tests/rng.hpp"
#include "reads.hpp"
#include "timing.hpp"

using namespace kimik3;
using nlohmann::json;

namespace {

using bench::median;
using bench::median_seconds;
using Ids = std::vector<std::int64_t>;

using bench::load_average;

std::vector<std::size_t> parse_list(const std::string& s) {
    std::vector<std::size_t> v;
    for (std::size_t i = 0; i <= s.size();) {
        const std::size_t j = std::min(s.find(',', i), s.size());
        v.push_back(std::size_t(std::stoul(s.substr(i, j - i))));
        i = j + 1;
    }
    return v;
}

// ---------------------------------------------------------------------------------------------------
// rollback: per-token snapshots against scratch copy + replay, one KDA layer
// ---------------------------------------------------------------------------------------------------
void bench_rollback(int reps) {
    std::printf("rollback of one KDA layer over a verify step of T tokens, keeping j (medians of %d)\n", reps);
    std::printf("  per-token snapshots: copy the state after each of the first T-1 tokens, restore the one kept\n");
    std::printf("  replay (chapter 16): the step runs on a scratch copy; the kept j tokens are replayed into the state\n");
    std::printf("  both: the step's own T-token conv + recurrence is common to both; only what each adds is timed\n\n");
    struct Size {
        const char* name;
        KdaDims d;
        int layers;  // KDA layers of the model
    };
    const Size sizes[] = {{"tiny K3", KdaDims{128, 4, 32, 4, -5.0f, 1e-5f}, 9}, {"K3", KdaDims{7168, 96, 128, 4, -5.0f, 1e-5f}, 69}};
    json out = json::array();
    for (const Size& z : sizes) {
        const KdaDims& d = z.d;
        const std::size_t P = d.width(), H = d.heads;
        test::Rng rng(16);
        const auto qc = rng.floats(P * d.conv, -0.3f, 0.3f), kc = rng.floats(P * d.conv, -0.3f, 0.3f), vc = rng.floats(P * d.conv, -0.3f, 0.3f);
        std::vector<float> A_log(d.head_dim, 0.0f), dt = rng.floats(P, -0.05f, 0.05f);
        for (std::size_t h = 0; h < H; ++h) A_log[h] = rng.uniform(-1.0f, 1.0f);
        KdaWeights w{};
        w.q_conv = qc.data(), w.k_conv = kc.data(), w.v_conv = vc.data(), w.A_log = A_log.data(), w.dt_bias = dt.data();
        KdaState live(d);
        const std::size_t state_bytes = live.bytes();
        std::printf("  %s: %zu heads x %zu x %zu, state %s per layer, %d KDA layers\n", z.name, H, d.head_dim, d.head_dim,
                    human_bytes(double(state_bytes)).c_str(), z.layers);
        std::printf("    %3s %3s  %23s  %23s  %19s  %19s  %12s\n", "T", "j", "snapshots: time", "replay: time", "snapshots: memory",
                    "replay: memory", "the step's");
        std::printf("    %3s %3s  %12s %10s  %12s %10s  %9s %9s  %9s %9s  %12s\n", "", "", "per layer", "all", "per layer", "all", "per layer", "all",
                    "per layer", "all", "recurrence");
        for (std::size_t T : {2, 5, 9}) {
            KdaInputs in;
            in.tokens = T;
            in.q = rng.floats(T * P, -1, 1), in.k = rng.floats(T * P, -1, 1), in.v = rng.floats(T * P, -1, 1);
            in.f = rng.floats(T * P, -1, 1), in.b = rng.floats(T * H, -1, 1);
            std::vector<KdaInputs> one(T);  // token t alone (the snapshot strategy steps token by token)
            for (std::size_t t = 0; t < T; ++t) {
                one[t].tokens = 1;
                for (auto [dst, src] : {std::pair{&one[t].q, &in.q}, {&one[t].k, &in.k}, {&one[t].v, &in.v}, {&one[t].f, &in.f}})
                    dst->assign(src->begin() + long(t * P), src->begin() + long((t + 1) * P));
                one[t].b.assign(in.b.begin() + long(t * H), in.b.begin() + long((t + 1) * H));
            }
            std::vector<KdaState> snaps(T - 1, live);
            KdaState scratch = live, work = live;
            // the bare sequential part of the step (what both strategies do anyway), for scale
            const double bare = median_seconds(reps, [&] {
                work = live;
                kda_advance(work, in, T, w, d);
            });
            std::vector<std::size_t> kept = {1, (T + 1) / 2, T};
            kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
            for (std::size_t j : kept) {
                // snapshots: T-1 copies of the state during the step, then the one after the last kept token
                // restored (none when every token is kept: the live state is already right)
                const double snap = median_seconds(reps, [&] {
                    for (std::size_t t = 0; t + 1 < T; ++t) snaps[t] = work;
                    if (j < T) work = snaps[j - 1];
                });
                // replay: one scratch copy for the step to run on, then the kept tokens replayed into the state
                const double replay = median_seconds(reps, [&] {
                    scratch = live;
                    work = live;
                    kda_advance(work, in, j, w, d);
                }) - median_seconds(reps, [&] { work = live; });  // less the reset of `work` this loop needs
                const double snap_mem = double(T - 1) * double(state_bytes);
                const double replay_mem = double(state_bytes) + double(T * (4 * P + H) * 4);
                // all layers: every layer's snapshots live until the step's logits are known; replay needs one
                // scratch state at a time and every layer's kept inputs
                const double replay_all = double(state_bytes) + double(T * (4 * P + H) * 4) * z.layers;
                std::printf("    %3zu %3zu  %9.3f ms %9.0f ms  %9.3f ms %9.0f ms  %9s %9s  %9s %9s  %9.3f ms\n", T, j, snap * 1e3,
                            snap * 1e3 * z.layers, replay * 1e3, replay * 1e3 * z.layers,
                            human_bytes(snap_mem).c_str(), human_bytes(snap_mem * z.layers).c_str(), human_bytes(replay_mem).c_str(),
                            human_bytes(replay_all).c_str(), bare * 1e3);
                out.push_back({{"size", z.name}, {"T", T}, {"kept", j}, {"bare_seconds", bare}, {"snapshot_extra_seconds", snap},
                               {"replay_extra_seconds", replay}, {"snapshot_bytes_per_layer", snap_mem},
                               {"replay_bytes_per_layer", replay_mem}, {"layers", z.layers}, {"state_bytes", state_bytes}});
            }
        }
    }
    std::printf("\n  (time: what the strategy adds to the step's own conv + recurrence (last column, per layer); memory:\n"
                "   what it holds beyond the session.\n"
                "   all = every KDA layer: snapshots live until the step's last logits are known; replay holds one\n"
                "   scratch state at a time and every layer's kept inputs; load average %s)\n", load_average().c_str());
    SafetensorsWriter::write_text_atomic("build/bench-speculate-rollback.json", out.dump(2) + "\n");
}

// ---------------------------------------------------------------------------------------------------
// compare: plain against speculative decoding over prompt sets, side by side
// ---------------------------------------------------------------------------------------------------
struct Tally {
    std::size_t steps = 0, yielded = 0, drafted = 0, accepted = 0;
    double trunk = 0, experts = 0, seconds = 0;
    std::map<std::size_t, std::size_t> fed;  // decode steps by tokens fed
    // the routed experts of verify steps (T > 1), per MoE layer: the union measured, and what it would be if
    // every token chose its K of E independently (E (1 - (1 - K/E)^T)), each less the K of one token
    double union_excess = 0, independent_excess = 0;
    void add(const Tally& o) {
        steps += o.steps, yielded += o.yielded, drafted += o.drafted, accepted += o.accepted;
        trunk += o.trunk, experts += o.experts, seconds += o.seconds;
        union_excess += o.union_excess, independent_excess += o.independent_excess;
        for (auto [t, n] : o.fed) fed[t] += n;
    }
};

using bench::Counters;
using bench::counters;

// One generation of exactly `gen` tokens (no stop tokens) with up to `draft` drafts per step (0: plain).
// The decode figures start after the first token (the prefill's, which costs the same either way).
Tally generate_once(Model& m, const Ids& prompt, std::size_t gen, std::size_t draft, bool adapt, const DraftOptions& lookup,
                    std::size_t context, Ids& ids, std::vector<float>& logits) {
    Tally t;
    Session s(m.config, context);
    Counters c0;
    double t0 = 0;
    bool first = true, prefill = true;
    const double E = m.config.num_experts, K = m.config.num_experts_per_token, moe = std::max(1, m.config.moe_layer_count());
    auto requested = [&] { return m.experts() ? double(m.experts()->experts_requested) : 0.0; };
    double requested0 = 0;
    auto on_token = [&](std::int64_t) {
        if (first) c0 = counters(m), t0 = bench::now_seconds(), first = false;
        return true;
    };
    logits.clear();
    const SamplingParams greedy{.temperature = 0};
    PromptLookup drafter{.max_draft = draft, .options = lookup, .adapt = adapt};
    ids = continue_speculative(
        m, s, prompt, gen, draft, 32, [&](std::span<const float> l, std::uint64_t pos) { return std::int64_t(sample(l, greedy, pos)); },
        drafter, on_token,
        [&](const SpeculativeStep& st) {
            const double unique = (requested() - requested0) / moe;  // this step's union of experts per MoE layer
            requested0 = requested();
            if (prefill) return void(prefill = false);  // the first step is the prefill: not a decode step
            ++t.steps, t.yielded += st.yielded, t.drafted += st.drafted, t.accepted += st.accepted, ++t.fed[st.fed];
            if (st.fed > 1 && m.experts())
                t.union_excess += unique - K, t.independent_excess += E * (1.0 - std::pow(1.0 - K / E, double(st.fed))) - K;
        },
        &logits);
    const Counters c1 = counters(m);
    t.seconds = bench::now_seconds() - t0, t.trunk = c1.trunk - c0.trunk, t.experts = c1.experts - c0.experts;
    return t;
}

Ids encode_prompt(const Tokenizer& tok, const std::string& text, bool chat) {
    std::vector<std::uint32_t> enc;
    if (chat) {
        const ChatMessage user{"user", text};
        ChatOptions co;
        co.thinking = false;
        enc = render_chat(tok, std::span<const ChatMessage>(&user, 1), co);
    } else {
        enc = tok.encode(text);
    }
    return Ids(enc.begin(), enc.end());
}

int bench_compare(const std::string& dir, std::vector<std::string> sets, const std::string& budget_arg, std::size_t gen,
                  const std::vector<std::size_t>& drafts, const std::string& length, const DraftOptions& lookup, bool chat, int reps,
                  std::string json_path) {
    if (sets.empty()) sets.push_back(std::string(KIMIK3_SOURCE_DIR) + "/bench/prompts/repetitive");
    const Tokenizer tok = Tokenizer::load(dir);
    // the prompts, per set
    std::vector<std::pair<std::string, std::vector<std::pair<std::string, Ids>>>> prompts;
    std::size_t longest = 0;
    for (const std::string& set : sets) {
        std::vector<std::filesystem::path> files;
        for (const auto& e : std::filesystem::directory_iterator(set))
            if (e.is_regular_file()) files.push_back(e.path());
        std::sort(files.begin(), files.end());
        if (files.empty()) fail(ErrorKind::usage, set + ": no prompt files");
        auto& list = prompts.emplace_back(std::filesystem::path(set).filename().string(), std::vector<std::pair<std::string, Ids>>{}).second;
        for (const auto& f : files) {
            std::ifstream in(f, std::ios::binary);
            std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            // A text file ends in a line break that belongs to the file, not to the prompt: these prompts
            // stop mid-sentence ("... the keeper"), and a model that sees "\n" there reads the paragraph
            // as finished and starts another. So the file's one final "\n" is dropped.
            if (!text.empty() && text.back() == '\n') text.pop_back();
            list.emplace_back(f.filename().string(), encode_prompt(tok, text, chat));
            longest = std::max(longest, list.back().second.size());
        }
    }
    const std::size_t context = longest + gen;
    ModelOptions probe_options;
    probe_options.plan.context = context;
    ModelOptions o;
    o.plan.context = context;
    {
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors mt = bind_tensors(ck, c);
        const Census census = take_census(ck, c, mt);
        o.budget = budget_arg == "floor" ? make_plan(c, census, 0, o.plan).floor : budget_arg == "resident" ? 0 : cli::parse_size(budget_arg);
    }
    Model m(dir, o);
    std::printf("kimik3-bench-speculate compare: %s at %s (%s), %zu tokens per prompt, greedy, prompt lookup %zu..%zu-grams; "
                "medians of %d; load average %s\n\n",
                dir.c_str(), budget_arg.c_str(), o.budget ? human_bytes(double(o.budget)).c_str() : "everything resident", gen, lookup.min_ngram,
                lookup.max_ngram, reps, load_average().c_str());
    // a mode: (draft length, adaptive?); (0, _) is plain decoding
    using Mode = std::pair<std::size_t, bool>;
    std::vector<Mode> modes = {{0, false}};
    for (std::size_t n : drafts) {
        if (length != "adaptive") modes.push_back({n, false});
        if (length != "fixed") modes.push_back({n, true});
    }
    auto key = [](Mode md) { return md.first == 0 ? std::string("0") : std::to_string(md.first) + (md.second ? " adaptive" : ""); };
    json out = {{"model", dir}, {"budget", budget_arg}, {"budget_bytes", o.budget}, {"gen", gen}, {"reps", reps},
                {"ngram", {lookup.min_ngram, lookup.max_ngram}}, {"sets", json::object()}};
    bool all_exact = true;
    for (const auto& [set, list] : prompts) {
        std::printf("prompt set %s (%zu prompts)\n", set.c_str(), list.size());
        std::printf("  %-10s %9s %10s %12s %14s %14s %12s %9s %9s\n", "mode", "accepted", "tok/step", "trunk/token", "experts/token",
                    "bytes/token", "s/token", "bytes", "time");
        // per rep: the set's totals per mode; the reported figure is the median over reps
        std::map<Mode, std::vector<Tally>> per_rep;
        for (int rep = 0; rep < reps; ++rep) {
            std::map<Mode, Tally> totals;
            for (const auto& [name, ids] : list) {
                Ids base_ids;
                std::vector<float> base_logits;
                for (const Mode& md : modes) {
                    Ids got;
                    std::vector<float> logits;
                    totals[md].add(generate_once(m, ids, gen, md.first, md.second, lookup, context, got, logits));
                    if (md.first == 0) base_ids = got, base_logits = logits;
                    else if (got != base_ids || logits.size() != base_logits.size() ||
                             std::memcmp(logits.data(), base_logits.data(), logits.size() * 4) != 0) {
                        std::printf("  MISMATCH: %s, --speculate %s differs from plain decoding\n", name.c_str(), key(md).c_str());
                        all_exact = false;
                    }
                }
            }
            for (auto& [n, t] : totals) per_rep[n].push_back(t);
        }
        const auto med = [&](Mode n, auto f) {
            std::vector<double> v;
            for (const Tally& t : per_rep[n]) v.push_back(f(t));
            return median(v);
        };
        auto bytes_per_token = [](const Tally& t) { return (t.trunk + t.experts) / double(t.yielded); };
        auto secs_per_token = [](const Tally& t) { return t.seconds / double(t.yielded); };
        json jset = json::object();
        const double plain_bytes = med(modes[0], bytes_per_token), plain_secs = med(modes[0], secs_per_token);
        for (const Mode& n : modes) {
            const Tally& t = per_rep[n].front();  // counts are the same every rep (deterministic); bytes and times: medians
            const double bpt = med(n, bytes_per_token), spt = med(n, secs_per_token);
            char mode[32];
            std::snprintf(mode, sizeof mode, n.first ? (n.second ? "adapt %zu" : "spec %zu") : "plain", n.first);
            // with everything resident nothing is read: no bytes ratio ("-" here, null in the JSON)
            const auto ratio = [](double a, double b) {
                char r[32];
                b > 0 ? std::snprintf(r, sizeof r, "%.2fx", a / b) : std::snprintf(r, sizeof r, "-");
                return std::string(r);
            };
            std::printf("  %-10s %8.1f%% %10.2f %12s %14s %14s %12.4f %9s %9s\n", mode, 100.0 * (t.drafted ? double(t.accepted) / double(t.drafted) : 0.0),
                        double(t.yielded) / double(t.steps), human_bytes(med(n, [](const Tally& x) { return x.trunk / double(x.yielded); })).c_str(),
                        human_bytes(med(n, [](const Tally& x) { return x.experts / double(x.yielded); })).c_str(), human_bytes(bpt).c_str(), spt,
                        ratio(bpt, plain_bytes).c_str(), ratio(spt, plain_secs).c_str());
            json fed = json::object();
            for (auto [k, c] : t.fed) fed[std::to_string(k)] = c;
            if (t.independent_excess > 0)
                std::printf("  %-10s routed experts of its verify steps: %.2f of the excess over one token's that independent routing gives\n",
                            "", t.union_excess / t.independent_excess);
            jset[key(n)] = {{"union_excess_vs_independent", t.independent_excess > 0 ? t.union_excess / t.independent_excess : 1.0},
                                       {"steps", t.steps}, {"yielded", t.yielded}, {"drafted", t.drafted}, {"accepted", t.accepted},
                                       {"acceptance", t.drafted ? double(t.accepted) / double(t.drafted) : 0.0},
                                       {"tokens_per_step", double(t.yielded) / double(t.steps)}, {"steps_by_tokens_fed", fed},
                                       {"bytes_per_token", bpt}, {"seconds_per_token", spt}, {"bytes_vs_plain", plain_bytes > 0 ? json(bpt / plain_bytes) : json(nullptr)},
                                       {"time_vs_plain", spt / plain_secs}};
        }
        out["sets"][set] = jset;
        std::printf("  (bytes and time: per generated token over the decode steps, against plain decoding in the same run)\n\n");
    }
    std::printf("every speculative run's ids and logits equal plain decoding's: %s\n", all_exact ? "yes" : "NO");
    if (json_path.empty()) json_path = "build/bench-speculate-compare.json";
    out["exact"] = all_exact;
    SafetensorsWriter::write_text_atomic(json_path, out.dump(2) + "\n");
    std::printf("wrote %s\n", json_path.c_str());
    return all_exact ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------------
// verify-cost: a verify step of T tokens at K3's widths, and the projection to the full K3
// ---------------------------------------------------------------------------------------------------
double dd_direct(const std::string& path) {
    const std::uint64_t bytes = std::filesystem::file_size(path);
    const double t0 = bench::now_seconds();
    const std::string cmd = "dd if='" + path + "' of=/dev/null bs=64M iflag=direct 2>/dev/null";
    if (std::system(cmd.c_str()) != 0) fail(ErrorKind::runtime, "dd failed on " + path);
    return double(bytes) / (bench::now_seconds() - t0);
}

struct StepCost {
    double seconds = 0, trunk = 0, experts = 0, unique = 0, replay = 0, head = 0;
    std::vector<double> layers;
};

int bench_verify_cost(const std::string& dir, const std::vector<std::size_t>& sizes, int reps, const std::string& acceptance_path,
                      std::string json_path) {
    const Config c = load_config(dir);
    std::size_t most = 1;
    for (std::size_t T : sizes) most = std::max(most, T);
    ModelOptions o;
    o.plan.context = 8 + 2 + std::uint64_t(reps) * sizes.size() + most;  // prompt, warm-up, one kept per step, the widest step
    {
        Checkpoint ck(dir);
        const ModelTensors mt = bind_tensors(ck, c);
        const Census census = take_census(ck, c, mt);
        o.budget = make_plan(c, census, 0, o.plan).floor / 100 * 102;
    }
    Model m(dir, o);
    const std::size_t V = std::size_t(c.vocab_size);
    const int moe_layers = c.moe_layer_count();
    std::printf("kimik3-bench-speculate verify-cost: %s, %d layers %s, %d experts per MoE layer, at the floor (%s); medians of %d\n",
                dir.c_str(), c.num_hidden_layers, c.schedule_string().c_str(), c.num_experts, human_bytes(double(o.budget)).c_str(), reps);
    std::vector<double> dd;
    for (const auto& sh : m.checkpoint.shards()) dd.push_back(dd_direct(sh->path()));
    const double disk = median(dd);
    std::printf("  the disk: dd iflag=direct of the shards %.0f MB/s\n\n", disk / 1e6);

    Session s(m.config, o.plan.context);
    test::Rng rng(2026);
    auto token = [&] { return std::int64_t(rng.bits() % V); };
    Ids prompt(8);
    for (auto& t : prompt) t = token();
    std::vector<float> logits(most * V);
    forward(logits.data(), m, s, prompt);
    std::int64_t last = token();
    for (int w = 0; w < 2; ++w) forward(logits.data(), m, s, {&last, 1});  // warm the ring's schedule
    TentativeKda tentative;
    std::map<std::size_t, StepCost> cost;
    for (std::size_t T : sizes) {
        std::vector<StepCost> runs;
        for (int r = 0; r < reps; ++r) {
            Ids step(T);
            step[0] = last;
            for (std::size_t i = 1; i < T; ++i) step[i] = token();  // drafts: all rejected (worst case for experts)
            const Counters c0 = counters(m);
            const std::uint64_t req0 = m.experts() ? m.experts()->experts_requested : 0;
            const double t0 = bench::now_seconds();
            StepTimes times;
            forward(logits.data(), m, s, step, {.rows = Rows::all, .tentative = T > 1 ? &tentative : nullptr, .times = &times});
            StepCost sc;
            sc.layers = times.layers, sc.head = times.head;
            const double t1 = bench::now_seconds();
            if (T > 1) keep_tokens(m, s, tentative, 1);
            sc.replay = bench::now_seconds() - t1;
            sc.seconds = bench::now_seconds() - t0;
            const Counters c1 = counters(m);
            sc.trunk = c1.trunk - c0.trunk, sc.experts = c1.experts - c0.experts;
            sc.unique = double((m.experts() ? m.experts()->experts_requested : 0) - req0) / std::max(1, moe_layers);
            runs.push_back(sc);
            last = argmax(logits.data(), V);
        }
        StepCost med;
        auto pick = [&](auto f) {
            std::vector<double> v;
            for (const StepCost& r : runs) v.push_back(f(r));
            return median(v);
        };
        med.seconds = pick([](const StepCost& r) { return r.seconds; });
        med.trunk = pick([](const StepCost& r) { return r.trunk; });
        med.experts = pick([](const StepCost& r) { return r.experts; });
        med.unique = pick([](const StepCost& r) { return r.unique; });
        med.replay = pick([](const StepCost& r) { return r.replay; });
        med.head = pick([](const StepCost& r) { return r.head; });
        for (std::size_t l = 0; l < runs[0].layers.size(); ++l) med.layers.push_back(pick([&](const StepCost& r) { return r.layers[l]; }));
        cost[T] = med;
    }
    const double expert_rate = m.experts() && m.experts()->stats().read_seconds > 0
                                   ? double(m.experts()->stats().bytes_read) / m.experts()->stats().read_seconds
                                   : disk;
    std::printf("  %3s %10s %11s %12s %16s %11s\n", "T", "step", "trunk read", "experts read", "experts / layer", "replay");
    for (const auto& [T, sc] : cost)
        std::printf("  %3zu %8.2f s %11s %12s %16.1f %8.1f ms\n", T, sc.seconds, human_bytes(sc.trunk).c_str(), human_bytes(sc.experts).c_str(),
                    sc.unique, sc.replay * 1e3);
    std::printf("  (T = 1: a one-token step; T > 1: a verify step of the last token + T-1 drafts, all rejected)\n");

    // the projection: the real 93-layer K3 at its floor, from the per-kind times of each step size
    const Config k3 = load_config(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json");
    const Census s3 = config_census(k3);
    const Plan p3 = make_plan(k3, s3, make_plan(k3, s3, 0, PlanOptions{}).floor, PlanOptions{});
    auto kind_of = [](const Config& cc, int l) {
        const bool moe = cc.layers[std::size_t(l)].ffn == FfnKind::MoE, mla = cc.layers[std::size_t(l)].attn == AttnKind::MLA;
        return !moe ? 0 : mla ? 2 : 1;  // dense(+KDA) / KDA + MoE / MLA + MoE
    };
    const double E = double(k3.num_experts), K = double(k3.num_experts_per_token);
    // neighbouring tokens share experts: with compare's JSON, its measured share of independent routing's
    // excess (the little model's router, applied to K3's); without it, independent routing (the costly end)
    double union_ratio = 1.0;
    if (!acceptance_path.empty()) {
        std::ifstream f(acceptance_path);
        if (!f) fail(ErrorKind::usage, acceptance_path + ": cannot open");
        double num = 0, den = 0;
        // a named json: a range-for over items() of json::parse(f)'s temporary would read it after its end
        const json acc = json::parse(f);
        for (const auto& [set, modes] : acc["sets"].items())
            for (const auto& [mode, r] : modes.items())
                if (r.contains("union_excess_vs_independent") && mode != "0") num += r["union_excess_vs_independent"].get<double>(), den += 1;
        if (den > 0) union_ratio = num / den;
    }
    std::printf("\n  K3's union of routed experts for T tokens: 16 + %.2f x (independent routing's 896 (1 - (1 - 16/896)^T) - 16)%s\n",
                union_ratio, acceptance_path.empty() ? " (independent: no --acceptance)" : " (the share measured by compare)");
    std::map<std::size_t, double> projected;
    std::printf("\n  projected full K3 at the floor (%d layers streamed%s), per step of T tokens:\n", k3.num_hidden_layers - p3.pinned_layers(),
                p3.lm_head_pinned ? ", lm_head pinned" : "");
    std::printf("  %3s %12s %22s %14s\n", "T", "step", "K3 experts / layer", "trunk read");
    for (const auto& [T, sc] : cost) {
        double per_kind[3] = {0, 0, 0}, count[3] = {0, 0, 0};
        for (int l = 0; l < c.num_hidden_layers; ++l) per_kind[kind_of(c, l)] += sc.layers[std::size_t(l)], count[kind_of(c, l)] += 1;
        for (int k = 0; k < 3; ++k) per_kind[k] /= std::max(1.0, count[k]);
        // the synth's own union (64 experts per layer) is in its measured time; K3 reads the difference more
        const double union_k3 = K + union_ratio * (E * (1.0 - std::pow(1.0 - K / E, double(T))) - K);
        const double extra_experts = std::max(0.0, union_k3 - sc.unique) * double(s3.expert_bytes) / expert_rate;
        double t = sc.head;
        for (int l = 0; l < k3.num_hidden_layers; ++l) {
            const int k = kind_of(k3, l);
            t += per_kind[k] + (k > 0 ? extra_experts : 0.0);
        }
        projected[T] = t;
        std::printf("  %3zu %10.1f s %22.1f %14s\n", T, t, union_k3, human_bytes(double(p3.trunk_read_per_token)).c_str());
    }
    const double floor_one = double(p3.trunk_read_per_token + p3.expert_read_per_token) / disk;
    std::printf("  one-token disk floor: %s / dd = %.1f s per token; the projected one-token step: %.1f s\n",
                human_bytes(double(p3.trunk_read_per_token + p3.expert_read_per_token)).c_str(), floor_one, projected.begin()->second);
    auto at = [&](double T) {  // linear between the measured step sizes
        auto hi = projected.lower_bound(std::size_t(std::ceil(T)));
        if (hi == projected.end()) return std::prev(hi)->second * T / double(std::prev(hi)->first);
        if (hi == projected.begin() || double(hi->first) == T) return hi->second;
        const auto lo = std::prev(hi);
        return lo->second + (hi->second - lo->second) * (T - double(lo->first)) / double(hi->first - lo->first);
    };
    std::printf("\n  projected s per generated token if every step verifies T tokens and yields a:\n  %3s", "T");
    for (double a : {1.0, 1.5, 2.0, 3.0, 4.0, 6.0}) std::printf("  a=%-6.1f", a);
    std::printf("\n");
    for (const auto& [T, t] : projected) {
        if (T == 1) continue;
        std::printf("  %3zu", T);
        for (double a : {1.0, 1.5, 2.0, 3.0, 4.0, 6.0}) a <= double(T) ? std::printf("  %7.1f ", t / a) : std::printf("  %7s ", "-");
        std::printf("\n");
    }
    json out = {{"checkpoint", dir}, {"disk_bytes_per_second", disk}, {"expert_fetch_bytes_per_second", expert_rate}, {"union_ratio", union_ratio},
                {"one_token_disk_floor_seconds", floor_one}, {"steps", json::object()}, {"projection", json::object()}};
    for (const auto& [T, sc] : cost)
        out["steps"][std::to_string(T)] = {{"seconds", sc.seconds}, {"trunk_bytes", sc.trunk}, {"expert_bytes", sc.experts},
                                           {"experts_per_layer", sc.unique}, {"replay_seconds", sc.replay}, {"layer_seconds", sc.layers},
                                           {"projected_k3_seconds", projected[T]}};
    // with the acceptance measured by `compare`: every decode step's size and yield, as the run had them
    if (!acceptance_path.empty()) {
        std::ifstream f(acceptance_path);
        if (!f) fail(ErrorKind::usage, acceptance_path + ": cannot open");
        const json acc = json::parse(f);
        std::printf("\n  with the acceptance measured in %s (%s):\n", acceptance_path.c_str(), acc["model"].get<std::string>().c_str());
        std::printf("  %-14s %6s %9s %10s %16s %12s\n", "set", "mode", "accepted", "tok/step", "K3 s per token", "vs floor");
        for (const auto& [set, modes] : acc["sets"].items())
            for (const auto& [mode, r] : modes.items()) {
                double secs = 0;
                for (const auto& [fed, n] : r["steps_by_tokens_fed"].items()) secs += n.get<double>() * at(std::stod(fed));
                const double per = secs / r["yielded"].get<double>();
                std::printf("  %-14s %6s %8.1f%% %10.2f %14.1f s %11.2fx\n", set.c_str(), mode == "0" ? "plain" : mode.c_str(),
                            100.0 * r["acceptance"].get<double>(), r["tokens_per_step"].get<double>(), per, per / floor_one);
                out["projection"][set][mode] = {{"seconds_per_token", per}, {"vs_one_token_floor", per / floor_one}};
            }
    }
    if (json_path.empty()) json_path = dir + "/bench-speculate.json";
    SafetensorsWriter::write_text_atomic(json_path, out.dump(2) + "\n");
    std::printf("\nwrote %s\n", json_path.c_str());
    return 0;
}

const char* kUsage =
    "usage: kimik3-bench-speculate rollback [--reps N]\n"
    "       kimik3-bench-speculate compare MODEL_DIR [--prompts DIR]... [--budget floor|resident|SIZE] [--gen N]\n"
    "                              [--draft 2,8,16,32] [--length adaptive|fixed|both] [--ngram MIN:MAX] [--chat] [--reps N]\n"
    "                              [--json FILE]\n"
    "       kimik3-bench-speculate verify-cost K3_SHAPED_DIR [--sizes 1,2,3,5,9,17,33] [--reps N] [--acceptance FILE]\n"
    "                              [--json FILE]\n"
    "  rollback     per-token KDA snapshots against scratch + replay, at tiny and K3 sizes\n"
    "  compare      plain against speculative decoding over prompt sets (a directory of text files each, a\n"
    "               file's final line break dropped; default bench/prompts/repetitive), side by side, at the\n"
    "               floor by default; --length: the drafter's length rule (fixed: always up to N, what the\n"
    "               engine does, the default; adaptive: chapter 16's PromptLookup with adapt; both: side by side)\n"
    "  verify-cost  a verify step of T tokens on a K3-shaped checkpoint at the floor, projected to the full K3\n"
    "               (with --acceptance: compare's JSON, the projected seconds per generated token)\n";

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (args.empty() || args[0] == "--help" || args[0] == "-h") return std::fputs(kUsage, args.empty() ? stderr : stdout), args.empty() ? 2 : 0;
    const std::string mode = args[0];
    std::string dir, budget = "floor", json_path, acceptance, length = "fixed";
    std::vector<std::string> sets;
    std::size_t gen = 64;
    std::vector<std::size_t> drafts = {2, 8, 16, 32}, sizes = {1, 2, 3, 5, 9, 17, 33};
    DraftOptions lookup;
    bool chat = false;
    int reps = 3;
    try {
        for (std::size_t i = 1; i < args.size(); ++i) {
            const std::string& a = args[i];
            auto value = [&]() -> std::string {
                if (i + 1 >= args.size()) fail(ErrorKind::usage, a + " needs a value");
                return args[++i];
            };
            if (a == "--prompts") sets.push_back(value());
            else if (a == "--budget") budget = value();
            else if (a == "--gen") gen = std::size_t(std::stoul(value()));
            else if (a == "--draft") drafts = parse_list(value());
            else if (a == "--length") {
                length = value();
                if (length != "adaptive" && length != "fixed" && length != "both")
                    fail(ErrorKind::usage, "--length wants adaptive, fixed or both, not '" + length + "'");
            }
            else if (a == "--sizes") sizes = parse_list(value());
            else if (a == "--ngram") {
                const std::string v = value();
                const std::size_t colon = v.find(':');
                if (colon == std::string::npos) fail(ErrorKind::usage, "--ngram wants MIN:MAX, e.g. 2:4");
                lookup.min_ngram = std::stoul(v.substr(0, colon)), lookup.max_ngram = std::stoul(v.substr(colon + 1));
            } else if (a == "--chat") chat = true;
            else if (a == "--reps") reps = std::max(1, std::stoi(value()));
            else if (a == "--json") json_path = value();
            else if (a == "--acceptance") acceptance = value();
            else if (!a.empty() && a[0] != '-' && dir.empty()) dir = a;
            else fail(ErrorKind::usage, "unexpected argument '" + a + "'");
        }
        if (mode == "rollback") return bench_rollback(reps), 0;
        if (dir.empty()) fail(ErrorKind::usage, mode + " needs a directory");
        if (mode == "compare") return bench_compare(dir, sets, budget, gen, drafts, length, lookup, chat, reps, json_path);
        if (mode == "verify-cost") {
            if (std::find(sizes.begin(), sizes.end(), std::size_t(1)) == sizes.end()) sizes.insert(sizes.begin(), 1);
            return bench_verify_cost(dir, sizes, reps, acceptance, json_path);
        }
        fail(ErrorKind::usage, "unknown mode '" + mode + "'");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kimik3-bench-speculate: %s\n\n%s", e.what(), kUsage);
        return 2;
    }
    return 0;
}
