// kimik3 chapter 12, APPENDIX A: pack_trunk -- every layer's non-expert tensors in one aligned file.
// ====================================================================================================
//
// APPENDIX to chapter 12 (12_trunk_stream.hpp, section 12.4 in its index). The lesson plans memory and
// streams row chunks straight from the release's shards; this packs those same bytes into trunk.bin,
// one 4096-aligned run per layer, described by trunk.json (`kimik3 pack-trunk`), and loads a packed
// trunk back, checked against the checkpoint it claims to hold. Optional: same bytes, same results.
//
// CONTRACT
//   * pack_trunk refuses a layer whose tensors are not one contiguous run in one shard, verifies what it
//     wrote (re-read from disk and compared by hash), and writes trunk.json last, after removing any old
//     one, so an interrupted pack never leaves a trunk that looks complete. A failed pack leaves no
//     trunk.bin.tmp behind.
//   * load_trunk refuses a trunk.json that is malformed, describes another model (a tensor's size, dtype
//     or shape differs), or a trunk.bin of another length, with ErrorKind::format naming the file.
//
// USES     chapters 00-02 (appendix 01a: pread_exact, read_json_file; appendix 01b: RemoveUnlessKept,
//          write_text_atomic)
// TEST     make test-12   (test "12.4 ...")      CLI   kimik3 pack-trunk
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "00_numerics.hpp"
#include "01_safetensors.hpp"
#include "01b_writer.hpp"  // APPENDIX: trunk.bin and trunk.json are written atomically
#include "02_config.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 12.4 Packing the trunk: trunk.bin + trunk.json
// ---------------------------------------------------------------------------------------------------
// A 64-bit hash of bytes, used to verify the copy (FNV-1a over 8-byte words: simple, and fast enough to
// be no slower than the disk).
inline std::uint64_t hash_bytes(const std::byte* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        std::uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; ++i) h = (h ^ std::uint64_t(p[i])) * 1099511628211ull;
    return h;
}

struct TrunkLayer {
    std::uint64_t file_off = 0, nbytes = 0, hash = 0;  // the run in trunk.bin (4096-aligned start)
    std::uint64_t source_off = 0;                      // where the run starts in its shard
    std::string shard;
};
struct TrunkLayout {
    std::string dir;
    std::uint64_t file_bytes = 0;
    std::vector<TrunkLayer> layers;
    std::map<std::string, std::uint64_t> tensor_off;   // name -> absolute offset in trunk.bin
};

// The run of layer l's non-expert tensors in its shard: [lo, hi), refusing scattered layers.
inline std::pair<std::uint64_t, std::uint64_t> layer_run(const LayerTensors& lt) {
    std::uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
    const SafetensorsFile* file = lt.all.front()->file;
    for (const Checkpoint::Ref* r : lt.all) {
        if (r->file != file)
            fail(ErrorKind::format, "pack-trunk: layer " + std::to_string(lt.layer) + ": tensor '" + r->info->name + "' is in " +
                                        r->file->path() + ", not in " + file->path() + " with the rest of the layer");
        lo = std::min(lo, r->info->file_offset);
        hi = std::max(hi, r->info->file_offset + r->info->nbytes());
        sum += r->info->nbytes();
    }
    if (hi - lo != sum)
        fail(ErrorKind::format, "pack-trunk: layer " + std::to_string(lt.layer) + "'s non-expert tensors are not one contiguous run in " +
                                    file->path() + " (" + std::to_string(hi - lo - sum) + " foreign bytes between " +
                                    std::to_string(lo) + " and " + std::to_string(hi) + ")");
    return {lo, hi};
}

using Progress = std::function<void(const std::string& what, std::uint64_t done, std::uint64_t total)>;

