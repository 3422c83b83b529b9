// Tests for chapter 16: the drafter's rule worked by hand, rollback proved bit for bit against a
// session that never saw the rejected tokens, and speculation against plain decoding: the same ids and
// the same logits bits at every draft length, budget, thread count and prompt chunk, greedy and sampled.
// The tiny K3 has random weights, so its own text drafts little; the tests also draft with an oracle
// (the plain run's own tokens, some of them deliberately wrong) so that every path (all accepted, a
// mismatch at each place, a stop token inside accepted drafts, the last token) is taken.
#include "../chapters/16_speculative.hpp"

#include "fixture.hpp"

using namespace kimik3;

namespace {

const std::string kTiny = test::source_path("fixtures/tiny-k3");

const std::vector<std::int64_t>& prompt() {
    static const std::vector<std::int64_t> p = test::Fixture("fixtures/tiny-k3/reference/model.safetensors").i64("prompt_ids");
    return p;
}

using Ids = std::vector<std::int64_t>;
using Draft = std::function<Ids(std::span<const std::int64_t>, std::size_t)>;
using OnToken = std::function<bool(std::int64_t)>;

struct Run {
    Session session;
    Ids ids;
    std::vector<float> logits;  // (ids, V)
    SpeculationStats stats;
    std::vector<SpeculativeStep> steps;
    Run(const Config& c, std::size_t context) : session(c, context) {}
};

const OnToken kNoStop = [](std::int64_t) { return true; };

Run plain(Model& m, const Ids& fresh, std::size_t max_new, const SamplingParams& sp, std::size_t chunk = 32, std::size_t context = 64,
          const OnToken& on_token = kNoStop) {
    Run r(m.config, context);
    r.ids = continue_session(m, r.session, fresh, max_new, sp, chunk, on_token, &r.logits);
    return r;
}

Run speculative(Model& m, const Ids& fresh, std::size_t max_new, const SamplingParams& sp, std::size_t max_draft, const Draft& draft,
                std::size_t chunk = 32, std::size_t context = 64, const OnToken& on_token = kNoStop) {
    Run r(m.config, context);
    r.ids = continue_speculative(
        m, r.session, fresh, max_new, max_draft, chunk,
        [&](std::span<const float> l, std::uint64_t pos) { return std::int64_t(sample(l, sp, pos)); }, draft, on_token,
        [&](const SpeculativeStep& st) {
            if (!r.steps.empty()) r.stats.add(st);
            r.steps.push_back(st);
        },
        &r.logits);
    return r;
}

// Proposes the tokens a plain run produced (truth), from the position the sequence has reached; with
// wrong_every = k, every k-th generated token is proposed wrong (truth + 1 mod V).
Draft oracle(const Ids& truth, std::size_t prompt_len, std::size_t wrong_every = 0) {
    return [=](std::span<const std::int64_t> seq, std::size_t n) {
        Ids d;
        for (std::size_t g = seq.size() - prompt_len; d.size() < n && g < truth.size(); ++g)
            d.push_back(wrong_every && g % wrong_every == wrong_every - 1 ? (truth[g] + 1) % 512 : truth[g]);
        return d;
    };
}

const Draft kLookup1 = [](std::span<const std::int64_t> seq, std::size_t n) { return draft_from_context(seq, n, {.min_ngram = 1}); };

void check_same_session(const Session& got, const Session& want) {
    CHECK(got.tokens == want.tokens);
    REQUIRE(got.kda.size() == want.kda.size());
    for (std::size_t l = 0; l < got.kda.size(); ++l) {
        CAPTURE(l);
        if (want.kda[l]) {
            CHECK_BITS_EQ(got.kda[l]->S, want.kda[l]->S);
            CHECK_BITS_EQ(got.kda[l]->history, want.kda[l]->history);
        } else {
            const MlaCache &a = *got.mla[l], &b = *want.mla[l];
            REQUIRE(a.length() == b.length());
            CHECK_BITS_EQ(std::span<const float>(a.data(), a.length() * a.width()), std::span<const float>(b.data(), b.length() * b.width()));
        }
    }
}

void check_same_run(const Run& got, const Run& want) {
    CHECK(got.ids == want.ids);
    CHECK_BITS_EQ(got.logits, want.logits);
    check_same_session(got.session, want.session);
}

const SamplingParams kGreedy{.temperature = 0};

}  // namespace

