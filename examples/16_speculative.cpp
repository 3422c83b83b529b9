// Chapter 16 example: drafts from the sequence itself, one verify step with a wrong draft in it, the
// rollback checked bit for bit, then speculative generation against one token per step on the tiny K3
// at its floor budget (greedy and sampled): the same tokens, fewer steps, fewer trunk reads.
//   make run-16      (measured bytes and times go to stderr; stdout is the transcript)
#include <chrono>
#include <cstdio>
#include <functional>

#include "../chapters/16_speculative.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

namespace {

using Ids = std::vector<std::int64_t>;

std::string join(std::span<const std::int64_t> ids) {
    std::string s;
    for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s;
}

bool same_session(const Session& a, const Session& b) {
    if (a.tokens != b.tokens) return false;
    for (std::size_t l = 0; l < a.kda.size(); ++l) {
        if (a.kda[l] && (std::memcmp(a.kda[l]->S.data(), b.kda[l]->S.data(), a.kda[l]->S.size() * 4) != 0 ||
                         std::memcmp(a.kda[l]->history.data(), b.kda[l]->history.data(), a.kda[l]->history.size() * 4) != 0))
            return false;
        if (a.mla[l] && (a.mla[l]->length() != b.mla[l]->length() ||
                         std::memcmp(a.mla[l]->data(), b.mla[l]->data(), a.mla[l]->length() * a.mla[l]->width() * 4) != 0))
            return false;
    }
    return true;
}

}  // namespace

