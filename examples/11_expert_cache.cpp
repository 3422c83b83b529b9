// Example for chapter 11: a real expert trace. The trained little K3 decodes held-out English one token
// per step through a small LRU expert cache; the trace that left is replayed under LRU, LFU and
// Belady's optimum at every size, against two controls (the same tokens in shuffled order, and
// independent even routing); then what that says, and does not say, about K3's 896 experts per layer.
// Last, read-ahead at the floor's two slots, and K3-shaped traces at K3's sizes.
//   make run-11
//   build/g++/examples/11_expert_cache --write-trace FILE   (also writes the little K3's trace)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "../kimik3.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

static std::uint64_t splitmix(std::uint64_t& seed) {
    std::uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// `t`'s steps in a seeded random order: every token keeps its own experts, nearby tokens are no longer near.
static Trace shuffled(const Trace& t, std::uint64_t seed) {
    std::vector<std::vector<ExpertRequest>> steps(t.steps);
    for (const ExpertRequest& r : t.requests) steps[r.step].push_back(r);
    for (std::size_t i = steps.size() - 1; i > 0; --i) std::swap(steps[i], steps[splitmix(seed) % (i + 1)]);
    Trace out = t;
    out.requests.clear();
    for (std::uint32_t s = 0; s < t.steps; ++s)
        for (ExpertRequest r : steps[s]) r.step = s, out.requests.push_back(r);
    return out;
}

// A trace of `steps` tokens through MoE layers [first, layers): k distinct experts of `experts` per layer,
// drawn with probability ~ 1 / (rank + 1)^skew under a seeded per-layer shuffle (skew 0: even routing).
static Trace drawn(std::uint32_t steps, std::uint32_t first, std::uint32_t layers, std::uint32_t experts, std::uint32_t k,
                   std::uint64_t expert_bytes, double skew, std::uint64_t seed) {
    std::vector<double> cdf(experts);
    double total = 0;
    for (std::uint32_t r = 0; r < experts; ++r) cdf[r] = total += std::pow(double(r + 1), -skew);
    std::vector<std::vector<std::uint16_t>> rank_to_expert(layers, std::vector<std::uint16_t>(experts));
    for (auto& perm : rank_to_expert) {
        for (std::uint32_t e = 0; e < experts; ++e) perm[e] = std::uint16_t(e);
        for (std::uint32_t e = experts - 1; e > 0; --e) std::swap(perm[e], perm[splitmix(seed) % (e + 1)]);
    }
    Trace t{layers, experts, k, steps, expert_bytes, {}};
    for (std::uint32_t step = 0; step < steps; ++step)
        for (std::uint32_t layer = first; layer < layers; ++layer) {
            std::vector<std::uint16_t> chosen;
            while (chosen.size() < k) {
                const double u = double(splitmix(seed) >> 11) * 0x1p-53 * total;
                const std::size_t r = std::size_t(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
                const std::uint16_t e = rank_to_expert[layer][std::min<std::size_t>(r, experts - 1)];
                if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
            }
            for (std::uint16_t e : chosen) t.requests.push_back({step, std::uint16_t(layer), e});
        }
    return t;
}

// Passes every call through to a cache and says what moe_forward asked for, to show read-ahead at work.
class Narrated : public ExpertProvider {
  public:
    explicit Narrated(ExpertCache& c) : c_(c) {}
    std::size_t capacity() const override { return c_.capacity(); }
    bool reads_ahead() const override { return c_.reads_ahead(); }
    void begin_step() override { c_.begin_step(); }
    void fetch(int layer, std::span<const int> ids, ExpertWeights* out) override {
        const std::uint64_t misses = c_.stats().misses;
        c_.fetch(layer, ids, out);
        std::printf("    fetch    %-5s %s\n", list(ids).c_str(),
                    c_.stats().misses > misses ? "read now: the caller waits" : "read ahead already: waits only for what is left");
    }
    void prefetch(int layer, std::span<const int> ids) override {
        c_.prefetch(layer, ids);
        std::printf("    prefetch %-5s read on a background thread while the group above computes\n", list(ids).c_str());
    }

  private:
    static std::string list(std::span<const int> ids) {
        std::string s = "[";
        for (int id : ids) s += (s.size() > 1 ? " " : "") + std::to_string(id);
        return s + "]";
    }
    ExpertCache& c_;
};

int main(int argc, char** argv) {
    const std::string trace_out = argc == 3 && std::string(argv[1]) == "--write-trace" ? argv[2] : "";
    if (argc != 1 && trace_out.empty()) return std::fprintf(stderr, "usage: %s [--write-trace FILE]\n", argv[0]), 2;
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        const Tokenizer tok = Tokenizer::load(dir);
        const std::string text = detail::read_text_file(dir + "/heldout-sample.txt");  // held-out English (chapter 14a)
        const std::vector<std::uint32_t> ids32 = tok.encode_ordinary(text);
        const std::vector<std::int64_t> ids(ids32.begin(), ids32.end());

        // Decode the text one token per step (what a cache sees while generating) through a 64-slot LRU
        // cache; check every step's logits against one step over all tokens with every expert resident.
        const std::size_t live_slots = 64;
        Model all(dir, ModelOptions{});
        const std::size_t V = std::size_t(all.config.vocab_size), all_experts = all.experts()->capacity();
        std::vector<float> want(ids.size() * V), logits(V);
        Session s_all(all.config, ids.size());
        forward(want.data(), all, s_all, ids, {.rows = Rows::all});
        ModelOptions o;
        o.plan.expert_slots = live_slots;
        Model model(dir, o);
        Session s(model.config, ids.size());
        bool same = true;
        const auto t0 = std::chrono::steady_clock::now();
        for (std::size_t t = 0; t < ids.size(); ++t) {
            forward(logits.data(), model, s, {&ids[t], 1});
            same = same && std::memcmp(logits.data(), &want[t * V], V * sizeof(float)) == 0;
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const Trace& trace = model.experts()->trace();
        const CacheStats& live = model.experts()->stats();
        const std::size_t expert_bytes = model.tensors.expert_bytes;
        const std::size_t per_token = trace.requests.size() / trace.steps;
        std::printf("11.4 the little K3 decodes %u tokens of held-out text (fixtures/little-k3/heldout-sample.txt), one per\n"
                    "     step: %zu requests per token (8 MoE layers x top %u of %u), %zu experts in all, %zu bytes each\n",
                    trace.steps, per_token, trace.k, trace.experts, all_experts, expert_bytes);
        std::printf("  through a %zu-slot LRU cache: %llu requests, %llu hits (%llu from earlier tokens), %llu misses, %s read\n",
                    live_slots, (unsigned long long)live.requests, (unsigned long long)live.hits, (unsigned long long)live.retained,
                    (unsigned long long)live.misses, human_bytes(double(live.bytes_read)).c_str());
        std::printf("  every step's logits bit-identical to one step over all %zu tokens with all %zu experts resident: %s\n",
                    ids.size(), all_experts, same ? "yes" : "NO");
        const CacheStats replayed = replay_trace(trace, live_slots, PolicyKind::lru);
        std::printf("  the simulator replaying the recorded trace at %zu slots gives the same counts: %s\n", live_slots,
                    replayed.hits == live.hits && replayed.retained == live.retained && replayed.misses == live.misses &&
                            replayed.evictions == live.evictions && replayed.bytes_read == live.bytes_read
                        ? "yes"
                        : "NO");
        std::fprintf(stderr, "  [decode through the cache: %.2f s, %.2f ms per token]\n", seconds, 1e3 * seconds / double(ids.size()));
        if (!trace_out.empty()) write_trace(trace_out, trace), std::fprintf(stderr, "  [trace written to %s]\n", trace_out.c_str());

        std::printf("\n11.6 that trace replayed at other sizes (%zu slots = one token's walk, %zu = every expert)\n", per_token, all_experts);
        const std::size_t sizes[] = {6, 16, 32, 64, 128, 256};
        const std::size_t table_sizes[] = {32, 64, 128};
        print_simulation(stdout, trace, simulate_cache(trace, table_sizes));

        // Controls: where do the hits come from?
        const Trace mixed = shuffled(trace, 2026);
        const Trace even = drawn(trace.steps, 1, trace.layers, trace.experts, trace.k, trace.expert_bytes, 0.0, 2026);
        std::printf("\n11.6 hit %% at each size: the real order, the same tokens shuffled, and independent even routing\n");
        std::printf("  %6s %7s  %-21s %-21s %s\n", "slots", "share", "real: LRU LFU Belady", "shuffled: LRU Belady", "even: LRU Belady");
        for (std::size_t sz : sizes) {
            auto hit = [&](const Trace& t, PolicyKind k) { const CacheStats st = replay_trace(t, sz, k); return percent(st.hits, st.requests); };
            std::printf("  %6zu %6.1f%%  %5.1f %5.1f %6.1f     %5.1f %6.1f         %5.1f %6.1f\n", sz, percent(sz, all_experts),
                        hit(trace, PolicyKind::lru), hit(trace, PolicyKind::lfu), hit(trace, PolicyKind::belady), hit(mixed, PolicyKind::lru),
                        hit(mixed, PolicyKind::belady), hit(even, PolicyKind::lru), hit(even, PolicyKind::belady));
        }
        std::printf("  (share: the slots' share of all %zu experts. Below one token's walk of %zu requests LRU keeps\n"
                    "   nothing: each expert is evicted before the next token asks for it again, as chapter 11's top\n"
                    "   block derives. From there LRU hits about its share, and so does the even draw: the trained\n"
                    "   router, balanced by its bias (make run-10), leaves little locality to use; the real order adds\n"
                    "   a few points over the shuffled one, and Belady's column bounds every policy.)\n",
                    all_experts, per_token);

        std::printf("\n11.6 what this says about K3, and what it does not\n");
        std::printf("  the same share of all experts in a cache, at each size:\n");
        std::printf("  %14s %14s %18s %16s\n", "little K3 slots", "share", "K3 slots", "K3 memory");
        const double k3_experts = 896.0 * 92.0, k3_expert = 17'551'360.0;  // slots of 17.55 MB (chapter 11)
        for (std::size_t sz : {32, 64, 128}) {
            const double share = double(sz) / double(all_experts);
            std::printf("  %14zu %13.1f%% %18.0f %16s\n", sz, 100.0 * share, share * k3_experts, human_bytes(share * k3_experts * k3_expert).c_str());
        }
        std::printf("  It says: a trained router that balances its load gives a cache about its share of all experts,\n"
                    "  which is what chapter 11's top block assumes for K3 (S / 82,432: 887 slots keep about 1.1%%), and\n"
                    "  that below one token's walk (K3: 16 x 92 = 1,472 slots, 25.8 GB) LRU keeps nothing. It does not\n"
                    "  say K3's own numbers: K3 (896 experts, top 16, 200,000 times the parameters, trained on far more\n"
                    "  text) may route with more skew or more locality, and only its own trace (kimik3 simulate-cache)\n"
                    "  can tell; and the same share costs K3 hundreds of GB, as the table shows.\n");

        {  // read-ahead: at the floor's 2 slots, a token's 4 experts arrive one group of 1 at a time
            const Config& c = all.config;
            TrunkWeights& tw = all.trunk();
            const LayerTensors& lt = all.tensors.layers[1];
            const MoeWeights w{tw.matrix(lt.router), tw.vec(lt.router_bias), tw.matrix(lt.latent_down), tw.vec(lt.latent_norm),
                               tw.matrix(lt.latent_up), DenseFfnWeights{tw.matrix(lt.shared_gate), tw.matrix(lt.shared_up), tw.matrix(lt.shared_down)}};
            const std::size_t D = std::size_t(c.hidden_size);
            std::vector<float> x(D), ones(D, 1.0f), y(D), y_all(D);
            tw.embed_row(x.data(), ids[1]);  // a stand-in input: the normalised embedding row of token 1
            rmsnorm(x.data(), x.data(), ones.data(), D, c.rms_norm_eps);
            ExpertCache floor_cache(all.tensors, c, 2);
            Narrated narrated(floor_cache);
            std::printf("\n11.4 read-ahead: the floor's 2 slots serve layer 1 for '%s' (its experts do not fit at once)\n",
                        std::string(tok.token_bytes(ids32[1])).c_str());
            floor_cache.begin_step();
            moe_forward(y.data(), x.data(), 1, w, MoeDims::from(c, 1), narrated);
            moe_forward(y_all.data(), x.data(), 1, w, MoeDims::from(c, 1), *all.experts());
            std::printf("  output bit-identical to all-resident experts: %s\n", std::memcmp(y.data(), y_all.data(), D * sizeof(float)) == 0 ? "yes" : "NO");
        }

        // K3's own shape, where no trace can be recorded here: a token walks 16 x 92 = 1,472 experts. 887
        // slots is the server preset (15.6 GB), 1,472 one token's worth (25.8 GB), 2,944 two tokens' worth.
        std::printf("\n11.6 drawn K3-shaped traces (12 tokens, 92 MoE layers, top 16 of 896): even routing, then skewed\n");
        const std::size_t k3_sizes[] = {887, 1472, 2944};
        for (const double skew : {0.0, 1.2}) {
            std::printf("%s\n", skew == 0 ? "even (every expert equally likely):" : "skewed (probability ~ 1 / (rank + 1)^1.2 within each layer):");
            const Trace k3 = drawn(12, 1, 93, 896, 16, 17'547'264, skew, 2026);
            print_simulation(stdout, k3, simulate_cache(k3, k3_sizes), 1000);
        }
        std::printf("  (even: LRU keeps nothing below 1,472 slots; only Belady, which knows the future, reaches this short\n"
                    "   trace's ceiling. Skewed: a few hot experts per layer take most requests, and one token's worth of\n"
                    "   slots starts to pay. Which of the two K3 is, only its own trace can say.)\n");
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
