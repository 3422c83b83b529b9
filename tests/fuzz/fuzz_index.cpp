// Fuzz target: model.safetensors.index.json (chapter 01's parse_index).
#include "../../chapters/01_safetensors.hpp"
#include "fuzz.hpp"

void kimik3_fuzz_one(std::string_view input) {
    for (const auto& [name, file] : kimik3::parse_index(input, "fuzz.index.json"))
        if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) std::abort();  // must have been refused
}

std::vector<std::string> kimik3_fuzz_seeds() {
    return {kimik3::fuzz::source_file("fixtures/tiny-k3/model.safetensors.index.json"),
            R"({"metadata":{"total_size":24},"weight_map":{"model.x":"model-00001-of-00002.safetensors","model.y":"model-00002-of-00002.safetensors"}})"};
}
