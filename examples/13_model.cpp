// Example for chapter 13: the whole little K3 (14 M parameters, trained on English) against the PyTorch
// reference: teacher forcing, the same logits at two budgets and two thread counts, then a greedy
// continuation of a sentence, incremental and by full recompute (its text decoded with chapter 14's
// tokenizer, which the next chapter teaches).
//   make run-13
#include <cstdio>

#include "../chapters/13_model.hpp"
#include "../chapters/14_tokenizer.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main() {
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        SafetensorsFile ref(dir + "/reference/model.safetensors");
        const auto tf = to_i64(ref.read("tf_ids")), tf_argmax = to_i64(ref.read("tf_argmax"));
        const auto prompt = to_i64(ref.read("prompt_ids")), greedy = to_i64(ref.read("greedy_ids"));
        const auto tf_logits = to_f32(ref.read("tf_logits"));

        ModelOptions o;
        Model model(dir, o);  // everything resident: the little K3 is 18 MB
        const std::size_t V = std::size_t(model.config.vocab_size);
        std::printf("13.3 teacher forcing %zu positions in one forward step (layers %s)\n", tf.size(), model.config.schedule_string().c_str());
        Session s(model.config, 64);
        const std::vector<float> logits = teacher_force(model, s, tf, 32);
        int agree = 0;
        double worst = 0, scale = 0;
        for (std::size_t i = 0; i < logits.size(); ++i) {
            worst = std::max(worst, std::fabs(double(logits[i]) - tf_logits[i]));
            scale = std::max(scale, std::fabs(double(tf_logits[i])));
        }
        for (std::size_t t = 0; t < tf.size(); ++t) agree += argmax(&logits[t * V], V) == tf_argmax[t];
        std::printf("  argmax agrees with the float64 reference at %d of %zu positions\n", agree, tf.size());
        std::printf("  largest logit difference %.1e, %.1e relative to the largest logit (the test allows 2e-5)\n", worst, worst / scale);
        std::printf("  position 0: top logits");
        std::vector<std::size_t> order(V);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + 3, order.end(), [&](std::size_t a, std::size_t b) { return logits[a] > logits[b]; });
        for (int k = 0; k < 3; ++k) std::printf("  id %zu %.4f", order[std::size_t(k)], double(logits[order[std::size_t(k)]]));

        // The budget decides only where weights come from; threads split outputs, never sums: so the
        // hash of all 32 x V logits is the same in all four runs.
        std::printf("\n  the same %zu logits (FNV-1a hash of their bytes) at two budgets and two thread counts:\n", logits.size());
        const int threads_before = max_threads();
        for (const bool at_floor : {false, true}) {
            ModelOptions ob;
            ob.budget = at_floor ? kBudgetFloor : 0;  // the plan's floor, or everything resident
            Model m(dir, ob);
            for (const int nt : {1, 2}) {
                set_threads(nt);
                Session s2(m.config, 64);
                const std::vector<float> l = teacher_force(m, s2, tf, 32);
                std::printf("    %-34s %d thread%s  %016llx  %s\n",
                            at_floor ? ("floor, " + human_bytes(double(m.plan.budget)) + " (weights streamed)").c_str()
                                     : "everything resident",
                            nt, nt == 1 ? ": " : "s:",
                            (unsigned long long)hash_bytes(reinterpret_cast<const std::byte*>(l.data()), l.size() * sizeof(float)),
                            std::memcmp(l.data(), logits.data(), l.size() * sizeof(float)) == 0 ? "same bits" : "DIFFERENT");
            }
        }
        set_threads(threads_before);
        std::printf("  (fixtures/little-k3/engine_tf_logits.hash pins this value for every build: make test-13)\n");

        // 13.4: the decode loop, greedy, on the reference's prompt and on a sentence of our own
        const Tokenizer tok = Tokenizer::load(dir);
        auto text = [&](const std::vector<std::int64_t>& ids) { return tok.decode_text(std::vector<std::uint32_t>(ids.begin(), ids.end())); };
        std::printf("\n13.4 greedy generation, incremental (one token per step) and full recompute\n");
        auto quiet = [](std::size_t, std::int64_t) {};
        const Generation inc = generate_greedy(model, prompt, greedy.size(), kPrefillChunk, false, 64, quiet);
        const Generation rec = generate_greedy(model, prompt, greedy.size(), kPrefillChunk, true, 64, quiet);
        const bool same = std::memcmp(inc.logits.data(), rec.logits.data(), inc.logits.size() * 4) == 0;
        std::printf("  the reference's %zu-token prompt: \"%s\"\n  continues:  \"%s\"\n", prompt.size(), text(prompt).c_str(), text(inc.ids).c_str());
        std::printf("  incremental: %s; recompute: %s; their logits: %s\n", inc.ids == greedy ? "the reference's tokens" : "DIFFERENT tokens",
                    rec.ids == greedy ? "the reference's tokens" : "DIFFERENT tokens", same ? "bit-identical" : "DIFFERENT");
        const std::vector<std::uint32_t> enc = tok.encode("She opened the door and saw");
        const Generation g = generate_greedy(model, std::vector<std::int64_t>(enc.begin(), enc.end()), 24, kPrefillChunk, false, 64, quiet);
        std::printf("  \"She opened the door and saw\" continues greedily: \"%s\"\n", text(g.ids).c_str());
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
