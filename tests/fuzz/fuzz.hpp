// The libFuzzer harness shared by every target in tests/fuzz/ (built and run by `make fuzz`).
//
// Each target defines kimik3_fuzz_one(data, size), which feeds one input to one of the engine's parsers,
// and kimik3_fuzz_seeds(), the valid inputs (from the fixtures) that start its corpus. The contract a
// target checks: a hostile input ends in a kimik3::Error (a clear refusal) or is accepted; anything else
// (a crash, a sanitizer report, another exception type, a timeout, memory past -rss_limit_mb) is a bug.
//
//   KIMIK3_FUZZ_SEEDS=DIR build/fuzz/fuzz_header     writes the seeds into DIR and exits
//   build/fuzz/fuzz_header -max_total_time=20 DIR    fuzzes from DIR (libFuzzer's usual flags)
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "../../chapters/00_numerics.hpp"

void kimik3_fuzz_one(std::string_view input);
std::vector<std::string> kimik3_fuzz_seeds();

namespace kimik3::fuzz {
// A file of the source tree (fixtures), read whole.
inline std::string source_file(const std::string& rel) {
    std::ifstream f(std::string(KIMIK3_SOURCE_DIR) + "/" + rel, std::ios::binary);
    if (!f) std::fprintf(stderr, "fuzz: cannot read %s\n", rel.c_str()), std::exit(1);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
}  // namespace kimik3::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    if (const char* dir = std::getenv("KIMIK3_FUZZ_SEEDS")) {
        int i = 0;
        for (const std::string& s : kimik3_fuzz_seeds()) {
            const std::string path = std::string(dir) + "/seed-" + std::to_string(i++);
            std::ofstream(path, std::ios::binary) << s;
        }
        std::exit(0);
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    try {
        kimik3_fuzz_one(std::string_view(reinterpret_cast<const char*>(data), size));
    } catch (const kimik3::Error&) {
        // a refusal: what every hostile input should get
    }
    return 0;
}
