// Chapter 15 example: a short chat rendered to K3's XTML token ids, then the little K3 (14 M parameters,
// trained on English and synthetic chat turns) in a conversation: a greedy turn, a second turn that
// feeds only its new tokens, then one question answered greedily and sampled at T = 0.7 and 1.0, then a
// list of words it has just read, begun again: does it continue it?
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
    const Tokenizer tok = Tokenizer::load(argc > 1 ? argv[1] : KIMIK3_SOURCE_DIR "/fixtures/little-k3");
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

    // The little K3 itself: every token the real engine's, every reply's text read by token id
    // (chapters/15a_reply.hpp), so the markup that closes a reply is never shown.
    ModelOptions mo;
    Model model(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3", mo);
    auto ids_text = [&](const std::vector<std::int64_t>& r) {
        return tok.decode(std::vector<std::uint32_t>(r.begin(), r.end() - (stop.contains(std::uint32_t(r.back())) ? 1 : 0)));
    };
    std::printf("15.7 a conversation with the little K3 (greedy, thinking off)\n");
    Chat conversation(model.config, 512);
    conversation.options.thinking = false;
    for (const char* user : {"Hello!", "What time is it?"}) {
        std::string text;
        const std::size_t before = conversation.session.position();
        const auto reply = chat_turn(model, conversation, tok, user, 24, SamplingParams{.temperature = 0}, [&](const std::string& t) { text += t; });
        std::printf("  user: %s\n  K3:   %s\n", user, text.c_str());
        std::printf("        (fed %zu new tokens, %zu drawn; the drawn ids decode to \"%s\")\n", conversation.session.position() - before - (reply.size() - 1),
                    reply.size(), ids_text(reply).c_str());
    }
    std::printf("\n15.5 one question, greedy and sampled (top-k 40, top-p 0.95, seed 2026)\n");
    for (float temperature : {0.0f, 0.7f, 1.0f}) {
        Chat chat(model.config, 128);
        chat.options.thinking = false;
        const SamplingParams sp{.temperature = temperature, .top_k = 40, .top_p = 0.95f, .seed = 2026};
        std::string text;
        const auto reply = chat_turn(model, chat, tok, "Who are you?", 32, sp, [&](const std::string& t) { text += t; });
        std::printf("  T = %.1f (%2zu tokens): %s\n", double(temperature), reply.size(), text.c_str());
    }

    // Copying. Eight words in no order any text predicts, read once, then begun again: only a layer that
    // retrieves from the context can go on (in the little K3 that is a KDA layer: its TRAINING.md says
    // which, and how the training made it; make run-07 builds such a head by hand). Twice: the words apart
    // by spaces, then by commas.
    std::printf("\n15.6 copying: a list read once, then begun again (greedy, plain text, continue_session)\n");
    const std::vector<std::string> words = {"river", "radio", "dinner", "island", "doctor", "engine", "market", "window"};
    for (const std::string sep : {" ", ", "}) {
        std::string list;
        for (std::size_t i = 0; i < words.size(); ++i) list += (i ? sep : "") + words[i];
        const std::string text = "The words on the card were " + list + ". She read them out again: " + words[0] + sep + words[1] + (sep == " " ? "" : ",");
        const std::vector<std::uint32_t> enc = tok.encode(text);
        Session session(model.config, 128);
        const auto drawn = continue_session(model, session, std::vector<std::int64_t>(enc.begin(), enc.end()), 16, SamplingParams{.temperature = 0}, 64,
                                            [](std::int64_t) { return true; });
        const std::string got = tok.decode(std::vector<std::uint32_t>(drawn.begin(), drawn.end()));
        std::size_t at = 0, right = 0;  // how many of the list's next words follow, in order
        for (std::size_t i = 2; i < words.size(); ++i) {
            const std::string w = " " + words[i];
            if (got.compare(at, w.size(), w) != 0) break;
            ++right, at += w.size();
            if (sep != " " && at < got.size() && got[at] == ',') ++at;
        }
        std::printf("  prompt: %s\n  K3:    %s\n  the list's next %zu words, in order: %zu\n", text.c_str(), got.c_str(), words.size() - 2, right);
    }
    return 0;
}
