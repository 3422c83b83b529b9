// Example for chapter 11: ten tokens, one per step, through the tiny K3's 12 MoE layers with a small
// expert cache; what it hit, kept and evicted; read-ahead at the floor's two slots; then the simulator
// on the trace those steps left.
//   make run-11
//   build/g++/examples/11_expert_cache --write-trace FILE   (also writes the trace; this is how
//                                                            fixtures/traces/tiny.k3trace was made)
#include <cstdio>
#include <deque>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "../chapters/11_expert_cache.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

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
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
