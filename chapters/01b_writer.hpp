// kimik3 chapter 01, APPENDIX B: writing a safetensors file, atomically.
// ====================================================================================================
//
// APPENDIX to chapter 01 (01_safetensors.hpp, section 1.7 in its index). The lesson reads the format;
// this writes it: tests craft files byte by byte with it, the synthetic-checkpoint tool writes K3-sized
// headers with it, chapter 11 writes traces, chapter 12 packs the trunk, chapter 15 saves sessions.
//
// CONTRACT  Tensors are laid out in the order they were added, contiguous; the header is padded with
//   spaces to a multiple of 8; a byte count that does not match the shape is refused (ErrorKind::usage).
//   Every file is written to a temporary file of a unique name (NAME.tmp.XXXXXX), flushed to disk and
//   renamed into place, so an interrupted or failed write never leaves a half-written file under the
//   real name, and nothing at all when it fails (a signal's default death included). A symlink is
//   written through (its target replaced), a character device or pipe is written in place (so
//   `--out /dev/stdout` prints), a directory or block device is refused: never replaced by a file.
//
// USES     chapter 01 (DType, Shape), nlohmann/json, POSIX open/pwrite/ftruncate/fsync/rename.
// TEST     make test-01   (test "1.7 the writer ...")
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
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
// no partial file behind (writers write a temporary file, keep() it once renamed into place).
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

// Where a write to `path` goes, decided before anything is created:
//   nothing there              a new regular file at `path`
//   a regular file             replaced atomically (its permission bits kept)
//   a symlink to a regular file    the file it leads to is replaced; the link stays a link
//   a character device, a FIFO, a socket (/dev/stdout, /dev/null, a pipe)   written in place, as a device
//   a directory, a block device, a dangling symlink, an empty name          refused, nothing created
//   /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N   the open descriptor itself (so the
//                              output joins what the program already wrote there, even a file)
struct WriteTarget {
    std::string path;      // the file to write (a symlink's resolved target)
    bool device = false;   // write in place: no temporary file, no rename
    bool exists = false;   // a regular file is there (its mode is kept)
    mode_t mode = 0644;
    int fd = -1;           // an open descriptor of this process to write to
};
inline WriteTarget write_target(const std::string& path) {
    if (path.empty()) fail(ErrorKind::runtime, "cannot write a file with an empty name");
    int fd = path == "/dev/stdout" ? 1 : path == "/dev/stderr" ? 2 : -1;
    for (const std::string prefix : {"/dev/fd/", "/proc/self/fd/"})
        if (path.rfind(prefix, 0) == 0 && path.size() > prefix.size() && path.size() < prefix.size() + 9 &&
            path.find_first_not_of("0123456789", prefix.size()) == std::string::npos)
            fd = std::stoi(path.substr(prefix.size()));
    if (fd >= 0) {
        if (::fcntl(fd, F_GETFD) < 0) fail(ErrorKind::runtime, path + ": is not an open descriptor of this program");
        return {path, true, false, 0644, fd};
    }
    struct stat st {}, lst {};
    const bool link = ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode);
    if (::stat(path.c_str(), &st) != 0) {
        const int e = errno;
        if (link && e == ENOENT) fail(ErrorKind::runtime, path + ": is a symbolic link to a file that does not exist: refused (write its target)");
        if (e != ENOENT) fail(ErrorKind::runtime, path + ": cannot write: " + errno_text(e));
        return {path};
    }
    if (S_ISDIR(st.st_mode)) fail(ErrorKind::runtime, path + ": is a directory");
    if (S_ISBLK(st.st_mode)) fail(ErrorKind::runtime, path + ": is a block device: refused (it would overwrite a disk)");
    if (!S_ISREG(st.st_mode)) return {path, true};
    if (!link) return {path, false, true, st.st_mode & 07777};
    char* real = ::realpath(path.c_str(), nullptr);
    if (!real) fail(ErrorKind::runtime, path + ": cannot resolve its symbolic link: " + errno_text(errno));
    const std::string target = real;
    std::free(real);
    return {target, false, true, st.st_mode & 07777};
}

namespace detail {
// Temporary files still on disk, for a signal that ends the program mid-write: a handler (installed for
// SIGINT, SIGTERM and SIGHUP while they have their default action) removes them, then dies by the signal
// as it would have. Fixed slots, so the handler touches no allocator.
inline constexpr int kTempSlots = 8;
inline char g_temp_path[kTempSlots][4096];
inline std::atomic<bool> g_temp_used[kTempSlots];
inline void remove_temps_and_die(int sig) {
    for (int i = 0; i < kTempSlots; ++i)
        if (g_temp_used[i].load()) ::unlink(g_temp_path[i]);
    ::signal(sig, SIG_DFL);
    ::raise(sig);
}
inline void guard_temps_against_signals() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
            struct sigaction old {};
            if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO)) {
                struct sigaction sa {};
                sa.sa_handler = remove_temps_and_die;
                sigemptyset(&sa.sa_mask);
                ::sigaction(sig, &sa, nullptr);
            }
        }
    });
}
}  // namespace detail

