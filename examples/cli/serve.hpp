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
//                  and resets the session; the server goes on.
//
//   Generation is chapter 13's decode loop, as in `run` and `chat` (with --speculate, chapter 16's
//   prompt lookup: the same tokens in fewer steps). What the page at / shows comes from the engine's
//   real per-step state, through the StepRecord the loop hands to each forward step (chapter 13): the
//   experts each MoE layer chose with their combine weights, the AttnRes depth weights of each mix, and
//   the trunk and expert-cache counters of that step (a verify step's tokens share them). API clients get
//   none of it unless they ask ("kimik3": {"trace": true} in the request).
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
// ====================================================================================================
#pragma once

#include <httplib.h>
#include <dirent.h>
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
#include "run.hpp"
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
    "AttnRes depth weights and reads. One generation at a time; the conversation's state carries over when a\n"
    "request extends the one before.\n"
    "\n"
    "  --host ADDR       address to listen on (default 127.0.0.1: this machine only). Anything else exposes\n"
    "                    the server to the network: give --api-key then\n"
    "  --port N          TCP port (default 8080; 0: any free port, printed at start)\n"
    "  --api-key KEY     require 'Authorization: Bearer KEY' on /v1/ and /kimik3/ (401 otherwise)\n"
    "  --model-name ID   the model id clients send (default: MODEL_DIR's last component)\n"
    "  --context N       positions a conversation may reach (default 4096)\n"
    "  --queue N         requests that may wait while one generates (default 4; more get 503)\n"
    "  --max-body SIZE   largest request body (default 4M; larger gets 413)\n"
    "  --speculate N     speculative decoding, as for kimik3 run: the same replies, bit for bit, in fewer steps\n"
    "  --budget SIZE, --preset NAME, --trunk DIR, --no-direct, --threads N   as for kimik3 run\n"
    "  --quiet           no request log on stderr\n"
    "\n"
    "Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET / (the page).\n"
    "Request fields: messages (or prompt), stream, stream_options.include_usage, max_tokens (or\n"
    "max_completion_tokens), temperature (default 1), top_p, top_k, seed (default: random), stop,\n"
    "ignore_eos (true: end-of-turn tokens do not end the reply; for benchmarks and tests),\n"
    "thinking ({\"type\": \"enabled\" | \"disabled\", \"effort\": low|high|max}, or a boolean; default on: replies carry\n"
    "reasoning_content), reasoning_effort, chat_template_kwargs {thinking, thinking_effort}, tools (also in a system\n"
    "message), tool_choice (auto, none, required), response_format (text, json_object, json_schema: told, not enforced),\n"
    "kimik3 ({\"trace\": true}: per-token token ids, experts, depth weights and I/O).\n"
    "Stop with Ctrl-C (SIGINT) or SIGTERM. Exit codes as for run.\n";

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
    std::atomic<bool> cancelled{false};
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

class Engine {
  public:
    Engine(Model& model, const Tokenizer& tok, std::size_t context, std::size_t queue_limit, int threads, std::size_t speculate = 0)
        : model_(model), tok_(tok), context_(context), queue_limit_(queue_limit), threads_(threads), speculate_(speculate),
          live_(model.config, context), stops_(stop_tokens(tok)) {
        std::uint64_t kda = 0;
        for (const auto& k : live_.kda)
            if (k) kda += k->bytes();
        mark_bytes_ = kda;
        // The mark is a second copy of the KDA states: kept only when the budget has room beside the plan.
        mark_enabled_ = model.plan.budget >= model.plan.total() && model.plan.budget - model.plan.total() >= kda;
        worker_ = std::thread([this] { loop(); });
    }
    ~Engine() { stop(); }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    bool mark_enabled() const { return mark_enabled_; }
    std::uint64_t mark_bytes() const { return mark_bytes_; }

