// Tests for appendix 13a: a batched step and the scheduler give every conversation exactly the ids and
// logits it gets alone (forward, decode), whatever else is in the batch, whenever it joined.
#include "../chapters/13a_batch.hpp"
#include "../chapters/15_generate.hpp"

#include <map>

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
void forward_batch_matches(const std::string& rel, const ModelOptions& o) {
    Model m(test::source_path(rel), o);
    const std::size_t V = std::size_t(m.config.vocab_size);
    const auto ps = prompts(rel, V);
    std::vector<Session> alone, batched;
    for (std::size_t i = 0; i < ps.size(); ++i) alone.emplace_back(m.config, 64), batched.emplace_back(m.config, 64);
    for (int round = 0; round < 3; ++round) {  // round 0: whole prompts (Rows::all); then one token each
        std::vector<std::vector<std::int64_t>> ids(ps.size());
        std::vector<std::vector<float>> want(ps.size()), got(ps.size());
        std::vector<BatchItem> items;
        for (std::size_t i = 0; i < ps.size(); ++i) {
            ids[i] = round == 0 ? ps[i] : std::vector<std::int64_t>{std::int64_t((7 * i + 13 * std::size_t(round)) % V)};
            want[i].resize(ids[i].size() * V), got[i].resize(ids[i].size() * V);
            forward(want[i].data(), m, alone[i], ids[i], {.rows = Rows::all});
            items.push_back(BatchItem{&batched[i], ids[i], got[i].data(), Rows::all});
        }
        forward_batch(m, items);
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
// `cancel_after` tokens, and the step at which it arrives.
struct Request {
    std::vector<std::int64_t> prompt;
    SamplingParams sp;
    std::size_t max_new, cancel_after, arrives;
};

struct Turn {
    std::vector<std::int64_t> ids;
    std::vector<float> logits;
};

Turn alone(Model& m, const Request& r, std::size_t chunk) {
    Session s(m.config, 64);
    Turn t;
    std::size_t n = 0;
    t.ids = decode(m, s, r.prompt, {.max_new = r.max_new, .chunk = chunk}, sampler(r.sp),
                   {.token = [&](std::int64_t) { return ++n, true; }, .cancelled = [&] { return n >= r.cancel_after; }, .logits = &t.logits});
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
                ids[i] = batch.join(Conversation{&sessions[i], reqs[i].prompt, {.max_new = reqs[i].max_new, .chunk = chunk}, sampler(reqs[i].sp),
                                                 {.token = [&, i](std::int64_t) { return ++count[i], true; },
                                                  .cancelled = [&, i] { return count[i] >= reqs[i].cancel_after; },
                                                  .logits = &got[i].logits}});
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
    set_threads(2);
}

}  // namespace

TEST_CASE("13a.1 a batched step gives every session the logits bits it gets alone (tiny K3, resident and at the floor)") {
    forward_batch_matches("fixtures/tiny-k3", ModelOptions{});
    forward_batch_matches("fixtures/tiny-k3", at_floor(test::source_path("fixtures/tiny-k3")));
}

TEST_CASE("13a.1 a batched step on the little K3 and the odd-width variant") {
    forward_batch_matches("fixtures/little-k3", at_floor(test::source_path("fixtures/little-k3")));
    forward_batch_matches("fixtures/variants/odd-widths", ModelOptions{});
}

TEST_CASE("13a.1 a batched step reads the trunk once, however many sessions it steps") {
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
            std::vector<BatchItem> items;
            for (std::size_t i = 0; i < n; ++i) items.push_back(BatchItem{&s[i], std::span(&ids[i], 1), &logits[i * V]});
            forward_batch(m, items);
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

TEST_CASE("13a.1 forward_batch refuses two items on one session, an empty item, an empty batch") {
    Model m(test::source_path("fixtures/tiny-k3"), ModelOptions{});
    Session s(m.config, 64);
    std::vector<float> logits(2 * std::size_t(m.config.vocab_size));
    const std::vector<std::int64_t> ids = {1, 2};
    const std::vector<BatchItem> twice = {{&s, std::span(ids).first(1), logits.data()}, {&s, std::span(ids).last(1), logits.data()}};
    CHECK_THROWS_WITH(forward_batch(m, twice), doctest::Contains("share one session"));
    const std::vector<BatchItem> empty = {{&s, {}, logits.data()}};
    CHECK_THROWS_WITH(forward_batch(m, empty), doctest::Contains("no tokens"));
    CHECK_THROWS_WITH(forward_batch(m, {}), doctest::Contains("no conversation"));
    CHECK(s.position() == 0);
}

TEST_CASE("13a.2 the scheduler: staggered arrivals, a cancellation mid-batch, mixed samplers = each request alone") {
    scheduler_matches("fixtures/tiny-k3", ModelOptions{}, 8, 32, 2);
    scheduler_matches("fixtures/tiny-k3", ModelOptions{}, 2, 5, 1);  // a queue (2 at a time), prompts in chunks of 5, one thread
}

TEST_CASE("13a.2 the scheduler on the little K3 at its floor budget") {
    const std::string dir = test::source_path("fixtures/little-k3");
    scheduler_matches("fixtures/little-k3", at_floor(dir), 4, 32, 2);
    scheduler_matches("fixtures/little-k3", at_floor(dir), 3, 3, 1);
}

TEST_CASE("13a.2 Batch refuses max_batch 0, a conversation without tokens, drafts") {
    Model m(test::source_path("fixtures/tiny-k3"), ModelOptions{});
    CHECK_THROWS_WITH(Batch(m, 0), doctest::Contains("at least 1"));
    Batch b(m, 1);
    Session s(m.config, 64);
    CHECK_THROWS_WITH(b.join(Conversation{&s, {}, {.max_new = 1}, sampler({}), {}}), doctest::Contains("tokens to feed"));
    Conversation c{&s, {1}, {.max_new = 1}, sampler({}), {}};
    c.hooks.draft = [](std::span<const std::int64_t>, std::size_t) { return std::vector<std::int64_t>{}; };
    CHECK_THROWS_WITH(b.join(std::move(c)), doctest::Contains("drafts"));
    CHECK(b.idle());
}
