// kimik3 serve MODEL_DIR: an OpenAI-compatible HTTP server, and a page that shows the model at work.
// ====================================================================================================
//
// APPENDIX TO CHAPTER 15: WHAT A SERVER ADDS OVER `kimik3 chat`
//   `chat` already holds a conversation: chapter 15 renders each turn in K3's chat format, feeds only
//   the tokens the session has not seen, and draws each reply token with the seeded sampler. A server
//   adds three things and no arithmetic:
//
//   the protocol   Editors, chat front ends and scripts speak OpenAI's chat API: POST a JSON body with
//                  the WHOLE conversation (`messages`) every time, get one JSON reply, or a stream of
//                  server-sent events ("data: {chunk}\n\n" per token, then "data: [DONE]"). Every field
//                  is checked before anything runs; a refusal is an error object with an HTTP status:
//                    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
//                               "code": "integer_below_min_value"}}
//   state reuse    The client resends the history; the server must not recompute it. The rendered
//                  prompt is compared with the tokens the live session has already processed: when
//                  those are a prefix of the prompt, only the rest is fed (the KDA states and the latent
//                  cache carry it, as in `chat`). KDA's state is a running sum, so a session cannot be
//                  rewound token by token; the server therefore also keeps a copy of the KDA states
//                  taken at the end of the last prompt (the MLA caches rewind by truncation) when the
//                  budget has room for it: a client that resends the reply with other tokens than the
//                  model drew (re-tokenised text, an edited reply) still reuses everything up to the
//                  reply. The reused length is reported as usage.prompt_tokens_details.cached_tokens.
//                  Reuse changes no bit: a step of T tokens equals T steps of one (chapter 13).
//   one at a time  One model, one session, one generation: requests wait in a bounded queue (then 503
//                  with Retry-After), run on one engine thread (the only caller of chapter 00's thread
//                  team, whose workers split each step's rows; a second caller would run alone), and stop
//                  when their client disconnects. A failed weight read ends that request with an error
//                  and resets the session; the server goes on. With --max-batch N, up to N requests run
//                  together through appendix 13a's Batch (loop_batch below): one read of the weights per
//                  step for all of them, each on a session of its own, each reply the one it gets alone.
//
//   Generation is chapter 13's decode loop, as in `run` and `chat` (with --speculate, chapter 16's
//   prompt lookup: the same tokens in fewer steps). What the page at / shows comes from the engine's
//   real per-step state, through the StepRecord the loop hands to each forward step (chapter 13): the
//   experts each MoE layer chose with their combine weights, the AttnRes depth weights of each mix, and
//   the trunk and expert-cache counters of that step (a verify step's tokens share them). API clients get
//   none of it unless they ask ("kimik3": {"trace": true} in the request).
//
// CONNECTIONS AND ACCESS (serve_guard.hpp, and the HTTP section below)
//   Every request is bounded before it is parsed: headers and body within deadlines and byte caps (any
//   transfer encoding), one thread per connection, JSON nesting checked before the parser sees it. Host
//   and Origin must be the server's own, POST bodies application/json, the key (when there is one)
//   never empty. docs/serve.md says what that protects on a shared machine, and what it does not.
//
// SAME TOKENS AS `kimik3 run`
//   Chat requests render as K3's encoder renders them (chapter 15b, serve_api.hpp: tools, tool choice,
//   response formats; thinking on unless the request turns it off, as K3's API); sampling is
//   chapter 15's: temperature 0 is greedy, otherwise the token at position p takes output p of `seed`'s SplitMix64 stream (top-k
//   and top-p as in `run`). So `run --prompt X --seed S --temperature T` and a request with one user
//   message X, thinking off, and the same seed and temperature draw the same ids (tests/serve.sh checks it).
//
// ENDPOINTS
//   POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/ID]   GET /health
//   GET / (the page)            GET /kimik3/info (the model's shape, for the page)
//   GET /kimik3/status (the conversations the engine holds, the reads their steps share: the page)
// ====================================================================================================
#pragma once

#include <httplib.h>
#include <signal.h>
#include <unistd.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "common.hpp"
#include "options.hpp"
#include "plan.hpp"
#include "run.hpp"
#include "serve_guard.hpp"
#include "serve_reply.hpp"

// The page, embedded at build time: examples/web/index.html as bytes in .rodata (no generated file).
#define KIMIK3_STR2(x) #x
#define KIMIK3_STR(x) KIMIK3_STR2(x)
__asm__(".pushsection .rodata\n"
        ".global kimik3_index_html\n"
        ".type kimik3_index_html, @object\n"
        "kimik3_index_html:\n"
        ".incbin \"" KIMIK3_SOURCE_DIR "/examples/web/index.html\"\n"
        ".global kimik3_index_html_end\n"
        "kimik3_index_html_end:\n"
        ".byte 0\n"
        ".popsection\n");
extern "C" const char kimik3_index_html[], kimik3_index_html_end[];

