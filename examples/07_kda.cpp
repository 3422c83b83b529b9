// Example for chapter 07: a KDA state written by one token, then decaying channel by channel; what the
// decay gate's lower bound prevents, in numbers (K3's bounded gate against Kimi Linear's unbounded one,
// alone and inside a chunked kernel's 16-token block); one head wired by hand as an induction memory,
// which reads a list back when the list begins again (and where keys of one token fail); then the trained
// little K3's first KDA layer on held-out text: how its gates use the range the bound leaves, and
// prefill = decode, bit for bit.
//   make run-07
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>

#include "../kimik3.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

// Kimi Linear's gate, which K3 replaced: g = -exp(A_log) softplus(z), unbounded below (f32, as kernels run it).
static float gate_unbounded(float z, float A_log) {
    const float softplus = z > 20.0f ? z : float(std::log1p(double(exp_f32(z))));
    return -exp_f32(A_log) * softplus;
}

// One 16-token block of a chunked kernel: the decay from token j to token i >= j is exp(G_i - G_j), G the
// running sum of g in the block. Factored as exp(G_i) * exp(-G_j), the block becomes a matrix product;
// in f32, exp overflows above 88.72. Returns the number of non-finite entries and the largest factor.
static int block_entries(const std::vector<float>& g, float& largest, double& worst_rel) {
    std::vector<float> G(g.size());
    float run = 0;
    for (std::size_t i = 0; i < g.size(); ++i) G[i] = run = run + g[i];
    int bad = 0;
    largest = 0, worst_rel = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
        for (std::size_t j = 0; j <= i; ++j) {
            const float f = exp_f32(G[i]) * exp_f32(-G[j]), direct = exp_f32(G[i] - G[j]);
            largest = std::max(largest, exp_f32(-G[j]));
            if (!std::isfinite(f)) ++bad;
            else if (direct > 1e-30f) worst_rel = std::max(worst_rel, std::fabs(double(f) - direct) / direct);
        }
    return bad;
}

