// Example for chapter 10: the trained little K3 reads held-out English in one step. Which of its 32
// experts per layer fire on digits, punctuation, capitalised words and function words; how evenly the
// load spreads over experts and layers; and what the router's selection bias changes.
//   make run-10
#include <cctype>
#include <cstdio>
#include <set>
#include <string>

#include "../kimik3.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

enum Kind { Digit, Punct, Capital, Function, Other, Kinds };
static const char* kKindName[Kinds] = {"digits", "punctuation", "Capitalised", "function words", "other words"};

// What a token is, from its bytes (a leading space dropped) and whether the next token continues its word.
static Kind kind_of(std::string_view t, bool word_continues) {
    static const std::set<std::string_view> function_words = {
        "the", "of", "and", "to", "a", "an", "in", "is", "was", "that", "it", "for", "on", "with", "as", "by", "at", "from",
        "or", "be", "had", "has", "have", "his", "its", "their", "which", "who", "this", "were", "not", "but", "no", "if", "than"};
    if (!t.empty() && t[0] == ' ') t.remove_prefix(1);
    if (t.empty()) return Other;
    bool digit = false, punct = true;
    for (unsigned char ch : t) digit = digit || std::isdigit(ch), punct = punct && std::ispunct(ch);
    if (digit) return Digit;
    if (punct) return Punct;
    if (std::isupper((unsigned char)t[0])) return Capital;
    return !word_continues && function_words.count(t) ? Function : Other;
}

// The k ids with the highest v (ties to the lower id: the router's rule).
static std::vector<int> top_k(const float* v, std::size_t n, std::size_t k) {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + long(k), order.end(), [&](int p, int q) { return v[p] > v[q] || (v[p] == v[q] && p < q); });
    order.resize(k);
    return order;
}