namespace kimik3::cli {

inline const char* kServeUsage =
    "usage: kimik3 serve MODEL_DIR [--host 127.0.0.1] [--port 8080] [--budget SIZE | --preset NAME] [options]\n"
    "\n"
    "An OpenAI-compatible server for the model in MODEL_DIR, and a page at / that shows each token's experts,\n"
    "AttnRes depth weights and reads. One generation at a time (--max-batch N: N in each forward step); the state\n"
    "of a conversation carries over when a request extends the one before.\n"
    "\n"
    "  --host ADDR       address to listen on (default 127.0.0.1: this machine only). Anything else exposes\n"
    "                    the server to the network: give an API key then\n"
    "  --port N          TCP port (default 8080; 0: any free port, printed at start)\n"
    "  --api-key-file F  require 'Authorization: Bearer KEY' on /v1/ and /kimik3/ (401 otherwise), KEY being\n"
    "                    the first line of F; or the environment variable KIMIK3_API_KEY; or --api-key KEY\n"
    "                    (visible to every local user in the process list). An empty key is refused\n"
    "  --allow-host H,.. Host header names accepted besides the address it listens on (a proxy's name)\n"
    "  --model-name ID   the model id clients send (default: MODEL_DIR's last component)\n"
    "  --context N       positions a conversation may reach (default 4096)\n"
    "  --queue N         requests that may wait while one generates (default 4; more get 503)\n"
    "  --max-body SIZE   largest request body, whatever its transfer encoding (default 4M; larger gets 413)\n"
    "  --header-time S   seconds a client has to send its request line and headers (default 10)\n"
    "  --body-time S     seconds it has to send the body (default 30); past either, the connection is closed\n"
    "  --speculate N     speculative decoding, as for kimik3 run: the same replies, bit for bit, in fewer steps\n"
    "  --max-batch N     conversations generated together (default 1): each forward step advances every active\n"
    "                    request by a token (or a prompt chunk) in one read of the weights, each on a session of\n"
    "                    its own (planned: N carried states and MLA caches inside --budget, refused with exit\n"
    "                    code 3 when they do not fit). Every reply is the one it gets alone, bit for bit. Requests\n"
    "                    past N wait in the queue; a traced request (the page's) runs alone, between batches.\n"
    "                    With --speculate, each request in the batch verifies its own drafts in the shared step\n"
    "  --budget SIZE, --preset NAME, --trunk DIR, --no-direct, --threads N   as for kimik3 run\n"
    "  --quiet           no request log on stderr\n"
    "\n"
    "Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET / (the page),\n"
    "GET /kimik3/status (every conversation the engine holds, and the bytes its forward steps read).\n"
    "Request fields: messages (or prompt), stream, stream_options.include_usage, max_tokens (or\n"
    "max_completion_tokens), temperature (default 1), top_p, top_k, seed (default: random), stop,\n"
    "ignore_eos (true: end-of-turn tokens do not end the reply; for benchmarks and tests),\n"
    "thinking ({\"type\": \"enabled\" | \"disabled\", \"effort\": low|high|max}, or a boolean; default on: replies carry\n"
    "reasoning_content), reasoning_effort, chat_template_kwargs {thinking, thinking_effort}, tools (also in a system\n"
    "message), tool_choice (auto, none, required), response_format (text, json_object, json_schema: told, not enforced),\n"
    "kimik3 ({\"trace\": true}: per-token token ids, experts, depth weights and I/O).\n"
    "Requests: POST bodies must be Content-Type: application/json; the Host header must name the server;\n"
    "a browser page from another origin is refused. Stop with Ctrl-C (SIGINT) or SIGTERM: a reply cut by it\n"
    "ends with the error code server_shutdown. Exit codes as for run.\n";

// ---------------------------------------------------------------------------------------------------
// The engine: one thread, one model, one live session, a bounded queue of jobs
// ---------------------------------------------------------------------------------------------------
struct Event {
    enum Kind { started, token, done, error } kind = token;
    std::int64_t id = 0;
    std::string piece, content, reasoning;
    nlohmann::ordered_json step;         // the trace of the step that produced the token (trace only)
    std::string finish_reason;           // done: stop, length or tool_calls
    std::vector<ToolCallOut> calls;      // tool calls completed by this token (serve_api.hpp)
    std::size_t prompt_tokens = 0, completion_tokens = 0, reused = 0;
    double queue_seconds = 0, prefill_seconds = 0, decode_seconds = 0;
    ApiError failure;                    // error
};

struct Job {
    GenRequest req;
    std::atomic<bool> cancelled{false};    // stop generating (read by the engine after every token)
    std::atomic<bool> client_left{false};  // ... because the client closed its connection
    std::atomic<bool> shutdown{false};     // ... because the server is stopping (SIGINT/SIGTERM)
    std::string name;                      // the reply's id (the status page lists it)
    std::atomic<int> phase{0};             // 0 queued, 1 feeding its prompt, 2 generating
    std::atomic<std::size_t> drawn{0}, reused{0};
    std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
    void push(Event e) {
        {
            std::lock_guard<std::mutex> g(mu_);
            events_.push_back(std::move(e));
        }
        cv_.notify_all();
    }
    // The next event, or false after `wait` without one.
    bool pop(Event& e, std::chrono::milliseconds wait) {
        std::unique_lock<std::mutex> lk(mu_);
        if (!cv_.wait_for(lk, wait, [&] { return !events_.empty(); })) return false;
        e = std::move(events_.front());
        events_.pop_front();
        return true;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Event> events_;
};

// For tests only: KIMIK3_TEST_FAIL_SERVE_READS=N:M makes weight reads N+1 .. N+M after the server started
// serving fail with EIO (chapter 01's pread_hook), to check that a failed read ends that request with an
// error and that the next request is served with the right tokens.
inline std::atomic<long> g_serve_reads{0};
inline long g_serve_fail_from = -1, g_serve_fail_count = 0;
inline ssize_t serve_failing_pread(int fd, void* buf, std::size_t n, off_t off) {
    const long k = g_serve_reads.fetch_add(1);
    if (k >= g_serve_fail_from && k < g_serve_fail_from + g_serve_fail_count) {
        errno = EIO;
        return -1;
    }
    return ::pread(fd, buf, n, off);
}

// A request's tokens as the events of its reply: each token's own text (the page shows it), the content
// and reasoning channels, tool calls, the stop sequences' cut. Alone (decode) and in a batch (appendix
// 13a) alike: the same ids make the same bytes.
class ReplyEvents {
  public:
    ReplyEvents(const GenRequest& q, const Tokenizer& tok, const StopTokens& stops)
        : q_(q), tok_(tok), stops_(stops), reader_(tok, q.chat, q.thinking), calls_(tok), stop_(q.stop) {}
    Event token(std::int64_t id) {
        ++drawn;
        Event e;
        e.kind = Event::token;
        e.id = id;
        const std::uint32_t u = std::uint32_t(id);
        const bool is_stop = !q_.ignore_eos && stops_.contains(u);
        e.piece = raw_.push(u < tok_.vocab_size() ? std::string(tok_.token_bytes(u)) : std::string());
        if (!is_stop) {
            ReplyReader::Delta d = reader_.push(u);
            if (q_.chat) e.calls = calls_.push(u);
            e.content = stop_.push(d.content);
            e.reasoning = d.reasoning;
        }
        if (is_stop || stop_.stopped || drawn == q_.max_tokens) {  // the last token: flush what is held back
            const ReplyReader::Delta d = reader_.finish();
            e.content += stop_.push(d.content);
            e.reasoning += d.reasoning;
            e.content += stop_.finish();
            if (q_.chat) for (ToolCallOut& c : calls_.finish()) e.calls.push_back(std::move(c));
        }
        if (q_.tool_choice == "none") e.calls.clear();  // told not to call: what it wrote anyway is not a call (as vLLM)
        if (is_stop || stop_.stopped) stopped = true;
        return e;
    }
    // The reply's end: stop, length or tool_calls, with its counts and times.
    Event done(std::size_t reused, double queue_seconds, double prefill_seconds, double decode_seconds) const {
        Event d;
        d.kind = Event::done;
        d.finish_reason = stopped ? (calls_.count() > 0 && q_.tool_choice != "none" ? "tool_calls" : "stop") : "length";
        d.prompt_tokens = q_.prompt_tokens;
        d.completion_tokens = drawn;
        d.reused = reused;
        d.queue_seconds = queue_seconds, d.prefill_seconds = prefill_seconds, d.decode_seconds = decode_seconds;
        return d;
    }
    std::size_t drawn = 0;
    bool stopped = false;  // at a stop token or a stop sequence

  private:
    const GenRequest& q_;
    const Tokenizer& tok_;
    const StopTokens& stops_;
    ReplyReader reader_;
    Utf8Stream raw_;           // each token's own text, markup included
    ToolCallReader calls_;     // the reply's tool calls, by token id (serve_api.hpp)
    StopMatcher stop_;
};

// What the forward steps read, shared by every conversation in them (the status page shows it).
struct SharedReads {
    std::uint64_t steps = 0, rows = 0, generated = 0, trunk = 0, experts = 0;
    std::uint64_t last_rows = 0, last_generated = 0, last_conversations = 0, last_trunk = 0, last_experts = 0;
    void add(const IoSnapshot& a, const IoSnapshot& b, std::size_t rows_fed, std::size_t drawn, std::size_t conversations) {
        ++steps, rows += rows_fed, generated += drawn, trunk += b.trunk - a.trunk, experts += b.experts - a.experts;
        last_rows = rows_fed, last_generated = drawn, last_conversations = conversations;
        last_trunk = b.trunk - a.trunk, last_experts = b.experts - a.experts;
    }
};

class Engine {
  public:
    Engine(Model& model, const Tokenizer& tok, std::size_t context, std::size_t queue_limit, int threads, std::size_t speculate = 0,
           std::size_t max_batch = 1)
        : model_(model), tok_(tok), context_(context), queue_limit_(queue_limit), threads_(threads), speculate_(speculate),
          max_batch_(std::max<std::size_t>(max_batch, 1)), live_(model.config, context), stops_(stop_tokens(tok)) {
        std::uint64_t kda = 0;
        for (const auto& k : live_.kda)
            if (k) kda += k->bytes();
        mark_bytes_ = kda;
        // The mark is a second copy of the KDA states: kept only when the budget has room beside the plan
        // (and with one session only: in a batch, session 0 serves other conversations in between).
        mark_enabled_ = max_batch_ == 1 && model.plan.budget >= model.plan.total() && model.plan.budget - model.plan.total() >= kda;
        for (std::size_t i = 1; i < max_batch_; ++i) extra_.push_back(std::make_unique<Session>(model.config, context_));
        worker_ = std::thread([this] { max_batch_ > 1 ? loop_batch() : loop(); });
    }
    ~Engine() { stop(); }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    bool mark_enabled() const { return mark_enabled_; }
    std::size_t max_batch() const { return max_batch_; }
    std::uint64_t mark_bytes() const { return mark_bytes_; }

