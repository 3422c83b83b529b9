// kimik3 chapter 01, APPENDIX B: writing a safetensors file, atomically.
// ====================================================================================================
//
// APPENDIX to chapter 01 (01_safetensors.hpp, section 1.7 in its index). The lesson reads the format;
// this writes it: tests craft files byte by byte with it, the synthetic-checkpoint tool writes K3-sized
// headers with it, chapter 11 writes traces, chapter 12 packs the trunk, chapter 15 saves sessions.
//
// CONTRACT  Tensors are laid out in the order they were added, contiguous; the header is padded with
//   spaces to a multiple of 8; a byte count that does not match the shape is refused (ErrorKind::usage).
//   Every file is written to NAME.tmp and renamed into place, so an interrupted or failed write never
//   leaves a half-written file under the real name, and nothing at all when it fails.
//
// USES     chapter 01 (DType, Shape), nlohmann/json, POSIX open/pwrite/ftruncate/fsync/rename.
// TEST     make test-01   (test "1.7 the writer ...")
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "01_safetensors.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 1.7 Writing a file
// ---------------------------------------------------------------------------------------------------
// Removes `path` when it goes out of scope, unless keep() was called: a write that fails partway leaves
// no partial file behind (writers write NAME.tmp, keep() it once renamed into place).
class RemoveUnlessKept {
  public:
    explicit RemoveUnlessKept(std::string path) : path_(std::move(path)) {}
    RemoveUnlessKept(const RemoveUnlessKept&) = delete;
    RemoveUnlessKept& operator=(const RemoveUnlessKept&) = delete;
    ~RemoveUnlessKept() {
        if (!kept_) std::remove(path_.c_str());
    }
    void keep() { kept_ = true; }

  private:
    std::string path_;
    bool kept_ = false;
};

// The writer lays tensors out in the order they were added, contiguous, pads the header with spaces to a
// multiple of 8, and writes to `path.tmp` before renaming, so an interrupted write never leaves a
// half-written file under the real name. `add_sparse` declares a tensor without data: its bytes are a
// hole in the file (ftruncate), which lets tests build a header-only checkpoint of real K3 size on no disk.
class SafetensorsWriter {
  public:
    void add(const std::string& name, DType dtype, const Shape& shape, const void* data, std::size_t nbytes) {
        const std::uint64_t need = std::uint64_t(shape.numel()) * dtype_size(dtype);
        if (need != nbytes)
            fail(ErrorKind::usage, "SafetensorsWriter: tensor '" + name + "' has " + std::to_string(nbytes) +
                                       " bytes but shape " + shape.str() + " needs " + std::to_string(need));
        const auto* p = static_cast<const std::byte*>(data);
        entries_.push_back({name, dtype, shape, std::vector<std::byte>(p, p + nbytes), false});
    }
    template <class T> void add(const std::string& name, DType dtype, const Shape& shape, const std::vector<T>& v) {
        add(name, dtype, shape, v.data(), v.size() * sizeof(T));
    }
    void add_sparse(const std::string& name, DType dtype, const Shape& shape) {
        entries_.push_back({name, dtype, shape, {}, true});
    }
    void metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

    // The 8-byte length plus the padded JSON header; the data section follows it.
    std::string header_bytes() const {
        nlohmann::ordered_json h = nlohmann::ordered_json::object();
        if (!metadata_.empty()) h["__metadata__"] = metadata_;
        std::uint64_t off = 0;
        for (const auto& e : entries_) {
            nlohmann::ordered_json shape = nlohmann::ordered_json::array();
            for (int i = 0; i < e.shape.rank; ++i) shape.push_back(e.shape[i]);
            h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", shape}, {"data_offsets", {off, off + e.nbytes()}}};
            off += e.nbytes();
        }
        std::string text = h.dump();
        text.resize(round_up(text.size(), 8), ' ');
        std::string out(8, '\0');
        for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((std::uint64_t(text.size()) >> (8 * i)) & 0xFF);
        return out + text;
    }

    // The whole file as bytes (tests corrupt these on purpose). Not for sparse tensors.
    std::vector<std::byte> bytes() const {
        const std::string head = header_bytes();
        std::vector<std::byte> out(head.size());
        std::memcpy(out.data(), head.data(), head.size());
        for (const auto& e : entries_) {
            if (e.sparse) fail(ErrorKind::usage, "SafetensorsWriter::bytes: tensor '" + e.name + "' is sparse; use write()");
            out.insert(out.end(), e.data.begin(), e.data.end());
        }
        return out;
    }

    void write(const std::string& path) const {
        const std::string tmp = path + ".tmp";
        const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) fail(ErrorKind::runtime, tmp + ": cannot create: " + errno_text(errno));
        auto bail = [&](const std::string& what) {
            const int e = errno;
            ::close(fd);
            ::unlink(tmp.c_str());
            fail(ErrorKind::runtime, tmp + ": " + what + ": " + errno_text(e));
        };
        const std::string head = header_bytes();
        std::uint64_t pos = 0;
        auto put = [&](const void* p, std::size_t n) {
            std::size_t done = 0;
            while (done < n) {
                const ssize_t w = ::pwrite(fd, static_cast<const char*>(p) + done, n - done, off_t(pos + done));
                if (w < 0 && errno == EINTR) continue;
                if (w <= 0) bail("write failed");
                done += std::size_t(w);
            }
        };
        put(head.data(), head.size());
        pos = head.size();
        for (const auto& e : entries_) {
            if (!e.sparse) put(e.data.data(), e.data.size());
            pos += e.nbytes();
        }
        if (::ftruncate(fd, off_t(pos)) != 0) bail("could not set the file size");
        if (::fsync(fd) != 0) bail("could not be flushed to disk");
        if (::close(fd) != 0) {
            ::unlink(tmp.c_str());
            fail(ErrorKind::runtime, tmp + ": close failed");
        }
        if (std::rename(tmp.c_str(), path.c_str()) != 0) {
            const int err = errno;
            ::unlink(tmp.c_str());
            fail(ErrorKind::runtime, path + ": rename failed: " + errno_text(err));
        }
    }

    // Any small text file (JSON next to the weights), written the same atomic way.
    // Nothing is left behind when it fails: not the file, not NAME.tmp (an empty name or a directory is
    // refused before anything is created).
    static void write_text_atomic(const std::string& path, const std::string& text) {
        if (path.empty()) fail(ErrorKind::runtime, "cannot write a file with an empty name");
        if (is_directory(path)) fail(ErrorKind::runtime, path + ": is a directory");
        const std::string tmp = path + ".tmp";
        {
            std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
            if (!f) fail(ErrorKind::runtime, tmp + ": cannot create: " + errno_text(errno));
            f.write(text.data(), std::streamsize(text.size()));
            f.flush();
            if (!f) {
                const int err = errno;
                f.close();
                std::remove(tmp.c_str());
                fail(ErrorKind::runtime, tmp + ": write failed: " + errno_text(err));
            }
        }
        if (std::rename(tmp.c_str(), path.c_str()) != 0) {
            const int err = errno;
            std::remove(tmp.c_str());
            fail(ErrorKind::runtime, path + ": rename failed: " + errno_text(err));
        }
    }

  private:
    struct Entry {
        std::string name;
        DType dtype;
        Shape shape;
        std::vector<std::byte> data;
        bool sparse;
        std::uint64_t nbytes() const { return std::uint64_t(shape.numel()) * dtype_size(dtype); }
    };
    std::vector<Entry> entries_;
    std::map<std::string, std::string> metadata_;
};

}  // namespace kimik3
