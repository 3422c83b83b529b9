// Tests for a step over several sessions (13.3) and appendix 13a's scheduler: every conversation gets
// exactly the ids and logits it gets alone (forward, decode), whatever else is in the batch, whenever it
// joined, with or without speculation.
#include "../chapters/13a_batch.hpp"
#include "../chapters/15_generate.hpp"
#include "../chapters/16_speculative.hpp"

#include <map>
#include <memory>

#include "fixture.hpp"

using namespace kimik3;

namespace {

// Prompts of different lengths made from a fixture's prompt (ids stay inside the vocabulary).
std::vector<std::vector<std::int64_t>> prompts(const std::string& rel, std::size_t V) {
    const std::vector<std::int64_t> base = test::Fixture(rel + "/reference/model.safetensors").i64("prompt_ids");
    std::vector<std::vector<std::int64_t>> out;
    for (std::size_t n : {base.size(), std::size_t(3), std::size_t(1), std::size_t(7), base.size() + 9}) {
        std::vector<std::int64_t> p;
        for (std::size_t i = 0; i < n; ++i) p.push_back((base[i % base.size()] + std::int64_t(31 * out.size() + i / base.size())) % std::int64_t(V));
        out.push_back(p);
    }
    return out;
}

ModelOptions at_floor(const std::string& dir) {
    Model probe(dir, ModelOptions{});
    ModelOptions o;
    o.budget = make_plan(probe.config, probe.census, 0, o.plan, unit_bytes(probe.tensors)).floor;
    return o;
}

// Several sessions stepped together, prompt chunks of different lengths in the same step and then one
// token each, against each session stepped alone: the same logits bits, every row.
void step_matches(const std::string& rel, const ModelOptions& o) {
    Model m(test::source_path(rel), o);
    const std::size_t V = std::size_t(m.config.vocab_size);
    const auto ps = prompts(rel, V);
    std::vector<Session> alone, batched;
    for (std::size_t i = 0; i < ps.size(); ++i) alone.emplace_back(m.config, 64), batched.emplace_back(m.config, 64);
    for (int round = 0; round < 3; ++round) {  // round 0: whole prompts (Rows::all); then one token each
        std::vector<std::vector<std::int64_t>> ids(ps.size());
        std::vector<std::vector<float>> want(ps.size()), got(ps.size());
        std::vector<StepItem> items;
        for (std::size_t i = 0; i < ps.size(); ++i) {
            ids[i] = round == 0 ? ps[i] : std::vector<std::int64_t>{std::int64_t((7 * i + 13 * std::size_t(round)) % V)};
            want[i].resize(ids[i].size() * V), got[i].resize(ids[i].size() * V);
            forward(want[i].data(), m, alone[i], ids[i], {.rows = Rows::all});
            items.push_back(StepItem{&batched[i], ids[i], got[i].data(), {.rows = Rows::all}});
        }
        forward(m, items);
        for (std::size_t i = 0; i < ps.size(); ++i) {
            CAPTURE(rel);
            CAPTURE(round);
            CAPTURE(i);
            CHECK_BITS_EQ(got[i], want[i]);
            CHECK(batched[i].tokens == alone[i].tokens);
        }
    }
}

// One request of the scheduler tests: a prompt, a sampler, a token budget, maybe a cancellation after
// `cancel_after` tokens, the step at which it arrives, and how it decodes: with prompt-lookup drafts
// (chapter 16) or by full recompute.
struct Request {
    std::vector<std::int64_t> prompt;
    SamplingParams sp;
    std::size_t max_new, cancel_after, arrives;
    bool speculate = false, recompute = false;
};

// A request's hooks beyond the token counter: its drafter (a fresh PromptLookup per run) when it speculates.
DecodeHooks hooks_of(const Request& r, std::size_t& count, std::vector<float>* logits) {
    DecodeHooks h{.token = [&count](std::int64_t) { return ++count, true; },
                  .cancelled = [&count, &r] { return count >= r.cancel_after; },
                  .logits = logits};
    if (r.speculate)
        h.draft = [lookup = std::make_shared<PromptLookup>(PromptLookup{.max_draft = 4})](std::span<const std::int64_t> seq, std::size_t room) {
            return (*lookup)(seq, room);
        };
    return h;
}

struct Turn {
    std::vector<std::int64_t> ids;
    std::vector<float> logits;
};

Turn alone(Model& m, const Request& r, std::size_t chunk) {
    Session s(m.config, 64);
    Turn t;
    std::size_t n = 0;
    t.ids = decode(m, s, r.prompt, {.max_new = r.max_new, .chunk = chunk}, sampler(r.sp), hooks_of(r, n, &t.logits));
    return t;
}

void scheduler_matches(const std::string& rel, const ModelOptions& o, std::size_t max_batch, std::size_t chunk, int threads) {
    set_threads(threads);
    Model m(test::source_path(rel), o);
    const auto ps = prompts(rel, std::size_t(m.config.vocab_size));
    const std::vector<Request> reqs = {
        {ps[0], {0.0f, 0, 1.0f, 0}, 12, 99, 0},   // greedy
        {ps[1], {0.8f, 40, 0.95f, 7}, 9, 99, 0},  // sampled
        {ps[2], {1.0f, 0, 1.0f, 123}, 14, 4, 2},  // sampled, arrives at step 2, cancelled after 4 tokens
        {ps[3], {0.5f, 5, 1.0f, 9}, 1, 99, 3},    // one token only
        {ps[4], {0.0f, 0, 1.0f, 0}, 10, 99, 5},   // a long prompt arriving late
        {ps[0], {0.0f, 0, 1.0f, 0}, 16, 99, 1, true},          // greedy with prompt-lookup drafts
        {ps[1], {0.7f, 0, 1.0f, 5}, 12, 9, 4, true},           // sampled with drafts, cancelled after 9
        {ps[2], {0.0f, 0, 1.0f, 0}, 5, 99, 2, false, true},    // full recompute
    };
    std::vector<Turn> want;
    for (const Request& r : reqs) want.push_back(alone(m, r, chunk));
    std::vector<Session> sessions;
    for (std::size_t i = 0; i < reqs.size(); ++i) sessions.emplace_back(m.config, 64);
    std::vector<Turn> got(reqs.size());
    std::vector<std::size_t> count(reqs.size(), 0);
    std::vector<Batch::Id> ids(reqs.size());
    Batch batch(m, max_batch);
    std::size_t joined = 0, most = 0, queued = 0;
    for (std::size_t step = 0; joined < reqs.size() || !batch.idle(); ++step) {
        for (std::size_t i = 0; i < reqs.size(); ++i)
            if (reqs[i].arrives == step) {
                ids[i] = batch.join(Conversation{&sessions[i], reqs[i].prompt,
                                                 {.max_new = reqs[i].max_new, .chunk = chunk, .recompute = reqs[i].recompute},
                                                 sampler(reqs[i].sp), hooks_of(reqs[i], count[i], &got[i].logits)});
                ++joined;
            }
        batch.step();
        most = std::max(most, batch.active());
        queued = std::max(queued, batch.waiting());
        REQUIRE(step < 500);
    }
    CHECK(most <= max_batch);
    if (max_batch >= reqs.size()) CHECK(queued == 0);
    if (max_batch <= 3) CHECK(queued > 0);  // a request arriving at step 3 finds 3 active and waits
    for (std::size_t i = 0; i < reqs.size(); ++i) {
        CAPTURE(rel);
        CAPTURE(i);
        CAPTURE(max_batch);
        CAPTURE(chunk);
        CAPTURE(threads);
        CHECK(batch.done(ids[i]));
        CHECK(batch.drawn(ids[i]) == want[i].ids);
        CHECK_BITS_EQ(got[i].logits, want[i].logits);
    }
    CHECK(batch.drawn(ids[2]).size() == 4);  // the cancellation took effect mid-batch
    CHECK(batch.drawn(ids[6]).size() >= 9);  // a speculating request stops at a step's end: 9 or a few more
    set_threads(2);
}

}  // namespace

