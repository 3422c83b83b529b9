// kimik3 chapter 01: safetensors -- reading a checkpoint without trusting it.
// ====================================================================================================
//
// WHAT THIS CHAPTER TEACHES
//   Kimi K3 ships as 96 files in the safetensors format. This chapter reads that format from first
//   principles: a length, a JSON table of contents, raw bytes. New since chapter 00: files, the header
//   schema, dtypes, validating a header before any byte of data is believed, multi-shard checkpoints,
//   `pread` into aligned buffers, and an `mmap` view. Writing the format (tests and tools craft files
//   with it) is appendix 01b.
//
// WHERE THIS SITS IN KIMI K3
//   The release is 1.56 TB in 96 shards `model-000NN-of-000096.safetensors` plus
//   `model.safetensors.index.json` (tensor name -> shard file). The largest tensors are the embedding
//   and lm_head, [163840, 7168] BF16 = 2.35 GB each; the most numerous are the routed experts,
//   82,432 experts x 6 tensors (U8). Routed experts are never loaded whole: chapter 11 reads one expert
//   (17,547,264 bytes) with one pread at the offset this chapter computes.
//
// CONCEPTS
//   header length   the first 8 bytes, a little-endian u64 N: the size of the JSON header that follows.
//   header          N bytes of UTF-8 JSON: {"name": {"dtype": "BF16", "shape": [r, c],
//                   "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}. Writers pad it
//                   with spaces to a multiple of 8 so the data section starts 8-aligned.
//   data section    everything after the header. `data_offsets` are relative to its first byte;
//                   `end` is one past the last byte.
//   shard / index   a large checkpoint is several files; `model.safetensors.index.json` has a
//                   "weight_map" from every tensor name to the file that holds it.
//
// FILE LAYOUT
//
//     byte 0        8             8+N                                             file size
//     +-------------+--------------+-----------------------------------------------+
//     | N (u64 LE)  | JSON header  | data: tensor bytes, little-endian, row-major   |
//     +-------------+--------------+-----------------------------------------------+
//                                  ^ offset 0 of every data_offsets pair
//
//   A tensor "w" with {"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]} occupies file bytes
//   [8+N+16, 8+N+28): 2*3 elements * 2 bytes = 12 bytes, element (i, j) at byte 2*(3i + j).
//
// CONTRACT (what is validated before any data is trusted; each failure names file, tensor and field)
//   1. the file holds at least 8 bytes; 2 <= N <= 100,000,000 (the reference implementation's cap)
//      and 8 + N <= file size;
//   2. the header is valid JSON, an object, and starts with '{'; no tensor name appears twice;
//   3. `__metadata__`, if present, maps strings to strings;
//   4. every tensor has a known `dtype` (BF16 F16 F32 F64 U8 I8 I16 I32 I64 BOOL), a `shape` of at most
//      8 non-negative integers whose product times the dtype size does not overflow 64 bits, and
//      `data_offsets` [begin, end] with begin <= end <= data size and end - begin == bytes needed;
//   5. no two tensors' byte ranges overlap (gaps are allowed: nothing we read depends on them);
//   6. an index maps every name to a shard that exists and whose header holds that name.
//   Reads are exact: a short read or an I/O error is an Error naming the file, offset and size, never
//   a partially filled buffer.
//   Every input is a regular file, whole-file reads have a size cap, and every JSON text goes through one
//   bounded reader: how, in appendix 01a (01a_bounded_input.hpp).
//
// USES     chapter 00 (Error), nlohmann/json, POSIX open/pread/mmap.
// RUN      make run-01    (lists the tensors of a file or checkpoint; default: a bundled fixture)
// TEST     make test-01   (a crafted corpus of broken files, each with its asserted error)
//
// SECTIONS
//   1.1 dtypes         1.2 aligned buffers and exact reads      1.3 the header and its validation
//   1.4 one file       1.5 typed views                          1.6 multi-shard checkpoints
//   APPENDIX 01a_bounded_input.hpp: 1.2 (the rest) regular files only, exact, direct and capped reads;
//                                   1.3 (the first half) the bounded JSON reader
//   APPENDIX 01b_writer.hpp:        1.7 writing a file (tests, tools, pack-trunk, traces, sessions)
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "00_numerics.hpp"
#include "01a_bounded_input.hpp"  // APPENDIX: files, exact reads, the bounded JSON reader (1.2, 1.3)

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 1.1 dtypes
// ---------------------------------------------------------------------------------------------------
enum class DType : std::uint8_t { BF16, F16, F32, F64, U8, I8, I16, I32, I64, BOOL };

