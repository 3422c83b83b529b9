// Chapter 16 example: drafts from the sequence itself, then the little K3 (14 M parameters, trained on
// English) at its floor budget: one verify step of real prompt-lookup drafts, the rollback checked bit
// for bit, and speculative generation against one token per step, greedy and sampled: the same tokens
// and logits, fewer steps, fewer trunk reads.
//   make run-16      (measured times go to stderr; stdout is the transcript)
#include <chrono>
#include <cstdio>

#include "../chapters/16_speculative.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;
using Ids = std::vector<std::int64_t>;

static std::string join(std::span<const std::int64_t> ids) {
    std::string s;
    for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s;
}

static bool same_session(const Session& a, const Session& b) {
    bool same = a.tokens == b.tokens;
    for (std::size_t l = 0; l < a.kda.size(); ++l) {
        if (a.kda[l]) same = same && a.kda[l]->S == b.kda[l]->S && a.kda[l]->history == b.kda[l]->history;
        if (a.mla[l]) same = same && a.mla[l]->length() == b.mla[l]->length() &&
                             std::memcmp(a.mla[l]->data(), b.mla[l]->data(), a.mla[l]->length() * a.mla[l]->width() * 4) == 0;
    }
    return same;
}

int main() {
    try {
        std::printf("16.1 drafts from the sequence itself (the last 4..2 tokens, their most recent earlier match)\n");
        for (const Ids& seq : {Ids{3, 1, 2, 7, 4, 1, 2, 9, 3, 1, 2}, Ids{1, 2, 9, 1, 2, 8, 1, 2}, Ids{4, 5, 4, 5}, Ids{9, 3, 4, 9}}) {
            const Ids d = draft_from_context(seq, 4);
            std::printf("  %-26s -> %s\n", join(seq).c_str(), d.empty() ? "(no match: no draft)" : join(d).c_str());
        }
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        ModelOptions o;
        o.budget = kBudgetFloor;  // the smallest budget: every layer streamed, each step reads the trunk
        Model model(dir, o);
        const Tokenizer tok = Tokenizer::load(dir);
        const std::size_t V = std::size_t(model.config.vocab_size);
        const std::string text = "The United Nations system is the most important part of the United Nations. The United Nations system";
        const std::vector<std::uint32_t> enc = tok.encode(text);
        const Ids prompt(enc.begin(), enc.end());
        auto show = [&](const Ids& ids) { return tok.decode_text(std::vector<std::uint32_t>(ids.begin(), ids.end())); };
        const SamplingParams greedy{.temperature = 0};

        std::printf("\n16.2 one verify step on the little K3 (at its floor, %s)\n  prompt (%zu tokens): \"%s\"\n",
                    human_bytes(double(model.plan.budget)).c_str(), prompt.size(), text.c_str());
        Session plain(model.config, 128);
        std::vector<float> plain_logits;  // (48, V): row g = the logits token g was chosen from
        const Ids truth = continue_session(model, plain, prompt, 48, greedy, kPrefillChunk, [](std::int64_t) { return true; }, &plain_logits);
        // the first point of the plain run where the lookup's draft is right at least twice: truth[at] is
        // the last chosen token, draft guesses what follows it; every row the step could keep must lie
        // inside the plain run, to be compared with it
        std::size_t at = 0;
        Ids seq, draft;
        for (; at + 1 < truth.size(); ++at) {
            seq.assign(prompt.begin(), prompt.end()), seq.insert(seq.end(), truth.begin(), truth.begin() + long(at + 1));
            draft = draft_from_context(seq, 6);
            if (at + 1 + draft.size() >= truth.size()) continue;
            std::size_t right = 0;
            while (right < draft.size() && draft[right] == truth[at + 1 + right]) ++right;
            if (right >= 2) break;
        }
        if (at + 1 >= truth.size()) {
            std::printf("  the lookup's drafts are never right twice in a row in this run: nothing to verify\n");
            return 1;
        }
        Ids step = {truth[at]};
        step.insert(step.end(), draft.begin(), draft.end());
        Session s(model.config, 128);
        std::vector<float> last(V), rows(step.size() * V);
        forward(last.data(), model, s, {seq.data(), seq.size() - 1});  // the prompt and the tokens before truth[at]
        TentativeKda tentative;
        forward(rows.data(), model, s, step, {.rows = Rows::all, .tentative = &tentative});
        std::size_t kept = 1;  // the last chosen token, then every draft the model itself chooses
        while (kept < step.size() && argmax(&rows[(kept - 1) * V], V) == step[kept]) ++kept;
        std::printf("  one token per step continues: \"%s\"\n  after \"...%s\" the lookup drafts \"%s\"\n", show(truth).c_str(),
                    show(Ids(seq.end() - 4, seq.end())).c_str(), show(draft).c_str());
        std::printf("  fed [last, %zu drafts] in one step: %zu drafts accepted, the step yields %zu tokens\n", draft.size(), kept - 1, kept);
        const bool rows_same = std::memcmp(rows.data(), &plain_logits[(at + 1) * V], kept * V * 4) == 0;
        std::printf("  the kept rows' logits = those of one-token steps: %s\n", rows_same ? "bit-identical" : "DIFFERENT");

        std::printf("\n16.3 rollback to the %zu kept tokens (MLA caches truncate, KDA states replay kept inputs)\n", kept);
        keep_tokens(model, s, tentative, kept);
        Session ref(model.config, 128);
        forward(last.data(), model, ref, {seq.data(), seq.size() - 1});
        for (std::size_t i = 0; i < kept; ++i) forward(last.data(), model, ref, {&step[i], 1});
        std::printf("  the session = one that fed only those tokens, one per step: %s\n", same_session(s, ref) ? "bit-identical" : "DIFFERENT");

        std::printf("\n16.4 speculative generation: 32 tokens after the prompt, at the floor\n");
        for (const SamplingParams& sp : {greedy, SamplingParams{.temperature = 0.8f, .top_k = 40, .seed = 7}}) {
            std::printf("  %s\n", sp.temperature > 0 ? "sampled (T = 0.8, top-k 40, seed 7)" : "greedy");
            std::printf("    %-24s %5s %11s %7s %8s %12s  %s\n", "drafts per step", "steps", "tokens/step", "drafted", "accepted", "trunk reads", "output");
            Ids base;
            std::vector<float> base_logits;
            for (std::size_t n : {0u, 4u, 16u}) {
                Session run(model.config, 128);
                std::vector<float> l;
                SpeculationStats st;
                const auto t0 = std::chrono::steady_clock::now();
                const Ids ids = n == 0 ? continue_session(model, run, prompt, 32, sp, kPrefillChunk, [](std::int64_t) { return true; }, &l)
                                       : continue_session_speculative(model, run, prompt, 32, sp, kPrefillChunk, n, [](std::int64_t) { return true; }, &l, &st);
                const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                if (n == 0) base = ids, base_logits = l, st.steps = ids.size() - 1;
                const bool same = ids == base && l == base_logits;
                std::printf("    %-24s %5zu %11.2f %7zu %8zu %12s  %s\n", n ? ("prompt lookup, up to " + std::to_string(n)).c_str() : "none (one per step)",
                            st.steps, double(ids.size() - 1) / double(st.steps), st.drafted, st.accepted,
                            human_bytes(double(st.steps * model.plan.trunk_read_per_token)).c_str(),
                            n == 0 ? "(plain)" : same ? "ids and logits bit-identical" : "DIFFERENT");
                std::fprintf(stderr, "    (up to %zu drafts: measured %.3f s)\n", n, sec);
            }
            std::printf("    text: \"%s\"\n", show(base).c_str());
        }
        std::printf("  (trunk reads: decode steps x the plan's %s of streamed trunk per step)\n", human_bytes(double(model.plan.trunk_read_per_token)).c_str());
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