    // Queues a job; false when the queue is full (the caller answers 503).
    bool submit(const std::shared_ptr<Job>& job) {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (stopping_ || queue_.size() + (running_ ? 1 : 0) >= queue_limit_ + 1) return false;
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
        return running_;
    }
    // A guess for Retry-After: the mean job time so far times the jobs ahead, at least a second.
    int retry_after_seconds() {
        std::lock_guard<std::mutex> g(mu_);
        const double mean = jobs_done_ ? job_seconds_ / double(jobs_done_) : 1.0;
        return std::max(1, int(std::ceil(mean * double(queue_.size() + 1))));
    }
    void stop() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stopping_ = true;
            for (auto& j : queue_) j->cancelled = true;
            if (current_) current_->cancelled = true;
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
            const auto t0 = std::chrono::steady_clock::now();
            if (job->cancelled) job->push(cancelled_event());
            else run(*job);
            {
                std::lock_guard<std::mutex> g(mu_);
                running_ = false;
                current_.reset();
                ++jobs_done_;
                job_seconds_ += seconds_since(t0);
            }
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
            const std::vector<std::int64_t> fresh(q.prompt.begin() + long(reused), q.prompt.end());
            SamplingParams sp = q.sampling;  // the token at position p draws output p of the seed's stream (chapter 15)
            sp.seed = q.seed;
            ReplyReader reader(tok_, q.chat, q.thinking);
            Utf8Stream raw;  // each token's own text, markup included (the page shows it)
            ToolCallReader calls(tok_);  // the reply's tool calls, by token id (serve_api.hpp)
            StopMatcher stop(q.stop);
            StepRecord rec;
            PromptLookup drafter{.max_draft = speculate_};
            // the step being read: its index (0: the prompt), the next row of its logits, its reads and time
            std::size_t drawn = 0, step = 0, row = 0;
            IoSnapshot before = io_snapshot(model_), after = before;
            auto t_step = std::chrono::steady_clock::now();
            double step_seconds = 0, prefill = 0;
            std::string finish = "length";
            auto t_decode = t_step;
            DecodeHooks hooks;
            hooks.record = q.trace ? &rec : nullptr;
            hooks.cancelled = [&] { return job.cancelled.load(); };
            if (speculate_) hooks.draft = [&](std::span<const std::int64_t> seq, std::size_t room) { return drafter(seq, room); };
            hooks.token = [&](std::int64_t id) {
                ++drawn;
                Event e;
                e.kind = Event::token;
                e.id = id;
                const std::uint32_t u = std::uint32_t(id);
                const bool is_stop = !q.ignore_eos && stops_.contains(u);
                e.piece = raw.push(u < tok_.vocab_size() ? std::string(tok_.token_bytes(u)) : std::string());
                if (!is_stop) {
                    ReplyReader::Delta d = reader.push(u);
                    if (q.chat) e.calls = calls.push(u);
                    e.content = stop.push(d.content);
                    e.reasoning = d.reasoning;
                }
                if (is_stop || stop.stopped || drawn == q.max_tokens) {  // the last token: flush what is held back
                    const ReplyReader::Delta d = reader.finish();
                    e.content += stop.push(d.content);
                    e.reasoning += d.reasoning;
                    e.content += stop.finish();
                    if (q.chat) for (ToolCallOut& c : calls.finish()) e.calls.push_back(std::move(c));
                }
                if (q.tool_choice == "none") e.calls.clear();  // told not to call: what it wrote anyway is not a call (as vLLM)
                if (q.trace) {
                    if (row == 0) after = io_snapshot(model_), step_seconds = seconds_since(t_step);
                    e.step = step_json(rec, before, after, step, step ? rec.tokens : fresh.size(), step_seconds, row++);
                }
                job.push(std::move(e));
                if (is_stop || stop.stopped) finish = "stop";
                return finish != "stop";
            };
            hooks.step = [&](const DecodeStep&) {
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
            if (job.cancelled && finish != "stop" && drawn < q.max_tokens)
                std::fprintf(stderr, "kimik3 serve: the client left after %zu of %zu tokens: generation stopped\n", drawn, q.max_tokens);
            Event d;
            d.kind = Event::done;
            d.finish_reason = finish == "stop" && calls.count() > 0 && q.tool_choice != "none" ? "tool_calls" : finish;
            d.prompt_tokens = q.prompt_tokens;
            d.completion_tokens = drawn;
            d.reused = reused;
            d.queue_seconds = start.queue_seconds;
            d.prefill_seconds = prefill;
            d.decode_seconds = seconds_since(t_decode);
            job.push(std::move(d));
        } catch (const std::exception& ex) {
            // The session may hold half a step: start the next request from scratch.
            mark_.reset();
            live_.reset();
            const Error* err = dynamic_cast<const Error*>(&ex);
            Event e;
            e.kind = Event::error;
            if (err && err->kind == ErrorKind::io)
                e.failure = ApiError{500, std::string("a weight read failed: ") + ex.what(), "", "weight_read_failed", "server_error"};
            else e.failure = ApiError{500, std::string("the generation failed: ") + ex.what(), "", "generation_failed", "server_error"};
            std::fprintf(stderr, "kimik3 serve: %s (the session was reset)\n", e.failure.message.c_str());
            job.push(std::move(e));
        }
    }

    Model& model_;
    const Tokenizer& tok_;
    std::size_t context_, queue_limit_;
    int threads_;
    std::size_t speculate_;  // --speculate: prompt lookup drafts per step (0: one token per step)
    Session live_;
    std::optional<Mark> mark_;
    bool mark_enabled_ = false;
    std::uint64_t mark_bytes_ = 0;
    StopTokens stops_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::shared_ptr<Job> current_;
    bool running_ = false, stopping_ = false;
    std::uint64_t jobs_done_ = 0;
    double job_seconds_ = 0;
    std::thread worker_;
};