// A temporary file of a unique name next to the file it will become (TARGET.tmp.XXXXXX, created with
// O_EXCL by mkstemp: a user's own TARGET.tmp is never touched), removed unless commit() renames it into
// place. commit() flushes the data to disk before the rename and the directory after it, so a crash
// leaves the old file or the new one, never an empty one.
class UniqueTemp {
  public:
    explicit UniqueTemp(const WriteTarget& t) : target_(t) {
        std::string name = t.path + ".tmp.XXXXXX";
        fd_ = ::mkstemp(name.data());
        if (fd_ < 0) fail(ErrorKind::runtime, name + ": cannot create: " + errno_text(errno));
        path_ = name;
        detail::guard_temps_against_signals();
        for (int i = 0; i < detail::kTempSlots && slot_ < 0; ++i) {
            bool free = false;
            if (path_.size() < sizeof detail::g_temp_path[i] && detail::g_temp_used[i].compare_exchange_strong(free, true)) {
                std::memcpy(detail::g_temp_path[i], path_.c_str(), path_.size() + 1);
                slot_ = i;
            }
        }
    }
    UniqueTemp(const UniqueTemp&) = delete;
    UniqueTemp& operator=(const UniqueTemp&) = delete;
    ~UniqueTemp() {
        if (fd_ >= 0) ::close(fd_);
        if (!committed_) ::unlink(path_.c_str());
        if (slot_ >= 0) detail::g_temp_used[slot_] = false;
    }
    int fd() const { return fd_; }
    const std::string& path() const { return path_; }
    [[noreturn]] void fail_with(const std::string& what, int e) const { fail(ErrorKind::runtime, path_ + ": " + what + ": " + errno_text(e)); }
    void commit() {
        if (::fchmod(fd_, target_.mode) != 0) fail_with("cannot set its mode", errno);
        if (::fsync(fd_) != 0) fail_with("could not be flushed to disk", errno);
        const int fd = fd_;
        fd_ = -1;
        if (::close(fd) != 0) fail_with("close failed", errno);
        if (std::rename(path_.c_str(), target_.path.c_str()) != 0) fail(ErrorKind::runtime, target_.path + ": rename failed: " + errno_text(errno));
        committed_ = true;
        const std::size_t slash = target_.path.find_last_of('/');
        const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : target_.path.substr(0, slash);
        if (const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) ::fsync(d), ::close(d);  // the rename itself
    }

  private:
    WriteTarget target_;
    std::string path_;
    int fd_ = -1, slot_ = -1;
    bool committed_ = false;
};

// All of `n` bytes at the file's current position (EINTR and short writes retried).
inline bool write_all(int fd, const char* p, std::size_t n) {
    while (n > 0) {
        const ssize_t w = ::write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w, n -= std::size_t(w);
    }
    return true;
}

// The writer lays tensors out in the order they were added, contiguous, pads the header with spaces to a
// multiple of 8, and writes through a UniqueTemp before renaming, so an interrupted write never leaves a
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
        const WriteTarget target = write_target(path);
        if (target.device) fail(ErrorKind::runtime, path + ": is not a regular file (a safetensors file is written with holes and a rename)");
        UniqueTemp tmp(target);
        const std::string head = header_bytes();
        std::uint64_t pos = 0;
        auto put = [&](const void* p, std::size_t n) {
            std::size_t done = 0;
            while (done < n) {
                const ssize_t w = ::pwrite(tmp.fd(), static_cast<const char*>(p) + done, n - done, off_t(pos + done));
                if (w < 0 && errno == EINTR) continue;
                if (w <= 0) tmp.fail_with("write failed", errno);
                done += std::size_t(w);
            }
        };
        put(head.data(), head.size());
        pos = head.size();
        for (const auto& e : entries_) {
            if (!e.sparse) put(e.data.data(), e.data.size());
            pos += e.nbytes();
        }
        if (::ftruncate(tmp.fd(), off_t(pos)) != 0) tmp.fail_with("could not set the file size", errno);
        tmp.commit();
    }

    // Any small text file (JSON next to the weights, a session, --out), written the same way: where
    // write_target says, through a unique temporary file (a device in place). Nothing is left behind when
    // it fails: not the file, not the temporary.
    static void write_text_atomic(const std::string& path, const std::string& text) {
        const WriteTarget target = write_target(path);
        if (target.fd >= 0) {  // after what stdio holds for it
            std::fflush(nullptr);
            if (!write_all(target.fd, text.data(), text.size())) fail(ErrorKind::runtime, path + ": write failed: " + errno_text(errno));
            return;
        }
        if (target.device) {
            const int fd = ::open(target.path.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
            if (fd < 0) fail(ErrorKind::runtime, path + ": cannot open: " + errno_text(errno));
            const bool ok = write_all(fd, text.data(), text.size());
            const int e = errno;
            if (!ok || ::close(fd) != 0) fail(ErrorKind::runtime, path + ": write failed: " + errno_text(ok ? errno : e));
            return;
        }
        UniqueTemp tmp(target);
        if (!write_all(tmp.fd(), text.data(), text.size())) tmp.fail_with("write failed", errno);
        tmp.commit();
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
