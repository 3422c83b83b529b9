// tokenize_jsonl: the engine's own tokenizer (chapter 14) for tools that prepare training data.
//
//   g++ -std=c++20 -O2 -I. tools/tokenize_jsonl.cpp -o build/tokenize_jsonl
//   build/tokenize_jsonl MODEL_DIR < strings.jsonl > ids.txt
//
// Reads one JSON string per input line (so any text, newlines included, fits on a line) and writes one
// line per input: the comma-separated token ids of that string (an empty line for an empty string),
// exactly what `kimik3 tokenize` gives for it (specials typed in the text stay text). tools/
// train_little_k3.py uses it so that the ids a model is trained on are the ids the engine produces; a
// Python approximation of K3's pre-tokenizer regex would differ on some strings.
#include <cstdio>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "chapters/14_tokenizer.hpp"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: tokenize_jsonl MODEL_DIR < strings.jsonl\n");
        return 2;
    }
    try {
        const kimik3::Tokenizer tok = kimik3::Tokenizer::load(argv[1]);
        std::string line, out;
        std::size_t n = 0;
        while (std::getline(std::cin, line)) {
            ++n;
            const nlohmann::json j = nlohmann::json::parse(line);
            if (!j.is_string()) throw std::runtime_error("line " + std::to_string(n) + " is not a JSON string");
            out.clear();
            for (std::uint32_t id : tok.encode(j.get<std::string>())) {
                if (!out.empty()) out += ',';
                out += std::to_string(id);
            }
            out += '\n';
            std::fwrite(out.data(), 1, out.size(), stdout);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "tokenize_jsonl: %s\n", e.what());
        return 1;
    }
    return 0;
}