struct DTypeInfo {
    DType dtype;
    const char* name;      // as written in the header
    std::size_t size;      // bytes per element
};

inline constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::BF16, "BF16", 2}, {DType::F16, "F16", 2}, {DType::F32, "F32", 4}, {DType::F64, "F64", 8},
    {DType::U8, "U8", 1},     {DType::I8, "I8", 1},   {DType::I16, "I16", 2}, {DType::I32, "I32", 4},
    {DType::I64, "I64", 8},   {DType::BOOL, "BOOL", 1},
}};

inline const DTypeInfo& dtype_info(DType d) { return kDTypes[std::size_t(d)]; }
inline const char* dtype_name(DType d) { return dtype_info(d).name; }
inline std::size_t dtype_size(DType d) { return dtype_info(d).size; }

inline bool parse_dtype(std::string_view s, DType& out) {
    for (const auto& d : kDTypes)
        if (s == d.name) return out = d.dtype, true;
    return false;
}

// A tensor shape: at most 8 dimensions, stored inline (the K3 header holds ~500,000 tensors; a heap
// vector per shape would cost tens of MB for nothing).
struct Shape {
    static constexpr int kMaxRank = 8;
    std::array<std::int64_t, kMaxRank> dims{};
    int rank = 0;

    Shape() = default;
    Shape(std::initializer_list<std::int64_t> d) {
        for (auto x : d) dims[std::size_t(rank++)] = x;
    }
    std::int64_t operator[](int i) const { return dims[std::size_t(i)]; }
    // The element count. A product past 2^63 - 1 is an error, never a wrapped (signed: undefined) value:
    // headers are checked against this when read, but shapes built from a config are not headers.
    std::int64_t numel() const {
        std::int64_t n = 1;
        for (int i = 0; i < rank; ++i)
            if (__builtin_mul_overflow(n, dims[std::size_t(i)], &n))
                fail(ErrorKind::format, "shape " + str() + " has more elements than a 64-bit count holds");
        return n;
    }
    bool operator==(const Shape& o) const {
        return rank == o.rank && std::equal(dims.begin(), dims.begin() + rank, o.dims.begin());
    }
    std::string str() const {
        std::string s = "[";
        for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[std::size_t(i)]);
        return s + "]";
    }
};

// ---------------------------------------------------------------------------------------------------
// 1.2 Aligned buffers and exact reads
// ---------------------------------------------------------------------------------------------------
// Tensor bytes live in buffers that are 4096-aligned (kPageAlign) and sized up to a multiple of 4096:
// what O_DIRECT reads need (chapters 11 and 12), and harmless otherwise. Bytes arrive by pread_exact(fd,
// dst, n, offset, path): exactly n bytes or an Error naming the file, offset and size. It, the owned
// descriptor Fd and open_read (regular files only, refused by name otherwise) are appendix 01a, 1.2.
class AlignedBuffer {
  public:
    AlignedBuffer() = default;
    explicit AlignedBuffer(std::size_t n) { resize(n); }
    void resize(std::size_t n) {
        const std::size_t cap = round_up(std::max<std::size_t>(n, 1), kPageAlign);
        if (cap > capacity_) {
            void* p = std::aligned_alloc(kPageAlign, cap);
            if (!p) fail(ErrorKind::runtime, "out of memory allocating " + std::to_string(cap) + " bytes");
            ptr_.reset(static_cast<std::byte*>(p));
            capacity_ = cap;
        }
        size_ = n;
    }
    std::byte* data() { return ptr_.get(); }
    const std::byte* data() const { return ptr_.get(); }
    std::size_t size() const { return size_; }
    std::size_t capacity() const { return capacity_; }
    template <class T> T* as() { return reinterpret_cast<T*>(ptr_.get()); }
    template <class T> const T* as() const { return reinterpret_cast<const T*>(ptr_.get()); }

