// Example for chapter 11: ten tokens, one per step, through the tiny K3's 12 MoE layers with a small
// expert cache; what it hit, kept and evicted; read-ahead at the floor's two slots; then the simulator
// on the trace those steps left, and on K3-shaped traces with balanced and with skewed routing.
//   make run-11
//   build/g++/examples/11_expert_cache --write-trace FILE   (also writes the trace; this is how
//                                                            fixtures/traces/tiny.k3trace was made)
#include <cmath>
#include <cstdio>
#include <deque>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "../chapters/11_expert_cache.hpp"
#include "../chapters/11a_traces.hpp"  // APPENDIX: traces and the simulator

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

// A K3-shaped trace without the model: `tokens` steps through MoE layers 1..92, 16 distinct experts of
// 896 per layer, drawn with probability proportional to 1 / (rank + 1)^skew under a fixed per-layer
// shuffle of the ranks (skew 0: every expert equally likely, as K3's balanced router aims for).
static Trace k3_shaped_trace(std::uint32_t tokens, double skew, std::uint64_t seed) {
    const std::uint32_t layers = 93, experts = 896, k = 16;
    auto next = [&seed] {  // splitmix64
        std::uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    };
    std::vector<double> cdf(experts);
    double total = 0;
    for (std::uint32_t r = 0; r < experts; ++r) cdf[r] = total += std::pow(double(r + 1), -skew);
    std::vector<std::vector<std::uint16_t>> rank_to_expert(layers, std::vector<std::uint16_t>(experts));
    for (auto& perm : rank_to_expert) {
        for (std::uint32_t e = 0; e < experts; ++e) perm[e] = std::uint16_t(e);
        for (std::uint32_t e = experts - 1; e > 0; --e) std::swap(perm[e], perm[next() % (e + 1)]);
    }
    Trace t;
    t.layers = layers, t.experts = experts, t.k = k, t.steps = tokens, t.expert_bytes = 17'547'264;
    for (std::uint32_t step = 0; step < tokens; ++step)
        for (std::uint16_t layer = 1; layer < layers; ++layer) {
            std::vector<std::uint16_t> chosen;
            while (chosen.size() < k) {
                const double u = double(next() >> 11) * 0x1p-53 * total;
                const std::size_t r = std::size_t(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
                const std::uint16_t e = rank_to_expert[layer][std::min<std::size_t>(r, experts - 1)];
                if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
            }
            for (std::uint16_t e : chosen) t.requests.push_back({step, layer, e});
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
        std::printf("    fetch    %-8s %s\n", list(ids).c_str(),
                    c_.stats().misses > misses ? "read now: the caller waits" : "read ahead already: waits only for what is left");
    }
    void prefetch(int layer, std::span<const int> ids) override {
        c_.prefetch(layer, ids);
        std::printf("    prefetch %-8s read on a background thread while the group above computes\n", list(ids).c_str());
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
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        SafetensorsFile ref(dir + "/reference/layers.safetensors");  // the reference's input to every MoE layer
        std::vector<Tensor> keep;                                     // the trunk tensors the layers point into
        auto load = [&](const Checkpoint::Ref* r) -> const Tensor& { return keep.emplace_back(ck.read(r->info->name)); };
        keep.reserve(12 * 8);
        auto mat = [&](const Checkpoint::Ref* r) {
            const Tensor& t = load(r);
            return MatrixRef{t.bytes.as<bf16>(), nullptr, std::size_t(t.info.shape[0]), std::size_t(t.info.shape[1])};
        };
        std::map<int, MoeWeights> w;
        std::deque<std::vector<float>> norms;  // the latent norms, widened to f32
        std::map<int, std::vector<float>> x;  // layer -> (10, D) mlp_norm_out
        for (int l = 1; l <= 12; ++l) {
            const LayerTensors& lt = m.layers[std::size_t(l)];
            w[l] = MoeWeights{mat(lt.router), load(lt.router_bias).bytes.as<float>(), mat(lt.latent_down), norms.emplace_back(to_f32(load(lt.latent_norm))).data(),
                              mat(lt.latent_up), DenseFfnWeights{mat(lt.shared_gate), mat(lt.shared_up), mat(lt.shared_down)}};
            x[l] = to_f32(ref.read("layer." + std::to_string(l) + ".mlp_norm_out"));
        }
        const std::size_t D = std::size_t(c.hidden_size), slots = std::size_t(c.num_experts_per_token) + 2;
        ExpertCache cache(m, c, slots);
        ResidentExperts all(m);
        std::printf("11.4 ten tokens, one per step, through %d MoE layers (top %d of %d experts, %llu bytes each)\n", c.moe_layer_count(),
                    c.num_experts_per_token, c.num_experts, (unsigned long long)m.expert_bytes);
        std::printf("     cache: %zu slots (k + 2) of %zu bytes (aligned reads), LRU\n", slots, cache.slot_bytes());
        std::printf("  %4s %9s %6s %9s %7s %10s\n", "step", "requests", "hits", "retained", "misses", "evictions");
        bool same = true;
        std::vector<float> y(D), y_all(D);
        for (std::size_t t = 0; t < 10; ++t) {
            cache.begin_step();
            const CacheStats before = cache.stats();
            for (int l = 1; l <= 12; ++l) {
                const MoeDims d = MoeDims::from(c, l);
                moe_forward(y.data(), &x[l][t * D], 1, w[l], d, cache);
                moe_forward(y_all.data(), &x[l][t * D], 1, w[l], d, all);
                same = same && std::memcmp(y.data(), y_all.data(), D * sizeof(float)) == 0;
            }
            const CacheStats& s = cache.stats();
            std::printf("  %4zu %9llu %6llu %9llu %7llu %10llu\n", t, (unsigned long long)(s.requests - before.requests),
                        (unsigned long long)(s.hits - before.hits), (unsigned long long)(s.retained - before.retained),
                        (unsigned long long)(s.misses - before.misses), (unsigned long long)(s.evictions - before.evictions));
        }
        const CacheStats& s = cache.stats();
        std::printf("  %4s %9llu %6llu %9llu %7llu %10llu   (%s read)\n", "all", (unsigned long long)s.requests, (unsigned long long)s.hits,
                    (unsigned long long)s.retained, (unsigned long long)s.misses, (unsigned long long)s.evictions,
                    human_bytes(double(s.bytes_read)).c_str());
        std::printf("  every MoE output bit-identical to all-resident experts: %s\n", same ? "yes" : "NO");
        std::printf("  (a cyclic walk over 12 layers x 4 experts = 48 requests per token: 6 slots keep nothing)\n");
        std::fprintf(stderr, "  [%zu of %zu shards read with O_DIRECT; %.2f ms reading, %llu bytes from disk]\n", cache.store().direct_shards(),
                     cache.store().shards(), s.read_seconds * 1e3, (unsigned long long)s.disk_bytes);

        {  // read-ahead: at the floor's 2 slots, a token's 4 experts arrive one group of 1 at a time
            ExpertCache floor_cache(m, c, 2);
            Narrated narrated(floor_cache);
            std::printf("\n11.4 read-ahead: the floor's 2 slots serve layer 1 of token 0 (its experts do not fit at once)\n");
            floor_cache.begin_step();
            moe_forward(y.data(), &x[1][0], 1, w[1], MoeDims::from(c, 1), narrated);
            moe_forward(y_all.data(), &x[1][0], 1, w[1], MoeDims::from(c, 1), all);
            std::printf("  output bit-identical to all-resident experts: %s\n",
                        std::memcmp(y.data(), y_all.data(), D * sizeof(float)) == 0 ? "yes" : "NO");
        }

        const Trace& trace = cache.trace();
        std::map<std::uint64_t, int> count;
        for (const ExpertRequest& r : trace.requests) ++count[expert_key(r.layer, r.expert)];
        std::vector<std::pair<int, std::uint64_t>> busiest;
        for (const auto& [key, n] : count) busiest.push_back({-n, key});  // most requests first, then lower key
        std::sort(busiest.begin(), busiest.end());
        std::printf("\n11.5 the trace: %zu requests, %zu distinct experts; busiest:", trace.requests.size(), count.size());
        for (std::size_t i = 0; i < 4; ++i)
            std::printf("  L%llu e%llu x%d", (unsigned long long)(busiest[i].second >> 32), (unsigned long long)(busiest[i].second & 0xFFFFFFFF),
                        -busiest[i].first);
        std::printf("\n");
        if (!trace_out.empty()) write_trace(trace_out, trace), std::fprintf(stderr, "  [trace written to %s]\n", trace_out.c_str());

        std::printf("\n11.6 replaying that trace at other sizes (LRU, LFU, and Belady's optimum)\n");
        const std::size_t sizes[] = {5, 6, 16, 48, 96, 192};
        print_simulation(stdout, trace, simulate_cache(trace, sizes), 1300);

        // The same question at K3's shape: a token walks 16 x 92 = 1,472 experts in a cycle. 887 slots is
        // the server preset (15.6 GB), 1,472 one token's worth (25.8 GB), 2,944 two tokens' worth.
        std::printf("\n11.6 K3-shaped traces (12 tokens, 92 MoE layers, top 16 of 896): balanced routing, then skewed\n");
        const std::size_t k3_sizes[] = {887, 1472, 2944};
        for (const double skew : {0.0, 1.2}) {
            std::printf("%s\n", skew == 0 ? "balanced (every expert equally likely):" : "skewed (probability ~ 1 / (rank + 1)^1.2 within each layer):");
            const Trace k3 = k3_shaped_trace(12, skew, 2026);
            print_simulation(stdout, k3, simulate_cache(k3, k3_sizes), 1000);
        }
        std::printf("  (balanced: LRU keeps nothing below 1,472 slots and about slots / 82,432 above, as chapter 11's\n"
                    "   top block derives; only Belady, which knows the future, reaches this short trace's ceiling.\n"
                    "   Skewed: a few hot experts per layer take most requests, and one token's worth of slots starts\n"
                    "   to pay: LRU then saves about a quarter of the expert reads.)\n");
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