    // Queues a job; false when the queue is full (the caller answers 503).
    bool submit(const std::shared_ptr<Job>& job) {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (stopping_ || queue_.size() + (running_ ? 1 : 0) + batched_.size() >= queue_limit_ + max_batch_) return false;
            queue_.push_back(job);
        }
        cv_.notify_all();
        return true;
    }
    std::size_t queued() {
        std::lock_guard<std::mutex> g(mu_);
        return queue_.size();
    }
    bool busy() {
        std::lock_guard<std::mutex> g(mu_);
        return running_ || !batched_.empty();
    }
    // A guess for Retry-After: the mean job time so far times the jobs ahead (N at a time), at least a second.
    int retry_after_seconds() {
        std::lock_guard<std::mutex> g(mu_);
        const double mean = jobs_done_ ? job_seconds_ / double(jobs_done_) : 1.0;
        return std::max(1, int(std::ceil(mean * double(queue_.size() + 1) / double(max_batch_))));
    }
    // GET /kimik3/status: every conversation the engine holds (generating, feeding its prompt, queued)
    // and what the forward steps read, shared by the conversations in them.
    nlohmann::ordered_json status_json() {
        std::lock_guard<std::mutex> g(mu_);
        nlohmann::ordered_json convs = nlohmann::ordered_json::array();
        auto add = [&](const Job& j, bool batched) {
            static const char* names[] = {"queued", "prompt", "generating"};
            convs.push_back({{"id", j.name}, {"state", names[std::clamp(j.phase.load(), 0, 2)]}, {"batched", batched},
                             {"prompt_tokens", j.req.prompt.size()}, {"reused_tokens", j.reused.load()}, {"tokens", j.drawn.load()},
                             {"max_tokens", j.req.max_tokens}, {"seconds", seconds_since(j.submitted)}});
        };
        if (current_) add(*current_, false);
        for (const auto& j : batched_) add(*j, true);
        for (const auto& j : queue_) add(*j, false);
        const SharedReads& r = reads_;
        auto per = [](std::uint64_t bytes, std::uint64_t n) { return n ? double(bytes) / double(n) : 0.0; };
        return {{"max_batch", max_batch_},
                {"active", (current_ ? 1 : 0) + batched_.size()},
                {"queued", queue_.size()},
                {"conversations", std::move(convs)},
                {"reads", {{"steps", r.steps}, {"rows", r.rows}, {"generated_tokens", r.generated}, {"trunk_bytes", r.trunk},
                           {"expert_bytes", r.experts}, {"trunk_bytes_per_step", per(r.trunk, r.steps)},
                           {"expert_bytes_per_step", per(r.experts, r.steps)}, {"trunk_bytes_per_token", per(r.trunk, r.generated)},
                           {"expert_bytes_per_token", per(r.experts, r.generated)},
                           {"last_step", {{"conversations", r.last_conversations}, {"rows", r.last_rows}, {"generated_tokens", r.last_generated},
                                          {"trunk_bytes", r.last_trunk}, {"expert_bytes", r.last_experts}}}}}};
    }
    void stop() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stopping_ = true;
            for (auto& j : queue_) j->shutdown = true, j->cancelled = true;
            if (current_) current_->shutdown = true, current_->cancelled = true;
            for (auto& j : batched_) j->shutdown = true, j->cancelled = true;
        }
        cv_.notify_all();
        if (worker_.joinable()) worker_.join();
    }

  private:
    struct Mark {  // the session at the end of the last prompt: its tokens and KDA states (MLA rewinds)
        std::vector<std::int64_t> tokens;
        std::vector<std::optional<KdaState>> kda;
    };

    void loop() {
        if (threads_ > 0) set_threads(threads_);
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
                if (stopping_) {
                    for (auto& j : queue_) j->push(cancelled_event());
                    return;
                }
                job = queue_.front();
                queue_.pop_front();
                running_ = true;
                current_ = job;
            }
            run_alone(job);
        }
    }

    // A job taken from the queue (running_ and current_ set): decode on the live session.
    void run_alone(const std::shared_ptr<Job>& job) {
        const auto t0 = std::chrono::steady_clock::now();
        if (job->cancelled) job->push(cancelled_event());
        else run(*job);
        std::lock_guard<std::mutex> g(mu_);
        running_ = false;
        current_.reset();
        ++jobs_done_;
        job_seconds_ += seconds_since(t0);
    }

    // --max-batch N > 1: appendix 13a's Batch steps every active request, each on a session of its own
    // (session 0 is live_), by one token or one prompt chunk per forward step (under --speculate, its last
    // token and its drafts); requests join and leave between steps, the rest wait in the queue in arrival
    // order. A traced request (its trace reports each step's reads, which a batch shares) waits until the
    // batch is empty and runs alone on session 0. Each free session keeps its conversation: a request
    // takes the free one that holds the longest prefix of its prompt (else the one left longest ago).
    struct Member {
        std::shared_ptr<Job> job;
        ReplyEvents out;
        PromptLookup drafter{};
        std::size_t slot = 0, reused = 0;
        Batch::Id id = 0;
        double queue_seconds = 0, prefill = 0;
        std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now(), t_first = t0;
    };
    bool alone(const Job& j) const { return j.req.trace; }
    Session& slot(std::size_t i) { return i == 0 ? live_ : *extra_[i - 1]; }

    void loop_batch() {
        if (threads_ > 0) set_threads(threads_);
        std::optional<Batch> batch;
        std::vector<std::unique_ptr<Member>> members;
        std::vector<bool> used(max_batch_, false);
        std::vector<std::uint64_t> last_use(max_batch_, 0);
        std::uint64_t clock = 0;
        std::size_t drawn_this_step = 0;
        auto leave = [&](Member& m, bool had_slot = true) {  // the job is answered: its session is free for the next one
            if (had_slot) used[m.slot] = false, last_use[m.slot] = ++clock;
            std::lock_guard<std::mutex> g(mu_);
            std::erase(batched_, m.job);
            ++jobs_done_;
            job_seconds_ += seconds_since(m.t0);
        };
        for (;;) {
            std::vector<std::shared_ptr<Job>> joining;
            std::shared_ptr<Job> solo;
            {
                std::unique_lock<std::mutex> lk(mu_);
                if (members.empty()) cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
                if (stopping_ && members.empty()) {
                    for (auto& j : queue_) j->push(cancelled_event());
                    return;
                }
                while (!stopping_ && !queue_.empty() && members.size() + joining.size() < max_batch_ && !alone(*queue_.front()))
                    joining.push_back(queue_.front()), batched_.push_back(queue_.front()), queue_.pop_front();
                if (!stopping_ && members.empty() && joining.empty() && !queue_.empty())
                    solo = queue_.front(), queue_.pop_front(), running_ = true, current_ = solo;
            }
            if (solo) {
                run_alone(solo);
                last_use[0] = ++clock;
                continue;
            }
            for (auto& job : joining) {
                const GenRequest& q = job->req;
                auto m = std::make_unique<Member>(Member{job, ReplyEvents(q, tok_, stops_), PromptLookup{.max_draft = speculate_}});
                m->queue_seconds = seconds_since(job->submitted);
                if (job->cancelled) {
                    job->push(cancelled_event()), leave(*m, false);
                    continue;
                }
                std::size_t best = max_batch_;
                for (std::size_t i = 0; i < max_batch_; ++i) {
                    const std::size_t n = strict_prefix(slot(i).tokens, q.prompt) ? slot(i).tokens.size() : 0;
                    if (!used[i] && (best == max_batch_ || n > m->reused || (n == m->reused && last_use[i] < last_use[best]))) best = i, m->reused = n;
                }
                m->slot = best, used[best] = true;
                if (m->reused == 0) slot(best).reset();
                Event start;
                start.kind = Event::started;
                start.queue_seconds = m->queue_seconds;
                start.reused = m->reused;
                job->push(start);
                job->reused = m->reused, job->phase = 1;
                SamplingParams sp = q.sampling;  // as run(): output p of the seed's stream for position p
                sp.seed = q.seed;
                Conversation c;
                c.session = &slot(best);
                c.fresh.assign(q.prompt.begin() + long(m->reused), q.prompt.end());
                c.limits.max_new = q.max_tokens;
                c.choose = sampler(sp);
                Member* mp = m.get();
                c.hooks.cancelled = [mp] { return mp->job->cancelled.load(); };
                if (speculate_) c.hooks.draft = [mp](std::span<const std::int64_t> seq, std::size_t room) { return mp->drafter(seq, room); };
                c.hooks.token = [mp, &drawn_this_step](std::int64_t id) {
                    if (mp->out.drawn == 0) mp->prefill = seconds_since(mp->t0), mp->t_first = std::chrono::steady_clock::now();
                    ++drawn_this_step;
                    mp->job->push(mp->out.token(id));
                    mp->job->drawn = mp->out.drawn, mp->job->phase = 2;
                    return !mp->out.stopped;
                };
                if (!batch) batch.emplace(model_, max_batch_);
                m->id = batch->join(std::move(c));
                members.push_back(std::move(m));
            }
            if (members.empty()) continue;
            if (model_.experts()) model_.experts()->clear_trace();  // the server keeps no trace: memory stays bounded
            const IoSnapshot before = io_snapshot(model_);
            drawn_this_step = 0;
            std::size_t rows = 0;
            try {
                rows = batch->step();
            } catch (const std::exception& ex) {
                // Every session in the step may hold half of it: each of these requests ends with the
                // error, their sessions start from scratch, the queue goes on.
                const Event e = failure_event(ex, "the batch's sessions were reset");
                for (auto& m : members) slot(m->slot).reset(), m->job->push(e), leave(*m);
                members.clear();
                batch.reset();
                continue;
            }
            {
                std::lock_guard<std::mutex> g(mu_);
                reads_.add(before, io_snapshot(model_), rows, drawn_this_step, members.size());
            }
            std::erase_if(members, [&](const std::unique_ptr<Member>& m) {
                if (!batch->done(m->id)) return false;
                log_cut(*m->job, m->out);
                m->job->push(m->out.done(m->reused, m->queue_seconds, m->prefill, m->out.drawn ? seconds_since(m->t_first) : 0.0));
                leave(*m);
                return true;
            });
            if (members.empty()) batch.reset();  // a fresh one next time: its record of ended conversations goes
        }
    }

    static Event cancelled_event() {
        Event e;
        e.kind = Event::error;
        e.failure = ApiError{499, "the request was cancelled", "", "cancelled", "server_error"};
        return e;
    }

    static bool strict_prefix(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& p) {
        return !a.empty() && a.size() < p.size() && std::equal(a.begin(), a.end(), p.begin());
    }

    // Makes the live session a prefix of `prompt` as long as possible; returns its length.
    std::size_t prepare(const std::vector<std::int64_t>& prompt) {
        if (strict_prefix(live_.tokens, prompt)) return live_.tokens.size();
        if (mark_ && strict_prefix(mark_->tokens, prompt)) {
            const std::size_t n = mark_->tokens.size();
            for (std::size_t l = 0; l < live_.kda.size(); ++l) {
                if (live_.kda[l]) *live_.kda[l] = *mark_->kda[l];
                if (live_.mla[l]) live_.mla[l]->truncate(n);
            }
            live_.tokens = mark_->tokens;
            return n;
        }
        mark_.reset();
        live_.reset();
        return 0;
    }

    // The trace of the token chosen from row `row` of a step's logits (a verify step has one row per token
    // it fed, a prompt step one, for its last token).
    nlohmann::ordered_json step_json(const StepRecord& r, const IoSnapshot& before, const IoSnapshot& after, std::size_t index,
                                     std::size_t fed, double seconds, std::size_t row) const {
        const Config& c = model_.config;
        const std::size_t n = r.out_candidates, rows = r.out_mix.size() / std::max<std::size_t>(n, 1);
        const std::size_t t = r.tokens - rows + row;  // the step's token whose logits were sampled
        nlohmann::ordered_json layers = nlohmann::ordered_json::array();
        for (std::size_t l = 0; l < r.layers.size(); ++l) {
            const StepRecord::Layer& L = r.layers[l];
            nlohmann::ordered_json j;
            j["attn"] = c.layers[l].attn == AttnKind::KDA ? "KDA" : "MLA";
            j["attn_mix"] = std::vector<float>(L.attn_mix.begin() + long(t * L.attn_candidates), L.attn_mix.begin() + long((t + 1) * L.attn_candidates));
            j["mlp_mix"] = std::vector<float>(L.mlp_mix.begin() + long(t * L.mlp_candidates), L.mlp_mix.begin() + long((t + 1) * L.mlp_candidates));
            if (!L.routing.ids.empty()) {
                const std::size_t K = L.routing.k;
                j["experts"] = std::vector<int>(L.routing.ids.begin() + long(t * K), L.routing.ids.begin() + long((t + 1) * K));
                j["weights"] = std::vector<float>(L.routing.weights.begin() + long(t * K), L.routing.weights.begin() + long((t + 1) * K));
            }
            layers.push_back(std::move(j));
        }
        return {{"index", index},
                {"tokens_fed", fed},
                {"seconds", seconds},
                {"io",
                 {{"trunk_bytes", after.trunk - before.trunk},
                  {"expert_bytes", after.experts - before.experts},
                  {"expert_requests", after.cache.requests - before.cache.requests},
                  {"expert_hits", after.cache.hits - before.cache.hits},
                  {"expert_retained", after.cache.retained - before.cache.retained},
                  {"expert_misses", after.cache.misses - before.cache.misses},
                  {"expert_evictions", after.cache.evictions - before.cache.evictions}}},
                {"layers", std::move(layers)},
                {"out_mix", std::vector<float>(r.out_mix.begin() + long(row * n), r.out_mix.begin() + long((row + 1) * n))}};
    }

    // One request: the live session made a prefix of the prompt, then chapter 13's decode loop (with
    // chapter 16's prompt lookup under --speculate), every token an event as soon as it is chosen.
    void run(Job& job) {
        const GenRequest& q = job.req;
        Event start;
        start.kind = Event::started;
        start.queue_seconds = seconds_since(job.submitted);
        try {
            if (model_.experts()) model_.experts()->clear_trace();  // the server keeps no trace: memory stays bounded
            const std::size_t reused = prepare(q.prompt);
            start.reused = reused;
            job.push(start);
            job.reused = reused, job.phase = 1;
            const std::vector<std::int64_t> fresh(q.prompt.begin() + long(reused), q.prompt.end());
            SamplingParams sp = q.sampling;  // the token at position p draws output p of the seed's stream (chapter 15)
            sp.seed = q.seed;
            ReplyEvents out(q, tok_, stops_);
            StepRecord rec;
            PromptLookup drafter{.max_draft = speculate_};
            // the step being read: its index (0: the prompt), the next row of its logits, its reads and time
            std::size_t step = 0, row = 0;
            IoSnapshot before = io_snapshot(model_), after = before, shared = before;
            auto t_step = std::chrono::steady_clock::now();
            double step_seconds = 0, prefill = 0;
            auto t_decode = t_step;
            DecodeHooks hooks;
            hooks.record = q.trace ? &rec : nullptr;
            hooks.cancelled = [&] { return job.cancelled.load(); };
            if (speculate_) hooks.draft = [&](std::span<const std::int64_t> seq, std::size_t room) { return drafter(seq, room); };
            hooks.token = [&](std::int64_t id) {
                Event e = out.token(id);
                job.drawn = out.drawn, job.phase = 2;
                if (q.trace) {
                    if (row == 0) after = io_snapshot(model_), step_seconds = seconds_since(t_step);
                    e.step = step_json(rec, before, after, step, step ? rec.tokens : fresh.size(), step_seconds, row++);
                }
                job.push(std::move(e));
                return !out.stopped;
            };
            hooks.step = [&](const DecodeStep& ds) {
                const IoSnapshot now = io_snapshot(model_);
                {
                    std::lock_guard<std::mutex> g(mu_);
                    reads_.add(shared, now, ds.fed, ds.yielded, 1);
                }
                shared = now;
                if (step++ == 0) {  // the prompt is in: keep the mark there
                    prefill = seconds_since(t_step);
                    if (mark_enabled_) mark_ = Mark{live_.tokens, live_.kda};
                    t_decode = std::chrono::steady_clock::now();
                }
                row = 0;
                before = io_snapshot(model_);
                t_step = std::chrono::steady_clock::now();
            };
            decode(model_, live_, fresh, {.max_new = q.max_tokens}, sampler(sp), hooks);
            log_cut(job, out);
            job.push(out.done(reused, start.queue_seconds, prefill, seconds_since(t_decode)));
        } catch (const std::exception& ex) {
            // The session may hold half a step: start the next request from scratch.
            mark_.reset();
            live_.reset();
            job.push(failure_event(ex, "the session was reset"));
        }
    }

    static void log_cut(const Job& job, const ReplyEvents& out) {
        if (job.cancelled && !out.stopped && out.drawn < job.req.max_tokens)
            std::fprintf(stderr, "kimik3 serve: the client left after %zu of %zu tokens: generation stopped\n", out.drawn, job.req.max_tokens);
    }
    // A failed step's error event (a weight read, or anything else), logged.
    static Event failure_event(const std::exception& ex, const char* after) {
        const Error* err = dynamic_cast<const Error*>(&ex);
        Event e;
        e.kind = Event::error;
        if (err && err->kind == ErrorKind::io)
            e.failure = ApiError{500, std::string("a weight read failed: ") + ex.what(), "", "weight_read_failed", "server_error"};
        else e.failure = ApiError{500, std::string("the generation failed: ") + ex.what(), "", "generation_failed", "server_error"};
        std::fprintf(stderr, "kimik3 serve: %s (%s)\n", e.failure.message.c_str(), after);
        return e;
    }

    Model& model_;
    const Tokenizer& tok_;
    std::size_t context_, queue_limit_;
    int threads_;
    std::size_t speculate_;  // --speculate: prompt lookup drafts per step (0: one token per step)
    std::size_t max_batch_;  // --max-batch: conversations per forward step (1: one at a time, loop)
    Session live_;
    std::vector<std::unique_ptr<Session>> extra_;  // sessions 1 .. max_batch - 1 (loop_batch)
    std::optional<Mark> mark_;
    bool mark_enabled_ = false;
    std::uint64_t mark_bytes_ = 0;
    StopTokens stops_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::shared_ptr<Job> current_;
    std::vector<std::shared_ptr<Job>> batched_;  // the jobs in loop_batch's batch
    SharedReads reads_;
    bool running_ = false, stopping_ = false;
    std::uint64_t jobs_done_ = 0;
    double job_seconds_ = 0;
    std::thread worker_;
};

