// Fuzz target: a session file (chapter 15's parse_chat, with chapters 07 and 08 loading each layer's
// state) for the tiny K3's config at a 64-position context.
#include "../../chapters/15c_session_file.hpp"
#include "fuzz.hpp"

namespace {
const kimik3::Config& config() {
    static const kimik3::Config c = kimik3::parse_config(kimik3::parse_json(kimik3::fuzz::source_file("fixtures/tiny-k3/config.json"), "config.json"), "config.json");
    return c;
}
}  // namespace

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3;
    // A mutated file almost never matches its checksum: the input is also parsed resealed (its last 8
    // bytes rewritten to its checksum), so that the checks after the checksum see hostile bytes too.
    constexpr std::uint64_t kIdentity = 0x6b696d696b33;  // the seeds' model fingerprint
    {
        Chat raw(config(), 64);
        try {
            parse_chat(input, "fuzz.session", config(), kIdentity, raw);
        } catch (const Error&) {
        }
    }
    std::string sealed(input);
    seal_session(sealed);
    Chat chat(config(), 64);
    parse_chat(sealed, "fuzz.session", config(), kIdentity, chat);
    // what loaded is consistent: one MLA position per token, ids in the vocabulary
    for (const auto& m : chat.session.mla)
        if (m && m->length() != chat.session.tokens.size()) std::abort();
    for (std::int64_t id : chat.pending)
        if (id < 0 || id >= config().vocab_size) std::abort();
}

std::vector<std::string> kimik3_fuzz_seeds() {
    using namespace kimik3;
    std::vector<std::string> seeds;
    for (std::size_t n : {0, 3}) {  // a fresh chat, and one with 3 tokens of history in every cache
        Chat chat(config(), 64);
        for (std::size_t t = 0; t < n; ++t) {
            chat.session.tokens.push_back(std::int64_t(t + 1));
            for (auto& m : chat.session.mla)
                if (m) m->append()[0] = 0.5f;
        }
        for (auto& k : chat.session.kda)
            if (k) k->S[0] = 0.25f;
        chat.pending = {482};
        seeds.push_back(session_bytes(config(), chat, 0x6b696d696b33));
    }
    return seeds;
}
