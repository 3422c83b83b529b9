// Fuzz target: the tokenizer files (chapter 14): tiktoken.model and tokenizer_config.json, then the
// encoder and decoder of whatever loaded. Input: a 2-byte little-endian length L, then L bytes of
// tiktoken.model, then tokenizer_config.json.
#include "../../chapters/14_tokenizer.hpp"
#include "fuzz.hpp"

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3;
    if (input.size() < 2) return;
    const std::size_t n = std::min<std::size_t>(std::uint8_t(input[0]) | std::size_t(std::uint8_t(input[1])) << 8, input.size() - 2);
    const std::string_view model = input.substr(2, n), config = input.substr(2 + n);
    const Tokenizer t = Tokenizer::from_strings(model, "fuzz/tiktoken.model", config, "fuzz/tokenizer_config.json");
    // whatever loaded must encode and decode without crashing; ids always decode back to the text
    const std::string text(config.substr(0, 200));
    std::vector<std::uint32_t> ids;
    try {
        ids = t.encode(text);
    } catch (const Error&) {
        return;  // invalid UTF-8 is refused
    }
    if (t.decode(ids) != text) std::abort();
    std::vector<std::uint32_t> every;
    for (std::uint32_t id = 0; id < t.vocab_size() && id < 600; ++id) every.push_back(id);
    Utf8Stream s;
    for (std::uint32_t id : every) (void)s.push(t.decode(std::span<const std::uint32_t>(&id, 1)));
    (void)s.finish();
}

namespace {
// A vocabulary of the 256 bytes plus "ab" (so there is one merge), as tiktoken.model text.
std::string small_model() {
    const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    for (int b = 0; b < 256; ++b) {
        const unsigned v = unsigned(b) << 16;
        out += abc[v >> 18 & 63], out += abc[v >> 12 & 63], out += "== " + std::to_string(b) + "\n";
    }
    return out + "YWI= 256\n";
}
std::string with_length(const std::string& model, const std::string& config) {
    const std::string m = model.substr(0, 65535);
    return std::string(1, char(m.size() & 0xFF)) + char(m.size() >> 8) + m + config;
}
}  // namespace

std::vector<std::string> kimik3_fuzz_seeds() {
    const std::string tiny_model = kimik3::fuzz::source_file("fixtures/tiny-k3/tiktoken.model");
    const std::string tiny_config = kimik3::fuzz::source_file("fixtures/tiny-k3/tokenizer_config.json");
    return {with_length(tiny_model, tiny_config),
            with_length(small_model(), R"({"added_tokens_decoder":{"257":{"content":"[BOS]"},"258":{"content":"[EOS]","special":true}},"bos_token":"[BOS]","eos_token":{"content":"[EOS]"}})")};
}