// An induction memory in one KDA head (7.4). Every token writes its own embedding as the value under a
// key made of the token(s) before it, and reads with a query made of itself (and the token before), which
// is what the NEXT token's key will be. At a token seen before, the query finds the key written at the
// token that followed its last occurrence, and the state hands back that token. Keys have two halves of
// 16 channels, one per position (a short convolution gives each tap its own weights): the token two back
// in channels 0-15, the token before in 16-31. Embeddings are one-hot (no cross-talk; a trained model's
// are only nearly orthogonal). Returns how many of the second pass's words it predicts, and appends to
// `said` what it predicted at each of them.
static int induction_read_back(const std::vector<int>& seq, std::size_t second, bool two_token_keys, int words, std::string& said,
                               const char* const* names) {
    const std::size_t Dh = 32, half = 16;
    std::vector<float> S(Dh * Dh, 0.0f), k(Dh), q(Dh), v(Dh), o(Dh), alpha(Dh, 1.0f), beta = {1.0f};
    auto key_ending_at = [&](std::vector<float>& out, std::size_t end) {  // unit vector: token end, and end - 1
        std::fill(out.begin(), out.end(), 0.0f);
        out[half + std::size_t(seq[end])] = 1.0f;
        if (two_token_keys && end > 0) out[std::size_t(seq[end - 1])] = 1.0f;
        const float norm = two_token_keys && end > 0 ? std::sqrt(2.0f) : 1.0f;
        for (float& x : out) x = x / norm;
    };
    int right = 0;
    for (std::size_t t = 1; t + 1 < seq.size(); ++t) {
        key_ending_at(k, t - 1);  // written under the token(s) before this one
        key_ending_at(q, t);      // read with this one (and the one before): the next token's key
        std::fill(v.begin(), v.end(), 0.0f);
        v[std::size_t(seq[t])] = 1.0f;
        kda_recurrence_ref(o.data(), S.data(), q.data(), k.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
        if (t < second || seq[t + 1] >= words) continue;  // score the second pass's words only
        const int guess = int(std::max_element(o.begin(), o.end()) - o.begin());
        right += guess == seq[t + 1];
        said += std::string(" ") + names[guess];
    }
    return right;
}

int main() {
    std::printf("7.3 the decay gate, A_log = 0: K3's g = -5 sigmoid(z) against Kimi Linear's g = -softplus(z)\n");
    std::printf("  %8s %10s %12s %12s %14s\n", "z", "K3 g", "K3 alpha", "unbounded g", "alpha");
    KdaDims one{1, 1, 1, 1, -5.0f, 1e-5f};
    const float zero = 0.0f;
    for (const float z : {-4.0f, 0.0f, 4.0f, 20.0f, 100.0f, 110.0f}) {
        float a = 0, g = 0;
        kda_decay(&a, &g, &z, &zero, &zero, one);  // the engine's gate
        const float gu = gate_unbounded(z, 0.0f), au = exp_f32(gu);
        std::printf("  %8.1f %10.4f %12.4g %12.4f %14.4g%s\n", double(z), double(g), double(a), double(gu), double(au),
                    au == 0 ? "  (zero: the memory is gone)" : au < 1.17549435e-38f ? "  (subnormal f32)" : "");
    }
    std::printf("  K3's alpha never falls below e^-5 = %.4f: one token can fade a key channel to 0.7%%, never erase it\n",
                double(exp_f32(-5.0f)));

    std::printf("\n7.3 why the bound: a chunked kernel's 16-token block, every factor exp(-G_j) an f32\n");
    std::printf("  %-38s %12s %14s %s\n", "gates in the block", "largest", "non-finite", "factored vs direct");
    struct Case {
        const char* name;
        std::vector<float> g;
    };
    std::vector<float> spike(16, -0.5f);
    spike[5] = gate_unbounded(100.0f, 0.0f);
    for (const Case& c : {Case{"K3's worst case: every g = -5", std::vector<float>(16, -5.0f)},
                          Case{"unbounded, every g = -5.5", std::vector<float>(16, -5.5f)},
                          Case{"unbounded, every g = -6", std::vector<float>(16, -6.0f)},
                          Case{"unbounded, g = -0.5 but one -100", spike}}) {
        float largest = 0;
        double rel = 0;
        const int bad = block_entries(c.g, largest, rel);
        char agree[64];
        std::snprintf(agree, sizeof agree, "agree within %.1e (relative)", rel);
        std::printf("  %-38s %12.4g %7d of 136  %s\n", c.name, double(largest), bad, bad ? "inf or NaN where the true decay is in [0, 1]" : agree);
    }
    std::printf("  (16 x 5 = 80 < 88.72: with the bound no block can overflow; without it, 16 gates of -5.55 already\n"
                "   do, and one strong gate poisons the block. fla's TensorCore KDA kernels rely on this)\n");

    std::printf("\n7.4 one head, Dh = 16: token 1 writes value v under key e0 (beta = 1, no decay)\n");
    const std::size_t Dh = 16;
    std::vector<float> S(Dh * Dh, 0.0f), e0(Dh, 0.0f), v(Dh), o(Dh), alpha(Dh, 1.0f), beta = {1.0f};
    e0[0] = 1.0f;
    for (std::size_t j = 0; j < Dh; ++j) v[j] = float(j + 1);
    kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
    std::printf("  read back with q = e0: o[0..4] = %g %g %g %g %g\n", double(o[0]), double(o[1]), double(o[2]), double(o[3]), double(o[4]));
    std::printf("  then three tokens with beta = 0: the state only decays, by alpha of each KEY channel (here 0.5)\n");
    for (std::size_t i = 0; i < Dh; ++i) alpha[i] = 1.0f - 0.05f * float(i);
    alpha[0] = 0.5f;  // key channel 0 (where v was written) halves each token
    beta[0] = 0.0f;
    for (int t = 1; t <= 3; ++t) {
        kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
        std::printf("  token %d: o[3] = %.5f, o[15] = %.5f\n", t + 1, double(o[3]), double(o[15]));
    }
    std::vector<float> S_unbounded = S;
    alpha[0] = exp_f32(-5.0f);  // K3's strongest forgetting
    kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
    std::printf("  token 5 at K3's strongest decay (alpha = e^-5): o[3] = %.5f, o[15] = %.5f: faded, still there\n", double(o[3]), double(o[15]));
    alpha[0] = exp_f32(gate_unbounded(110.0f, 0.0f));  // what the unbounded gate allows: 0
    kda_recurrence_ref(o.data(), S_unbounded.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
    std::printf("  token 5 with the unbounded gate at z = 110 (alpha = %g):     o[3] = %.5f, o[15] = %.5f: erased\n", double(alpha[0]),
                double(o[3]), double(o[15]));

    std::printf("\n7.4 the same recurrence as an induction memory: a list read once, then begun again\n");
    {
        const char* names[] = {"river", "radio", "dinner", "island", "doctor", "engine", "market", "window", ","};
        const int words = 8, comma = 8;
        std::vector<int> spaced, commas;
        for (int pass = 0; pass < 2; ++pass)
            for (int w = 0; w < words; ++w) {
                spaced.push_back(w);
                commas.push_back(w);
                commas.push_back(comma);
            }
        struct Case {
            const char* name;
            const std::vector<int>& seq;
            bool two_token_keys;
        };
        std::printf("  one head, Dh = 32; value = this token, key = the token(s) before it, query = this token (and the\n"
                    "  one before), i.e. the next token's key; beta = 1, no decay; one-hot embeddings\n");
        for (const Case& c : {Case{"spaces, keys of 1 token ", spaced, false}, Case{"commas, keys of 1 token ", commas, false},
                              Case{"commas, keys of 2 tokens", commas, true}}) {
            std::string said;
            const int right = induction_read_back(c.seq, c.seq.size() / 2, c.two_token_keys, words, said, names);
            std::printf("  %s read back %d of 7:%s\n", c.name, right, said.c_str());
        }
        std::printf("  (with commas every word follows ',', so keys of one token put every word under the same key and the\n"
                    "   delta rule keeps the last one written: at each comma it says the word it has just read. Keys of\n"
                    "   two tokens tell the places apart; a short convolution, one weight per tap, can make them)\n");
    }

    std::printf("\n7.5 the little K3's first KDA layer (layer 0) on held-out text, as the model runs it\n");
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        const Tokenizer tok = Tokenizer::load(dir);
        const std::string text = detail::read_text_file(dir + "/heldout-sample.txt");  // held-out English (chapter 14a)
        const std::vector<std::uint32_t> ids = tok.encode_ordinary(text);
        std::vector<Tensor> keep;
        keep.reserve(64);
        std::deque<std::vector<float>> widened;  // vector tensors as f32 (the engine widens them at load)
        auto mat = [&](const Checkpoint::Ref* r) {
            keep.push_back(ck.read(r->info->name));
            return MatrixRef{keep.back().bytes.data(), nullptr, std::size_t(r->info->shape[0]), std::size_t(r->info->shape[1])};
        };
        auto vec = [&](const Checkpoint::Ref* r) { return widened.emplace_back(to_f32(ck.read(r->info->name))).data(); };
        const KdaWeights w = kda_weights(m.layers[0], mat, vec);
        const KdaDims d = KdaDims::from(c);
        // layer 0's input: the embedding row (no depth mix before the first layer), then input_layernorm
        const std::size_t T = ids.size(), D = d.hidden, P = d.width();
        const Tensor embed = ck.read(m.embed->info->name);
        const float* norm = vec(m.layers[0].input_norm);
        std::vector<float> u(T * D), y(T * D), y2(T * D);
        for (std::size_t t = 0; t < T; ++t) {
            for (std::size_t j = 0; j < D; ++j) u[t * D + j] = bf16_to_f32(embed.bytes.as<bf16>()[std::size_t(ids[t]) * D + j]);
            rmsnorm(&u[t * D], &u[t * D], norm, D, c.rms_norm_eps);
        }
        KdaState st(d), st2(d);
        KdaRecord rec;
        kda_forward(y.data(), u.data(), T, w, d, st, &rec);
        std::printf("  %zu tokens, %zu heads x %zu key channels: %zu gates g; gate_lower_bound %.0f\n", T, d.heads, d.head_dim, rec.g.size(),
                    double(d.lower_bound));
        std::printf("  %5s %7s %10s %12s %12s %12s %10s\n", "head", "A_log", "median g", "g < -4.5", "alpha > 0.9", "min g", "|S| after");
        for (std::size_t h = 0; h < d.heads; ++h) {
            std::vector<float> gh;
            for (std::size_t t = 0; t < T; ++t) gh.insert(gh.end(), &rec.g[t * P + h * d.head_dim], &rec.g[t * P + (h + 1) * d.head_dim]);
            std::size_t strong = 0, weak = 0;
            for (float g : gh) strong += g < -4.5f, weak += exp_f32(g) > 0.9f;
            std::vector<float> sorted = gh;
            std::nth_element(sorted.begin(), sorted.begin() + long(sorted.size() / 2), sorted.end());
            double n2 = 0;
            for (std::size_t i = 0; i < d.head_dim * d.head_dim; ++i) n2 += double(st.S[h * d.head_dim * d.head_dim + i]) * st.S[h * d.head_dim * d.head_dim + i];
            std::printf("  %5zu %+7.2f %10.3f %11.1f%% %11.1f%% %12.4f %10.4f\n", h, double(w.A_log[h]), double(sorted[sorted.size() / 2]),
                        100.0 * double(strong) / double(gh.size()), 100.0 * double(weak) / double(gh.size()),
                        double(*std::min_element(gh.begin(), gh.end())), std::sqrt(n2));
        }
        std::printf("  (|S|: the Frobenius norm of the head's state after the last token.\n");
        std::printf("   The trained gates use the whole range: channels that keep 90%% per token, and channels pressed\n"
                    "   against the bound, which a trained model reaches: it is a limit that binds, not a formality)\n");
        const std::size_t half = T / 2;
        kda_forward(y2.data(), u.data(), half, w, d, st2);
        kda_forward(y2.data() + half * D, u.data() + half * D, T - half, w, d, st2);
        auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        std::printf("  %zu at once vs %zu then %zu: outputs same bits: %s; state S: %s; conv history: %s (%zu bytes of state)\n", T, half,
                    T - half, same(y, y2) ? "yes" : "NO", same(st.S, st2.S) ? "yes" : "NO", same(st.history, st2.history) ? "yes" : "NO",
                    st.bytes());
        std::printf("  (K3: 6.29 MB of S + 0.44 MB of conv history = 6.73 MB per layer)\n");
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
