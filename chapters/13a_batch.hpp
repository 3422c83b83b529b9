// kimik3 chapter 13, APPENDIX A: batch -- several conversations advanced by one forward step.
// ====================================================================================================
//
// APPENDIX to chapter 13 (13_model.hpp, sections 13.3 and 13.4). At the memory floor every step streams
// the whole trunk through the ring, so two conversations stepped one after the other read it twice. A
// batched step reads it once: chapter 13's forward takes several StepItems, stacks the rows of every
// conversation (its prompt chunk, or its last chosen token and any guesses) into one (N, D) activation,
// multiplies every trunk matrix and every routed expert over all N rows in one pass, and runs only what
// carries state per conversation (KDA on its own KdaState, MLA on its own cache: chapters 07 and 08 take
// several sequences in one call for this). This appendix adds no arithmetic: it is a scheduler that
// runs chapter 13's Decoder, the one decode loop, for each conversation, and one forward step for all.
//
// CONTRACT
//   * Exact per user: every conversation's ids and logits are bit-identical to decode() on its session
//     alone, whatever else is in the step and whenever it joined. This holds because a step gives each
//     row the bits it gets alone (chapter 13.3) and each conversation's choices are its own Decoder's,
//     the same code decode() runs. Tests 13a.* check it bit for bit, with staggered arrivals, a
//     conversation leaving mid-batch, different samplers and speculation.
//   * One read per step: every trunk matrix is streamed once per step and every expert the batch routes
//     to is fetched once (the union), however many conversations there are.
//   * A conversation owns its Session; the batch holds a pointer to it while the conversation is active.
//   * Speculation (a drafter in the hooks) works per conversation: its step feeds its last token and its
//     guesses, tentatively, beside the others' rows, and keeps what matches (chapter 16).
//
// CONCEPTS
//   Conversation  one request's turn: its session, the tokens to feed, limits, a chooser and hooks, as
//                 decode() takes them.
//   Batch         the scheduler (13a.1): conversations join between steps (up to max_batch at once, the
//                 rest wait in arrival order), each step feeds every active one what its Decoder asks
//                 for, a conversation leaves when its turn ends (a stop, max_new, or cancelled).
//
// SOURCES  Orca: a distributed serving system for transformer-based generative models (Yu et al., OSDI
//          2022) for iteration-level scheduling; vLLM (Kwon et al., SOSP 2023) for per-sequence caches.
// USES     chapter 13 (Model, Session, forward over StepItems, Decoder)
// TEST     make test-13 (tests "13a ...")
// ====================================================================================================
#pragma once

#include <deque>
#include <optional>

#include "13_model.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 13a.1 The scheduler: conversations join and leave between steps
// ---------------------------------------------------------------------------------------------------
// One conversation's turn, as decode() takes it.
struct Conversation {
    Session* session = nullptr;         // owned by the caller; used while the conversation is active
    std::vector<std::int64_t> fresh;    // fed first, in chunks of limits.chunk
    DecodeLimits limits;
    Chooser choose;
    DecodeHooks hooks;                  // as decode uses them; `times` receives the whole shared step's
};

class Batch {
  public:
    using Id = std::size_t;
    Batch(Model& model, std::size_t max_batch) : model_(model), max_batch_(max_batch) {
        if (max_batch == 0) fail(ErrorKind::usage, "Batch: --max-batch must be at least 1");
    }

    // Queues a conversation; it joins at the next step that has room (arrival order).
    Id join(Conversation c) {
        if (!c.session || c.fresh.empty() || !c.choose) fail(ErrorKind::usage, "Batch::join: a conversation needs a session, tokens to feed and a chooser");
        if (c.limits.chunk == 0) fail(ErrorKind::usage, "Batch::join: the prompt chunk must be at least 1 token");
        if (c.limits.recompute && c.hooks.draft) fail(ErrorKind::usage, "Batch::join: full recompute verifies no drafts");
        convs_.emplace_back().c = std::move(c);
        waiting_.push_back(convs_.size() - 1);
        return convs_.size() - 1;
    }
    bool done(Id id) const { return convs_.at(id).done; }
    const std::vector<std::int64_t>& drawn(Id id) const { return convs_.at(id).drawn; }
    std::size_t active() const { return active_.size(); }
    std::size_t waiting() const { return waiting_.size(); }
    bool idle() const { return active_.empty() && waiting_.empty(); }
    std::size_t steps() const { return steps_; }

    // One forward step over every active conversation (after admitting waiting ones): each feeds what its
    // Decoder asks for; one that has nothing more to feed (its turn ended or it was cancelled) leaves.
    // Returns the rows fed.
    std::size_t step() {
        while (!waiting_.empty() && active_.size() < max_batch_) {
            State& s = convs_[waiting_.front()];
            s.decoder.emplace(model_, *s.c.session, s.c.fresh, s.c.limits, s.c.choose, s.c.hooks);
            active_.push_back(waiting_.front()), waiting_.pop_front();
        }
        std::vector<StepItem> items;
        std::vector<Id> stepping;
        for (Id id : active_) {
            State& s = convs_[id];
            StepItem item;
            if (s.decoder->next(item)) items.push_back(item), stepping.push_back(id);
            else finish(s);
        }
        std::size_t rows = 0;
        if (!items.empty()) {
            forward(model_, items);
            for (std::size_t i = 0; i < items.size(); ++i) {
                State& s = convs_[stepping[i]];
                rows += items[i].ids.size();
                s.decoder->took();
                if (s.decoder->done()) finish(s);
            }
            ++steps_;
        }
        std::erase_if(active_, [&](Id id) { return convs_[id].done; });
        return rows;
    }

    // Steps until every conversation, waiting ones included, has ended.
    void run() {
        while (!idle()) step();
    }

  private:
    struct State {
        Conversation c;
        std::optional<Decoder> decoder;  // while active
        bool done = false;
        std::vector<std::int64_t> drawn;
    };
    // A conversation that has ended keeps only what it drew: its decoder, prompt and hooks (which may
    // hold a caller's objects) go at once, so that a long-lived batch (a server's) grows by its ids only.
    static void finish(State& s) {
        s.drawn = std::move(s.decoder->drawn());
        s.decoder.reset();
        s.c = Conversation{};
        s.done = true;
    }
    Model& model_;
    std::size_t max_batch_;
    std::deque<State> convs_;            // stable addresses: drawn() references stay valid
    std::vector<Id> active_;
    std::deque<Id> waiting_;
    std::size_t steps_ = 0;
};

}  // namespace kimik3