// ---------------------------------------------------------------------------------------------------
// HTTP: who may ask, and what a request may be (all checked before its body is read)
// ---------------------------------------------------------------------------------------------------
inline std::string random_id(const char* prefix) {
    static std::atomic<std::uint64_t> counter{0};
    static const std::uint64_t salt = (std::uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s-%012llx%04llx", prefix, (unsigned long long)(salt & 0xFFFFFFFFFFFFull),
                  (unsigned long long)(counter.fetch_add(1) & 0xFFFF));
    return buf;
}

inline std::string lower(std::string s) {
    for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
}
inline bool ip_literal(const std::string& h) {  // 127.0.0.1, or [::1] as a Host header writes it
    unsigned char a[16];
    if (h.size() > 2 && h.front() == '[' && h.back() == ']') return inet_pton(AF_INET6, h.substr(1, h.size() - 2).c_str(), a) == 1;
    return inet_pton(AF_INET, h.c_str(), a) == 1;
}

// Who may use the server. The Host header must name what the server is bound to (a web page on another
// name that resolves here, DNS rebinding, is refused), an Origin header must be the server's own (a
// page on another site cannot post to it), and the API needs the key when there is one.
struct Access {
    std::string key;                  // empty: none was given (an empty key is refused at start)
    std::vector<std::string> hosts;   // accepted Host names (lower case; IPv6 in brackets)
    bool any_ip = false;              // bound to every address: any IP literal is a valid Host
    int port = 0;
    static Access bound_to(const std::string& host, int port, const std::string& allow) {
        Access a;
        a.port = port;
        const std::string h = lower(host);
        if (h == "0.0.0.0" || h == "::") a.any_ip = true, a.hosts = {"localhost"};
        else if (h == "localhost") a.hosts = {"localhost", "127.0.0.1", "[::1]"};
        else if (h == "::1") a.hosts = {"[::1]", "localhost"};
        else if (h.rfind("127.", 0) == 0) a.hosts = {h, "localhost"};
        else if (h.find(':') != std::string::npos) a.hosts = {"[" + h + "]"};
        else a.hosts = {h};
        for (std::size_t i = 0; i < allow.size();) {  // --allow-host a,b,c
            const std::size_t j = std::min(allow.find(',', i), allow.size());
            if (j > i) a.hosts.push_back(lower(allow.substr(i, j - i)));
            i = j + 1;
        }
        return a;
    }
    bool host_ok(const std::string& header) const {
        std::string name = lower(header), port_text;
        const std::size_t colon = name.rfind(':');
        if (colon != std::string::npos && name.find(']', colon) == std::string::npos)
            port_text = name.substr(colon + 1), name.resize(colon);
        if (port_text.empty() ? port != 80 : port_text != std::to_string(port)) return false;
        if (any_ip && ip_literal(name)) return true;
        return std::find(hosts.begin(), hosts.end(), name) != hosts.end();
    }
    bool key_ok(const httplib::Request& req) const {
        if (key.empty()) return true;
        const std::string h = req.get_header_value("Authorization"), want = "Bearer " + key;
        if (h.size() != want.size()) return false;
        unsigned char diff = 0;  // the same time whatever matches
        for (std::size_t i = 0; i < h.size(); ++i) diff |= static_cast<unsigned char>(h[i] ^ want[i]);
        return diff == 0;
    }
};