// ---- 16.1 the drafter --------------------------------------------------------------------------------
TEST_CASE("16.1 the drafter worked by hand: the longest suffix, its most recent match, the tokens after it") {
    auto d = [](const Ids& seq, std::size_t n, DraftOptions o = {}) { return draft_from_context(seq, n, o); };
    // 5 6 7 8 5 6 7: no earlier [8 5 6 7]; [5 6 7] at 0 -> the tokens after it, 8 5 6 7
    CHECK(d({5, 6, 7, 8, 5, 6, 7}, 4) == Ids{8, 5, 6, 7});
    CHECK(d({5, 6, 7, 8, 5, 6, 7}, 2) == Ids{8, 5});
    // 1 2 9 1 2 8 1 2: [1 2] occurs at 0 and 3; the most recent (3) wins -> 8, then the copy runs on
    // past the end into the draft itself: 1 2 (seq[6..7]) then 8 (draft[0])
    CHECK(d({1, 2, 9, 1, 2, 8, 1, 2}, 4) == Ids{8, 1, 2, 8});
    // 3 1 2 7 4 1 2 9 3 1 2: [3 1 2] at 0 beats the more recent [1 2] at 5 (longer first) -> 7 4 1 2
    CHECK(d({3, 1, 2, 7, 4, 1, 2, 9, 3, 1, 2}, 4) == Ids{7, 4, 1, 2});
    // a cycle is proposed whole: 4 5 4 5 -> [4 5] at 0 -> 4 5, then 4 5 4 5 from the draft
    CHECK(d({4, 5, 4, 5}, 6) == Ids{4, 5, 4, 5, 4, 5});
    CHECK(d({7, 7, 7}, 3) == Ids{7, 7, 7});  // [7 7] at 0 -> 7, then the draft
    // no 2-gram repeats: nothing; with 1-grams allowed, the most recent earlier 9 -> 3 9 3
    CHECK(d({9, 3, 4, 9}, 3).empty());
    CHECK(d({9, 3, 4, 9}, 3, {.min_ngram = 1}) == Ids{3, 4, 9});
    // max_ngram limits the suffix: with max 2, [1 2] at 5 (the most recent) -> 9 3 1 2
    CHECK(d({3, 1, 2, 7, 4, 1, 2, 9, 3, 1, 2}, 4, {.min_ngram = 2, .max_ngram = 2}) == Ids{9, 3, 1, 2});
    CHECK(d({1, 2, 1, 2}, 0).empty());
    CHECK(d({1}, 4).empty());
    CHECK(d({}, 4).empty());
    test::expect_error([&] { d({1, 2}, 1, {.min_ngram = 0}); }, ErrorKind::usage, {"n-gram sizes 0..4"});
    test::expect_error([&] { d({1, 2}, 1, {.min_ngram = 3, .max_ngram = 2}); }, ErrorKind::usage, {"want 1 <= min <= max"});
}

TEST_CASE("16.1 PromptLookup: fixed by default; adapting, max first, doubled when all kept, accepted + 1 after a miss") {
    PromptLookup p{.max_draft = 8, .adapt = true};
    const Ids cycle = {4, 5, 4, 5, 4, 5};  // a cycle: the lookup can always fill any length
    auto step = [](std::size_t drafted, std::size_t accepted) { return SpeculativeStep{drafted + 1, drafted, accepted, accepted + 1}; };
    CHECK(p(cycle, 32).size() == 8);       // starts at max_draft
    CHECK(p(cycle, 3).size() == 3);        // never more than the room the engine gives
    p.observe(step(8, 2));                 // a miss after 2: the next draft is 3 long
    CHECK(p(cycle, 32).size() == 3);
    p.observe(step(3, 3));                 // all kept: doubled
    CHECK(p(cycle, 32).size() == 6);
    p.observe(step(6, 6));                 // doubled, capped at max_draft
    CHECK(p(cycle, 32).size() == 8);
    p.observe(step(8, 0));                 // nothing kept: one guess
    CHECK(p(cycle, 32).size() == 1);
    p.observe(step(0, 0));                 // a step with no draft teaches nothing
    CHECK(p(cycle, 32).size() == 1);
    PromptLookup fixed{.max_draft = 8};
    fixed.observe(step(8, 0));
    CHECK(fixed(cycle, 32).size() == 8);   // the fixed rule: always up to max_draft
}

