// kimik3 chapter 16: speculative -- several tokens per read of the trunk, without changing a bit.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Below the whole trunk's size in memory, a decode step reads every non-resident trunk byte to make one
//   token. A forward step of T tokens reads the trunk once for all T (chapter 13: a prompt chunk). So
//   guess the next few tokens cheaply, run the last chosen token and the guesses through ONE step, read
//   every position's logits, and keep the guesses the model itself would have chosen: the trunk bytes
//   per generated token divide by the tokens a step yields. That is speculative decoding (Leviathan,
//   Kalman, Matias 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318), here with drafts taken
//   from the sequence itself, "prompt lookup" (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding):
//   no draft model, no extra weights. It is exact by construction: a step of T tokens gives each token
//   the bits it would get alone (chapter 13), and a guess is kept only when it IS the model's choice.
//   New since chapter 15: a drafter, verification of several positions in one step, and rolling the
//   session back over the rejected guesses (the MLA cache truncates; the KDA states are replayed).
//
// WHERE THIS SITS IN KIMI K3 (docs/kimi-k3.md 3.4, 3.5, 3.6)
//   At the floor budget (1.16 GB) one token reads 111 GB of trunk and up to 25.8 GB of routed experts
//   (16 of 896 per MoE layer, 92 layers). A verify step of N + 1 tokens reads the same 111 GB of trunk
//   once, and the union of the experts its tokens route to (at most (N + 1) x 16 per layer). If a step
//   yields a tokens on average, the trunk bytes per token divide by a; the expert bytes do not shrink,
//   and rejected guesses add their own experts: drafting pays when guesses are usually right, and when
//   the step is bound by reading the trunk (at or near the floor, not with the whole trunk resident).
//   The state to roll back: 69 KDA layers x (96 x 128 x 128 f32 S = 6.29 MB + 442 kB of conv history)
//   = 465 MB; 24 MLA layers x 576 floats per position (truncation is free).
//
// CONCEPTS
//   draft         up to N tokens guessed to follow the sequence (16.1).
//   verify step   one forward step over [last chosen token, draft 1 .. N] with every position's logits:
//                 row i holds the logits for the position after token i of the step.
//   acceptance    draft i + 1 is kept when the token chosen from row i equals it; the first mismatch ends
//                 the step and the token chosen there (the model's own) is kept instead. A step yields
//                 accepted + 1 tokens, so it never does worse than a one-token step in tokens.
//   rollback      the session must end as if only the kept tokens had been fed (16.3).
//   position draw chapter 15's rule: the token at position p is sampled with u(seed, p). A draft is then
//                 accepted exactly when it equals what the sampler draws there, so sampled text is exact too.
//
// THE DRAFTER (16.1, deterministic)
//   For n = max_ngram down to min_ngram (4 down to 2 by default): look for the last n tokens of the
//   sequence at every earlier start, the most recent first. The first n that has a match wins, and of its
//   matches the most recent one (nothing else can tie: one start per n). The draft is the tokens that
//   followed that match, up to N; when the match ends close to the end of the sequence the copy runs on
//   into the draft itself (an overlapping copy, as in LZ77), so a repeating cycle is proposed whole. No
//   match: no draft, and the step is an ordinary one-token step. 1-grams are left out by default: a single
//   common token predicts little, and every rejected guess costs its experts' reads.
//
// CONTRACT
//   1. Exactness: the ids, and the logits each id was chosen from, are bit-identical to chapter 15's
//      continue_session (one token per step) at every draft length, budget, thread count and prompt chunk,
//      greedy or sampled (tests 16.4). The drafter decides only how many steps it takes.
//   2. A step feeds at most N + 1 tokens and never reaches a position one-token decoding would not: the
//      draft is cut to the tokens still to generate, less one. A context that fits plain decoding fits.
//   3. After every step the session (token list, every KDA S and conv history, every MLA cache) is bit for
//      bit the session one-token steps make (test 16.3).
//   4. A stop token, or the max_new-th token, ends the turn even inside accepted drafts; the session then
//      holds the tokens before it, exactly as continue_session leaves it (the last token is not fed).
//
// ROLLBACK: REPLAY FROM KEPT INPUTS, NOT PER-TOKEN SNAPSHOTS (measured: make bench-speculate)
//   The KDA recurrence is sequential, so the state after the last accepted token exists only during the
//   verify step. Two ways to get it back:
//     per-token snapshots  copy every KDA state after each of the step's first N tokens, restore the one
//                          after the last kept token: N x 465 MB at K3 (3.7 GB at N = 8, three times the
//                          whole floor budget); time: N state copies per step.
//     replay (chosen)      chapter 13's tentative step runs each KDA layer on a scratch copy of its state
//                          (one layer's: 6.7 MB at K3) and keeps its tokens' projected inputs (q, k, v, the
//                          decay gate's f, beta's logits: 13.6 MB per token for K3's 69 layers); the
//                          session's own states never see a rejected token. Once the step's acceptance is
//                          known, keep_tokens (chapter 13) replays the kept tokens' conv and recurrence
//                          into each state (kda_advance, chapter 07): no weight is read again, the replay
//                          is the same code, so the same bits. Time: one recurrence per kept token and layer, a few ms at K3 size
//                          against a step that reads 111 GB.
//   Memory decides it: at the floor, the state snapshots would cost more than everything else resident.
//
// USES     chapter 13 (the decode loop, which verifies and rolls back: forward with every position's
//          logits, tentative KDA steps, keep_tokens), chapter 15 (sampling at a position, chat turns)
// RUN      make run-16      TEST   make test-16      BENCH   make bench-speculate
//
// SECTIONS
//   16.1 drafts from the sequence itself     16.2 verification in one step and 16.3 rollback (chapter 13's
//   decode loop runs them)     16.4 speculative generation: a session continued, a chat turn, the counts
// ====================================================================================================
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "13_model.hpp"
#include "15_generate.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 16.1 Drafts from the sequence itself (prompt lookup)
// ---------------------------------------------------------------------------------------------------
struct DraftOptions {
    std::size_t min_ngram = 2;  // the shortest suffix looked up (at least 1)
    std::size_t max_ngram = 4;  // the longest (tried first)
};

