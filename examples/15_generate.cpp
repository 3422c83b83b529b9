// Chapter 15 example: a short chat rendered to K3's XTML token ids, then sampling at two temperatures.
// The sampling here draws from a fixed, hand-made logit vector (clearly labelled): the tiny K3 model
// that will produce real logits is wired in by the later sections of this chapter.
// Usage: 15_generate [TOKENIZER_DIR]
#include <cstdio>
#include <string>

#include "../chapters/15_generate.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

// The ids as segments: specials in [brackets], each run of text ids decoded between them.
static void print_segments(const Tokenizer& tok, const std::vector<std::uint32_t>& ids) {
    std::string line = "   ";
    std::vector<std::uint32_t> run;
    auto flush = [&] {
        if (!run.empty()) line += " \"" + tok.decode_text(run) + "\"(" + std::to_string(run.size()) + ")";
        run.clear();
    };
    for (std::uint32_t id : ids) {
        if (!tok.is_special(id)) {
            run.push_back(id);
            continue;
        }
        flush();
        line += " [" + std::string(tok.token_bytes(id)) + "]";
        if (tok.token_bytes(id) == "<|end_of_msg|>") std::printf("%s\n", line.c_str()), line = "   ";
    }
    flush();
    std::printf("%s\n", line.c_str());
}

int main(int argc, char** argv) {
    const Tokenizer tok = Tokenizer::load(argc > 1 ? argv[1] : KIMIK3_SOURCE_DIR "/fixtures/tiny-k3");
    const ChatMessage chat[] = {{.role = "system", .content = "You are Kimi."},
                                {.role = "user", .content = "What does <|open|> mean?", .name = "Ada \"A&B\""}};

    for (bool thinking : {true, false}) {
        const std::vector<std::uint32_t> ids = render_chat(tok, chat, {.thinking = thinking});
        std::printf("15.2 the chat rendered with thinking %s: %zu ids\n", thinking ? "on" : "off", ids.size());
        print_segments(tok, ids);
        if (!thinking) {
            std::printf("    ids:");
            for (std::uint32_t id : ids) std::printf(" %u", id);
            std::printf("\n");
        }
        std::printf("\n");
    }

    const StopTokens stop = stop_tokens(tok);
    std::printf("15.3 generation stops at %u <|end_of_msg|> or %u [EOS]\n\n", stop.end_of_msg, stop.eos);

    // A hand-made logit vector (NOT model output): a few plausible next tokens, everything else -8.
    std::vector<float> logits(tok.vocab_size(), -8.0f);
    const std::pair<const char*, float> favourites[] = {{" the", 3.0f}, {" a", 2.5f}, {" token", 2.0f}, {" model", 1.5f},
                                                        {" text", 1.0f}, {".", 0.5f}};
    for (const auto& [text, logit] : favourites) logits[tok.encode(text).at(0)] = logit;

    std::printf("15.5 sampling from HAND-MADE logits (the model is wired in later), seed 2026, top_k 0, top_p 0.95\n");
    for (float temperature : {0.5f, 1.5f}) {
        const SamplingParams sp{.temperature = temperature, .top_k = 0, .top_p = 0.95f};
        const std::vector<TokenCandidate> kept = sampling_candidates(logits, sp);
        std::printf("  T = %.1f: %zu ids survive top-p;", double(temperature), kept.size());
        for (std::size_t j = 0; j < kept.size() && j < 6; ++j)
            std::printf(" \"%s\" %.3f", tok.decode_text(std::vector<std::uint32_t>{kept[j].id}).c_str(), double(kept[j].p));
        SplitMix64 rng(2026);
        std::string text;
        for (int i = 0; i < 16; ++i) text += tok.decode_text(std::vector<std::uint32_t>{sample(logits, sp, rng)});
        std::printf("\n         16 draws: \"%s\"\n", text.c_str());
    }
    std::printf("  T = 0 (greedy): \"%s\"\n", tok.decode_text(std::vector<std::uint32_t>{greedy(logits)}).c_str());
    return 0;
}