  private:
    struct Free {
        void operator()(std::byte* p) const { std::free(p); }
    };
    std::unique_ptr<std::byte, Free> ptr_;
    std::size_t size_ = 0, capacity_ = 0;
};

// ---------------------------------------------------------------------------------------------------
// 1.3 The header and its validation
// ---------------------------------------------------------------------------------------------------
// The header's JSON text is read by parse_json / for_each_json_member (appendix 01a, 1.3): bounded in
// depth, no key twice, no NUL, numbers in range, one linear pass. What it means is checked here.
struct TensorInfo {
    std::string name;
    DType dtype = DType::U8;
    Shape shape;
    std::uint64_t begin = 0, end = 0;   // [begin, end) relative to the data section
    std::uint64_t file_offset = 0;      // absolute: 8 + N + begin
    std::uint64_t nbytes() const { return end - begin; }
    std::int64_t numel() const { return shape.numel(); }
};

inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct Header {
    std::vector<TensorInfo> tensors;               // in data-offset order
    std::map<std::string, std::string> metadata;   // __metadata__
    std::uint64_t header_bytes = 0;                // N
    std::uint64_t data_start = 0;                  // 8 + N
};

// Parses and validates the JSON header of `path` (only for messages) whose data section holds
// `data_size` bytes. Nothing here touches the data.
inline Header parse_header(const std::string& text, const std::string& path, std::uint64_t data_size) {
    using nlohmann::json;
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, path + ": " + what); };
    auto bad_field = [&](const std::string& tensor, const char* field, const std::string& what) {
        fail(ErrorKind::format, path + ": tensor '" + tensor + "': field '" + field + "': " + what);
    };
    auto x = [](const json& v) { return json_excerpt(v); };  // what a message quotes of a value
    if (text.empty() || text[0] != '{') bad("header does not start with '{'");

    // One pass over the members (linear time, one entry in memory at a time); the reader refuses a name
    // given twice, nesting deeper than kMaxJsonDepth, NUL bytes and numbers out of range.
    Header out;
    auto clip = [](const std::string& name) { return clipped(name); };
    for_each_json_member(text, path, [&](const std::string& key, json& entry) {
        const json& v = entry;
        const std::string name = clip(key);
        if (key == "__metadata__") {
            if (!v.is_object()) bad("'__metadata__' is not an object");
            for (auto m = v.begin(); m != v.end(); ++m) {
                if (!m.value().is_string()) bad("'__metadata__' value of '" + clip(m.key()) + "' is not a string");
                out.metadata[m.key()] = m.value().get<std::string>();
            }
            return;
        }
        if (!v.is_object()) bad("tensor '" + name + "': entry is not an object");
        TensorInfo t;
        t.name = key;
        // dtype
        if (!v.contains("dtype") || !v["dtype"].is_string()) bad_field(name, "dtype", "missing or not a string");
        const std::string ds = v["dtype"].get<std::string>();
        if (!parse_dtype(ds, t.dtype))
            bad_field(name, "dtype", "unknown dtype \"" + ds + "\" (known: BF16 F16 F32 F64 U8 I8 I16 I32 I64 BOOL)");
        // shape
        if (!v.contains("shape") || !v["shape"].is_array()) bad_field(name, "shape", "missing or not an array");
        const json& sh = v["shape"];
        if (sh.size() > std::size_t(Shape::kMaxRank))
            bad_field(name, "shape", "rank " + std::to_string(sh.size()) + " is more than 8");
        std::uint64_t numel = 1;
        for (const json& d : sh) {
            if (!d.is_number_integer()) bad_field(name, "shape", "dimension " + x(d) + " is not an integer");
            if (d.is_number_integer() && !d.is_number_unsigned() && d.get<std::int64_t>() < 0)
                bad_field(name, "shape", "dimension " + x(d) + " is negative");
            const std::uint64_t n = d.get<std::uint64_t>();
            if (n > std::uint64_t(INT64_MAX) || __builtin_mul_overflow(numel, n, &numel) || numel > std::uint64_t(INT64_MAX))
                bad_field(name, "shape", x(sh) + " overflows a 64-bit element count");
            t.shape.dims[std::size_t(t.shape.rank++)] = std::int64_t(n);
        }
        std::uint64_t need = 0;
        if (__builtin_mul_overflow(numel, std::uint64_t(dtype_size(t.dtype)), &need))
            bad_field(name, "shape", x(sh) + " of " + ds + " overflows a 64-bit byte count");
        // data_offsets
        if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
            bad_field(name, "data_offsets", "missing or not a pair [begin, end]");
        const json& off = v["data_offsets"];
        for (const json& o : off)
            if (!o.is_number_unsigned()) bad_field(name, "data_offsets", x(off) + " is not two non-negative integers");
        t.begin = off[0].get<std::uint64_t>();
        t.end = off[1].get<std::uint64_t>();
        if (t.begin > t.end) bad_field(name, "data_offsets", x(off) + " has begin > end");
        if (t.end > data_size)
            bad_field(name, "data_offsets", x(off) + " ends past the data section (" + std::to_string(data_size) +
                                                 " bytes): the file is truncated or the offsets are wrong");
        if (t.end - t.begin != need)
            bad_field(name, "data_offsets", x(off) + " holds " + std::to_string(t.end - t.begin) +
                                                 " bytes but shape " + x(sh) + " of " + ds + " needs " +
                                                 std::to_string(need));
        out.tensors.push_back(std::move(t));
    });
    // No overlaps: sorted by begin, each non-empty range must start at or after the previous end.
    std::sort(out.tensors.begin(), out.tensors.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    const TensorInfo* prev = nullptr;
    for (const TensorInfo& t : out.tensors) {
        if (t.begin == t.end) continue;  // empty tensors occupy no bytes
        if (prev && t.begin < prev->end)
            bad_field(clip(t.name), "data_offsets", "[" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                                                  "] overlaps tensor '" + clip(prev->name) + "' [" + std::to_string(prev->begin) +
                                                  ", " + std::to_string(prev->end) + "]");
        prev = &t;
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------
// 1.4 One file
// ---------------------------------------------------------------------------------------------------
// A tensor read into memory: its description plus an aligned copy of its bytes.
struct Tensor {
    TensorInfo info;
    AlignedBuffer bytes;
};

class SafetensorsFile {
  public:
    SafetensorsFile(const SafetensorsFile&) = delete;             // index_ holds views into header_
    SafetensorsFile& operator=(const SafetensorsFile&) = delete;
    explicit SafetensorsFile(std::string path) : path_(std::move(path)) {
        fd_ = open_read(path_);
        size_ = file_size(fd_.get(), path_);
        if (size_ < 8) fail(ErrorKind::format, path_ + ": file is " + std::to_string(size_) + " bytes, shorter than the 8-byte header length");
        unsigned char le[8];
        pread_exact(fd_.get(), le, 8, 0, path_);
        std::uint64_t n = 0;
        for (int i = 7; i >= 0; --i) n = n << 8 | le[i];  // little-endian regardless of the host
        if (n < 2 || n > kMaxHeaderBytes)
            fail(ErrorKind::format, path_ + ": header length " + std::to_string(n) + " is outside [2, 100000000]");
        if (n > size_ - 8)
            fail(ErrorKind::format, path_ + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                                        std::to_string(size_) + " bytes)");
        std::string text(std::size_t(n), '\0');
        pread_exact(fd_.get(), text.data(), std::size_t(n), 8, path_);
        header_ = parse_header(text, path_, size_ - 8 - n);
        header_.header_bytes = n;
        header_.data_start = 8 + n;
        for (std::size_t i = 0; i < header_.tensors.size(); ++i) {
            TensorInfo& t = header_.tensors[i];
            t.file_offset = header_.data_start + t.begin;
        }
        for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
    }

    const std::string& path() const { return path_; }
    int fd() const { return fd_.get(); }
    std::uint64_t size() const { return size_; }
    const Header& header() const { return header_; }
    const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
    const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

    const TensorInfo* find(std::string_view name) const {
        auto it = index_.find(name);
        return it == index_.end() ? nullptr : &header_.tensors[it->second];
    }
    const TensorInfo& get(std::string_view name) const {
        if (const TensorInfo* t = find(name)) return *t;
        fail(ErrorKind::format, path_ + ": no tensor '" + std::string(name) + "'");
    }

    // Copies a tensor's bytes into dst (nbytes of it).
    void read_into(const TensorInfo& t, void* dst) const { pread_exact(fd_.get(), dst, t.nbytes(), t.file_offset, path_); }

    Tensor read(std::string_view name) const {
        const TensorInfo& t = get(name);
        Tensor out{t, AlignedBuffer(t.nbytes())};
        read_into(t, out.bytes.data());
        return out;
    }

  private:
    std::string path_;
    Fd fd_;
    std::uint64_t size_ = 0;
    Header header_;
    std::unordered_map<std::string_view, std::size_t> index_;  // views into header_.tensors' names
};

// A read-only memory map of a whole file: tensors become spans without copying. The kernel pages data
// in on first touch, so this is how the examples browse a large file; the engine's weight reads use
// pread (chapter 11 explains why: control over when I/O happens and how much memory it takes).
class MappedFile {
  public:
    explicit MappedFile(const SafetensorsFile& f) : path_(f.path()), size_(f.size()) {
        void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd(), 0);
        if (p == MAP_FAILED) fail(ErrorKind::io, path_ + ": mmap failed: " + errno_text(errno));
        base_ = static_cast<const std::byte*>(p);
    }
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    ~MappedFile() { ::munmap(const_cast<std::byte*>(base_), size_); }
    std::span<const std::byte> bytes(const TensorInfo& t) const { return {base_ + t.file_offset, std::size_t(t.nbytes())}; }

  private:
    std::string path_;
    std::uint64_t size_;
    const std::byte* base_ = nullptr;
};

// ---------------------------------------------------------------------------------------------------
// 1.5 Typed views
// ---------------------------------------------------------------------------------------------------
// Which C++ element type may view which dtype. bf16 and f16 are both raw uint16_t patterns, so a view
// must also name the dtype it expects; a mismatch is an error naming the tensor.
template <class T> constexpr bool dtype_matches(DType d) {
    if constexpr (std::is_same_v<T, float>) return d == DType::F32;
    else if constexpr (std::is_same_v<T, double>) return d == DType::F64;
    else if constexpr (std::is_same_v<T, std::uint16_t>) return d == DType::BF16 || d == DType::F16;
    else if constexpr (std::is_same_v<T, std::uint8_t>) return d == DType::U8 || d == DType::BOOL;
    else if constexpr (std::is_same_v<T, std::int8_t>) return d == DType::I8;
    else if constexpr (std::is_same_v<T, std::int16_t>) return d == DType::I16;
    else if constexpr (std::is_same_v<T, std::int32_t>) return d == DType::I32;
    else if constexpr (std::is_same_v<T, std::int64_t>) return d == DType::I64;
    else return false;
}

template <class T> struct View {
    const T* data = nullptr;
    Shape shape;
    std::size_t size() const { return std::size_t(shape.numel()); }
    std::span<const T> span() const { return {data, size()}; }
    const T* row(std::int64_t r) const { return data + r * (shape.numel() / std::max<std::int64_t>(shape[0], 1)); }
};

template <class T> View<T> view_as(const TensorInfo& t, const void* bytes, DType expect) {
    if (t.dtype != expect || !dtype_matches<T>(expect))
        fail(ErrorKind::format, "tensor '" + t.name + "': expected dtype " + dtype_name(expect) + ", found " + dtype_name(t.dtype));
    return View<T>{static_cast<const T*>(bytes), t.shape};
}
template <class T> View<T> view_as(const Tensor& t, DType expect) { return view_as<T>(t.info, t.bytes.data(), expect); }

// Any floating-point tensor widened to f32: BF16/F16 exactly, F32 as is, F64 rounded to nearest.
inline std::vector<float> to_f32(const Tensor& t) {
    const std::size_t n = std::size_t(t.info.numel());
    std::vector<float> out(n);
    const std::byte* p = t.bytes.data();
    switch (t.info.dtype) {
        case DType::BF16:
            for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
            break;
        case DType::F16:
            for (std::size_t i = 0; i < n; ++i) out[i] = f16_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
            break;
        case DType::F32:
            if (n) std::memcpy(out.data(), p, n * 4);  // an empty vector's data() may be null: no memcpy at all
            break;
        case DType::F64:
            for (std::size_t i = 0; i < n; ++i) out[i] = float(reinterpret_cast<const double*>(p)[i]);
            break;
        default:
            fail(ErrorKind::format, "tensor '" + t.info.name + "': dtype " + dtype_name(t.info.dtype) + " is not a float type");
    }
    return out;
}

// Refuses a floating-point tensor holding a NaN or an infinity, naming the tensor and the first such
// element (integer dtypes pass). For the small tensors a model keeps in memory (norms, biases, decay
// parameters): one of them non-finite would make every token's output NaN, or, for a router bias,
// silently pick the same expert forever.
inline void require_finite(const TensorInfo& t, const std::byte* bytes) {
    const std::size_t n = std::size_t(t.numel());
    auto bits16 = [&](std::size_t i) {
        std::uint16_t u;
        std::memcpy(&u, bytes + 2 * i, 2);
        return u;
    };
    for (std::size_t i = 0; i < n; ++i) {
        bool finite = true;
        switch (t.dtype) {
            case DType::BF16: finite = (bits16(i) & 0x7F80u) != 0x7F80u; break;  // exponent all ones: Inf or NaN
            case DType::F16: finite = (bits16(i) & 0x7C00u) != 0x7C00u; break;
            case DType::F32: {
                float f;
                std::memcpy(&f, bytes + 4 * i, 4);
                finite = std::isfinite(f);
                break;
            }
            case DType::F64: {
                double d;
                std::memcpy(&d, bytes + 8 * i, 8);
                finite = std::isfinite(d);
                break;
            }
            default: return;
        }
        if (!finite) fail(ErrorKind::format, "tensor '" + clipped(t.name) + "': element " + std::to_string(i) + " is not finite (NaN or Inf)");
    }
}

// Any integer tensor widened to int64 (token ids, expert ids).
inline std::vector<std::int64_t> to_i64(const Tensor& t) {
    const std::size_t n = std::size_t(t.info.numel());
    std::vector<std::int64_t> out(n);
    const std::byte* p = t.bytes.data();
    for (std::size_t i = 0; i < n; ++i) switch (t.info.dtype) {
            case DType::I64: out[i] = reinterpret_cast<const std::int64_t*>(p)[i]; break;
            case DType::I32: out[i] = reinterpret_cast<const std::int32_t*>(p)[i]; break;
            case DType::I16: out[i] = reinterpret_cast<const std::int16_t*>(p)[i]; break;
            case DType::I8: out[i] = reinterpret_cast<const std::int8_t*>(p)[i]; break;
            case DType::U8:
            case DType::BOOL: out[i] = reinterpret_cast<const std::uint8_t*>(p)[i]; break;
            default:
                fail(ErrorKind::format, "tensor '" + t.info.name + "': dtype " + dtype_name(t.info.dtype) + " is not an integer type");
        }
    return out;
}

// ---------------------------------------------------------------------------------------------------
// 1.6 Multi-shard checkpoints
// ---------------------------------------------------------------------------------------------------
// The index's "weight_map" as (tensor name, shard file name) pairs, in file order. Each file name must
// be a plain name in the checkpoint's directory: not empty, no '/', not "." or "..".
inline std::vector<std::pair<std::string, std::string>> parse_index(std::string_view text, const std::string& index_path) {
    using nlohmann::json;
    const json idx = parse_json(text, index_path);
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
        fail(ErrorKind::format, index_path + ": field 'weight_map' is missing or not an object");
    std::vector<std::pair<std::string, std::string>> out;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
        const std::string name = clipped(it.key());
        if (!it.value().is_string())
            fail(ErrorKind::format, index_path + ": weight_map['" + name + "'] = " + json_excerpt(it.value()) + " is not a file name");
        const std::string& file = it.value().get_ref<const std::string&>();
        if (file.find('/') != std::string::npos || file == ".." || file == "." || file.empty())
            fail(ErrorKind::format, index_path + ": weight_map['" + name + "'] = " + json_excerpt(it.value()) + " is not a plain file name");
        out.emplace_back(it.key(), file);
    }
    return out;
}

