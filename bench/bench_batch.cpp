// kimik3-bench-batch: continuous batching (appendix 13a) measured: 1, 2, 4, 8 concurrent users.
//
//   kimik3-bench-batch MODEL_DIR [--users 1,2,4,8] [--gen N] [--budget floor|BYTES] [--prompt N] [--reps N]
//
// For each user count, N conversations with different prompts join a Batch at once and generate --gen
// tokens each (greedy, no stop), at the model's floor budget by default. After the prompt step (the
// first token of every user), it reports the decode phase: aggregate tokens/s, time per step (= each
// user's time between tokens), and the bytes read per generated token, trunk (the ring's counter plus
// embedding rows) and experts (the cache's misses). Every user's ids are compared with the same
// request generated alone (decode, one conversation); any difference exits 1. Wall times are medians
// over --reps runs (the machine is shared); bytes do not depend on timing beyond the ring's read-ahead.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../kimik3.hpp"
#include "reads.hpp"
#include "timing.hpp"

using namespace kimik3;
using Ids = std::vector<std::int64_t>;

namespace {

using bench::load_average;

using bench::Counters;
using bench::counters;

struct Run {
    double seconds = 0, trunk = 0, experts = 0;
    std::size_t steps = 0, tokens = 0;
    std::vector<Ids> ids;
};

Run run_batch(const std::string& dir, const ModelOptions& mo, const std::vector<Ids>& prompts, std::size_t users, std::size_t gen) {
    Model m(dir, mo);
    std::vector<Session> sessions;
    for (std::size_t i = 0; i < users; ++i) sessions.emplace_back(m.config, prompts[i].size() + gen + 1);
    Batch batch(m, users);
    std::vector<Batch::Id> id;
    for (std::size_t i = 0; i < users; ++i)
        id.push_back(batch.join(Conversation{&sessions[i], prompts[i], {.max_new = gen}, [](std::span<const float> l, std::uint64_t) {
                                                 return argmax(l.data(), l.size());
                                             }, {}}));
    batch.step();  // the prompts (one chunk each) and every user's first token
    const Counters c0 = counters(m);
    const double t0 = bench::now_seconds();
    Run r;
    while (!batch.idle()) r.tokens += batch.step(), ++r.steps;
    r.seconds = bench::now_seconds() - t0;
    const Counters c1 = counters(m);
    r.trunk = c1.trunk - c0.trunk, r.experts = c1.experts - c0.experts;
    for (std::size_t i = 0; i < users; ++i) r.ids.push_back(batch.drawn(id[i]));
    return r;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        std::string dir, budget = "floor";
        std::vector<std::size_t> users = {1, 2, 4, 8};
        std::size_t gen = 32, prompt_len = 8;
        int reps = 1;
        for (int i = 1; i < argc; ++i) {
            const std::string a = argv[i];
            auto value = [&]() -> std::string {
                if (i + 1 >= argc) fail(ErrorKind::usage, a + " needs a value");
                return argv[++i];
            };
            if (a == "--users") {
                users.clear();
                const std::string s = value();
                for (std::size_t p = 0; p <= s.size();) {
                    const std::size_t q = std::min(s.find(',', p), s.size());
                    users.push_back(std::size_t(std::stoul(s.substr(p, q - p))));
                    p = q + 1;
                }
            } else if (a == "--gen") gen = std::stoul(value());
            else if (a == "--budget") budget = value();
            else if (a == "--prompt") prompt_len = std::stoul(value());
            else if (a == "--reps") reps = std::stoi(value());
            else if (dir.empty() && a[0] != '-') dir = a;
            else fail(ErrorKind::usage, "kimik3-bench-batch: unknown argument '" + a + "' (MODEL_DIR [--users 1,2,4,8] [--gen N] [--budget floor|BYTES] [--prompt N] [--reps N])");
        }
        if (dir.empty() || users.empty() || gen < 2 || prompt_len == 0 || reps < 1)
            fail(ErrorKind::usage, "kimik3-bench-batch MODEL_DIR [--users 1,2,4,8] [--gen N >= 2] [--budget floor|BYTES] [--prompt N] [--reps N]");
        // the floor from the checkpoint's census alone (a resident probe of a 14 GB checkpoint would load it all)
        const Config config = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors tensors = bind_tensors(ck, config);
        ModelOptions mo;
        mo.plan.context = prompt_len + gen + 1;
        mo.budget = budget == "floor" ? make_plan(config, take_census(ck, config, tensors), 0, mo.plan, unit_bytes(tensors)).floor
                                      : std::stoull(budget);
        const std::size_t most = *std::max_element(users.begin(), users.end());
        const std::int64_t V = config.vocab_size;
        std::vector<Ids> prompts(most);
        for (std::size_t u = 0; u < most; ++u)
            for (std::size_t j = 0; j < prompt_len; ++j) prompts[u].push_back(std::int64_t(17 + 131 * u + 7 * j + j * j) % V);
        std::printf("kimik3-bench-batch %s: budget %.2f MB, %zu-token prompts, %zu tokens per user, load %s, %d threads\n", dir.c_str(),
                    double(mo.budget) / 1e6, prompt_len, gen, load_average().c_str(), max_threads());
        // every user's request alone (one conversation, decode): the ids a batched reply must equal
        std::vector<Ids> alone;
        {
            Model m(dir, mo);
            for (std::size_t u = 0; u < most; ++u) {
                Session s(m.config, prompt_len + gen + 1);
                alone.push_back(decode(m, s, prompts[u], {.max_new = gen}, [](std::span<const float> l, std::uint64_t) { return argmax(l.data(), l.size()); }));
            }
        }
        std::printf("%6s %12s %10s %14s %16s %16s %16s %10s\n", "users", "tokens/s", "x 1 user", "ms per step", "trunk B/token",
                    "expert B/token", "total B/token", "identical");
        double base_rate = 0, base_bytes = 0;
        bool all_same = true;
        for (std::size_t n : users) {
            std::vector<double> secs;
            Run r;
            for (int k = 0; k < reps; ++k) r = run_batch(dir, mo, prompts, n, gen), secs.push_back(r.seconds);
            const double seconds = bench::median(secs), rate = double(r.tokens) / seconds;
            const double trunk = r.trunk / double(r.tokens), experts = r.experts / double(r.tokens);
            bool same = true;
            for (std::size_t u = 0; u < n; ++u) same = same && r.ids[u] == alone[u];
            all_same = all_same && same;
            if (n == users.front()) base_rate = rate, base_bytes = trunk + experts;
            std::printf("%6zu %12.2f %10.2f %14.2f %16.0f %16.0f %16.0f %10s   (bytes x %.3f of the first row)\n", n, rate, rate / base_rate,
                        1e3 * seconds / double(r.steps), trunk, experts, trunk + experts, same ? "yes" : "NO", (trunk + experts) / base_bytes);
            std::fflush(stdout);
        }
        std::printf("load after: %s\n", load_average().c_str());
        return all_same ? 0 : 1;
    } catch (const Error& e) {
        std::fprintf(stderr, "kimik3-bench-batch: %s\n", e.what());
        return 2;
    }
}
