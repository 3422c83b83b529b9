// kimik3 chapter 01, APPENDIX A: bounded input -- files that cannot hang or flood, JSON that cannot blow up.
// ====================================================================================================
//
// APPENDIX to chapter 01 (01_safetensors.hpp), which points here from sections 1.2 and 1.3. A learner
// can read chapter 01 without this file: it holds what makes the readers safe against a hostile or
// broken input, not what the format is. Chapters 02, 11, 12 and 14 use it too.
//
// WHAT IT HOLDS
//   1.2 (the rest)  files: only regular files are opened (a directory reads as an error, a FIFO blocks
//                   forever, /dev/zero never ends); exact reads (pread_exact: EINTR, short reads and
//                   end of file become an Error naming file, offset and size, never a partly filled
//                   buffer); the one hook every weight read goes through (tests inject faults there);
//                   O_DIRECT reads of aligned ranges (chapters 11 and 12 read experts and trunk pieces
//                   with them); whole small files read with a size cap.
//   1.3 (the first half)  one bounded JSON reader for every JSON text the engine reads (config.json,
//                   the index, each safetensors header, tokenizer_config.json, trunk.json): nesting at
//                   most 64 deep, no key twice in an object, no NUL byte, numbers that fit a double,
//                   linear time; messages quote at most a few hundred bytes of any input.
//
// CONTRACT  Every failure is an Error: ErrorKind::format for an input that is refused (exit code 2 in
//   the CLI), ErrorKind::io for a read that fails once the file is open (exit code 4). Every message
//   names the file and quotes little of it.
//
// USES     chapter 00 (Error), nlohmann/json, POSIX open/pread/fstat.
// TEST     make test-01   (tests "1.2 ..." and "1.3 parse_json ...")
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "00_numerics.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 1.2 (the rest) Files: regular files only, exact reads, direct reads, capped reads
// ---------------------------------------------------------------------------------------------------
// Buffers and direct reads are 4096-aligned and sized up to a multiple of 4096: what O_DIRECT reads
// need (chapters 11 and 12), and harmless otherwise.
inline constexpr std::size_t kPageAlign = 4096;

inline std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// An owned file descriptor.
class Fd {
  public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
    Fd& operator=(Fd&& o) noexcept {
        if (this != &o) reset(), fd_ = o.fd_, o.fd_ = -1;
        return *this;
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd() { reset(); }
    void reset() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }
    int get() const { return fd_; }

  private:
    int fd_ = -1;
};

inline std::string errno_text(int e) { return std::string(std::strerror(e)); }

// A file that cannot be opened is a refused input (ErrorKind::format: exit code 2 in the CLI), not a
// failed read: ErrorKind::io is kept for reads that fail once a file is open (exit code 4).
//
// Every input this engine reads is a regular file, and only a regular file: a directory reads as an
// error, a FIFO blocks forever waiting for a writer, and a device such as /dev/zero or /dev/urandom never
// ends. So open_read refuses anything else by name before a byte is read. The open itself uses
// O_NONBLOCK, which makes opening a FIFO return at once instead of waiting for a writer (it changes
// nothing for a regular file, and is cleared again before any read).
inline const char* file_type_name(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

inline Fd open_read(const std::string& path, int extra_flags = 0) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | extra_flags);
    if (fd < 0) fail(ErrorKind::format, path + ": cannot open: " + errno_text(errno));
    Fd f(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(ErrorKind::io, path + ": cannot stat: " + errno_text(errno));
    if (!S_ISREG(st.st_mode)) fail(ErrorKind::format, path + ": is " + file_type_name(st.st_mode) + ", not a regular file");
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) fail(ErrorKind::io, path + ": fcntl failed: " + errno_text(errno));
    return f;
}

inline std::uint64_t file_size(int fd, const std::string& path) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(ErrorKind::io, path + ": cannot stat: " + errno_text(errno));
    return std::uint64_t(st.st_size);
}