// A directory with `model.safetensors.index.json` (the release) or a single `model.safetensors`.
// Each shard is opened and validated once; every tensor is then found by name in O(1).
class Checkpoint {
  public:
    struct Ref {
        const SafetensorsFile* file;
        const TensorInfo* info;
    };

    explicit Checkpoint(const std::string& dir) : dir_(dir) {
        const std::string index_path = dir + "/model.safetensors.index.json";
        if (path_present(index_path)) {
            load_index(index_path);
        } else if (path_present(dir + "/model.safetensors")) {
            shards_.push_back(std::make_unique<SafetensorsFile>(dir + "/model.safetensors"));
            for (const TensorInfo& t : shards_[0]->tensors()) refs_.emplace(t.name, Ref{shards_[0].get(), &t});
        } else if (!is_directory(dir)) {
            fail(ErrorKind::format, dir + ": not a directory");
        } else {
            fail(ErrorKind::format, dir + ": neither model.safetensors.index.json nor model.safetensors is here");
        }
    }

    const std::string& dir() const { return dir_; }
    const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
    std::size_t size() const { return refs_.size(); }
    const std::unordered_map<std::string, Ref>& tensors() const { return refs_; }

    const Ref* find(const std::string& name) const {
        auto it = refs_.find(name);
        return it == refs_.end() ? nullptr : &it->second;
    }
    const Ref& get(const std::string& name) const {
        if (const Ref* r = find(name)) return *r;
        fail(ErrorKind::format, dir_ + ": checkpoint has no tensor '" + name + "'");
    }
    Tensor read(const std::string& name) const {
        const Ref& r = get(name);
        Tensor out{*r.info, AlignedBuffer(r.info->nbytes())};
        r.file->read_into(*r.info, out.bytes.data());
        return out;
    }

  private:
    void load_index(const std::string& index_path) {
        std::map<std::string, SafetensorsFile*> by_file;
        for (const auto& [name, file] : parse_index(read_file_capped(index_path, kMaxIndexBytes, "safetensors index"), index_path)) {
            auto f = by_file.find(file);
            if (f == by_file.end()) {
                const std::string path = dir_ + "/" + file;
                if (!path_present(path))
                    fail(ErrorKind::format, index_path + ": weight_map maps '" + clipped(name) + "' to '" + clipped(file) + "', which does not exist");
                shards_.push_back(std::make_unique<SafetensorsFile>(path));
                f = by_file.emplace(file, shards_.back().get()).first;
            }
            const TensorInfo* t = f->second->find(name);
            if (!t)
                fail(ErrorKind::format, index_path + ": weight_map maps '" + clipped(name) + "' to '" + clipped(file) + "', whose header has no such tensor");
            refs_.emplace(name, Ref{f->second, t});
        }
    }

    std::string dir_;
    std::vector<std::unique_ptr<SafetensorsFile>> shards_;
    std::unordered_map<std::string, Ref> refs_;
};

}  // namespace kimik3