inline void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(error_json(e)) + "\n", "application/json");
}
// A refusal after which the connection is closed (the body, if any, was not read).
inline httplib::Server::HandlerResponse refuse_and_close(httplib::Response& res, const ApiError& e) {
    if (Connection* c = Connection::current()) c->close_after = true;
    res.set_header("Connection", "close");
    send_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
}

// Every request, after its headers and before its body: the checks above, then what a body may be. The
// two POST endpoints take a body of at most --max-body bytes, framed by Content-Length or chunked, not
// compressed, of type application/json (a page's cross-site form or text/plain post is refused; a
// cross-site application/json post needs a CORS preflight, which this server never grants).
inline httplib::Server::HandlerResponse admit(const httplib::Request& req, httplib::Response& res, const Access& access, const HttpLimits& lim) {
    using HR = httplib::Server::HandlerResponse;
    auto no = [&](int status, std::string message, std::string code) { return refuse_and_close(res, ApiError{status, std::move(message), "", std::move(code)}); };
    if (req.headers.size() > lim.max_headers + 4)  // + the four REMOTE_/LOCAL_ entries the library adds
        return no(431, "more than " + std::to_string(lim.max_headers) + " header fields", "too_many_headers");
    if (!req.has_header("Host") || !access.host_ok(req.get_header_value("Host")))
        return no(421, "the Host header '" + clip(req.get_header_value("Host"), 100) + "' does not name this server (--allow-host adds names)", "host_not_allowed");
    if (req.has_header("Origin") && lower(req.get_header_value("Origin")) != "http://" + lower(req.get_header_value("Host")))
        return no(403, "requests from another origin ('" + clip(req.get_header_value("Origin"), 100) + "') are refused", "origin_not_allowed");
    const bool post = req.method == "POST";
    if (req.method != "GET" && req.method != "HEAD" && !post) return no(405, "method " + clip(req.method, 20) + " is not allowed", "method_not_allowed");
    if (post && req.path != "/v1/chat/completions" && req.path != "/v1/completions")
        return no(404, "no such endpoint: POST " + clip(req.path, 100), "not_found");
    const bool api = req.path.rfind("/v1/", 0) == 0 || req.path.rfind("/kimik3/", 0) == 0;
    if (api && !access.key_ok(req)) {
        res.set_header("WWW-Authenticate", "Bearer");
        return no(401, "a valid API key is required: send 'Authorization: Bearer KEY'", "invalid_api_key");
    }
    const std::string te = lower(req.get_header_value("Transfer-Encoding")), cl = req.get_header_value("Content-Length");
    if (!post) {
        if (!te.empty() || (!cl.empty() && cl != "0")) return no(400, "a " + req.method + " request has no body", "unexpected_body");
        return HR::Unhandled;
    }
    if (!te.empty() && te != "chunked") return no(501, "Transfer-Encoding '" + clip(te, 40) + "' is not supported (only chunked)", "unsupported_transfer_encoding");
    if (!te.empty() && !cl.empty()) return no(400, "a body with both Content-Length and Transfer-Encoding", "bad_request");
    if (te.empty() && cl.empty()) return no(411, "a request body needs Content-Length (or chunked transfer encoding)", "length_required");
    if (!cl.empty() && (cl.size() > 18 || cl.find_first_not_of("0123456789") != std::string::npos))
        return no(400, "Content-Length '" + clip(cl, 40) + "' is not a number", "bad_request");
    if (!cl.empty() && std::stoull(cl) > lim.max_body)
        return no(413, "the request body is larger than this server's limit of " + std::to_string(lim.max_body) + " bytes (--max-body)", "request_too_large");
    if (const std::string ce = lower(req.get_header_value("Content-Encoding")); !ce.empty() && ce != "identity")
        return no(415, "Content-Encoding '" + clip(ce, 40) + "' is not accepted: send the body uncompressed", "unsupported_media_type");
    std::string type = lower(req.get_header_value("Content-Type"));
    type = type.substr(0, type.find(';'));
    while (!type.empty() && type.back() == ' ') type.pop_back();
    if (type != "application/json")
        return no(415, "the body must be sent as Content-Type: application/json, not '" + clip(type, 60) + "'", "unsupported_media_type");
    if (Connection* c = Connection::current()) c->begin_body();
    return HR::Unhandled;
}

