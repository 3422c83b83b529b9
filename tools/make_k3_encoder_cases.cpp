// Writes fixtures/chat/k3_encoder_cases.json: each request of tools/k3_encoder_requests.json rendered by
// kimik3's K3 API path (examples/cli/serve_api.hpp chat_request, chapter 15b render_request) under K3's
// own vocabulary, as its segments and ids. The output is evidence only where it is compared with
// Moonshot's: the simply_* cases' ids equal the release's goldens (google-deepmind/simply,
// simply/zoo/kimi_k3/utils/testdata/kimi_k3_chat_goldens.json, kimi_k3_chat_template_goldens.json) and
// the verifier cases' prompt_tokens equal Kimi-Vendor-Verifier's counts; check both after a run.
//   g++ -std=c++20 -O1 -I. tools/make_k3_encoder_cases.cpp -o /tmp/make_k3_encoder_cases
//   /tmp/make_k3_encoder_cases K3_TOKENIZER_DIR > fixtures/chat/k3_encoder_cases.json
// K3_TOKENIZER_DIR holds the release's tiktoken.model (sha256 b6c497a7...c5103; not in this repository)
// and fixtures/tokenizer/k3_tokenizer_config.json as tokenizer_config.json.
#include "examples/cli/serve_reply.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

using namespace kimik3;
using namespace kimik3::cli;

int main(int argc, char** argv) {
    if (argc != 2) return std::fprintf(stderr, "usage: make_k3_encoder_cases K3_TOKENIZER_DIR\n"), 2;
    const Tokenizer tok = Tokenizer::load(argv[1]);
    std::ifstream f(std::string(KIMIK3_SOURCE_DIR) + "/tools/k3_encoder_requests.json");
    std::stringstream ss;
    ss << f.rdbuf();
    nlohmann::ordered_json in = nlohmann::ordered_json::parse(ss.str());
    std::printf("{\"about\":%s,\"cases\":[", in["about"].dump(-1, ' ', false).c_str());
    bool first = true;
    for (nlohmann::ordered_json c : in["cases"]) {
        const std::string text = c["request"].dump();
        ChatRequest cr = chat_request(text, nlohmann::json::parse(text));
        if (!c["effort_message"].get<bool>()) cr.options.thinking_effort = "";
        const ChatWriter w = render_request(tok, cr);
        c["segments"] = nlohmann::ordered_json::array();
        for (const auto& [t, special] : w.segments()) c["segments"].push_back(t);
        c["k3_ids"] = w.ids();
        std::printf("%s\n%s", first ? "" : ",", c.dump(-1, ' ', false).c_str());
        first = false;
    }
    std::printf("]}\n");
}
