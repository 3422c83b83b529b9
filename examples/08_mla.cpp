// Example for chapter 08: what the latent KV cache saves at K3 size, then attention on the tiny K3's layer 3.
//   make run-08
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "../chapters/08_mla.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

namespace {
std::string commas(std::uint64_t n) {  // 2949120 -> "2,949,120"
    const std::string digits = std::to_string(n);
    std::string s;
    for (std::size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) s += ',';
        s += digits[i];
    }
    return s;
}
}  // namespace

int main() {
    try {
        const std::string root = KIMIK3_SOURCE_DIR;
        const Config k3 = load_config(root + "/fixtures/k3-release/config.json");
        const MlaDims K = MlaDims::from(k3);
        const std::uint64_t layers = std::uint64_t(k3.count(AttnKind::MLA)), latent = mla_latent_bytes(K), expanded = mla_expanded_bytes(K);
        std::printf("8.2 the KV cache at K3 size (f32; %llu MLA layers; one position = one token of context)\n", (unsigned long long)layers);
        std::printf("  latent    %zu + %zu floats                        = %9s B per position and layer\n", K.kv_lora, K.rope,
                    commas(latent).c_str());
        std::printf("  expanded  %zu heads x (%zu key + %zu value) floats = %9s B per position and layer\n", K.heads, K.qk(), K.v,
                    commas(expanded).c_str());
        std::printf("  all layers: latent %s B, expanded %s B per position: %.1fx smaller\n", commas(layers * latent).c_str(),
                    commas(layers * expanded).c_str(), double(expanded) / double(latent));
        for (std::uint64_t ctx : {8192ull, 131072ull})
            std::printf("  context %7s: latent %10s, expanded %10s\n", commas(ctx).c_str(), human_bytes(double(layers * latent * ctx)).c_str(),
                        human_bytes(double(layers * expanded * ctx)).c_str());

        // The tiny K3's first MLA layer, fed the PyTorch reference's own layer inputs.
        const std::string dir = root + "/fixtures/tiny-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        const int layer = 3;
        const LayerTensors& lt = m.layers[layer];
        auto load = [&](const Checkpoint::Ref* r) { return ck.read(r->info->name); };
        const Tensor qa = load(lt.q_a_proj), qn = load(lt.q_a_norm), qb = load(lt.q_b_proj), kva = load(lt.kv_a_proj),
                     kvn = load(lt.kv_a_norm), kvb = load(lt.kv_b_proj), g = load(lt.g_proj), o = load(lt.o_proj);
        auto mat = [](const Tensor& t) { return MatrixRef{t.bytes.as<bf16>(), nullptr, std::size_t(t.info.shape[0]), std::size_t(t.info.shape[1])}; };
        const std::vector<float> q_norm = to_f32(qn), kv_norm = to_f32(kvn);  // norm weights widened to f32
        const MlaWeights w{mat(qa), q_norm.data(), mat(qb), mat(kva), kv_norm.data(), mat(kvb), mat(g), mat(o)};
        const MlaDims d = MlaDims::from(c);
        const SafetensorsFile ref(dir + "/reference/layers.safetensors");
        const std::vector<float> u = to_f32(ref.read("layer.3.attn_norm_out")), want = to_f32(ref.read("layer.3.attn_out"));

        const std::size_t D = d.hidden, prefill = 4, T = prefill + 1;
        std::printf("\n8.5 the tiny K3's layer %d: H %zu, R %zu, X %zu, N %zu, Dv %zu; scale 1/sqrt(%zu + %zu) = %.6f\n", layer, d.heads,
                    d.kv_lora, d.rope, d.nope, d.v, d.nope, d.rope, double(d.scale()));
        MlaCache cache(16, d.cache_width(), layer), naive_cache = cache;
        std::vector<float> y(T * D), y_naive(T * D);
        mla_forward(y.data(), u.data(), prefill, w, d, cache);  // prefill tokens 0..3
        MlaRecord rec;
        mla_forward(&y[prefill * D], &u[prefill * D], 1, w, d, cache, &rec);  // decode token 4
        std::printf("  prefill %zu tokens, decode 1: the cache holds %zu positions x %zu floats\n", prefill, cache.length(), cache.width());
        std::printf("  token %zu's attention probabilities over positions 0..%zu:\n", prefill, prefill);
        for (std::size_t h = 0; h < d.heads; ++h) {
            std::printf("    head %zu:", h);
            for (std::size_t s = 0; s < T; ++s) std::printf(" %.4f", double(rec.probs[h * T + s]));
            std::printf("\n");
        }
        std::printf("  its latent c[0..3] = %.5f %.5f %.5f %.5f, k_x[0..1] = %.5f %.5f (raw: no norm, no rotation)\n", double(rec.c[0]),
                    double(rec.c[1]), double(rec.c[2]), double(rec.c[3]), double(rec.k_x[0]), double(rec.k_x[1]));

        mla_forward_naive(y_naive.data(), u.data(), T, w, d, naive_cache);  // the expanded form, all 5 at once
        double scale = 0, err_ref = 0, err_naive = 0;
        for (std::size_t i = 0; i < T * D; ++i) scale = std::max(scale, std::fabs(double(want[i])));
        for (std::size_t i = 0; i < T * D; ++i) {
            err_ref = std::max(err_ref, std::fabs(double(y[i]) - double(want[i])) / scale);
            err_naive = std::max(err_naive, std::fabs(double(y[i]) - double(y_naive[i])) / scale);
        }
        std::printf("\n8.6 the output of tokens 0..%zu, relative to its largest value\n", prefill);
        std::printf("  absorbed vs the PyTorch float64 reference (naive form): %.2e\n", err_ref);
        std::printf("  absorbed vs this chapter's naive form:                  %.2e\n", err_naive);
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