// The body of an admitted POST, at most lim.max_body bytes whatever its framing. Throws ApiError.
inline std::string read_body(const httplib::ContentReader& reader, const HttpLimits& lim) {
    std::string body;
    bool too_big = false;
    const bool ok = reader([&](const char* d, std::size_t n) {
        if (body.size() + n > lim.max_body) return too_big = true, false;
        body.append(d, n);
        return true;
    });
    Connection* c = Connection::current();
    if (c) c->end_receiving();
    if (ok && !too_big) return body;
    if (c) c->close_after = true;
    if (too_big || (c && c->limit_hit() == Connection::Limit::size))
        throw ApiError{413, "the request body is larger than this server's limit of " + std::to_string(lim.max_body) + " bytes (--max-body)", "",
                       "request_too_large"};
    if (c && c->limit_hit() == Connection::Limit::time)
        throw ApiError{408, "the request body did not arrive within " + std::to_string(lim.body_time.count() / 1000) + " s", "", "request_timeout"};
    throw ApiError{400, "the request body could not be read (malformed chunked encoding, or the client left)", "", "bad_request"};
}

struct ServeContext {
    const Tokenizer& tok;
    Model& model;
    Engine& engine;
    ServeLimits limits;
    bool quiet = false;
    std::int64_t created = 0;
};

inline nlohmann::ordered_json usage_json(const Event& d) {
    return {{"prompt_tokens", d.prompt_tokens},
            {"completion_tokens", d.completion_tokens},
            {"total_tokens", d.prompt_tokens + d.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", std::min(d.reused, d.prompt_tokens)}}}};
}

inline nlohmann::ordered_json timings_json(const Event& d) {
    return {{"queue_seconds", d.queue_seconds},
            {"prefill_seconds", d.prefill_seconds},
            {"decode_seconds", d.decode_seconds},
            {"reused_tokens", d.reused}};
}

// What one reply needs besides its events: its names, and how to log its end.
struct ReplyInfo {
    std::string id, model, what;  // what: "POST /v1/chat/completions"
    std::int64_t created = 0;
    bool chat = true, quiet = false;
    std::chrono::steady_clock::time_point t0;
    void log_done(const char* how, const Event& d) const {
        if (quiet) return;
        std::fprintf(stderr, "%s %s: %zu prompt tokens (%zu reused), %zu generated, %.3f s\n", what.c_str(), how, d.prompt_tokens, d.reused,
                     d.completion_tokens, seconds_since(t0));
    }
    void log_error(const ApiError& e) const {
        if (!quiet) std::fprintf(stderr, "%s %d %s\n", what.c_str(), e.status, clip(e.message, 300).c_str());
    }
};

// A reply the server cut short or cancelled, said as such: shutdown (SIGINT/SIGTERM) is a 503
// "server_shutdown", never a normal finish; a client that left is "client_closed".
inline std::optional<ApiError> cut_short(const Job& job, const Event& e) {
    const bool cut = e.kind == Event::error ? e.failure.code == "cancelled"
                                            : e.kind == Event::done && e.finish_reason != "stop" && e.completion_tokens < job.req.max_tokens;
    if (!cut) return std::nullopt;
    if (job.shutdown)
        return ApiError{503, "the server is shutting down: the reply was stopped after " + std::to_string(e.completion_tokens) + " of at most " +
                                 std::to_string(job.req.max_tokens) + " tokens", "", "server_shutdown", "server_error"};
    if (job.client_left) return ApiError{499, "the client closed its connection: the request was cancelled", "", "client_closed"};
    return std::nullopt;
}

// Not streamed: wait for the whole reply, asking the request's own connection every 50 ms whether its
// client is still there (whether tokens arrive or not: when they come faster than that, a check made
// only on a quiet queue would never run).
inline void reply_whole(const std::shared_ptr<Job>& job, const ReplyInfo& info, httplib::Response& res) {
    const GenRequest& q = job->req;
    Connection* conn = Connection::current();
    std::string content, reasoning;
    std::vector<ToolCallOut> tool_calls;
    std::vector<std::int64_t> ids;
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    Event e;
    auto checked = std::chrono::steady_clock::now();
    for (;;) {
        const bool got = job->pop(e, std::chrono::milliseconds(50));
        if (std::chrono::steady_clock::now() - checked >= std::chrono::milliseconds(50)) {
            checked = std::chrono::steady_clock::now();
            if (conn && !job->client_left && conn->peer_gone()) job->client_left = true, job->cancelled = true;  // stop generating for it
        }
        if (!got) continue;
        if (e.kind == Event::token) {
            content += e.content, reasoning += e.reasoning, ids.push_back(e.id);
            tool_calls.insert(tool_calls.end(), e.calls.begin(), e.calls.end());
            if (q.trace) steps.push_back({{"token", e.id}, {"piece", e.piece}, {"step", std::move(e.step)}});
        }
        if (e.kind == Event::done || e.kind == Event::error) break;
    }
    if (const std::optional<ApiError> cut = cut_short(*job, e)) return info.log_error(*cut), send_error(res, *cut);
    if (e.kind == Event::error) return info.log_error(e.failure), send_error(res, e.failure);
    nlohmann::ordered_json choice;
    choice["index"] = 0;
    if (info.chat) {
        nlohmann::ordered_json msg = {{"role", "assistant"}, {"content", content}};
        if (q.thinking) msg["reasoning_content"] = reasoning;
        if (!tool_calls.empty()) msg["tool_calls"] = tool_calls_json(tool_calls, 0, false);
        if (!tool_calls.empty() && content.empty()) msg["content"] = nullptr;
        choice["message"] = msg;
    } else {
        choice["text"] = content;
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = e.finish_reason;
    nlohmann::ordered_json out = {{"id", info.id},
                                  {"object", info.chat ? "chat.completion" : "text_completion"},
                                  {"created", info.created},
                                  {"model", info.model},
                                  {"choices", nlohmann::ordered_json::array({choice})},
                                  {"usage", usage_json(e)}};
    if (q.extension) {
        out["kimik3"] = timings_json(e);
        out["kimik3"]["prompt_ids"] = q.prompt;
        out["kimik3"]["ids"] = ids;
        if (q.trace) out["kimik3"]["tokens"] = std::move(steps);
    }
    info.log_done("200", e);
    res.set_content(dump(out) + "\n", "application/json");
}

// Streamed: server-sent events, one chunk per token. The library asks the provider for more while its
// sink (our Connection) is writable; a client that left ends the stream and cancels the job.
inline void reply_stream(const std::shared_ptr<Job>& job, const ReplyInfo& info, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    struct StreamState {
        bool role_sent = false;
        std::size_t calls = 0;  // tool calls streamed so far: the next one's index
    };
    auto st = std::make_shared<StreamState>();
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, info, st](std::size_t, httplib::DataSink& sink) {
            const GenRequest& q = job->req;
            const bool chat = info.chat;
            auto send = [&](const nlohmann::ordered_json& j) {
                const std::string s = "data: " + dump(j) + "\n\n";
                return sink.write(s.data(), s.size());
            };
            auto chunk = [&](nlohmann::ordered_json delta_or_text, const nlohmann::ordered_json& finish) {
                nlohmann::ordered_json c = {{"index", 0}};
                if (chat) c["delta"] = std::move(delta_or_text);
                else c["text"] = std::move(delta_or_text), c["logprobs"] = nullptr;
                c["finish_reason"] = finish;
                return nlohmann::ordered_json{{"id", info.id},
                                              {"object", chat ? "chat.completion.chunk" : "text_completion"},
                                              {"created", info.created},
                                              {"model", info.model},
                                              {"choices", nlohmann::ordered_json::array({c})}};
            };
            Event e;
            while (!job->pop(e, std::chrono::milliseconds(50)))
                if (!sink.is_writable()) return job->client_left = true, job->cancelled = true, false;  // the client left
            bool ok = true;
            if (chat && !st->role_sent && e.kind != Event::error) {
                st->role_sent = true;
                ok = send(chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
            }
            const std::optional<ApiError> cut = cut_short(*job, e);
            if (ok && e.kind == Event::token) {
                nlohmann::ordered_json delta = nlohmann::ordered_json::object();
                if (!e.content.empty()) delta["content"] = e.content;
                if (!e.reasoning.empty()) delta["reasoning_content"] = e.reasoning;
                if (!e.calls.empty()) delta["tool_calls"] = tool_calls_json(e.calls, st->calls, true), st->calls += e.calls.size();
                nlohmann::ordered_json c = chunk(chat ? delta : nlohmann::ordered_json(e.content), nullptr);
                if (q.extension) {
                    c["kimik3"] = {{"token", e.id}, {"piece", e.piece}};
                    if (q.trace) c["kimik3"]["step"] = std::move(e.step);
                }
                ok = send(c);
            } else if (ok && (e.kind == Event::error || cut)) {
                const ApiError& f = cut ? *cut : e.failure;
                ok = send(error_json(f));  // an error event ends the stream (no [DONE])
                info.log_error(f);
                if (ok) sink.done();
            } else if (ok && e.kind == Event::done) {
                nlohmann::ordered_json c = chunk(chat ? nlohmann::ordered_json::object() : nlohmann::ordered_json(""), e.finish_reason);
                if (q.extension) c["kimik3"] = timings_json(e);
                ok = send(c);
                if (ok && q.include_usage) {
                    nlohmann::ordered_json u = chunk(nlohmann::ordered_json::object(), nullptr);
                    u["choices"] = nlohmann::ordered_json::array();
                    u["usage"] = usage_json(e);
                    ok = send(u);
                }
                if (ok) ok = sink.write("data: [DONE]\n\n", 14);
                if (ok) sink.done(), info.log_done("200 stream", e);
            }
            if (!ok) job->client_left = true, job->cancelled = true;
            return ok;
        },
        [job](bool) { job->cancelled = true; });  // whatever ended the response, the job has no reader left
}

// POST /v1/chat/completions, /v1/completions: read and check the body, queue the job, reply.
inline void handle_generate(ServeContext& cx, const HttpLimits& lim, const httplib::Request& req, httplib::Response& res,
                            const httplib::ContentReader& reader, bool chat) {
    ReplyInfo info{random_id(chat ? "chatcmpl" : "cmpl"), cx.limits.model_name, req.method + " " + req.path, std::int64_t(std::time(nullptr)),
                   chat, cx.quiet, std::chrono::steady_clock::now()};
    auto job = std::make_shared<Job>();
    job->name = info.id;
    try {
        job->req = parse_request(read_body(reader, lim), chat, cx.tok, cx.limits);
    } catch (const ApiError& e) {
        if (Connection* c = Connection::current(); c && c->close_after) res.set_header("Connection", "close");
        return info.log_error(e), send_error(res, e);
    }
    if (!cx.engine.submit(job)) {
        res.set_header("Retry-After", std::to_string(cx.engine.retry_after_seconds()));
        if (!cx.quiet) std::fprintf(stderr, "%s 503 (queue full)\n", info.what.c_str());
        return send_error(res, ApiError{503, "the server is busy: its generations run and the queue is full; retry later", "", "server_overloaded",
                                        "server_error"});
    }
    if (job->req.stream) reply_stream(job, info, res);
    else reply_whole(job, info, res);
}

inline nlohmann::ordered_json model_json(const ServeContext& cx) {
    return {{"id", cx.limits.model_name}, {"object", "model"}, {"created", cx.created}, {"owned_by", "kimik3"}};
}

inline nlohmann::ordered_json info_json(ServeContext& cx) {
    const Config& c = cx.model.config;
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const LayerPlan& l : c.layers) layers.push_back({{"attn", l.attn == AttnKind::KDA ? "KDA" : "MLA"}, {"ffn", l.ffn == FfnKind::MoE ? "MoE" : "dense"}});
    const Plan& p = cx.model.plan;
    return {{"model", cx.limits.model_name},
            {"context", cx.limits.context},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"num_experts", c.num_experts},
            {"experts_per_token", c.num_experts_per_token},
            {"attn_res_block_size", c.attn_res_block_size},
            {"layers", layers},
            {"plan", {{"budget_bytes", p.budget}, {"expected_bytes", p.total()}, {"pinned_layers", p.pinned_layers()},
                      {"lm_head_pinned", p.lm_head_pinned}, {"expert_slots", p.expert_slots}}},
            {"prompt_mark", cx.engine.mark_enabled()},
            {"max_batch", cx.engine.max_batch()}};
}

