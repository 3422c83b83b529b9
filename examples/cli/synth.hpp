// kimik3 synth OUT_DIR: a K3-shaped checkpoint (real widths, fewer layers and experts), for benchmarks.
#pragma once

#include <sys/statvfs.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "common.hpp"

namespace kimik3::cli {

inline const char* kSynthUsage =
    "usage: kimik3 synth OUT_DIR [--layers N] [--experts E] [--seed S] [--config CONFIG.json] [--force]\n"
    "\n"
    "Writes a checkpoint in the release layout (nested config.json, shards, model.safetensors.index.json,\n"
    "language_model.* names, MXFP4 routed experts in the compressed-tensors layout, F32 where the release has\n"
    "it) with K3's real widths (from fixtures/k3-release/config.json, or --config) but N layers (default 4,\n"
    "keeping the release's kinds: layer 0 dense, every 4th and the last MLA) and E routed experts per MoE\n"
    "layer (default 64; top-k stays 16). Weights are seeded random values scaled so activations stay healthy\n"
    "through the layers. One shard per layer (its trunk tensors as one run, then its experts, not in id order),\n"
    "plus one for the embedding and one for the head. Prints the bytes it will write and refuses when the disk\n"
    "lacks room (--force skips that check); shows progress; config.json is written last.\n"
    "  --layers N    layers (default 4)          --experts E   routed experts per MoE layer (default 64)\n"
    "  --seed S      weight seed (default 1)     --config F    the widths to use (default: the real K3's)\n";

namespace synth {

// splitmix64: a tiny, fast, well-mixed generator; each tensor gets its own stream (seed ^ hash(name)).
struct Rng {
    std::uint64_t s;
    std::uint64_t next() {
        std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // uniform in [-a, a) from 16 random bits
    static float uniform(std::uint64_t bits16, float a) { return (float(bits16 & 0xFFFF) * (1.0f / 32768.0f) - 1.0f) * a; }
};

// How a tensor is filled: uniform bf16/f32 with amplitude `a` (a = sqrt(3) std), a constant, or MXFP4.
struct Fill {
    enum Kind { Uniform, Constant, Mxfp4Codes, Mxfp4Scales, ALog } kind = Uniform;
    float a = 0;               // amplitude (Uniform), value (Constant)
    std::uint8_t scale = 120;  // Mxfp4Scales: the E8M0 byte
    int heads = 0;             // ALog: entries past `heads` are exactly 0 (the release's zero padding)
};

struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    Fill fill;
    std::uint64_t nbytes() const { return std::uint64_t(shape.numel()) * dtype_size(dtype); }
};

inline std::uint64_t name_hash(const std::string& s) { return fnv1a64(s); }

// Fills bytes [at, at + n) of tensor e (element-aligned), deterministically from (seed, name, position):
// every 4096-element block has its own stream, so threads may fill blocks in any order.
inline void fill_block(std::byte* out, const Entry& e, std::uint64_t at, std::size_t n, std::uint64_t seed) {
    const std::size_t es = dtype_size(e.dtype);
    const std::uint64_t first = at / es, count = n / es, name = name_hash(e.name);
    parallel_rows(std::size_t(count / 4096 + 1), 4096 * 64, [&](std::size_t b0, std::size_t b1) {
        for (std::size_t b = b0; b < b1; ++b) {
            const std::uint64_t i0 = std::uint64_t(b) * 4096, i1 = std::min<std::uint64_t>(count, i0 + 4096);
            Rng rng{seed ^ name ^ ((first + i0) * 0x9E3779B97F4A7C15ull)};
            auto bits16 = [&, word = std::uint64_t(0), left = 0]() mutable {  // 16 random bits at a time
                if (left == 0) word = rng.next(), left = 4;
                const std::uint64_t r = word & 0xFFFF;
                word >>= 16, --left;
                return r;
            };
            switch (e.fill.kind) {  // one tight loop per kind
                case Fill::Uniform:
                    if (e.dtype == DType::BF16) {
                        bf16* o = reinterpret_cast<bf16*>(out);
                        for (std::uint64_t i = i0; i < i1; ++i) {  // finite values: RNE without the NaN branch
                            const std::uint32_t u = std::bit_cast<std::uint32_t>(Rng::uniform(bits16(), e.fill.a));
                            o[i] = bf16((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                        }
                    } else {
                        for (std::uint64_t i = i0; i < i1; ++i) reinterpret_cast<float*>(out)[i] = Rng::uniform(bits16(), e.fill.a);
                    }
                    break;
                case Fill::Constant:
                    for (std::uint64_t i = i0; i < i1; ++i)
                        e.dtype == DType::BF16 ? void(reinterpret_cast<bf16*>(out)[i] = f32_to_bf16(e.fill.a))
                                               : void(reinterpret_cast<float*>(out)[i] = e.fill.a);
                    break;
                case Fill::Mxfp4Codes:
                    for (std::uint64_t i = i0; i < i1; i += 8) {  // 8 random bytes per draw
                        const std::uint64_t r = rng.next();
                        std::memcpy(reinterpret_cast<std::uint8_t*>(out) + i, &r, std::size_t(std::min<std::uint64_t>(8, i1 - i)));
                    }
                    break;
                case Fill::Mxfp4Scales:
                    for (std::uint64_t i = i0; i < i1; ++i) reinterpret_cast<std::uint8_t*>(out)[i] = std::uint8_t(e.fill.scale + (bits16() & 1));
                    break;
                case Fill::ALog:
                    for (std::uint64_t i = i0; i < i1; ++i)
                        reinterpret_cast<float*>(out)[i] = (first + i) < std::uint64_t(e.fill.heads) ? Rng::uniform(bits16(), 1.0f) : 0.0f;
                    break;
            }
        }
    });
}

// The fill of every tensor of docs/kimi-k3.md section 2, scaled so activations stay O(1): projections U with std 1/sqrt(in),
// norms 1, AttnRes projections std 1/sqrt(D) (mixing scores of order 1), the router std 1/sqrt(D), expert
// scales so that E2M1 codes (RMS 2.93) times the scale have std ~ 1/sqrt(in).
inline Fill fill_for(const std::string& name, DType dtype, const Shape& shape, const Config& c) {
    auto uni = [](double stdev) { return Fill{Fill::Uniform, float(std::sqrt(3.0) * stdev)}; };
    const auto ends = [&](const char* s) { return name.size() >= std::strlen(s) && name.compare(name.size() - std::strlen(s), std::strlen(s), s) == 0; };
    if (ends("weight_packed")) return Fill{Fill::Mxfp4Codes};
    if (ends("weight_scale")) {
        const double in = double(shape[1]) * 32;  // [out, in/32]; the fill adds 0 or 1, so start one below
        const long s = std::lround(127.0 + std::log2(1.0 / (std::sqrt(in) * 2.93))) - 1;
        return Fill{Fill::Mxfp4Scales, 0, std::uint8_t(std::clamp(s, 1L, 250L))};
    }
    if (ends("A_log")) return Fill{Fill::ALog, 0, 0, c.kda_num_heads};
    if (ends("conv1d.weight")) return uni(0.3);
    if (ends("dt_bias") || ends("e_score_correction_bias")) return uni(0.05);
    if (ends("res_proj.weight")) return uni(1.0 / std::sqrt(double(c.hidden_size)));
    if (shape.rank == 1) return Fill{Fill::Constant, 1.0f};  // norm weights
    if (ends("embed_tokens.weight")) return uni(1.0);
    (void)dtype;
    return uni(1.0 / std::sqrt(double(shape[1])));  // every [out, in] projection
}

}  // namespace synth

inline int cmd_synth(std::vector<std::string> args) {
    using namespace synth;
    if (wants_help(args)) return std::fputs(kSynthUsage, stdout), kExitOk;
    const std::string layers_arg = take_option(args, "--layers", kSynthUsage), experts_arg = take_option(args, "--experts", kSynthUsage),
                      seed_arg = take_option(args, "--seed", kSynthUsage), config_arg = take_option(args, "--config", kSynthUsage);
    const bool force = take_flag(args, "--force");
    if (args.size() != 1 || args[0].rfind("-", 0) == 0) throw Usage(std::string("synth takes one OUT_DIR\n\n") + kSynthUsage);
    const std::string out = args[0];
    const int layers = layers_arg.empty() ? 4 : int(parse_count(layers_arg, "--layers", kSynthUsage, kMaxLayers));
    const int experts = experts_arg.empty() ? 64 : int(parse_count(experts_arg, "--experts", kSynthUsage, kMaxWidth));
    const std::uint64_t seed = seed_arg.empty() ? 1 : std::uint64_t(parse_count(seed_arg, "--seed", kSynthUsage));
    if (layers < 1) throw Usage(std::string("--layers must be at least 1\n\n") + kSynthUsage);

    // the config: the release's (or --config's) widths, with N layers of the release's kinds and E experts
    const std::string base_path = config_arg.empty() ? std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json" : config_arg;
    nlohmann::json j = read_json_file(base_path, kMaxConfigBytes, "config.json");  // bounded, like every JSON input
    if (!j.is_object() || (j.contains("text_config") && !j["text_config"].is_object()))
        fail(ErrorKind::format, base_path + ": not a config (an object, with text_config an object)");
    nlohmann::json& t = j.contains("text_config") ? j["text_config"] : j;
    if (t.contains("linear_attn_config") && !t["linear_attn_config"].is_object())
        fail(ErrorKind::format, base_path + ": linear_attn_config is not an object");
    std::vector<int> kda, full;
    for (int l = 0; l < layers; ++l) (l % 4 == 3 || l == layers - 1 ? full : kda).push_back(l + 1);
    t["num_hidden_layers"] = layers;
    t["linear_attn_config"]["kda_layers"] = kda;
    t["linear_attn_config"]["full_attn_layers"] = full;
    t["num_experts"] = experts;
    const Config c = parse_config(j, "synth config");

    // the tensors, shard by shard, in the release's layout
    std::vector<std::pair<std::string, std::vector<Entry>>> shards;
    const std::int64_t D = c.hidden_size, V = c.vocab_size;
    auto entry = [&](const std::string& name, DType dt, const Shape& sh) { return Entry{name, dt, sh, fill_for(name, dt, sh, c)}; };
    const int nshards = layers + 2;
    auto shard_name = [&](int i) {
        char b[64];
        std::snprintf(b, sizeof b, "model-%05d-of-%05d.safetensors", i + 1, nshards);
        return std::string(b);
    };
    shards.push_back({shard_name(0), {entry(std::string(kPrefix) + "model.embed_tokens.weight", DType::BF16, {V, D})}});
    const auto parts = expert_part_shapes(c);
    for (int l = 0; l < layers; ++l) {
        std::vector<Entry> es;
        for (const Expected& e : expected_layer_tensors(c, l)) es.push_back(entry(e.name, e.dtypes[0], e.shape));
        if (c.layers[std::size_t(l)].ffn == FfnKind::MoE) {
            std::vector<int> order(static_cast<std::size_t>(experts));
            std::iota(order.begin(), order.end(), 0);
            Rng r{seed ^ std::uint64_t(l)};  // experts not in id order, like the release
            for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[r.next() % i]);
            for (int e : order)
                for (int p = 0; p < 6; ++p) es.push_back(entry(expert_name(l, e, p), DType::U8, parts[std::size_t(p)]));
        }
        shards.push_back({shard_name(l + 1), es});
    }
    shards.push_back({shard_name(layers + 1),
                      {entry(std::string(kPrefix) + "model.norm.weight", DType::BF16, {D}),
                       entry(std::string(kPrefix) + "model.output_attn_res_norm.weight", DType::BF16, {D}),
                       entry(std::string(kPrefix) + "model.output_attn_res_proj.weight", DType::BF16, {1, D}),
                       entry(std::string(kPrefix) + "lm_head.weight", DType::BF16, {V, D})}});
    std::uint64_t total = 0;
    for (const auto& [name, es] : shards)
        for (const Entry& e : es) total += e.nbytes();
    std::filesystem::create_directories(out);
    struct statvfs vfs {};
    const std::uint64_t room = ::statvfs(out.c_str(), &vfs) == 0 ? std::uint64_t(vfs.f_bavail) * vfs.f_frsize : 0;
    std::fprintf(stderr, "synth: %d layers (%s), %d experts per MoE layer, %d shards: %s (%s bytes) into %s (%s free)\n", layers,
                 c.schedule_string().c_str(), experts, nshards, human_bytes(double(total)).c_str(), thousands(total).c_str(), out.c_str(),
                 human_bytes(double(room)).c_str());
    if (!force && room < total + (64u << 20))
        fail(ErrorKind::runtime, out + ": the disk has " + human_bytes(double(room)) + " free, the checkpoint needs " +
                                    human_bytes(double(total)) + " (use --force to try anyway)");

    // write: per shard one stream of 32 MB blocks (the header padded with spaces to a whole number of
    // pages, then the tensors back to back), each block generated while a writer thread writes the
    // previous one with O_DIRECT (no page-cache copy); the last block is padded, then the file truncated.
    std::remove((out + "/config.json").c_str());  // written last: a half-written checkpoint never looks complete
    constexpr std::size_t kBlock = std::size_t(32) << 20;
    AlignedBuffer bufs[2] = {AlignedBuffer(kBlock), AlignedBuffer(kBlock)};
    std::uint64_t done = 0;
    double shown = -1;
    const auto t0 = std::chrono::steady_clock::now();
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
    for (const auto& [file, es] : shards) {
        SafetensorsWriter header;
        for (const Entry& e : es) header.add_sparse(e.name, e.dtype, e.shape), index["weight_map"][e.name] = file;
        header.metadata("format", "pt");
        header.metadata("kimik3", "synth seed " + std::to_string(seed));
        std::string head = header.header_bytes();  // 8-byte length + JSON padded to 8
        head.resize(round_up(head.size(), kPageAlign), ' ');  // JSON may end in spaces: pad to a page
        const std::uint64_t n_json = head.size() - 8;
        for (int i = 0; i < 8; ++i) head[std::size_t(i)] = char((n_json >> (8 * i)) & 0xFF);
        const std::string path = out + "/" + file, tmp = path + ".tmp";
        Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644));
        if (fd.get() < 0 && errno == EINVAL) fd = Fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
        if (fd.get() < 0) fail(ErrorKind::runtime, tmp + ": cannot create: " + errno_text(errno));
        RemoveUnlessKept cleanup(tmp);  // a failed write leaves no partial multi-GB shard behind
        std::uint64_t file_pos = 0;
        auto put = [&](const std::byte* p, std::size_t n) {  // n a multiple of 4096, p page-aligned
            for (std::size_t w = 0; w < n;) {
                const ssize_t k = ::pwrite(fd.get(), p + w, n - w, off_t(file_pos + w));
                if (k < 0 && errno == EINTR) continue;
                if (k <= 0) fail(ErrorKind::runtime, tmp + ": write failed: " + errno_text(errno));
                w += std::size_t(k);
            }
            file_pos += n;
        };
        std::thread writer;
        std::exception_ptr write_error;
        int which = 0;
        std::size_t pos = head.size();  // bytes filled in the current block
        std::memcpy(bufs[0].data(), head.data(), head.size());
        auto flush = [&](std::size_t n) {  // hand the current block to the writer, switch buffers
            if (writer.joinable()) writer.join();
            if (write_error) std::rethrow_exception(write_error);
            writer = std::thread([&, buf = bufs[which].data(), n] {
                try {
                    put(buf, n);
                } catch (...) {
                    write_error = std::current_exception();
                }
            });
            which ^= 1;
            pos = 0;
        };
        for (const Entry& e : es)
            for (std::uint64_t at = 0; at < e.nbytes();) {
                const std::size_t n = std::size_t(std::min<std::uint64_t>(kBlock - pos, e.nbytes() - at));
                fill_block(bufs[which].data() + pos, e, at, n, seed);
                pos += n, at += n, done += n;
                if (pos == kBlock) flush(kBlock);
                const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                if (sec - shown >= 0.5 || done == total) {  // progress twice a second
                    shown = sec;
                    std::fprintf(stderr, "\r  %5.1f%%  %s of %s  %.0f MB/s   ", 100.0 * double(done) / double(total),
                                 human_bytes(double(done)).c_str(), human_bytes(double(total)).c_str(), double(done) / 1e6 / std::max(sec, 1e-9));
                }
            }
        const std::size_t tail = pos;
        if (tail) {
            std::memset(bufs[which].data() + tail, 0, round_up(tail, kPageAlign) - tail);
            flush(round_up(tail, kPageAlign));
        }
        if (writer.joinable()) writer.join();
        if (write_error) std::rethrow_exception(write_error);
        const std::uint64_t exact = file_pos - (tail ? round_up(tail, kPageAlign) - tail : 0);
        if (::ftruncate(fd.get(), off_t(exact)) != 0 || ::fsync(fd.get()) != 0)
            fail(ErrorKind::runtime, tmp + ": could not be finished: " + errno_text(errno));
        fd.reset();
        if (std::rename(tmp.c_str(), path.c_str()) != 0) fail(ErrorKind::runtime, path + ": rename failed: " + errno_text(errno));
        cleanup.keep();
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    SafetensorsWriter::write_text_atomic(out + "/model.safetensors.index.json", index.dump(1) + "\n");
    SafetensorsWriter::write_text_atomic(out + "/config.json", j.dump(2) + "\n");
    std::fprintf(stderr, "\n");
    std::printf("wrote %s: %s in %.1f s (%.0f MB/s)\n", out.c_str(), human_bytes(double(total)).c_str(), sec, double(total) / 1e6 / std::max(sec, 1e-9));
    return kExitOk;
}

}  // namespace kimik3::cli