// Up to `max_draft` tokens guessed to follow `seq`, by the rule in the top block: the longest suffix
// (max_ngram .. min_ngram) that occurs earlier, its most recent occurrence, the tokens after it.
inline std::vector<std::int64_t> draft_from_context(std::span<const std::int64_t> seq, std::size_t max_draft,
                                                    const DraftOptions& o = {}) {
    if (o.min_ngram < 1 || o.max_ngram < o.min_ngram)
        fail(ErrorKind::usage, "draft_from_context: n-gram sizes " + std::to_string(o.min_ngram) + ".." + std::to_string(o.max_ngram) +
                                   " (want 1 <= min <= max)");
    std::vector<std::int64_t> draft;
    const std::size_t L = seq.size();
    if (max_draft == 0 || L < o.min_ngram + 1) return draft;  // an earlier match needs n + 1 tokens
    for (std::size_t n = std::min(o.max_ngram, L - 1); n >= o.min_ngram; --n) {
        const std::int64_t* suffix = seq.data() + (L - n);
        for (std::size_t i = L - n; i-- > 0;) {  // starts L-n-1 .. 0: the most recent first
            if (!std::equal(suffix, suffix + n, seq.data() + i)) continue;
            // the tokens after the match; past the end of seq the copy reads the draft itself
            for (std::size_t j = i + n; draft.size() < max_draft; ++j) draft.push_back(j < L ? seq[j] : draft[j - L]);
            return draft;
        }
    }
    return draft;
}

// How many to guess: the drafter object the engine uses. A rejected guess is not free: its position
// is computed and the experts it routes to are read. So there is a second rule, `adapt`: a length that
// follows the acceptance, between 1 and max_draft: max_draft first, doubled after a step whose drafts
// were all kept, (accepted + 1) after a step that missed. Measured against always drafting max_draft
// (kimik3-bench-speculate compare --length both, the first little K3 at its floor, repetitive prompts, 2..4-
// grams, medians of 3): at N = 8 it raises acceptance from 62% to 72% but lowers tokens per step from
// 1.63 to 1.57, so bytes per token rise (0.66x plain against 0.64x) and time is the same (0.72x against
// 0.73x); at N = 32, 1.62 tokens per step against 1.74 and 0.64x the bytes against 0.60x. At the floor
// the trunk read, paid once per step, outweighs the experts a wrong guess adds, so a long guess that is
// sometimes right beats a short one that is usually right.
// The engine therefore drafts max_draft (adapt = false); the rule stays for the comparison. Either way
// the output never depends on it (contract 1).
struct PromptLookup {
    std::size_t max_draft = 8;
    DraftOptions options{};
    bool adapt = false;        // true: the length follows the acceptance (see above); false: always max_draft
    std::size_t length = 0;    // the current cap; 0 until the first step (then max_draft)

    std::vector<std::int64_t> operator()(std::span<const std::int64_t> seq, std::size_t room) {
        if (length == 0) length = max_draft;
        return draft_from_context(seq, std::min(room, adapt ? length : max_draft), options);
    }
    template <class Step> void observe(const Step& st) {  // after every verify step (continue_speculative calls it)
        if (!adapt || st.drafted == 0) return;                 // nothing guessed: nothing learned
        length = st.accepted == st.drafted ? std::min(max_draft, 2 * st.drafted) : st.accepted + 1;
    }
};

