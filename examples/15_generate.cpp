// Chapter 15 example: a short chat rendered to K3's XTML token ids, then the tiny K3 replying to a
// user turn, greedy and sampled at two temperatures from one seed.
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

    // The tiny K3 itself (random weights: the text is noise, but every step is the real engine): one
    // user turn, then replies sampled at two temperatures from the same seed.
    ModelOptions mo;
    Model model(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3", mo);
    std::printf("15.6 the tiny K3 replies to \"Hello!\" (random weights: noise, but every bit the engine's)\n");
    for (float temperature : {0.0f, 0.7f, 1.5f}) {
        Chat chat(model.config, 128);
        chat.options.thinking = false;
        const SamplingParams sp{.temperature = temperature, .top_k = 40, .top_p = 0.95f, .seed = 2026};
        std::string text;
        const auto reply = chat_turn(model, chat, tok, "Hello!", 12, sp, [&](const std::string& t) { text += t; });
        std::printf("  T = %.1f: %2zu tokens, ids", double(temperature), reply.size());
        for (std::int64_t id : reply) std::printf(" %lld", (long long)id);
        std::printf("\n           text \"%s\"\n", text.c_str());
    }
    return 0;
}