// ---------------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------------
// The connection of a request (for a non-streaming reply, whose handler has no stream to ask): the
// socket whose peer and local ports are the request's. While the handler runs, the socket is its own.
inline int request_socket(const httplib::Request& req) {
    DIR* d = opendir("/proc/self/fd");
    if (!d) return -1;
    int found = -1;
    while (dirent* e = readdir(d)) {
        const int fd = std::atoi(e->d_name);
        if (fd < 3) continue;
        sockaddr_storage peer{}, local{};
        socklen_t pl = sizeof peer, ll = sizeof local;
        if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
        auto port = [](const sockaddr_storage& s) {
            return s.ss_family == AF_INET ? ntohs(reinterpret_cast<const sockaddr_in&>(s).sin_port)
                                          : ntohs(reinterpret_cast<const sockaddr_in6&>(s).sin6_port);
        };
        if (port(peer) == req.remote_port && port(local) == req.local_port) {
            found = fd;
            break;
        }
    }
    closedir(d);
    return found;
}
// False once the peer has closed its end (a read would return 0) or the socket failed.
inline bool socket_alive(int fd) {
    if (fd < 0) return true;  // unknown: assume alive
    char c;
    const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

inline std::string random_id(const char* prefix) {
    static std::atomic<std::uint64_t> counter{0};
    static const std::uint64_t salt = (std::uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s-%012llx%04llx", prefix, (unsigned long long)(salt & 0xFFFFFFFFFFFFull),
                  (unsigned long long)(counter.fetch_add(1) & 0xFFFF));
    return buf;
}

inline bool bearer_ok(const httplib::Request& req, const std::string& key) {
    const std::string h = req.get_header_value("Authorization"), want = "Bearer " + key;
    if (h.size() != want.size()) return false;
    unsigned char diff = 0;  // the same time whatever matches
    for (std::size_t i = 0; i < h.size(); ++i) diff |= static_cast<unsigned char>(h[i] ^ want[i]);
    return diff == 0;
}

inline void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(error_json(e)) + "\n", "application/json");
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