TEST_CASE("13.3 a step over several sessions gives each the logits bits it gets alone (tiny K3, resident and at the floor)") {
    step_matches("fixtures/tiny-k3", ModelOptions{});
    step_matches("fixtures/tiny-k3", at_floor(test::source_path("fixtures/tiny-k3")));
}

TEST_CASE("13.3 a step over several sessions on the little K3 and the odd-width variant") {
    step_matches("fixtures/little-k3", at_floor(test::source_path("fixtures/little-k3")));
    step_matches("fixtures/variants/odd-widths", ModelOptions{});
}

TEST_CASE("13.3 a step over several sessions reads the trunk once, however many it steps") {
    const std::string dir = test::source_path("fixtures/little-k3");
    Model m(dir, at_floor(dir));
    const std::size_t V = std::size_t(m.config.vocab_size);
    std::vector<Session> s;
    for (int i = 0; i < 4; ++i) s.emplace_back(m.config, 64);
    std::vector<float> logits(4 * V);
    const std::vector<std::int64_t> ids = {5, 6, 7, 8};
    auto trunk_bytes = [&](std::size_t n, int steps) {  // ring bytes over `steps` steps of n sessions
        const std::uint64_t before = m.trunk().ring_stats().bytes;
        for (int k = 0; k < steps; ++k) {
            std::vector<StepItem> items;
            for (std::size_t i = 0; i < n; ++i) items.push_back(StepItem{&s[i], std::span(&ids[i], 1), &logits[i * V]});
            forward(m, items);
        }
        return m.trunk().ring_stats().bytes - before;
    };
    // The ring's readers run ahead of the step (into the next one), so a step's own count varies by what
    // was read ahead when it was taken: compare over 8 steps, up to a ring's worth at either end.
    const std::uint64_t one = trunk_bytes(1, 8), four = trunk_bytes(4, 8);
    const std::uint64_t ring = std::uint64_t(m.plan.ring_slots) * m.plan.chunk_bytes;
    CAPTURE(one);
    CAPTURE(four);
    CHECK(one > 8 * ring);
    CHECK(four <= one + 2 * ring);  // four sessions stepped apart would read 4x

}