inline bool local_host(const std::string& h) { return h == "127.0.0.1" || h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0; }

// ---------------------------------------------------------------------------------------------------
// kimik3 serve: parse, build, listen
// ---------------------------------------------------------------------------------------------------
struct ServeOptions {
    std::string dir, host = "127.0.0.1", name, allow_hosts;
    int port = 8080;
    std::size_t context = 4096, queue = 4, speculate = 0, max_batch = 1;
    HttpLimits http;
    ModelArgs model;
    std::string key;
    bool key_on_command_line = false, quiet = false;
};

// The API key: from --api-key KEY, --api-key-file PATH (its first line) or KIMIK3_API_KEY, at most one of
// them; an empty key is refused, never taken as "no key".
inline std::string api_key(Options& o, bool& on_command_line) {
    const std::optional<std::string> arg = o.text("--api-key"), file = o.text("--api-key-file");
    const char* env = std::getenv("KIMIK3_API_KEY");
    if (int(bool(arg)) + int(bool(file)) + int(env != nullptr) > 1) o.refuse("give the API key one way: --api-key, --api-key-file or KIMIK3_API_KEY");
    std::string key;
    if (arg) key = *arg, on_command_line = true;
    else if (file) {
        key = read_file_capped(*file, 4096, "API key file");
        key = key.substr(0, key.find('\n'));
        if (!key.empty() && key.back() == '\r') key.pop_back();
        if (key.empty()) o.refuse("--api-key-file: '" + *file + "' starts with an empty line: no key");
    } else if (env) {
        key = env;
        if (key.empty()) o.refuse("KIMIK3_API_KEY is set but empty: unset it to serve without a key, or give a key");
    }
    for (char c : key)
        if (c <= ' ' || c == 127) o.refuse("the API key must be printable characters without spaces");
    return key;
}

inline ServeOptions parse_serve(std::vector<std::string> args) {
    Options o(std::move(args), kServeUsage);
    ServeOptions s;
    s.host = o.text("--host").value_or(s.host);
    s.port = int(o.count("--port", 0, 65535).value_or(8080));
    s.name = o.text("--model-name").value_or("");
    s.allow_hosts = o.text("--allow-host").value_or("");
    s.queue = std::size_t(o.count("--queue", 0, 256).value_or(4));
    if (const auto b = o.text("--max-body")) s.http.max_body = std::size_t(std::min<std::uint64_t>(parse_size(*b), 1ull << 32));
    if (s.http.max_body < 64) o.refuse("--max-body must be at least 64 bytes");
    if (const auto t = o.count("--header-time", 1, 3600)) s.http.head_time = std::chrono::seconds(*t);
    if (const auto t = o.count("--body-time", 1, 3600)) s.http.body_time = std::chrono::seconds(*t);
    s.key = api_key(o, s.key_on_command_line);
    s.speculate = speculate_arg(o);
    s.max_batch = std::size_t(o.count("--max-batch", 1, 256).value_or(1));
    s.model = model_args(o);
    s.context = std::size_t(s.model.context.value_or(4096));
    if (s.context < 2) o.refuse("--context must be at least 2");
    s.quiet = o.flag("--quiet");
    s.dir = o.positional(1, "MODEL_DIR")[0];
    if (s.name.empty()) {
        std::string d = s.dir;
        while (d.size() > 1 && d.back() == '/') d.pop_back();
        s.name = d.substr(d.find_last_of('/') == std::string::npos ? 0 : d.find_last_of('/') + 1);
    }
    return s;
}