// ---- 16.2 / 16.3 one tentative step and its rollback ----------------------------------------------------
TEST_CASE("16.3 a tentative step gives ordinary logits, and kept to n tokens the session is one that fed n tokens, bit for bit") {
    Model m(kTiny, ModelOptions{});
    const std::size_t V = 512;
    const Ids step = {17, 301, 44, 17, 301, 9};  // any tokens: the step's logits do not depend on acceptance
    for (std::size_t n = 0; n <= step.size(); ++n) {
        CAPTURE(n);
        Session a(m.config, 64), b(m.config, 64);
        std::vector<float> last(V), la(step.size() * V), lb(step.size() * V);
        forward(last.data(), m, a, prompt());
        forward(last.data(), m, b, prompt());
        TentativeKda t;
        forward(la.data(), m, a, step, {.rows = Rows::all, .tentative = &t});
        CHECK(t.start == prompt().size());
        CHECK(t.tokens == step.size());
        keep_tokens(m, a, t, n);
        for (std::size_t i = 0; i < n; ++i) forward(&lb[i * V], m, b, {&step[i], 1}, {.rows = Rows::all});  // one-token steps
        check_same_session(a, b);
        CHECK_BITS_EQ(std::span<const float>(la.data(), n * V), std::span<const float>(lb.data(), n * V));
        // both sessions go on to the same next logits
        const std::int64_t next = 200;
        forward(last.data(), m, a, {&next, 1});
        std::vector<float> last_b(V);
        forward(last_b.data(), m, b, {&next, 1});
        CHECK_BITS_EQ(last, last_b);
    }
}

TEST_CASE("16.3 keep_tokens refuses a step it did not follow, or more tokens than the step fed") {
    Model m(kTiny, ModelOptions{});
    Session s(m.config, 64);
    std::vector<float> l(4 * 512);
    const Ids step = {1, 2, 3, 4};
    TentativeKda t;
    forward(l.data(), m, s, {step.data(), 4}, {.rows = Rows::all, .tentative = &t});
    test::expect_error([&] { keep_tokens(m, s, t, 5); }, ErrorKind::usage, {"the tentative step fed 4 tokens from 0; keep 5"});
    keep_tokens(m, s, t, 2);
    test::expect_error([&] { keep_tokens(m, s, t, 1); }, ErrorKind::usage, {"the session is at position 2", "rolled back once"});
}