inline TrunkLayout pack_trunk(const ModelTensors& m, const std::string& out_dir, const Progress& progress) {
    namespace fs = std::filesystem;
    fs::create_directories(out_dir);
    const std::string bin = out_dir + "/trunk.bin", json_path = out_dir + "/trunk.json";
    std::remove(json_path.c_str());  // first: an old trunk.json must never describe a half-written trunk.bin
    TrunkLayout t;
    t.dir = out_dir;
    std::uint64_t total = 0;
    for (const LayerTensors& lt : m.layers) {
        const auto [lo, hi] = layer_run(lt);
        TrunkLayer L;
        L.file_off = round_up(std::size_t(total), kPageAlign);
        L.nbytes = hi - lo;
        L.source_off = lo;
        L.shard = lt.all.front()->file->path();
        total = L.file_off + L.nbytes;
        t.layers.push_back(L);
        for (const Checkpoint::Ref* r : lt.all) t.tensor_off[r->info->name] = L.file_off + (r->info->file_offset - lo);
    }
    t.file_bytes = round_up(std::size_t(total), kPageAlign);
    const std::string tmp = bin + ".tmp";
    Fd out(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.get() < 0) fail(ErrorKind::runtime, tmp + ": cannot create: " + errno_text(errno));
    RemoveUnlessKept cleanup(tmp);  // a failed pack leaves no multi-GB trunk.bin.tmp behind
    if (::ftruncate(out.get(), off_t(t.file_bytes)) != 0) fail(ErrorKind::runtime, tmp + ": cannot size the file: " + errno_text(errno));
    AlignedBuffer buf(std::size_t(64) << 20);
    std::uint64_t done = 0;
    for (std::size_t l = 0; l < t.layers.size(); ++l) {
        TrunkLayer& L = t.layers[l];
        const SafetensorsFile* src = m.layers[l].all.front()->file;
        std::uint64_t h = 1469598103934665603ull;
        for (std::uint64_t at = 0; at < L.nbytes; at += buf.size()) {  // copy verbatim, hashing as we go
            const std::size_t n = std::size_t(std::min<std::uint64_t>(buf.size(), L.nbytes - at));
            pread_exact(src->fd(), buf.data(), n, L.source_off + at, src->path());
            h = hash_bytes(buf.data(), n, h);
            for (std::size_t w = 0; w < n;) {
                const ssize_t k = ::pwrite(out.get(), buf.data() + w, n - w, off_t(L.file_off + at + w));
                if (k < 0 && errno == EINTR) continue;
                if (k <= 0) fail(ErrorKind::runtime, tmp + ": write failed: " + errno_text(errno));
                w += std::size_t(k);
            }
            done += n;
            if (progress) progress("copy", done, total);
        }
        L.hash = h;
    }
    if (::fsync(out.get()) != 0) fail(ErrorKind::runtime, tmp + ": could not be flushed to disk: " + errno_text(errno));
    // drop the written pages from the page cache, so the verification reads the disk, not memory (advice:
    // a kernel may keep some; then this verifies less, never wrongly)
    ::posix_fadvise(out.get(), 0, 0, POSIX_FADV_DONTNEED);
    done = 0;
    for (std::size_t l = 0; l < t.layers.size(); ++l) {  // verify: read back what was written
        const TrunkLayer& L = t.layers[l];
        std::uint64_t h = 1469598103934665603ull;
        for (std::uint64_t at = 0; at < L.nbytes; at += buf.size()) {
            const std::size_t n = std::size_t(std::min<std::uint64_t>(buf.size(), L.nbytes - at));
            pread_exact(out.get(), buf.data(), n, L.file_off + at, tmp);
            h = hash_bytes(buf.data(), n, h);
            done += n;
            if (progress) progress("verify", done, total);
        }
        if (h != L.hash)
            fail(ErrorKind::io, tmp + ": layer " + std::to_string(l) + " reads back differently from what was written (disk error?)");
    }
    out.reset();
    if (std::rename(tmp.c_str(), bin.c_str()) != 0) fail(ErrorKind::runtime, bin + ": rename failed: " + errno_text(errno));
    cleanup.keep();
    nlohmann::ordered_json j;
    j["format"] = "kimik3-trunk";
    j["version"] = 1;
    j["align"] = kPageAlign;
    j["file_bytes"] = t.file_bytes;
    j["layers"] = nlohmann::ordered_json::array();
    for (std::size_t l = 0; l < t.layers.size(); ++l) {
        const TrunkLayer& L = t.layers[l];
        nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
        for (const Checkpoint::Ref* r : m.layers[l].all) {
            nlohmann::ordered_json shape = nlohmann::ordered_json::array();
            for (int i = 0; i < r->info->shape.rank; ++i) shape.push_back(r->info->shape[i]);
            tensors[r->info->name] = {{"off", t.tensor_off[r->info->name] - L.file_off},
                                      {"nbytes", r->info->nbytes()},
                                      {"dtype", dtype_name(r->info->dtype)},
                                      {"shape", shape}};
        }
        char hash[17];
        std::snprintf(hash, sizeof hash, "%016llx", (unsigned long long)L.hash);
        j["layers"].push_back({{"layer", l}, {"file_off", L.file_off}, {"nbytes", L.nbytes}, {"hash", hash}, {"tensors", tensors}});
    }
    const std::string text = j.dump(1) + "\n";
    SafetensorsWriter::write_text_atomic(json_path, text);
    return t;
}