inline void handle_generate(ServeContext& cx, const httplib::Request& req, httplib::Response& res, bool chat) {
    const auto t0 = std::chrono::steady_clock::now();
    auto job = std::make_shared<Job>();
    try {
        job->req = parse_request(req.body, chat, cx.tok, cx.limits);
    } catch (const ApiError& e) {
        if (!cx.quiet) std::fprintf(stderr, "%s %s %d %s\n", req.method.c_str(), req.path.c_str(), e.status, e.message.c_str());
        return send_error(res, e);
    }
    if (!cx.engine.submit(job)) {
        res.set_header("Retry-After", std::to_string(cx.engine.retry_after_seconds()));
        if (!cx.quiet) std::fprintf(stderr, "%s %s 503 (queue full)\n", req.method.c_str(), req.path.c_str());
        return send_error(res, ApiError{503, "the server is busy: one generation runs and the queue is full; retry later", "",
                                        "server_overloaded", "server_error"});
    }
    const std::string id = random_id(chat ? "chatcmpl" : "cmpl");
    const std::int64_t created = std::time(nullptr);
    const GenRequest q = job->req;
    const std::string model = cx.limits.model_name;
    const bool quiet = cx.quiet;
    const std::string what = req.method + " " + req.path;
    auto log_done = [quiet, what, t0](const char* how, const Event& d) {
        if (quiet) return;
        std::fprintf(stderr, "%s %s: %zu prompt tokens (%zu reused), %zu generated, %.3f s\n", what.c_str(), how, d.prompt_tokens,
                     d.reused, d.completion_tokens, seconds_since(t0));
    };

    if (!q.stream) {
        const int fd = request_socket(req);
        std::string content, reasoning;
        std::vector<ToolCallOut> tool_calls;
        std::vector<std::int64_t> ids;
        nlohmann::ordered_json steps = nlohmann::ordered_json::array();
        Event e;
        // Every 50 ms, whether tokens arrive or not, look whether the client is still there: when tokens come
        // faster than that, a check made only on a quiet queue would never run.
        auto checked = std::chrono::steady_clock::now();
        for (;;) {
            const bool got = job->pop(e, std::chrono::milliseconds(50));
            if (std::chrono::steady_clock::now() - checked >= std::chrono::milliseconds(50)) {
                checked = std::chrono::steady_clock::now();
                if (!socket_alive(fd)) job->cancelled = true;  // the client left: stop generating for it
            }
            if (!got) continue;
            if (e.kind == Event::token) {
                content += e.content, reasoning += e.reasoning, ids.push_back(e.id);
                tool_calls.insert(tool_calls.end(), e.calls.begin(), e.calls.end());
                if (q.trace) steps.push_back({{"token", e.id}, {"piece", e.piece}, {"step", std::move(e.step)}});
            }
            if (e.kind == Event::done || e.kind == Event::error) break;
        }
        if (e.kind == Event::error) {
            if (!quiet) std::fprintf(stderr, "%s %d %s\n", what.c_str(), e.failure.status, e.failure.message.c_str());
            return send_error(res, e.failure);
        }
        nlohmann::ordered_json choice;
        choice["index"] = 0;
        if (chat) {
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
        nlohmann::ordered_json out = {{"id", id},
                                      {"object", chat ? "chat.completion" : "text_completion"},
                                      {"created", created},
                                      {"model", model},
                                      {"choices", nlohmann::ordered_json::array({choice})},
                                      {"usage", usage_json(e)}};
        if (q.extension) {
            out["kimik3"] = timings_json(e);
            out["kimik3"]["prompt_ids"] = q.prompt;
            out["kimik3"]["ids"] = ids;
            if (q.trace) out["kimik3"]["tokens"] = std::move(steps);
        }
        log_done("200", e);
        res.set_content(dump(out) + "\n", "application/json");
        return;
    }

    // streaming: server-sent events, one chunk per token
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    struct StreamState {
        bool role_sent = false, finished = false;
        std::size_t calls = 0;  // tool calls streamed so far: the next one's index
    };
    auto st = std::make_shared<StreamState>();
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, st, id, created, model, chat, q, log_done](std::size_t, httplib::DataSink& sink) {
            auto send = [&](const nlohmann::ordered_json& j) {
                const std::string s = "data: " + dump(j) + "\n\n";
                return sink.write(s.data(), s.size());
            };
            auto chunk = [&](nlohmann::ordered_json delta_or_text, const nlohmann::ordered_json& finish) {
                nlohmann::ordered_json c = {{"index", 0}};
                if (chat) c["delta"] = std::move(delta_or_text);
                else c["text"] = std::move(delta_or_text), c["logprobs"] = nullptr;
                c["finish_reason"] = finish;
                return nlohmann::ordered_json{{"id", id},
                                              {"object", chat ? "chat.completion.chunk" : "text_completion"},
                                              {"created", created},
                                              {"model", model},
                                              {"choices", nlohmann::ordered_json::array({c})}};
            };
            Event e;
            while (!job->pop(e, std::chrono::milliseconds(50)))
                if (!sink.is_writable()) return job->cancelled = true, false;  // the client left
            bool ok = true;
            if (chat && !st->role_sent && e.kind != Event::error) {
                st->role_sent = true;
                ok = send(chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
            }
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
                if (ok) sink.done(), st->finished = true, log_done("200 stream", e);
            } else if (ok && e.kind == Event::error) {
                ok = send(error_json(e.failure));  // an error event ends the stream (no [DONE])
                std::fprintf(stderr, "stream ended by an error: %s\n", e.failure.message.c_str());
                if (ok) sink.done(), st->finished = true;
            }
            if (!ok) job->cancelled = true;
            return ok;
        },
        [job](bool) { job->cancelled = true; });  // whatever ended the response, the job has no reader left
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
            {"prompt_mark", cx.engine.mark_enabled()}};
}

inline int g_stop_pipe[2] = {-1, -1};

inline bool local_host(const std::string& h) { return h == "127.0.0.1" || h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0; }