TEST_CASE("16.2 verification: right drafts are all kept, a wrong one ends the step with the model's own token") {
    Model m(kTiny, ModelOptions{});
    const Run base = plain(m, prompt(), 24, kGreedy);
    // all right, 4 drafts per step: the first token comes from the prefill, then every step yields 5
    const Run right = speculative(m, prompt(), 24, kGreedy, 4, oracle(base.ids, prompt().size()));
    check_same_run(right, base);
    REQUIRE(right.steps.size() >= 2);
    CHECK(right.steps[0].fed == prompt().size());
    CHECK(right.steps[1].fed == 5);
    CHECK(right.steps[1].accepted == 4);
    CHECK(right.steps[1].yielded == 5);
    // 23 tokens after the first: 4 steps of 5, then room for 2 drafts (contract 2: the last token is never fed)
    CHECK(right.stats.steps == 5);
    CHECK(right.stats.yielded == 23);
    CHECK(right.stats.accepted == 4 * 4 + 2);
    // every 3rd generated token proposed wrong: a step of drafts for tokens g..g+3 keeps those before the
    // first wrong one, then the model's token there; worked out: tokens 1, 2 right, 3... (index 2 wrong)
    const Run wrong = speculative(m, prompt(), 24, kGreedy, 4, oracle(base.ids, prompt().size(), 3));
    check_same_run(wrong, base);
    // step 1 starts after token 0: drafts for tokens 1, 2, 3, 4; token 2 (2 % 3 == 2) is wrong ->
    // accepted 1 (token 1), yielded 2 (token 1 and the model's token 2)
    REQUIRE(wrong.steps.size() >= 3);
    CHECK(wrong.steps[1].drafted == 4);
    CHECK(wrong.steps[1].accepted == 1);
    CHECK(wrong.steps[1].yielded == 2);
    // step 2 starts after token 2: drafts for 3, 4, 5, 6; 5 is wrong -> accepted 2, yielded 3
    CHECK(wrong.steps[2].accepted == 2);
    CHECK(wrong.steps[2].yielded == 3);
    // nothing right: each step yields one token, the model's
    const Draft garbage = [&](std::span<const std::int64_t> seq, std::size_t n) {
        Ids d;
        const std::size_t g = seq.size() - prompt().size();
        for (std::size_t k = 0; k < n && g + k < base.ids.size(); ++k) d.push_back((base.ids[g + k] + 7) % 512);
        return d;
    };
    const Run none = speculative(m, prompt(), 24, kGreedy, 3, garbage);
    check_same_run(none, base);
    CHECK(none.stats.accepted == 0);
    CHECK(none.stats.steps == 23);
    CHECK(none.stats.drafted > 0);
}

// ---- 16.4 exactness: greedy ----------------------------------------------------------------------------
TEST_CASE("16.4 greedy speculation = plain decoding, ids and logits bit for bit, at every draft length 1-8") {
    Model m(kTiny, ModelOptions{});
    const Run base = plain(m, prompt(), 28, kGreedy);
    std::size_t lookup_drafted = 0;
    for (std::size_t n = 1; n <= 8; ++n) {
        CAPTURE(n);
        std::vector<std::pair<const char*, Draft>> drafters = {{"oracle", oracle(base.ids, prompt().size())},
                                                               {"oracle, every 3rd wrong", oracle(base.ids, prompt().size(), 3)}};
        if (n == 1 || n == 4 || n == 8) drafters.push_back({"lookup with 1-grams", kLookup1});  // (drafts little here: slow, few)
        for (const auto& named : drafters) {  // (no structured binding: clang 14 cannot capture one in CAPTURE)
            const char* const name = named.first;
            const Draft& draft = named.second;
            CAPTURE(name);
            const Run r = speculative(m, prompt(), 28, kGreedy, n, draft);
            check_same_run(r, base);
            CHECK(r.stats.yielded == 27);
            if (std::string(name) == "lookup with 1-grams") lookup_drafted += r.stats.drafted;
        }
    }
    CHECK(lookup_drafted > 0);  // the prompt lookup did draft (with 1-grams, on this random model's text)
}

TEST_CASE("16.4 greedy speculation = plain decoding at every budget, thread count and prompt chunk") {
    Model probe(kTiny, ModelOptions{});
    const Run base = plain(probe, prompt(), 12, kGreedy);  // everything resident, 2 threads, one prompt chunk
    ModelOptions floor;
    floor.budget = make_plan(probe.config, probe.census, 0, floor.plan).floor;
    ModelOptions one_slot = floor;
    one_slot.plan.ring_slots = 1, one_slot.plan.chunk_bytes = 4096, one_slot.plan.expert_slots = 1;
    one_slot.budget = make_plan(probe.config, probe.census, 0, one_slot.plan).floor;
    ModelOptions middle = floor;
    middle.budget = floor.budget + 1'500'000;
    struct Variant {
        const char* what;
        ModelOptions o;
        std::size_t chunk;
        int threads;
    };
    const Variant variants[] = {{"at the floor", floor, 32, 2},
                                {"one ring slot, one expert slot", one_slot, 32, 2},
                                {"a middle budget", middle, 32, 2},
                                {"all resident, one thread", ModelOptions{}, 32, 1},
                                {"at the floor, one thread, prompt in chunks of 5", floor, 5, 1},
                                {"all resident, prompt one token at a time", ModelOptions{}, 1, 2}};
    for (const Variant& v : variants) {
        CAPTURE(v.what);
        set_threads(v.threads);
        Model m(kTiny, v.o);
        // (at the floor a step streams every layer: a few runs per variant keep this test short)
        for (std::size_t n : {2, 8}) {
            CAPTURE(n);
            check_same_run(speculative(m, prompt(), 12, kGreedy, n, oracle(base.ids, prompt().size(), 3), v.chunk), base);
        }
        check_same_run(speculative(m, prompt(), 12, kGreedy, 3, oracle(base.ids, prompt().size(), 2), v.chunk), base);
    }
    set_threads(2);
}