// ---------------------------------------------------------------------------------------------------
// 16.2 Verification in one step, 16.3 rollback, and 16.4 the loop around them
// ---------------------------------------------------------------------------------------------------
// The verify step, the acceptance rule and the rollback are chapter 13's decode loop (13.4), which every
// generation in the repository runs: plain decoding is this chapter's speculation with no guesses. A
// verify step is forward(..., {.rows = Rows::all, .tentative = &t}) over [last, d_1 .. d_N]; the rollback
// is keep_tokens(model, s, t, accepted + 1) (13.3), the replay chosen in the top block. What this
// chapter adds is where the guesses come from (16.1) and the counts.
using SpeculativeStep = DecodeStep;  // what one forward step did (the prefill counts as one, nothing drafted)

// Totals over the decode steps (the prefill's one token is not counted: it costs what it always costs).
struct SpeculationStats {
    std::size_t steps = 0, drafted = 0, accepted = 0, yielded = 0;
    void add(const SpeculativeStep& st) { ++steps, drafted += st.drafted, accepted += st.accepted, yielded += st.yielded; }
    double acceptance() const { return drafted ? double(accepted) / double(drafted) : 0.0; }
    double tokens_per_step() const { return steps ? double(yielded) / double(steps) : 0.0; }
};

// Feeds `fresh` (prompt chunks of at most `chunk`), then generates up to max_new tokens: each step
// drafts up to max_draft tokens with draft(seq, max) (seq: every token so far, the last chosen one
// included), verifies them in one forward step and keeps what contract 1 says. That is decode (13.4)
// with a drafter:
//   choose(logits, position) -> id     the model's choice at a position (greedy, or chapter 15's sample)
//   on_token(id) -> bool               sees each token as it is kept; false ends the turn (a stop token)
//   on_step(const SpeculativeStep&)    after every forward step (the prefill first)
// A drafter with an observe(step) member (PromptLookup) is told every verify step's outcome.
// Returns the tokens in order (the stop token included, not fed: continue_session's contract).
template <class Choose, class Draft, class OnToken, class OnStep>
std::vector<std::int64_t> continue_speculative(Model& model, Session& s, const std::vector<std::int64_t>& fresh, std::size_t max_new,
                                               std::size_t max_draft, std::size_t chunk, Choose&& choose, Draft&& draft,
                                               OnToken&& on_token, OnStep&& on_step,
                                               std::vector<float>* logits_out = nullptr) {  // logits_out (drawn, V)
    bool prefill = true;
    return decode(model, s, fresh, {.max_new = max_new, .chunk = chunk}, choose,
                  {.token = on_token,
                   .step =
                       [&](const DecodeStep& st) {
                           if constexpr (requires { draft.observe(st); })
                               if (!prefill) draft.observe(st);
                           prefill = false;
                           on_step(st);
                       },
                   .draft = [&](std::span<const std::int64_t> seq, std::size_t room) { return draft(seq, std::min(room, max_draft)); },
                   .logits = logits_out});
}

// ---------------------------------------------------------------------------------------------------
// 16.4 Speculative generation with prompt lookup: a session continued, a chat turn
// ---------------------------------------------------------------------------------------------------
// continue_session (chapter 15) with up to max_draft drafts per step: the same tokens and logits.
template <class OnToken>
std::vector<std::int64_t> continue_session_speculative(Model& model, Session& s, const std::vector<std::int64_t>& fresh,
                                                       std::size_t max_new, const SamplingParams& sp, std::size_t chunk,
                                                       std::size_t max_draft, OnToken&& on_token, std::vector<float>* logits_out = nullptr,
                                                       SpeculationStats* stats = nullptr, const DraftOptions& lookup = {}) {
    bool prefill = true;
    PromptLookup drafter{.max_draft = max_draft, .options = lookup};
    return continue_speculative(
        model, s, fresh, max_new, max_draft, chunk, sampler(sp), drafter, on_token,
        [&](const SpeculativeStep& st) {
            if (stats && !prefill) stats->add(st);
            prefill = false;
        },
        logits_out);
}

// chat_turn (chapter 15) with speculation: the same reply, the same conversation state afterwards.
template <class OnText>
std::vector<std::int64_t> chat_turn_speculative(Model& model, Chat& chat, const Tokenizer& tok, const std::string& user, std::size_t max_new,
                                                const SamplingParams& sp, std::size_t max_draft, OnText&& on_text,
                                                SpeculationStats* stats = nullptr) {
    return chat_turn_with(chat, tok, user, max_new, on_text, [&](const std::vector<std::int64_t>& fresh, auto&& on_token) {
        return continue_session_speculative(model, chat.session, fresh, max_new, sp, kPrefillChunk, max_draft, on_token, nullptr, stats);
    });
}

}  // namespace kimik3