TEST_CASE("13.3 at the floor a one-token step reads what the plan says a token reads (MLA's kv_b_proj twice)") {
    const std::string dir = test::source_path("fixtures/little-k3");
    Model m(dir, at_floor(dir));
    Session s(m.config, 80);
    std::vector<float> logits(std::size_t(m.config.vocab_size));
    const std::uint64_t before = m.trunk().ring_stats().bytes;  // a fresh model: nothing read ahead yet, or a ring's worth
    const std::size_t steps = 64;
    for (std::size_t i = 0; i < steps; ++i) {
        const std::int64_t id = std::int64_t(5 + i);
        forward(logits.data(), m, s, std::span(&id, 1));
    }
    const double read = double(m.trunk().ring_stats().bytes - before), ring = double(m.plan.ring_slots) * double(m.plan.chunk_bytes);
    const double want = double(steps) * double(m.plan.trunk_read_per_token - m.census.embed_bytes / std::uint64_t(m.config.vocab_size));
    CAPTURE(read);
    CAPTURE(want);
    CHECK(read >= want - ring);  // the reader may have run ahead of the first step, and runs ahead of the last
    CHECK(read <= want + ring);  // 64 x kv_b_proj's 123 kB (counting it once) would fall 7.9 MB short: more than a ring
}

TEST_CASE("13.3 a step refuses two items on one session, an empty item, an empty step") {
    Model m(test::source_path("fixtures/tiny-k3"), ModelOptions{});
    Session s(m.config, 64);
    std::vector<float> logits(2 * std::size_t(m.config.vocab_size));
    const std::vector<std::int64_t> ids = {1, 2};
    const std::vector<StepItem> twice = {{&s, std::span(ids).first(1), logits.data()}, {&s, std::span(ids).last(1), logits.data()}};
    CHECK_THROWS_WITH(forward(m, twice), doctest::Contains("share one session"));
    const std::vector<StepItem> empty = {{&s, {}, logits.data()}};
    CHECK_THROWS_WITH(forward(m, empty), doctest::Contains("no tokens"));
    CHECK_THROWS_WITH(forward(m, std::span<const StepItem>{}), doctest::Contains("no sequence"));
    CHECK(s.position() == 0);
}

