// Chapter 01's benchmark: parsing the safetensors headers and the index of a release-layout Kimi K3
// checkpoint (the release config's ~500,000 tensor names, dtypes and shapes, split over 96 shards as
// the release is), and one header of 100,000 entries. Called from bench/bench.cpp:
//   #include "bench_headers.hpp"   ...   kimik3::bench_headers(stdout, reps);
// The headers are generated here (SafetensorsWriter, sparse tensors: no data), then parsed from memory:
// this times the JSON reader and the validation, not the disk. Nothing is asserted: this measures.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "../chapters/01b_writer.hpp"
#include "../chapters/02_config.hpp"
#include "timing.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

namespace kimik3 {

// Every tensor of a release-layout checkpoint of `c`, in the release's order (globals, then per layer
// its trunk tensors and its routed experts), as (name, dtype, shape).
inline std::vector<std::tuple<std::string, DType, Shape>> release_tensors(const Config& c) {
    std::vector<std::tuple<std::string, DType, Shape>> t;
    const std::int64_t D = c.hidden_size, V = c.vocab_size;
    const std::string g = std::string(kPrefix) + "model.";
    t.push_back({g + "embed_tokens.weight", DType::BF16, Shape{V, D}});
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        for (const Expected& e : expected_layer_tensors(c, l)) t.push_back({e.name, e.dtypes[0], e.shape});
        if (c.layers[std::size_t(l)].ffn != FfnKind::MoE) continue;
        const auto shapes = expert_part_shapes(c);
        for (int e = 0; e < c.num_experts; ++e)
            for (int p = 0; p < 6; ++p) t.push_back({expert_name(l, e, p), DType::U8, shapes[std::size_t(p)]});
    }
    for (const char* n : {"norm.weight", "output_attn_res_norm.weight"}) t.push_back({g + n, DType::BF16, Shape{D}});
    t.push_back({g + "output_attn_res_proj.weight", DType::BF16, Shape{1, D}});
    t.push_back({std::string(kPrefix) + "lm_head.weight", DType::BF16, Shape{V, D}});
    return t;
}

inline void bench_headers(std::FILE* out, int reps) {
    const Config c = load_config(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json");
    const auto tensors = release_tensors(c);
    const int shards = 96;
    std::vector<std::string> headers;  // the JSON text of each shard's header (without the 8-byte length)
    std::vector<std::uint64_t> data_bytes;
    std::string index = R"({"metadata":{},"weight_map":{)";
    for (int s = 0; s < shards; ++s) {
        SafetensorsWriter w;
        std::uint64_t bytes = 0;
        char file[64];
        std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
        for (std::size_t i = tensors.size() * std::size_t(s) / shards; i < tensors.size() * std::size_t(s + 1) / shards; ++i) {
            const auto& [name, dtype, shape] = tensors[i];
            w.add_sparse(name, dtype, shape);
            bytes += std::uint64_t(shape.numel()) * dtype_size(dtype);
            index += (index.back() == '{' ? "\"" : ",\"") + name + "\":\"" + file + "\"";
        }
        headers.push_back(w.header_bytes().substr(8));
        data_bytes.push_back(bytes);
    }
    index += "}}";
    std::uint64_t header_total = 0;
    for (const std::string& h : headers) header_total += h.size();
    std::fprintf(out, "  Kimi K3 layout: %zu tensors in %d shards (%zu per shard), headers %.1f MB in all, index %.1f MB\n", tensors.size(),
                 shards, tensors.size() / shards, double(header_total) / 1e6, double(index.size()) / 1e6);
    std::size_t parsed = 0;
    const double one = bench::median_seconds(reps, [&] { parsed = parse_header(headers[48], "shard", data_bytes[48]).tensors.size(); });
    std::fprintf(out, "  %-44s %9.1f ms  (%zu tensors)\n", "one shard's header", one * 1e3, parsed);
    const double all = bench::median_seconds(std::max(1, reps / 2), [&] {
        for (int s = 0; s < shards; ++s) parsed = parse_header(headers[std::size_t(s)], "shard", data_bytes[std::size_t(s)]).tensors.size();
    });
    std::fprintf(out, "  %-44s %9.1f ms\n", "all 96 headers", all * 1e3);
    const double idx = bench::median_seconds(std::max(1, reps / 2), [&] { parsed = parse_index(index, "index").size(); });
    std::fprintf(out, "  %-44s %9.1f ms  (%zu names)\n", "model.safetensors.index.json", idx * 1e3, parsed);
    for (std::size_t n : {25000, 100000, 1000000}) {
        std::string h = "{";
        for (std::size_t i = 0; i < n; ++i)
            h += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"U8","shape":[1],"data_offsets":[)" + std::to_string(i) + "," +
                 std::to_string(i + 1) + "]}";
        h += "}";
        const double sec = bench::median_seconds(n > 100000 ? 1 : reps, [&] { parsed = parse_header(h, "wide", n).tensors.size(); });
        char what[64];
        std::snprintf(what, sizeof what, "a header of %zu entries (%.1f MB)", n, double(h.size()) / 1e6);
        std::fprintf(out, "  %-44s %9.1f ms\n", what, sec * 1e3);
    }
}

}  // namespace kimik3