int main() {
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        const Tokenizer tok = Tokenizer::load(dir);
        const std::string text = detail::read_text_file(dir + "/heldout-sample.txt");  // held-out English (chapter 14a)
        const std::vector<std::uint32_t> ids32 = tok.encode_ordinary(text);
        const std::vector<std::int64_t> ids(ids32.begin(), ids32.end());
        Model model(dir, ModelOptions{});  // everything resident: 14 M parameters
        const Config& c = model.config;
        const std::size_t T = ids.size(), E = std::size_t(c.num_experts), K = std::size_t(c.num_experts_per_token);
        Session s(c, T);
        StepRecord rec;  // what every layer chose for every token
        std::vector<float> logits(std::size_t(c.vocab_size));
        forward(logits.data(), model, s, {ids.data(), T}, {.record = &rec});

        std::vector<Kind> kind(T);
        std::size_t count[Kinds] = {};
        for (std::size_t t = 0; t < T; ++t) {
            const std::string_view next = t + 1 < T ? tok.token_bytes(ids32[t + 1]) : " ";
            kind[t] = kind_of(tok.token_bytes(ids32[t]), !next.empty() && std::isalpha((unsigned char)next[0]));
            ++count[kind[t]];
        }
        std::vector<int> moe;  // the MoE layers (layer 0 is the dense FFN)
        for (int l = 0; l < c.num_hidden_layers; ++l)
            if (c.layers[std::size_t(l)].ffn == FfnKind::MoE) moe.push_back(l);
        auto routing = [&](int l) -> const Routing& { return rec.layers[std::size_t(l)].routing; };
        auto fires = [&](int l, std::size_t t, int e) { const int* r = &routing(l).ids[t * K]; return std::find(r, r + K, e) != r + K; };
        std::printf("10.1 the little K3 (trained) reads %zu tokens of held-out text (fixtures/little-k3/heldout-sample.txt)\n"
                    "     in one step; each of its %zu MoE layers sends every token to %zu of %zu experts (%.1f%% each if even)\n",
                    T, moe.size(), K, E, 100.0 * double(K) / double(E));
        std::printf("  tokens:");
        for (int k = 0; k < Kinds; ++k) std::printf(" %zu %s%s", count[k], kKindName[k], k + 1 < Kinds ? "," : "\n");

        // One token's routing: the bias decides WHICH experts, the scores alone HOW MUCH each counts.
        const std::size_t t0 = std::size_t(std::find(kind.begin(), kind.end(), Digit) - kind.begin());
        const int l0 = 6;
        const float* bias = model.trunk().vec(model.tensors.layers[std::size_t(l0)].router_bias);
        const float* sc = &routing(l0).scores[t0 * E];
        std::printf("\n10.1 token %zu '%s' at layer %d: score + bias -> weight, in slot order\n   ", t0, std::string(tok.token_bytes(ids32[t0])).c_str(), l0);
        for (std::size_t j = 0; j < K; ++j) {
            const int e = routing(l0).ids[t0 * K + j];
            std::printf("  e%-2d %.3f%+.3f -> %.3f", e, double(sc[e]), double(bias[e]), double(routing(l0).weights[t0 * K + j]));
        }
        std::printf("\n   scores alone would pick:");
        for (int e : top_k(sc, E, K)) std::printf(" e%d", e);
        std::printf("\n");

        // Per layer and kind: the expert that kind of token uses most, and on what share of those tokens.
        std::printf("\n10.1 per MoE layer, the expert each kind of token uses most, and on what share of those tokens\n  %-15s", "layer");
        for (int l : moe) std::printf(" %8d", l);
        std::printf("\n");
        for (int k = 0; k < Kinds; ++k) {
            std::printf("  %-15s", kKindName[k]);
            for (int l : moe) {
                std::vector<int> n(E, 0);
                for (std::size_t t = 0; t < T; ++t)
                    if (kind[t] == k)
                        for (std::size_t j = 0; j < K; ++j) ++n[std::size_t(routing(l).ids[t * K + j])];
                const std::size_t e = std::size_t(std::max_element(n.begin(), n.end()) - n.begin());
                std::printf("  e%-2zu %3.0f%%", e, 100.0 * n[e] / double(std::max<std::size_t>(count[k], 1)));
            }
            std::printf("\n");
        }
        std::printf("  (\"other words\" is the baseline: its busiest expert is near the even 12.5%%)\n");
        std::printf("  the sharpest expert per kind: how often it fires on that kind and on every other token\n");
        for (int k = 0; k < Function + 1; ++k) {
            double best = -1;
            int bl = 0, be = 0, on = 0, off = 0;
            for (int l : moe)
                for (int e = 0; e < int(E); ++e) {
                    int a = 0, b = 0;
                    for (std::size_t t = 0; t < T; ++t)
                        if (fires(l, t, e)) ++(kind[t] == k ? a : b);
                    const double gap = double(a) / double(count[k]) - double(b) / double(T - count[k]);
                    if (gap > best) best = gap, bl = l, be = e, on = a, off = b;
                }
            std::printf("    %-14s layer %d e%-2d %3.0f%% vs %3.0f%%, e.g.", kKindName[k], bl, be, 100.0 * on / double(count[k]),
                        100.0 * off / double(T - count[k]));
            std::set<std::string_view> shown;
            for (std::size_t t = 0; t < T && shown.size() < 6; ++t)
                if (kind[t] == k && fires(bl, t, be) && shown.insert(tok.token_bytes(ids32[t])).second)
                    std::printf(" '%s'", std::string(tok.token_bytes(ids32[t])).c_str());
            std::printf("\n");
        }

        // The same token in another context, against the next token: how many of the 4 experts agree.
        std::printf("\n10.1 experts shared (of %zu) with the same token's previous occurrence, and with the previous token\n  %-15s", K, "layer");
        for (int l : moe) std::printf(" %5d", l);
        for (int same_id = 1; same_id >= 0; --same_id) {
            std::printf("\n  %-15s", same_id ? "same token" : "previous token");
            for (int l : moe) {
                double shared = 0;
                std::size_t pairs = 0;
                for (std::size_t t = 1; t < T; ++t) {
                    std::size_t u = t - 1;
                    if (same_id)
                        for (u = t; u-- > 0 && ids[u] != ids[t];) {}
                    if (u >= t || (!same_id && ids[u] == ids[t])) continue;  // no earlier occurrence / a repeat
                    for (std::size_t j = 0; j < K; ++j) shared += fires(l, u, routing(l).ids[t * K + j]);
                    ++pairs;
                }
                std::printf(" %5.2f", shared / double(pairs));
            }
        }
        std::printf("\n  (%.1f if the two choices were independent and even: a token brings most of its experts back when it\n"
                    "   comes again, while its neighbour shares hardly more than chance; chapter 11 asks what a cache gets\n"
                    "   from that)\n",
                    double(K * K) / double(E));

        // Load: each expert's share of a layer's T x K requests, in tenths of the even share; and the
        // busiest expert's load if the scores alone chose (the bias exists to even this out).
        std::printf("\n10.1 load per expert and layer (tenths of the even share: 10 = even), with and without the bias\n");
        std::printf("  %5s  %-96s %8s %8s\n", "layer", "experts 0..31", "max/mean", "no bias");
        std::size_t changed = 0;
        for (int l : moe) {
            std::vector<int> n(E, 0), plain(E, 0);
            for (std::size_t t = 0; t < T; ++t) {
                const std::vector<int> p = top_k(&routing(l).scores[t * E], E, K);
                bool same = true;
                for (std::size_t j = 0; j < K; ++j) {
                    ++n[std::size_t(routing(l).ids[t * K + j])], ++plain[std::size_t(p[j])];
                    same = same && fires(l, t, p[j]);
                }
                changed += !same;
            }
            const double mean = double(T * K) / double(E);
            std::printf("  %5d  ", l);
            for (std::size_t e = 0; e < E; ++e) std::printf("%2.0f ", std::min(99.0, 10.0 * n[e] / mean));
            std::printf("%6.2f %8.2f\n", *std::max_element(n.begin(), n.end()) / mean, *std::max_element(plain.begin(), plain.end()) / mean);
        }
        std::printf("  the bias changed the chosen set in %zu of %zu token-layers (%.0f%%): it spreads the load without\n"
                    "  changing any weight (the weights are the scores alone, renormalised)\n",
                    changed, T * moe.size(), 100.0 * double(changed) / double(T * moe.size()));
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