// ---- 16.4 exactness: sampling --------------------------------------------------------------------------
TEST_CASE("16.4 sampled speculation draws exactly what plain sampling draws under the same seed") {
    Model m(kTiny, ModelOptions{});
    for (const SamplingParams& sp : {SamplingParams{.temperature = 1.0f, .seed = 7}, SamplingParams{.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .seed = 2026}}) {
        CAPTURE(sp.seed);
        const Run base = plain(m, prompt(), 24, sp);
        const Run greedy_run = plain(m, prompt(), 24, kGreedy);
        CHECK(base.ids != greedy_run.ids);  // it did sample
        for (std::size_t n : {1, 4, 8}) {
            CAPTURE(n);
            check_same_run(speculative(m, prompt(), 24, sp, n, oracle(base.ids, prompt().size(), 3)), base);
            check_same_run(speculative(m, prompt(), 24, sp, n, kLookup1), base);
            // drafts of the greedy text: accepted only where the sampler drew the greedy token
            check_same_run(speculative(m, prompt(), 24, sp, n, oracle(greedy_run.ids, prompt().size())), base);
        }
        // the oracle of the sampled text is always right: a position's draw does not depend on the step
        const Run all = speculative(m, prompt(), 24, sp, 4, oracle(base.ids, prompt().size()));
        check_same_run(all, base);
        CHECK(all.stats.accepted == all.stats.drafted);
    }
}

TEST_CASE("16.4 continue_session_speculative is continue_session: prompt lookup, sampling, the counts") {
    Model m(kTiny, ModelOptions{});
    const SamplingParams sp{.temperature = 0.9f, .seed = 11};
    // a prompt that repeats itself, so prompt lookup has something to copy
    Ids fresh = prompt();
    fresh.insert(fresh.end(), prompt().begin(), prompt().end());
    const Run base = plain(m, fresh, 24, sp);
    Session s(m.config, 64);
    std::vector<float> logits;
    SpeculationStats stats;
    const Ids ids = continue_session_speculative(m, s, fresh, 24, sp, 32, 4, kNoStop, &logits, &stats);
    CHECK(ids == base.ids);
    CHECK_BITS_EQ(logits, base.logits);
    check_same_session(s, base.session);
    CHECK(stats.yielded == 23);
    CHECK(stats.steps + stats.accepted == 23);  // every step yields its accepted drafts + 1
    CHECK(stats.accepted <= stats.drafted);
}

// ---- 16.4 stops, the last token, the context --------------------------------------------------------
TEST_CASE("16.4 a stop inside accepted drafts ends the turn, and the session holds exactly what plain decoding leaves") {
    Model m(kTiny, ModelOptions{});
    const Run full = plain(m, prompt(), 24, kGreedy);
    for (std::size_t stop_at : {1, 2, 5, 6, 11}) {  // the index of the token on_token refuses
        CAPTURE(stop_at);
        std::size_t seen = 0;
        const OnToken stop = [&](std::int64_t) { return seen++ != stop_at; };
        seen = 0;
        const Run base = plain(m, prompt(), 24, kGreedy, 32, 64, stop);
        REQUIRE(base.ids.size() == stop_at + 1);
        for (std::size_t n : {1, 3, 8}) {
            CAPTURE(n);
            seen = 0;
            const Run r = speculative(m, prompt(), 24, kGreedy, n, oracle(full.ids, prompt().size()), 32, 64, stop);
            check_same_run(r, base);
        }
    }
}

