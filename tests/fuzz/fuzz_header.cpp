// Fuzz target: a safetensors header (chapter 01's parse_header and the bounded JSON reader under it).
#include "../../chapters/01_safetensors.hpp"
#include "fuzz.hpp"

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3;
    const Header h = parse_header(std::string(input), "fuzz.safetensors", 1u << 20);
    for (const TensorInfo& t : h.tensors)
        if (std::uint64_t(t.numel()) * dtype_size(t.dtype) != t.nbytes()) std::abort();  // accepted means consistent
}

std::vector<std::string> kimik3_fuzz_seeds() {
    std::vector<std::string> seeds;
    for (const char* f : {"fixtures/tiny-k3/model-00001-of-00002.safetensors", "fixtures/tiny-k3/model-00002-of-00002.safetensors"}) {
        const std::string file = kimik3::fuzz::source_file(f);
        std::uint64_t n = 0;
        for (int i = 7; i >= 0; --i) n = n << 8 | std::uint8_t(file[std::size_t(i)]);
        const std::string header = file.substr(8, std::size_t(n));
        seeds.push_back(header.substr(0, std::min<std::size_t>(header.size(), 6000)) + "}");  // a prefix, closed: small seeds mutate faster
        seeds.push_back(header);
    }
    seeds.push_back(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}})");
    return seeds;
}