inline int cmd_serve(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kServeUsage, stdout), kExitOk;
    const std::string host_arg = take_option(args, "--host", kServeUsage), port_arg = take_option(args, "--port", kServeUsage),
                      budget = take_option(args, "--budget", kServeUsage), preset = take_option(args, "--preset", kServeUsage),
                      context_arg = take_option(args, "--context", kServeUsage), threads_arg = take_option(args, "--threads", kServeUsage),
                      key = take_option(args, "--api-key", kServeUsage), name_arg = take_option(args, "--model-name", kServeUsage),
                      queue_arg = take_option(args, "--queue", kServeUsage), body_arg = take_option(args, "--max-body", kServeUsage),
                      trunk = take_option(args, "--trunk", kServeUsage), speculate_arg = take_option(args, "--speculate", kServeUsage);
    const bool no_direct = take_flag(args, "--no-direct"), quiet = take_flag(args, "--quiet");
    for (const std::string& a : args)
        if (a.rfind("-", 0) == 0) throw Usage("unknown option '" + a + "'\n\n" + kServeUsage);
    if (args.size() != 1) throw Usage(std::string(args.empty() ? "serve needs MODEL_DIR" : "serve takes one MODEL_DIR") + "\n\n" + kServeUsage);
    const std::string dir = args[0], host = host_arg.empty() ? "127.0.0.1" : host_arg;
    const int port = port_arg.empty() ? 8080 : int(parse_count(port_arg, "--port", kServeUsage, 65535));
    const std::size_t context = context_arg.empty() ? 4096 : std::size_t(parse_count(context_arg, "--context", kServeUsage, kMaxPositions));
    if (context < 2) throw Usage(std::string("--context must be at least 2\n\n") + kServeUsage);
    const std::size_t queue = queue_arg.empty() ? 4 : std::size_t(parse_count(queue_arg, "--queue", kServeUsage, 256));
    const std::uint64_t max_body = body_arg.empty() ? 4u << 20 : parse_size(body_arg);
    if (max_body < 64) throw Usage(std::string("--max-body must be at least 64 bytes\n\n") + kServeUsage);
    const int threads = threads_arg.empty() ? 0 : int(parse_count(threads_arg, "--threads", kServeUsage, 4096));
    const std::size_t speculate = speculate_arg.empty() ? 0 : std::size_t(parse_count(speculate_arg, "--speculate", kServeUsage, 32));
    if (!speculate_arg.empty() && speculate == 0)
        throw Usage(std::string("--speculate must be at least 1 (leave it out for one token per step)\n\n") + kServeUsage);
    if (!key.empty() && key.find_first_of(" \t\r\n") != std::string::npos) throw Usage(std::string("--api-key must not contain spaces\n\n") + kServeUsage);
    std::string name = name_arg;
    if (name.empty()) {
        std::string d = dir;
        while (d.size() > 1 && d.back() == '/') d.pop_back();
        name = d.substr(d.find_last_of('/') == std::string::npos ? 0 : d.find_last_of('/') + 1);
    }
    ModelOptions mo;
    mo.budget = budget_bytes(budget, preset, kServeUsage);
    mo.on_plan = show_and_check_plan;
    mo.plan.context = context;
    mo.trunk_dir = trunk;
    mo.direct = !no_direct;
    if (threads > 0) set_threads(threads);
    ::signal(SIGPIPE, SIG_IGN);  // a client that left is a failed write, not the end of the server

    const Tokenizer tok = Tokenizer::load(dir);
    Model model(dir, mo);
    if (const char* f = std::getenv("KIMIK3_TEST_FAIL_SERVE_READS"); f && *f) {
        long n = -1, m = 0;
        if (std::sscanf(f, "%ld:%ld", &n, &m) != 2 || n < 0 || m < 1) throw Usage("KIMIK3_TEST_FAIL_SERVE_READS must be N:M\n");
        g_serve_fail_from = n, g_serve_fail_count = m, detail::pread_hook = serve_failing_pread;
    }
    Engine engine(model, tok, context, queue, threads, speculate);
    ServeContext cx{tok, model, engine, ServeLimits{name, context, std::size_t(model.config.vocab_size)}, quiet, std::int64_t(std::time(nullptr))};

    httplib::Server svr;
    // Connections are served by a pool: the running request, the queue, and room for the page, /health
    // and the 503 answers. A connection beyond that waits for a free thread.
    const std::size_t pool = queue + 8;
    svr.new_task_queue = [pool] { return new httplib::ThreadPool(pool); };
    svr.set_payload_max_length(std::size_t(max_body));
    svr.set_keep_alive_timeout(2);
    svr.set_read_timeout(30);
    svr.set_write_timeout(30);
    svr.set_error_handler(httplib::Server::HandlerWithResponse([&](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.content_provider_) return httplib::Server::HandlerResponse::Unhandled;  // ours already
        ApiError e{res.status, "", "", "", res.status >= 500 ? "server_error" : "invalid_request_error"};
        if (res.status == 404) e.message = "no such endpoint: " + req.method + " " + req.path, e.code = "not_found";
        else if (res.status == 413) e.message = "the request body is larger than this server's limit of " + std::to_string(max_body) + " bytes (--max-body)", e.code = "request_too_large";
        else if (res.status == 405) e.message = "method not allowed", e.code = "method_not_allowed";
        else e.message = "bad request", e.code = "bad_request";
        send_error(res, e);
        return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception& e) {
            what = e.what();
        } catch (...) {
        }
        send_error(res, ApiError{500, what, "", "internal_error", "server_error"});
    });
    svr.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
        const bool api = req.path.rfind("/v1/", 0) == 0 || req.path.rfind("/kimik3/", 0) == 0;
        if (api && !key.empty() && !bearer_ok(req, key)) {
            res.set_header("WWW-Authenticate", "Bearer");
            send_error(res, ApiError{401, "a valid API key is required: send 'Authorization: Bearer KEY'", "", "invalid_api_key"});
            return httplib::Server::HandlerResponse::Handled;
        }
        return httplib::Server::HandlerResponse::Unhandled;
    });
    svr.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) { handle_generate(cx, req, res, true); });
    svr.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) { handle_generate(cx, req, res, false); });
    svr.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
        res.set_content(dump({{"object", "list"}, {"data", nlohmann::ordered_json::array({model_json(cx)})}}) + "\n", "application/json");
    });
    svr.Get("/v1/models/(.+)", [&](const httplib::Request& req, httplib::Response& res) {
        if (req.matches[1] != cx.limits.model_name)
            return send_error(res, ApiError{404, "the model '" + std::string(req.matches[1]) + "' does not exist", "model", "model_not_found"});
        res.set_content(dump(model_json(cx)) + "\n", "application/json");
    });
    svr.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
        res.set_content(dump({{"status", "ok"}, {"model", cx.limits.model_name}, {"busy", engine.busy()}, {"queued", engine.queued()}}) + "\n",
                        "application/json");
    });
    svr.Get("/kimik3/info", [&](const httplib::Request&, httplib::Response& res) { res.set_content(dump(info_json(cx)) + "\n", "application/json"); });
    const std::string page(kimik3_index_html, std::size_t(kimik3_index_html_end - kimik3_index_html));
    auto serve_page = [&page](const httplib::Request&, httplib::Response& res) {
        res.set_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'");
        res.set_content(page, "text/html; charset=utf-8");
    };
    svr.Get("/", serve_page);
    svr.Get("/index.html", serve_page);

    const int bound = port == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, port) ? port : -1);
    if (bound < 0) fail(ErrorKind::runtime, "cannot listen on " + host + ":" + std::to_string(port) + " (in use, or not an address of this machine)");
    if (!local_host(host))
        std::fprintf(stderr, "kimik3 serve: WARNING: listening on %s: anyone who can reach this machine can use the model%s\n", host.c_str(),
                     key.empty() ? " (no authentication: give --api-key KEY)" : " (with the API key)");
    std::fprintf(stderr, "kimik3 serve: state reuse: %s\n",
                 engine.mark_enabled() ? ("the live conversation, and the KDA states at the end of the last prompt (" +
                                          human_bytes(double(engine.mark_bytes())) + ")").c_str()
                                       : ("the live conversation only (the budget has no room for a second copy of the KDA states, " +
                                          human_bytes(double(engine.mark_bytes())) + ")").c_str());
    const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    std::fprintf(stderr, "kimik3 serve: listening on http://%s:%d (model '%s', context %zu, queue %zu); Ctrl-C stops\n", shown.c_str(), bound,
                 name.c_str(), context, queue);
    std::fflush(stderr);

    // SIGINT/SIGTERM (from now on; while loading they end the program as usual): the handler writes a
    // byte to a pipe, and a thread that waits on it stops the engine (the running generation ends after
    // its current token, queued ones are cancelled), then the listener.
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