// Whether anything is at `path` (a file, a directory, even a dangling or looping symlink). Never throws:
// std::filesystem::exists throws on a symlink loop, and what is there is open_read's to judge, with a
// message that names the file.
inline bool path_present(const std::string& path) {
    struct stat st {};
    return ::lstat(path.c_str(), &st) == 0 || (errno != ENOENT && errno != ENOTDIR);
}
// Whether `path` is a directory (following symlinks); false for anything else, never throws.
inline bool is_directory(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

namespace detail {
// The one place every weight read goes through. Tests replace it to inject faults (a short read, EIO)
// and check that they surface as errors, never as weights.
using PreadFn = ssize_t (*)(int fd, void* buf, std::size_t n, off_t offset);
inline PreadFn pread_hook = ::pread;
}  // namespace detail

// Reads exactly n bytes at `offset`, retrying on EINTR and on partial reads; reaching end of file
// early or any other error throws, naming the file, offset and size.
inline void pread_exact(int fd, void* dst, std::size_t n, std::uint64_t offset, const std::string& path) {
    auto* p = static_cast<std::byte*>(dst);
    std::size_t done = 0;
    while (done < n) {
        // Clamp each call to 1 GiB: some systems (Darwin) reject larger requests.
        const std::size_t want = std::min<std::size_t>(n - done, std::size_t(1) << 30);
        const ssize_t got = detail::pread_hook(fd, p + done, want, off_t(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            fail(ErrorKind::io, path + ": read of " + std::to_string(n) + " bytes at offset " +
                                    std::to_string(offset) + " failed: " + errno_text(errno));
        }
        if (got == 0)
            fail(ErrorKind::io, path + ": unexpected end of file: read of " + std::to_string(n) +
                                    " bytes at offset " + std::to_string(offset) + " got only " +
                                    std::to_string(done));
        done += std::size_t(got);
    }
}

namespace detail {

// Reads file bytes from `start` (4096-aligned) into dst (4096-aligned) through an O_DIRECT descriptor,
// asking for `want` bytes (a multiple of 4096) and requiring the first `need` of them. Returns the bytes
// that arrived, or 0 (nothing read) when the descriptor refuses O_DIRECT with EINVAL. A short read
// that leaves the position unaligned (a device returning odd sizes) is finished through the buffered
// descriptor `fd`, since O_DIRECT cannot continue from an unaligned offset.
inline std::size_t pread_direct(int direct_fd, int fd, std::byte* dst, std::uint64_t start, std::size_t want,
                                std::size_t need, const std::string& path) {
    std::size_t done = 0;
    while (done < need) {
        if (done % kPageAlign != 0) {
            pread_exact(fd, dst + done, need - done, start + done, path);
            return need;
        }
        const std::size_t ask = std::min<std::size_t>(want - done, std::size_t(1) << 30);  // 1 GiB per call
        const ssize_t got = pread_hook(direct_fd, dst + done, ask, off_t(start + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && errno == EINVAL && done == 0) return 0;  // O_DIRECT refused here: caller reads buffered
        if (got < 0)
            fail(ErrorKind::io, path + ": read of " + std::to_string(want) + " bytes at offset " + std::to_string(start) +
                                    " failed: " + errno_text(errno));
        if (got == 0)
            fail(ErrorKind::io, path + ": unexpected end of file: read of " + std::to_string(want) + " bytes at offset " +
                                    std::to_string(start) + " got only " + std::to_string(done) + " of the " +
                                    std::to_string(need) + " needed");
        done += std::size_t(got);
    }
    return done;  // may be less than want: the widened read stopped at end of file after the last needed byte
}

}  // namespace detail

// Caps on whole-file reads. Each is far above what Kimi K3's own file needs (in brackets), and far below
// what would exhaust memory: a text input has no business being gigabytes.
inline constexpr std::uint64_t kMaxConfigBytes = 16u << 20;       // config.json, tokenizer_config.json (K3: ~5 kB, ~40 kB)
inline constexpr std::uint64_t kMaxIndexBytes = 1u << 30;         // model.safetensors.index.json (K3: ~60 MB for ~500,000 names)
inline constexpr std::uint64_t kMaxTokenizerModelBytes = 64u << 20;  // tiktoken.model (K3: 2.8 MB)

// A whole small file read into memory, refused when it holds more than `cap` bytes. `what` names the
// kind of file in the message ("config.json").
inline std::string read_file_capped(const std::string& path, std::uint64_t cap, const char* what) {
    Fd fd = open_read(path);
    const std::uint64_t n = file_size(fd.get(), path);
    if (n > cap)
        fail(ErrorKind::format, path + ": is " + std::to_string(n) + " bytes, more than the " + std::to_string(cap) + " a " + what +
                                    " may hold");
    std::string text(std::size_t(n), '\0');
    pread_exact(fd.get(), text.data(), text.size(), 0, path);
    return text;
}

// ---------------------------------------------------------------------------------------------------
// 1.3 (the first half) JSON read with bounds
// ---------------------------------------------------------------------------------------------------
// Every JSON text the engine reads (config.json, the index, each safetensors header, tokenizer_config.json,
// trunk.json) goes through one reader, parse_json, with bounds that a hostile file cannot get past:
//   * nesting of at most kMaxJsonDepth (64) levels. K3's deepest file nests 6. Without a bound, a
//     100,000-deep `[[[...]]]` parses (nlohmann's parser is iterative) but every later recursive walk of
//     the value, such as printing it into an error message, overflows the stack;
//   * no key twice in one object (nlohmann and Python's json both keep the last one silently, so a
//     duplicate can hide a value from one reader and not another); no NUL byte (nlohmann stops reading
//     at one, ignoring whatever follows it); and every number must fit a double (1e400 is refused, not
//     read as infinity);
//   * one pass, linear in the text: nlohmann's SAX parser drives a small builder written here.
//     nlohmann's callback parser (json::parse with a callback, used here before) rescans the parent
//     object after every member, so a header of 100,000 tensors took minutes.
// A message names the file, the byte or JSON path, and quotes at most a few dozen characters of the
// input (json_excerpt): a bad value can be megabytes long.
inline constexpr std::size_t kMaxJsonDepth = 64;

namespace detail {
inline void json_excerpt_into(std::string& out, const nlohmann::json& v, std::size_t max, int depth) {
    using nlohmann::json;
    auto text = [](const std::string& s, std::size_t n) {  // a string literal, cut to n bytes (invalid UTF-8 replaced)
        return json(s.substr(0, n)).dump(-1, ' ', false, json::error_handler_t::replace);
    };
    if (out.size() > max) return;
    if (depth > 8) {
        out += "...";
    } else if (v.is_object()) {
        out += '{';
        for (auto it = v.begin(); it != v.end() && out.size() <= max; ++it) {
            if (it != v.begin()) out += ',';
            out += text(it.key(), max) + ':';
            json_excerpt_into(out, it.value(), max, depth + 1);
        }
        out += '}';
    } else if (v.is_array()) {
        out += '[';
        for (std::size_t i = 0; i < v.size() && out.size() <= max; ++i) {
            if (i) out += ',';
            json_excerpt_into(out, v[i], max, depth + 1);
        }
        out += ']';
    } else if (v.is_string()) {
        out += text(v.get_ref<const std::string&>(), max + 1);
    } else {
        out += v.dump();
    }
}
}  // namespace detail

// A name or text for a message: at most `max` bytes, then "..." (a hostile name can be megabytes long).
inline std::string clipped(const std::string& s, std::size_t max = 200) { return s.size() > max ? s.substr(0, max) + "..." : s; }

// At most `max` characters of a value as JSON text, then "..." when it was longer: what a message quotes.
inline std::string json_excerpt(const nlohmann::json& v, std::size_t max = 60) {
    std::string out;
    detail::json_excerpt_into(out, v, max, 0);
    if (out.size() > max) out.resize(max), out += "...";
    return out;
}

namespace detail {
// Builds a value from nlohmann's SAX events with the bounds above. With `on_member` set, the text must be
// one object whose members are handed over one at a time as each is complete and then dropped, so memory
// is one member's whatever the number of members (a safetensors header).
class JsonBuilder {
  public:
    using json = nlohmann::json;
    using OnMember = std::function<void(const std::string& key, json& value)>;

    JsonBuilder(const std::string& source, std::size_t max_depth, OnMember on_member)
        : source_(source), max_depth_(max_depth), on_member_(std::move(on_member)) {}

    bool null() { return put(json(nullptr)); }
    bool boolean(bool b) { return put(json(b)); }
    bool number_integer(std::int64_t v) { return put(json(v)); }
    bool number_unsigned(std::uint64_t v) { return put(json(v)); }
    bool number_float(double v, const std::string&) { return put(json(v)); }
    bool string(std::string& s) { return put(json(std::move(s))); }
    bool binary(json::binary_t&) { return refuse("a binary value"); }
    bool start_object(std::size_t) { return open(json::object()); }
    bool start_array(std::size_t) { return open(json::array()); }
    bool end_object() { return close(); }
    bool end_array() { return close(); }
    bool key(std::string& k) {
        Level& top = levels_.back();
        if (streaming_root() ? !root_keys_.insert(k).second : top.value->contains(k)) {
            const std::string where = levels_.size() == 1 ? "the top-level object" : "the object " + path(levels_.size() - 1);
            error_ = source_ + ": key '" + clip(k) + "' appears twice in " + where;
            return false;
        }
        top.key = std::move(k);
        return true;
    }
    bool parse_error(std::size_t position, const std::string& last_token, const nlohmann::detail::exception& ex) {
        if (!error_.empty()) return false;  // our own refusal came first
        if (ex.id == 406)  // out_of_range.406: a number that does not fit a double
            error_ = source_ + ": byte " + std::to_string(position) + ": the number " + json_excerpt(json(last_token), 40) +
                     " is out of range (more than a double holds)";
        else {
            std::string what = ex.what();  // "[json.exception.parse_error.101] parse error at line 1, column 2: ..."
            if (const std::size_t at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
            if (what.size() > 200) what = what.substr(0, 200) + "...";
            error_ = source_ + ": not valid JSON: " + what;
        }
        return false;
    }

    const std::string& error() const { return error_; }
    json& root() { return root_; }

  private:
    struct Level {
        json* value;         // the open object or array
        std::string key;     // objects: the key of the member being read
    };
    bool streaming_root() const { return on_member_ && levels_.size() == 1; }
    static std::string clip(const std::string& k) { return k.size() > 60 ? k.substr(0, 60) + "..." : k; }
    // The JSON path of the value being read (the first `upto` levels), e.g. `text_config.kda_layers[3]`.
    // An array with an open child names that child (its last element); the innermost names the next one.
    std::string path(std::size_t upto = SIZE_MAX) const {
        std::string p;
        for (std::size_t i = 0; i < levels_.size() && i < upto; ++i) {
            const Level& l = levels_[i];
            if (l.value->is_array()) p += "[" + std::to_string(l.value->size() - (i + 1 < levels_.size() ? 1 : 0)) + "]";
            else p += (p.empty() ? "" : ".") + clip(l.key);
        }
        return p.empty() ? "the top level" : p;
    }
    bool refuse(const std::string& what) {
        if (error_.empty()) error_ = source_ + ": " + path() + ": " + what;
        return false;
    }
    // Where a new value goes: the root, the member being streamed, or inside the innermost open value.
    json* place(json&& v) {
        if (levels_.empty()) return &(root_ = std::move(v));
        if (streaming_root()) return &(member_ = std::move(v));
        Level& top = levels_.back();
        if (top.value->is_array()) {
            top.value->push_back(std::move(v));
            return &top.value->back();
        }
        return &((*top.value)[top.key] = std::move(v));
    }
    bool put(json&& v) {
        if (on_member_ && levels_.empty()) return refuse("is not a JSON object");
        place(std::move(v));
        if (streaming_root()) hand_over();
        return true;
    }
    bool open(json&& container) {
        if (levels_.size() >= max_depth_) return refuse("nested more than " + std::to_string(max_depth_) + " levels deep");
        if (on_member_ && levels_.empty() && !container.is_object()) return refuse("is not a JSON object");
        json* c = nullptr;
        if (on_member_ && levels_.empty()) c = &(root_ = json::object());  // streamed: the top level keeps nothing
        else c = place(std::move(container));
        levels_.push_back({c, {}});
        return true;
    }
    bool close() {
        levels_.pop_back();
        if (streaming_root()) hand_over();
        return true;
    }
    void hand_over() {
        on_member_(levels_.back().key, member_);
        member_ = json();
    }

    const std::string& source_;
    std::size_t max_depth_;
    OnMember on_member_;
    json root_, member_;
    std::vector<Level> levels_;
    std::set<std::string> root_keys_;  // streaming: the keys seen at the top level
    std::string error_;
};

inline void run_json_builder(std::string_view text, const std::string& source, JsonBuilder& b) {
    if (const std::size_t z = text.find('\0'); z != std::string_view::npos)
        fail(ErrorKind::format, source + ": byte " + std::to_string(z) + " is a NUL byte, which JSON text never holds");
    const bool ok = nlohmann::json::sax_parse(text.begin(), text.end(), &b);
    if (!ok || !b.error().empty()) fail(ErrorKind::format, b.error().empty() ? source + ": not valid JSON" : b.error());
}
}  // namespace detail

// A JSON text as a value, within the bounds above. `source` names the file in messages.
inline nlohmann::json parse_json(std::string_view text, const std::string& source, std::size_t max_depth = kMaxJsonDepth) {
    detail::JsonBuilder b(source, max_depth, {});
    detail::run_json_builder(text, source, b);
    return std::move(b.root());
}

// The members of a JSON text that must be one object, handed to `f(key, value)` one at a time in file
// order and not kept: memory is one member's, whatever the number of members.
inline void for_each_json_member(std::string_view text, const std::string& source,
                                 const std::function<void(const std::string&, nlohmann::json&)>& f, std::size_t max_depth = kMaxJsonDepth) {
    detail::JsonBuilder b(source, max_depth, f);
    detail::run_json_builder(text, source, b);
}

// A small JSON file: read_file_capped, then parse_json.
inline nlohmann::json read_json_file(const std::string& path, std::uint64_t cap, const char* what) {
    return parse_json(read_file_capped(path, cap, what), path);
}

}  // namespace kimik3