TEST_CASE("16.4 speculation never needs a position plain decoding does not: a context of exactly prompt + max_new - 1") {
    Model m(kTiny, ModelOptions{});
    const std::size_t max_new = 20, context = prompt().size() + max_new - 1;
    const Run base = plain(m, prompt(), max_new, kGreedy, 32, context);
    for (std::size_t n : {1, 4, 8}) {
        CAPTURE(n);
        check_same_run(speculative(m, prompt(), max_new, kGreedy, n, oracle(base.ids, prompt().size()), 32, context), base);
    }
    // a drafter that proposes more than it was asked for is cut to the room (contract 2)
    const Draft greedy_drafter = [&](std::span<const std::int64_t> seq, std::size_t) {
        Ids d = oracle(base.ids, prompt().size())(seq, 100);
        d.resize(std::max<std::size_t>(d.size(), 12), 5);
        return d;
    };
    check_same_run(speculative(m, prompt(), max_new, kGreedy, 8, greedy_drafter, 32, context), base);
    CHECK(plain(m, prompt(), 1, kGreedy).ids == speculative(m, prompt(), 1, kGreedy, 8, greedy_drafter).ids);
    CHECK(speculative(m, prompt(), 0, kGreedy, 8, greedy_drafter).ids.empty());
}

TEST_CASE("16.4 a chat turn with speculation replies as chat_turn does, and the conversation goes on identically") {
    const Tokenizer tok = Tokenizer::load(kTiny);
    Model m(kTiny, ModelOptions{});
    for (const SamplingParams& sp : {kGreedy, SamplingParams{.temperature = 1.0f, .top_k = 64, .seed = 5}}) {
        Chat a(m.config, 256), b(m.config, 256);
        a.options.thinking = b.options.thinking = false;
        SpeculationStats stats;
        for (const char* text : {"Hello there. Hello there.", "Say it again: hello there."}) {
            std::string ta, tb;
            const Ids ra = chat_turn(m, a, tok, text, 16, sp, [&](const std::string& t) { ta += t; });
            const Ids rb = chat_turn_speculative(m, b, tok, text, 16, sp, 4, [&](const std::string& t) { tb += t; }, &stats);
            CHECK(ra == rb);
            CHECK(ta == tb);
            CHECK(a.pending == b.pending);
            check_same_session(b.session, a.session);
        }
        CHECK(stats.steps > 0);
    }
}

// ---- 16.4 on the trained little K3: real drafts, accepted ------------------------------------------------
// The little K3 repeats what it has read, so the prompt lookup's drafts are accepted often: the exactness
// above then holds on steps that keep several drafts, not only on the oracle's.
TEST_CASE("16.4 on the little K3, prompt lookup drafts are accepted and the output is plain decoding's, bit for bit") {
    const std::string dir = test::source_path("fixtures/little-k3");
    Model m(dir, ModelOptions{});
    const Tokenizer tok = Tokenizer::load(dir);
    const std::vector<std::uint32_t> enc =
        tok.encode("The United Nations system is the most important part of the United Nations. The United Nations system");
    const Ids p(enc.begin(), enc.end());
    const Run base = plain(m, p, 32, kGreedy, 32, 128);
    const Draft lookup = [](std::span<const std::int64_t> seq, std::size_t n) { return draft_from_context(seq, n); };
    for (std::size_t n : {2u, 4u, 8u, 16u, 32u}) {
        CAPTURE(n);
        const Run r = speculative(m, p, 32, kGreedy, n, lookup, 32, 128);
        check_same_run(r, base);
        CHECK(r.stats.accepted > 0);                   // real drafts were kept
        CHECK(r.stats.steps < r.stats.yielded);        // so fewer steps than tokens
    }
    SamplingParams sampled{.temperature = 0.8f, .seed = 7};
    const Run sbase = plain(m, p, 32, sampled, 32, 128);
    const Run s = speculative(m, p, 32, sampled, 4, lookup, 32, 128);
    check_same_run(s, sbase);  // sampled: each position's draw depends only on (seed, position)
}