// Opens a packed trunk and checks it against the checkpoint it claims to hold: every tensor of every
// layer present with the same dtype, shape and size, and trunk.bin exactly as long as recorded.
inline TrunkLayout load_trunk(const std::string& dir, const ModelTensors& m) {
    const std::string json_path = dir + "/trunk.json", bin = dir + "/trunk.bin";
    if (!path_present(json_path)) fail(ErrorKind::format, json_path + ": cannot open (run kimik3 pack-trunk first)");
    const nlohmann::json j = read_json_file(json_path, 64u << 20, "trunk.json");  // K3's is ~0.5 MB
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, json_path + ": " + what); };
    TrunkLayout t;
    t.dir = dir;
    try {  // a field of the wrong JSON type or a missing one (at() throws) is a malformed file, never a crash
        if (!j.is_object() || j.value("format", "") != "kimik3-trunk" || j.value("version", 0) != 1) bad("not a kimik3 trunk (format/version)");
        t.file_bytes = j.value("file_bytes", std::uint64_t(0));
        Fd fd = open_read(bin);
        if (file_size(fd.get(), bin) != t.file_bytes)
            bad("trunk.bin is " + std::to_string(file_size(fd.get(), bin)) + " bytes, trunk.json says " + std::to_string(t.file_bytes));
        const auto& layers = j.at("layers");
        if (!layers.is_array() || layers.size() != m.layers.size())
            bad("has " + std::to_string(layers.is_array() ? layers.size() : 0) + " layers, the checkpoint " + std::to_string(m.layers.size()));
        for (std::size_t l = 0; l < m.layers.size(); ++l) {
            const auto& L = layers.at(l);
            TrunkLayer tl;
            tl.file_off = L.value("file_off", std::uint64_t(0));
            tl.nbytes = L.value("nbytes", std::uint64_t(0));
            if (tl.file_off % kPageAlign || tl.file_off > t.file_bytes || tl.nbytes > t.file_bytes - tl.file_off)
                bad("layer " + std::to_string(l) + ": bad run");
            const auto& tensors = L.at("tensors");
            for (const Checkpoint::Ref* r : m.layers[l].all) {
                const std::string& name = r->info->name;
                if (!tensors.is_object() || !tensors.contains(name)) bad("layer " + std::to_string(l) + " has no tensor '" + name + "'");
                const auto& e = tensors.at(name);
                std::vector<std::int64_t> want_shape(r->info->shape.dims.begin(), r->info->shape.dims.begin() + r->info->shape.rank);
                const bool same_shape = e.contains("shape") && e["shape"].is_array() && e["shape"] == nlohmann::json(want_shape);
                if (e.value("nbytes", std::uint64_t(0)) != r->info->nbytes() || e.value("dtype", "") != dtype_name(r->info->dtype) || !same_shape)
                    bad("tensor '" + name + "' differs from the checkpoint's (size, dtype or shape): the trunk was packed from another model");
                const std::uint64_t off = e.value("off", std::uint64_t(0));
                if (off > tl.nbytes || r->info->nbytes() > tl.nbytes - off) bad("tensor '" + name + "' runs past its layer");
                t.tensor_off[name] = tl.file_off + off;
            }
            t.layers.push_back(tl);
        }
    } catch (const nlohmann::json::exception& e) {
        std::string what = e.what();
        if (const std::size_t at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
        bad("malformed (" + what + ")");
    }
    return t;
}

}  // namespace kimik3