inline int g_stop_pipe[2] = {-1, -1};

inline int cmd_serve(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kServeUsage, stdout), kExitOk;
    const ServeOptions so = parse_serve(std::move(args));
    ModelOptions mo;
    mo.budget = so.model.budget;
    mo.on_plan = show_and_check_plan;
    mo.plan.context = so.context;
    mo.plan.sessions = so.max_batch;  // --max-batch N: N carried states and MLA caches (appendix 13a)
    mo.trunk_dir = so.model.trunk;
    mo.direct = so.model.direct;
    if (so.model.threads > 0) set_threads(so.model.threads);
    ::signal(SIGPIPE, SIG_IGN);  // a client that left is a failed write, not the end of the server

    const Tokenizer tok = Tokenizer::load(so.dir);
    std::unique_ptr<Model> owned;
    try {
        owned = std::make_unique<Model>(so.dir, mo);
    } catch (const Error& e) {  // a batch that does not fit: say what each conversation takes
        if (e.kind != ErrorKind::budget || so.max_batch < 2) throw;
        Checkpoint ck(so.dir);
        const Config c = load_config(so.dir);
        fail(ErrorKind::budget, std::string(e.what()) + " (--max-batch " + std::to_string(so.max_batch) + ": " +
                                    per_conversation(take_census(ck, c, bind_tensors(ck, c)), so.context) + ")");
    }
    Model& model = *owned;
    if (const char* f = std::getenv("KIMIK3_TEST_FAIL_SERVE_READS"); f && *f) {
        long n = -1, m = 0;
        if (std::sscanf(f, "%ld:%ld", &n, &m) != 2 || n < 0 || m < 1) throw Usage("KIMIK3_TEST_FAIL_SERVE_READS must be N:M\n");
        g_serve_fail_from = n, g_serve_fail_count = m, detail::pread_hook = serve_failing_pread;
    }
    Engine engine(model, tok, so.context, so.queue, so.model.threads, so.speculate, so.max_batch);
    ServeContext cx{tok, model, engine, ServeLimits{so.name, so.context, std::size_t(model.config.vocab_size)}, so.quiet, std::int64_t(std::time(nullptr))};

    GuardedServer svr(so.http);
    const HttpLimits& lim = svr.limits();
    Access access;  // filled once the port is known
    svr.set_write_timeout(30);
    svr.set_error_handler(httplib::Server::HandlerWithResponse([&](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // ours already
        ApiError e{res.status, "", "", "", res.status >= 500 ? "server_error" : "invalid_request_error"};
        if (res.status == 404) e.message = "no such endpoint: " + clip(req.method, 20) + " " + clip(req.path, 100), e.code = "not_found";
        else if (res.status == 413) e.message = "the request body is larger than this server's limit of " + std::to_string(lim.max_body) + " bytes (--max-body)", e.code = "request_too_large";
        else if (res.status == 405) e.message = "method not allowed", e.code = "method_not_allowed";
        else if (res.status == 414) e.message = "the request line is too long", e.code = "uri_too_long";
        else e.message = "bad request", e.code = "bad_request";
        send_error(res, e);
        return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception& e) {
            what = clip(e.what());
        } catch (...) {
        }
        send_error(res, ApiError{500, what, "", "internal_error", "server_error"});
    });
    svr.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) { return admit(req, res, access, lim); });
    svr.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& r) {
        handle_generate(cx, lim, req, res, r, true);
    });
    svr.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& r) {
        handle_generate(cx, lim, req, res, r, false);
    });
    svr.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
        res.set_content(dump({{"object", "list"}, {"data", nlohmann::ordered_json::array({model_json(cx)})}}) + "\n", "application/json");
    });
    svr.Get("/v1/models/(.+)", [&](const httplib::Request& req, httplib::Response& res) {
        if (req.matches[1] != cx.limits.model_name)
            return send_error(res, ApiError{404, "the model '" + clip(req.matches[1], 100) + "' does not exist", "model", "model_not_found"});
        res.set_content(dump(model_json(cx)) + "\n", "application/json");
    });
    svr.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
        res.set_content(dump({{"status", "ok"}, {"model", cx.limits.model_name}, {"busy", engine.busy()}, {"queued", engine.queued()}}) + "\n",
                        "application/json");
    });
    svr.Get("/kimik3/info", [&](const httplib::Request&, httplib::Response& res) { res.set_content(dump(info_json(cx)) + "\n", "application/json"); });
    svr.Get("/kimik3/status", [&](const httplib::Request&, httplib::Response& res) { res.set_content(dump(engine.status_json()) + "\n", "application/json"); });
    const std::string page(kimik3_index_html, std::size_t(kimik3_index_html_end - kimik3_index_html));
    auto serve_page = [&page](const httplib::Request&, httplib::Response& res) {
        res.set_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'");
        res.set_content(page, "text/html; charset=utf-8");
    };
    svr.Get("/", serve_page);
    svr.Get("/index.html", serve_page);

    const std::string& host = so.host;
    const int bound = so.port == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, so.port) ? so.port : -1);
    if (bound < 0) fail(ErrorKind::runtime, "cannot listen on " + host + ":" + std::to_string(so.port) + " (in use, or not an address of this machine)");
    access = Access::bound_to(host, bound, so.allow_hosts);
    access.key = so.key;
    if (so.key_on_command_line)
        std::fprintf(stderr, "kimik3 serve: note: a key given with --api-key is visible to every user of this machine in the process list; "
                             "--api-key-file FILE or KIMIK3_API_KEY keep it private\n");
    if (!local_host(host))
        std::fprintf(stderr, "kimik3 serve: WARNING: listening on %s: anyone who can reach this machine can use the model%s\n", host.c_str(),
                     so.key.empty() ? " (no authentication: give --api-key-file FILE)" : " (with the API key; the traffic is not encrypted)");
    if (so.max_batch > 1)
        std::fprintf(stderr, "kimik3 serve: batch: up to %zu conversations per forward step, each on a session of its own; state reuse: a request "
                             "takes the free session that holds the longest prefix of its prompt%s\n", so.max_batch,
                     so.speculate ? "; each verifies its own --speculate drafts in the shared steps" : "");
    else std::fprintf(stderr, "kimik3 serve: state reuse: %s\n",
                 engine.mark_enabled() ? ("the live conversation, and the KDA states at the end of the last prompt (" +
                                          human_bytes(double(engine.mark_bytes())) + ")").c_str()
                                       : ("the live conversation only (the budget has no room for a second copy of the KDA states, " +
                                          human_bytes(double(engine.mark_bytes())) + ")").c_str());
    const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    std::fprintf(stderr, "kimik3 serve: listening on http://%s:%d (model '%s', context %zu, queue %zu); Ctrl-C stops\n", shown.c_str(), bound,
                 so.name.c_str(), so.context, so.queue);
    std::fflush(stderr);

    // SIGINT/SIGTERM (from now on; while loading they end the program as usual): the handler writes a
    // byte to a pipe, and a thread that waits on it stops the engine (the running generation ends after
    // its current token and is answered as cut by the shutdown, queued ones are cancelled), then the
    // listener.
    if (::pipe(g_stop_pipe) != 0) fail(ErrorKind::runtime, std::string("pipe: ") + std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = [](int) { [[maybe_unused]] const ssize_t n = ::write(g_stop_pipe[1], "x", 1); };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::thread stopper([&] {
        char c;
        while (::read(g_stop_pipe[0], &c, 1) < 0 && errno == EINTR) {
        }
        engine.stop();
        svr.stop();
    });
    const bool ok = svr.listen_after_bind();
    [[maybe_unused]] const ssize_t n = ::write(g_stop_pipe[1], "x", 1);  // listen ended on its own: wake the stopper
    stopper.join();
    engine.stop();
    std::fprintf(stderr, "kimik3 serve: stopped\n");
    return ok ? kExitOk : kExitRuntime;
}

}  // namespace kimik3::cli