int main() {
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
        std::printf("16.1 drafts from the sequence itself (the last 4..2 tokens, their most recent earlier match)\n");
        for (const Ids& seq : {Ids{3, 1, 2, 7, 4, 1, 2, 9, 3, 1, 2}, Ids{1, 2, 9, 1, 2, 8, 1, 2}, Ids{4, 5, 4, 5}, Ids{9, 3, 4, 9}}) {
            const Ids d = draft_from_context(seq, 4);
            std::printf("  %-26s -> %s\n", join(seq).c_str(), d.empty() ? "(no match: no draft)" : join(d).c_str());
        }

        ModelOptions probe_options;
        Model probe(dir, probe_options);
        ModelOptions o;
        o.budget = make_plan(probe.config, probe.census, 0, o.plan).floor;  // the smallest budget: every layer streamed
        Model model(dir, o);
        const std::size_t V = std::size_t(model.config.vocab_size);
        const Ids prompt = to_i64(SafetensorsFile(dir + "/reference/model.safetensors").read("prompt_ids"));
        const SamplingParams greedy{.temperature = 0};

        // the plain continuation, one token per step
        Session plain(model.config, 64);
        std::vector<float> plain_logits;
        const Ids truth = continue_session(model, plain, prompt, 8, greedy, 32, [](std::int64_t) { return true; }, &plain_logits);
        std::printf("\n16.2 one verify step on the tiny K3 (at its floor, %s)\n", human_bytes(double(o.budget)).c_str());
        std::printf("  one token per step after the %zu-token prompt: %s\n", prompt.size(), join(truth).c_str());
        // verify [truth[0], truth[1], truth[2], wrong, truth[4]] in one step
        Session s(model.config, 64);
        std::vector<float> last(V);
        forward(last.data(), model, s, prompt);
        const Ids step = {truth[0], truth[1], truth[2], (truth[3] + 1) % std::int64_t(V), truth[4]};
        std::vector<float> rows(step.size() * V);
        TentativeKda tentative;
        forward(rows.data(), model, s, step, {.rows = Rows::all, .tentative = &tentative});
        std::printf("  fed in one step: %s (the 4th is a wrong draft)\n  the model's choice after each:", join(step).c_str());
        std::size_t kept = 0;
        for (std::size_t i = 0; i < step.size(); ++i) {
            const std::int64_t y = argmax(&rows[i * V], V);
            std::printf(" %lld", (long long)y);
            if (kept == 0 && (i + 1 == step.size() || y != step[i + 1])) kept = i + 1;
        }
        std::printf("\n  accepted %zu drafts; the step yields %zu tokens (the accepted ones and the model's own)\n", kept - 1, kept);
        const bool rows_same = std::memcmp(rows.data(), &plain_logits[V], kept * V * 4) == 0;  // rows of the kept tokens
        std::printf("  the step's logits rows = those of one-token steps: %s\n", rows_same ? "bit-identical" : "DIFFERENT");

        std::printf("\n16.3 rollback to the %zu kept tokens (MLA caches truncate, KDA states replay kept inputs)\n", kept);
        keep_tokens(model, s, tentative, kept);
        Session ref(model.config, 64);
        forward(last.data(), model, ref, prompt);
        for (std::size_t i = 0; i < kept; ++i) forward(last.data(), model, ref, {&step[i], 1});
        std::printf("  the session = one that fed only those tokens, one per step: %s\n", same_session(s, ref) ? "bit-identical" : "DIFFERENT");

        std::printf("\n16.4 speculative generation: 20 tokens after the prompt, --speculate 4, at the floor\n");
        const std::uint64_t trunk_per_step = model.plan.trunk_read_per_token;
        using Drafter = std::function<Ids(std::span<const std::int64_t>, std::size_t)>;
        for (const SamplingParams& sp : {greedy, SamplingParams{.temperature = 1.0f, .top_k = 40, .seed = 2026}}) {
            std::printf("  %s\n", sp.temperature > 0 ? "sampled (T = 1.0, top-k 40, seed 2026)" : "greedy");
            std::printf("    %-34s %5s %11s %7s %8s %12s  %s\n", "drafter", "steps", "tokens/step", "drafted", "accepted", "trunk reads", "output");
            Session first(model.config, 64);
            std::vector<float> base_logits;
            const Ids base = continue_session(model, first, prompt, 20, sp, 32, [](std::int64_t) { return true; }, &base_logits);
            // an oracle knows the plain run's tokens: the most a drafter could achieve (wrong_every: every k-th wrong)
            auto oracle = [&](std::size_t wrong_every) -> Drafter {
                return [&, wrong_every](std::span<const std::int64_t> seq, std::size_t n) {
                    Ids d;
                    for (std::size_t g = seq.size() - prompt.size(); d.size() < n && g < base.size(); ++g)
                        d.push_back(wrong_every && g % wrong_every == wrong_every - 1 ? (base[g] + 1) % std::int64_t(V) : base[g]);
                    return d;
                };
            };
            const std::pair<const char*, Drafter> drafters[] = {
                {"none (one token per step)", nullptr},
                {"prompt lookup (4..2-grams)", [](std::span<const std::int64_t> q, std::size_t n) { return draft_from_context(q, n); }},
                {"prompt lookup with 1-grams", [](std::span<const std::int64_t> q, std::size_t n) { return draft_from_context(q, n, {.min_ngram = 1}); }},
                {"oracle: the plain run's tokens", oracle(0)},
                {"oracle, every 3rd token wrong", oracle(3)}};
            for (const auto& [name, drafter] : drafters) {
                Session run(model.config, 64);
                std::vector<float> l;
                SpeculationStats st;
                bool prefill = true;
                const auto t0 = std::chrono::steady_clock::now();
                const std::uint64_t bytes0 = model.trunk().ring_stats().bytes;
                const Ids ids = !drafter ? continue_session(model, run, prompt, 20, sp, 32, [](std::int64_t) { return true; }, &l)
                                         : continue_speculative(
                                               model, run, prompt, 20, 4, 32,
                                               [&](std::span<const float> x, std::uint64_t pos) { return std::int64_t(sample(x, sp, pos)); },
                                               drafter, [](std::int64_t) { return true; },
                                               [&](const SpeculativeStep& step) {
                                                   if (!prefill) st.add(step);
                                                   prefill = false;
                                               },
                                               &l);
                const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                const std::size_t steps = drafter ? st.steps : ids.size() - 1;
                const bool same = ids == base && l.size() == base_logits.size() && std::memcmp(l.data(), base_logits.data(), l.size() * 4) == 0;
                std::printf("    %-34s %5zu %11.2f %7zu %8zu %12s  %s\n", name, steps, double(ids.size() - 1) / double(steps), st.drafted,
                            st.accepted, human_bytes(double(steps * trunk_per_step)).c_str(),
                            !drafter ? "(plain)" : same ? "ids and logits bit-identical" : "DIFFERENT");
                std::fprintf(stderr, "    (%s: measured %.3f s, %s streamed by the ring)\n", name, sec,
                             human_bytes(double(model.trunk().ring_stats().bytes - bytes0)).c_str());
            }
        }
        std::printf("  (trunk reads: decode steps x the plan's %s of streamed trunk per step. The tiny K3's random\n"
                    "   weights rarely repeat themselves, so prompt lookup finds little here; a trained model on text\n"
                    "   that repeats (code, lists, quoting) drafts far more: make bench-speculate measures it)\n",
                    human_bytes(double(trunk_per_step)).c_str());
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
