// kimik3 tokenize / detokenize / chat: the text side of the program.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <iostream>

#include "common.hpp"
#include "options.hpp"
#include "run.hpp"

namespace kimik3::cli {

inline const char* kTokenizeUsage =
    "usage: kimik3 tokenize MODEL_DIR (TEXT | --text TEXT | --stdin)\n"
    "\n"
    "Prints the token ids of TEXT (comma-separated) with the checkpoint's tokenizer (MODEL_DIR/tiktoken.model\n"
    "and tokenizer_config.json). Special tokens typed in TEXT stay text. TEXT is always the text itself (so '-'\n"
    "is tokenized as '-'); --text TEXT takes a text that looks like an option; --stdin reads standard input.\n";

inline const char* kDetokenizeUsage =
    "usage: kimik3 detokenize MODEL_DIR IDS\n"
    "\n"
    "Prints the text of comma-separated token ids (special tokens by name; invalid UTF-8 as U+FFFD). Every byte\n"
    "is written, NUL included.\n";

inline const char* kChatUsage =
    "usage: kimik3 chat MODEL_DIR [--budget SIZE | --preset NAME] [--context N] [--max-new N] [--think [--think-effort E]]\n"
    "                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--system TEXT] [--trunk DIR]\n"
    "                   [--speculate N]\n"
    "\n"
    "A multi-turn conversation in K3's chat format. Each line you type is a user message; the reply streams\n"
    "as it is generated and stops at <|end_of_msg|> or [EOS] (or after --max-new tokens, default 256); a reply\n"
    "cut short is closed (its open tags, then <|end_of_msg|>) before the next turn, as K3's template renders\n"
    "past turns. The model's state (KDA states, latent KV cache) carries from turn to turn: only new tokens\n"
    "are computed. With --think the conversation opens with the template's thinking-effort message\n"
    "(--think-effort low, high, max: the default, or none).\n"
    "Commands: /reset (start over), /save FILE, /load FILE (a session file: token history and every layer's\n"
    "state, with a checksum; refused if damaged or made for another model), /quit (or end of input).\n"
    "Ctrl-C stops the reply being written and returns to the prompt (the conversation is kept); Ctrl-C at\n"
    "the prompt ends the program.\n"
    "  --budget SIZE, --preset NAME, --trunk DIR, --no-direct, --threads N   as for kimik3 run\n"
    "  --context N    positions the conversation may reach (default 4096)\n"
    "  --seed S       the token at position p of the conversation is sampled with output p of the seed's stream,\n"
    "                 so a conversation resumed with /load draws what it would have drawn\n"
    "  --speculate N  draft up to N tokens (1-32) per step from the conversation itself (what followed the most\n"
    "                 recent earlier match of its last 4..2 tokens) and verify them in one forward step: the\n"
    "                 same replies in fewer steps. It pays when a step is bound by reading the trunk (a budget\n"
    "                 well below the trunk's size) and replies repeat what came before (quoting, code, lists)\n";

inline std::string read_all_stdin() {
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

inline int cmd_tokenize(std::vector<std::string> args) {
    // --text first: its value may be anything, "--help" and "--stdin" included
    bool has_text = false;
    std::string text;
    for (std::size_t i = 0; i + 1 < args.size(); ++i)
        if (args[i] == "--text") {
            has_text = true, text = args[i + 1];
            args.erase(args.begin() + long(i), args.begin() + long(i) + 2);
            break;
        }
    if (wants_help(args)) return std::fputs(kTokenizeUsage, stdout), kExitOk;
    const bool from_stdin = take_flag(args, "--stdin");
    if (args.size() != (has_text || from_stdin ? 1u : 2u) || (has_text && from_stdin))
        throw Usage(std::string("tokenize takes MODEL_DIR and one of TEXT, --text TEXT, --stdin\n\n") + kTokenizeUsage);
    const Tokenizer tok = Tokenizer::load(args[0]);
    const std::vector<std::uint32_t> ids = tok.encode(from_stdin ? read_all_stdin() : has_text ? text : args[1]);
    for (std::size_t i = 0; i < ids.size(); ++i) std::printf("%s%u", i ? "," : "", ids[i]);
    std::printf("\n");
    return kExitOk;
}

inline int cmd_detokenize(std::vector<std::string> args) {
    if (wants_help(args)) return std::fputs(kDetokenizeUsage, stdout), kExitOk;
    if (args.size() != 2) throw Usage(std::string("detokenize takes MODEL_DIR IDS\n\n") + kDetokenizeUsage);
    const Tokenizer tok = Tokenizer::load(args[0]);
    std::vector<std::uint32_t> ids;
    for (std::int64_t id : parse_ids(args[1], "IDS", kDetokenizeUsage)) {
        if (id >= std::int64_t(tok.vocab_size())) throw Usage("token id " + std::to_string(id) + " is outside the vocabulary\n");
        ids.push_back(std::uint32_t(id));
    }
    const std::string text = tok.decode_text(ids) + "\n";
    std::fwrite(text.data(), 1, text.size(), stdout);  // every byte: printf("%s") would stop at a NUL
    return kExitOk;
}

// Ctrl-C in a chat: while a reply is drawn, it stops the reply (the conversation keeps what was said,
// the cut reply closed as any reply cut short); at the prompt, or a second time before the reply stops,
// it ends the program (exit 130). End of input (Ctrl-D) ends it too (exit 0).
inline std::atomic<int> g_chat_interrupts{0};
inline std::atomic<bool> g_chat_at_prompt{false};
inline void chat_interrupt(int) {
    if (g_chat_at_prompt.load() || g_chat_interrupts.fetch_add(1) > 0) {
        [[maybe_unused]] const ssize_t n = ::write(2, "\n", 1);
        ::_exit(130);
    }
}

struct ChatOptionsCli {
    std::string dir, system;
    ModelArgs model;
    SamplingParams sampling;
    ThinkArgs think;
    std::size_t max_new = 256, speculate = 0;
};
inline ChatOptionsCli parse_chat_args(std::vector<std::string> args) {
    Options o(std::move(args), kChatUsage);
    ChatOptionsCli c;
    c.system = o.text("--system").value_or("");
    c.max_new = std::size_t(o.count("--max-new", 1, std::uint64_t(kMaxPositions)).value_or(256));
    c.sampling = sampling_args(o);
    c.speculate = speculate_arg(o);
    c.model = model_args(o);
    c.think = think_args(o);
    c.dir = o.positional(1, "MODEL_DIR")[0];
    return c;
}

// Where chat's lines come from, and what it may do besides (kimik3-mpi chat: rank 0 reads the terminal and
// sends each line to every rank; a reply is stopped by ending the job, and no rank writes session files).
struct ChatIO {
    std::function<bool(std::string& line)> read_line = [](std::string& line) { return bool(std::getline(std::cin, line)); };
    bool files = true;       // /save and /load
    bool interrupts = true;  // Ctrl-C stops a reply, and the conversation goes on
};

inline int cmd_chat_with(std::vector<std::string> args, const ChatIO& io) {
    if (wants_help(args)) return std::fputs(kChatUsage, stdout), kExitOk;
    const ChatOptionsCli co = parse_chat_args(std::move(args));
    const std::string& system = co.system;
    const bool think = co.think.think;
    const std::string& effort = co.think.effort;
    const SamplingParams& sp = co.sampling;
    const std::size_t speculate = co.speculate, limit = co.max_new;
    ModelOptions mo;
    mo.budget = co.model.budget;
    mo.plan.context = co.model.context.value_or(4096);
    mo.trunk_dir = co.model.trunk;
    mo.direct = co.model.direct;
    if (co.model.threads > 0) set_threads(co.model.threads);
    mo.on_plan = show_and_check_plan;
    args = {co.dir};
    const Tokenizer tok = Tokenizer::load(args[0]);
    mo.on_plan = [&](const Plan& p, const Config& c) {  // before any weight is read
        require_same_vocabulary(tok, c, args[0]);
        show_and_check_plan(p, c);
    };
    Model model(args[0], mo);
    Chat chat(model.config, mo.plan.context);
    auto start = [&] {
        chat = Chat(model.config, mo.plan.context);
        chat.options.thinking = think;
        chat.options.thinking_effort = effort;
        // what opens the conversation (fed with the first turn): the thinking-effort message, a system message
        ChatWriter w(tok);
        render_chat_start(w, chat.options);
        if (!system.empty()) render_message(w, ChatMessage{"system", system}, chat.options);
        chat.pending.assign(w.ids().begin(), w.ids().end());
    };
    start();
    struct sigaction sa {}, old {};
    sa.sa_handler = chat_interrupt;
    sigemptyset(&sa.sa_mask);
    if (io.interrupts && ::sigaction(SIGINT, nullptr, &old) == 0 && old.sa_handler != SIG_IGN) ::sigaction(SIGINT, &sa, nullptr);  // ignored (nohup, &): stays so
    std::fprintf(stderr, "chat: type a message; %s/quit%s\n", io.files ? "/reset, /save FILE, /load FILE, " : "/reset, ",
                 io.interrupts ? "; Ctrl-C stops a reply" : "");
    std::string line;
    while (std::fprintf(stderr, "> "), g_chat_at_prompt = true, io.read_line(line)) {
        g_chat_at_prompt = false;
        g_chat_interrupts = 0;
        if (line.empty()) continue;
        if (line == "/quit") break;
        if (line == "/reset") {
            start();
            std::fprintf(stderr, "(conversation reset)\n");
            continue;
        }
        if (!io.files && (line.rfind("/save", 0) == 0 || line.rfind("/load", 0) == 0)) {
            std::fprintf(stderr, "(not here: under MPI each rank holds the session; /save and /load are kimik3 chat's)\n");
            continue;
        }
        if (line.rfind("/save", 0) == 0 && (line.size() == 5 || line[5] == ' ')) {
            if (line.size() <= 6) {
                std::fprintf(stderr, "(not saved: /save needs a FILE name)\n");
                continue;
            }
            try {
                save_chat(line.substr(6), model, chat);
                std::fprintf(stderr, "(saved %zu tokens of history to %s)\n", chat.session.tokens.size(), line.substr(6).c_str());
            } catch (const Error& e) {
                std::fprintf(stderr, "(not saved: %s)\n", e.what());
            }
            continue;
        }
        if (line.rfind("/load", 0) == 0 && (line.size() == 5 || line[5] == ' ')) {
            if (line.size() <= 6) {
                std::fprintf(stderr, "(not loaded: /load needs a FILE name)\n");
                continue;
            }
            try {
                load_chat(line.substr(6), model, chat);
                std::fprintf(stderr, "(loaded %zu tokens of history)\n", chat.session.tokens.size());
            } catch (const Error& e) {
                std::fprintf(stderr, "(not loaded: %s)\n", e.what());
            }
            continue;
        }
        if (line[0] == '/') {
            std::fprintf(stderr, "(unknown command %s: /reset, /save FILE, /load FILE, /quit)\n", line.c_str());
            continue;
        }
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::int64_t> reply;
        SpeculationStats stats;
        try {
            auto print = [](const std::string& text) {
                std::fputs(text.c_str(), stdout);
                std::fflush(stdout);
            };
            // chat_turn's loop, with one more reason to stop: Ctrl-C (the token it came on is shown and kept)
            reply = chat_turn_with(chat, tok, line, limit, print, [&](const std::vector<std::int64_t>& fresh, auto&& on_token) {
                auto go = [&](std::int64_t id) { return on_token(id) && g_chat_interrupts.load() == 0; };
                return speculate ? continue_session_speculative(model, chat.session, fresh, limit, sp, 32, speculate, go, nullptr, &stats)
                                 : continue_session(model, chat.session, fresh, limit, sp, 32, go);
            });
        } catch (const Error& e) {
            if (e.kind != ErrorKind::usage) throw;  // a failed read is the end (exit 4); a refused turn is not
            std::fprintf(stderr, "(not sent: %s)\n", e.what());
            continue;
        }
        std::printf("\n");
        std::fflush(stdout);
        if (g_chat_interrupts.load() > 0) std::fprintf(stderr, "(stopped by Ctrl-C; the conversation goes on from here)\n");
        std::fprintf(stderr, "(%zu tokens, %.2f s; %zu in the conversation", reply.size(), seconds_since(t0), chat.session.tokens.size());
        if (speculate)
            std::fprintf(stderr, "; %zu decode steps, %zu drafted, %zu accepted: %.2f tokens per step", stats.steps, stats.drafted,
                         stats.accepted, stats.tokens_per_step());
        std::fprintf(stderr, ")\n");
    }
    return kExitOk;
}

inline int cmd_chat(std::vector<std::string> args) { return cmd_chat_with(std::move(args), ChatIO{}); }

}  // namespace kimik3::cli