TEST_CASE("13.3 in a step over several sessions, one session's record and tentative step are what they are alone") {
    Model m(test::source_path("fixtures/tiny-k3"), ModelOptions{});
    const std::size_t V = std::size_t(m.config.vocab_size);
    const auto ps = prompts("fixtures/tiny-k3", V);
    Session a(m.config, 64), b(m.config, 64), other(m.config, 64);
    std::vector<float> la(ps[0].size() * V), lb(ps[0].size() * V), lo(ps[1].size() * V);
    StepRecord ra, rb;
    TentativeKda ta, tb;
    forward(la.data(), m, a, ps[0], {.rows = Rows::all, .tentative = &ta, .record = &ra});
    const std::vector<StepItem> items = {{&other, ps[1], lo.data(), {.rows = Rows::all}},
                                         {&b, ps[0], lb.data(), {.rows = Rows::all, .tentative = &tb, .record = &rb}}};
    forward(m, items);
    CHECK_BITS_EQ(lb, la);
    REQUIRE(rb.layers.size() == ra.layers.size());
    for (std::size_t l = 0; l < ra.layers.size(); ++l) {
        CAPTURE(l);
        CHECK_BITS_EQ(rb.layers[l].attn_mix, ra.layers[l].attn_mix);
        CHECK_BITS_EQ(rb.layers[l].mlp_mix, ra.layers[l].mlp_mix);
        CHECK(rb.layers[l].routing.ids == ra.layers[l].routing.ids);
        CHECK_BITS_EQ(rb.layers[l].routing.weights, ra.layers[l].routing.weights);
        CHECK_BITS_EQ(rb.layers[l].routing.scores, ra.layers[l].routing.scores);
    }
    CHECK_BITS_EQ(rb.out_mix, ra.out_mix);
    keep_tokens(m, a, ta, 3), keep_tokens(m, b, tb, 3);  // kept to 3 tokens, both sessions continue alike
    std::vector<float> na(V), nb(V);
    forward(na.data(), m, a, std::span(ps[0]).subspan(3, 1));
    forward(nb.data(), m, b, std::span(ps[0]).subspan(3, 1));
    CHECK_BITS_EQ(nb, na);
}

TEST_CASE("13a.1 the scheduler: staggered arrivals, a cancellation mid-batch, mixed samplers, speculation, recompute = each request alone") {
    scheduler_matches("fixtures/tiny-k3", ModelOptions{}, 8, 32, 2);
    scheduler_matches("fixtures/tiny-k3", ModelOptions{}, 2, 5, 1);  // a queue (2 at a time), prompts in chunks of 5, one thread
}

TEST_CASE("13a.1 the scheduler on the little K3 at its floor budget") {
    const std::string dir = test::source_path("fixtures/little-k3");
    scheduler_matches("fixtures/little-k3", at_floor(dir), 4, 32, 2);
    scheduler_matches("fixtures/little-k3", at_floor(dir), 3, 3, 1);
}

TEST_CASE("13a.1 Batch refuses max_batch 0, a conversation without tokens, drafts with full recompute") {
    Model m(test::source_path("fixtures/tiny-k3"), ModelOptions{});
    CHECK_THROWS_WITH(Batch(m, 0), doctest::Contains("at least 1"));
    Batch b(m, 1);
    Session s(m.config, 64);
    CHECK_THROWS_WITH(b.join(Conversation{&s, {}, {.max_new = 1}, sampler({}), {}}), doctest::Contains("tokens to feed"));
    Conversation c{&s, {1}, {.max_new = 1, .recompute = true}, sampler({}), {}};
    c.hooks.draft = [](std::span<const std::int64_t>, std::size_t) { return std::vector<std::int64_t>{}; };
    CHECK_THROWS_WITH(b.join(std::move(c)), doctest::Contains("drafts"));
    CHECK(b.idle());
}
