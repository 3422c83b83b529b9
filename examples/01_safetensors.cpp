// Example for chapter 01: list the tensors of a safetensors file or of a checkpoint directory.
//   make run-01                                   (a bundled fixture)
//   build/g++/examples/01_safetensors FILE|DIR    (any file or checkpoint; DIR uses its index)
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "../chapters/01_safetensors.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

static void list(const std::vector<const TensorInfo*>& ts, std::size_t limit) {
    std::printf("  %-44s %-5s %-16s %12s %10s\n", "name", "dtype", "shape", "file offset", "bytes");
    for (std::size_t i = 0; i < ts.size() && i < limit; ++i)
        std::printf("  %-44s %-5s %-16s %12llu %10llu\n", ts[i]->name.c_str(), dtype_name(ts[i]->dtype), ts[i]->shape.str().c_str(),
                    (unsigned long long)ts[i]->file_offset, (unsigned long long)ts[i]->nbytes());
    if (ts.size() > limit) std::printf("  ... and %zu more\n", ts.size() - limit);
}

int main(int argc, char** argv) {
    const std::string path = argc > 1 ? argv[1] : std::string(KIMIK3_SOURCE_DIR) + "/fixtures/kernels/mxfp4.safetensors";
    const std::string shown = argc > 1 ? path : "fixtures/kernels/mxfp4.safetensors";
    try {
        if (std::filesystem::is_directory(path)) {
            std::printf("1.6 checkpoint %s\n", shown.c_str());
            Checkpoint ck(path);
            std::uint64_t bytes = 0;
            std::vector<const TensorInfo*> ts;
            for (const auto& [name, ref] : ck.tensors()) bytes += ref.info->nbytes(), ts.push_back(ref.info);
            std::sort(ts.begin(), ts.end(), [](auto* a, auto* b) { return a->name < b->name; });
            std::printf("  %zu shards, %zu tensors, %llu bytes of tensor data\n", ck.shards().size(), ck.size(), (unsigned long long)bytes);
            list(ts, 40);
            return 0;
        }
        SafetensorsFile f(path);
        std::printf("1.3 %s: %llu bytes\n", shown.c_str(), (unsigned long long)f.size());
        std::printf("  header length N = %llu (the first 8 bytes, little-endian); data starts at byte %llu\n",
                    (unsigned long long)f.header().header_bytes, (unsigned long long)f.header().data_start);
        for (const auto& [k, v] : f.metadata())  // long values (hashes) by length only, to keep this stable
            v.size() <= 60 ? std::printf("  __metadata__ %s = %s\n", k.c_str(), v.c_str())
                           : std::printf("  __metadata__ %s = (%zu characters)\n", k.c_str(), v.size());
        std::printf("\n1.4 tensors in data order (every offset and size checked before this line)\n");
        std::vector<const TensorInfo*> ts;
        for (const TensorInfo& t : f.tensors()) ts.push_back(&t);
        list(ts, 40);
        std::printf("\n1.5 the first tensor's first bytes, read with pread into a 4096-aligned buffer\n  ");
        if (ts.empty()) {
            std::printf("(the file holds no tensors)\n");
        } else {
            const Tensor t = f.read(ts[0]->name);
            for (std::size_t i = 0; i < std::min<std::size_t>(16, t.info.nbytes()); ++i) std::printf("%02x ", unsigned(t.bytes.data()[i]));
            std::printf("\n");
        }
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
