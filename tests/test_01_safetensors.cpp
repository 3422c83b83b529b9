// Tests for chapter 01: safetensors. The heart is a corpus of broken files, each crafted byte by byte,
// each with the error it must produce. None may crash or trip a sanitizer (make debug).
#include "../chapters/01_safetensors.hpp"
#include "../chapters/01b_writer.hpp"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "check.hpp"

using namespace kimik3;

namespace {

using test::TempDir;
using test::expect_error;
using test::error_of;

void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A file from a header given as text: 8-byte length, the text, then `data_bytes` bytes of data.
std::string craft(const std::string& header, std::size_t data_bytes, std::uint64_t length_field = UINT64_MAX) {
    const std::uint64_t n = length_field == UINT64_MAX ? header.size() : length_field;
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((n >> (8 * i)) & 0xFF);
    out += header;
    for (std::size_t i = 0; i < data_bytes; ++i) out += char(i * 7 + 1);
    return out;
}

const char* kGood = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}})";

}  // namespace

TEST_CASE("1.1 dtype names and sizes; F16 -> f32 is exact for all 65,536 patterns") {
    DType d{};
    CHECK(parse_dtype("BF16", d));
    CHECK(d == DType::BF16);
    CHECK(dtype_size(DType::I64) == 8);
    CHECK(!parse_dtype("F8_E4M3", d));
    for (std::uint32_t h = 0; h < 65536; ++h) {
        const int e = int(h >> 10 & 31), m = int(h & 1023);
        const double sign = (h & 0x8000) ? -1.0 : 1.0;
        const float got = f16_to_f32(std::uint16_t(h));
        if (e == 31) {
            REQUIRE((m ? std::isnan(got) : std::isinf(got)));
            continue;
        }
        const double want = e == 0 ? sign * std::ldexp(double(m), -24) : sign * std::ldexp(1.0 + m / 1024.0, e - 15);
        REQUIRE(double(got) == want);
        REQUIRE(std::signbit(got) == bool(h & 0x8000));
    }
}

TEST_CASE("1.3 a good file: every field parsed, offsets absolute, data read by pread and by mmap agree") {
    TempDir dir;
    SafetensorsWriter w;
    std::vector<float> a = {1.5f, -2.0f, 0.25f, 1e-40f};  // includes a denormal
    std::vector<std::uint16_t> b = {0x3F80, 0xBF80, 0x0000, 0x7F80};
    std::vector<std::int64_t> ids = {1, -2, 163839};
    w.add("a", DType::F32, {2, 2}, a);
    w.add("b", DType::BF16, {4}, b);
    w.add("ids", DType::I64, {3}, ids);
    w.add("empty", DType::F32, {0, 5}, nullptr, 0);
    w.metadata("format", "pt");
    w.write(dir.file("x.safetensors"));

    SafetensorsFile f(dir.file("x.safetensors"));
    CHECK(f.tensors().size() == 4);
    CHECK(f.metadata().at("format") == "pt");
    CHECK(f.header().data_start % 8 == 0);  // the writer pads the header to 8
    const TensorInfo& ta = f.get("a");
    CHECK(ta.dtype == DType::F32);
    CHECK(ta.shape == Shape{2, 2});
    CHECK(ta.file_offset == f.header().data_start + ta.begin);
    CHECK(to_f32(f.read("a")) == a);
    const auto bv = to_f32(f.read("b"));
    CHECK(bv[0] == 1.0f);
    CHECK(bv[1] == -1.0f);
    CHECK(std::isinf(bv[3]));
    CHECK(to_i64(f.read("ids")) == ids);
    CHECK(f.get("empty").nbytes() == 0);

    MappedFile m(f);
    const auto span = m.bytes(ta);
    CHECK(std::memcmp(span.data(), a.data(), 16) == 0);

    Tensor t = f.read("b");
    const View<std::uint16_t> v = view_as<std::uint16_t>(t, DType::BF16);
    CHECK(v.size() == 4);
    CHECK(v.data[0] == 0x3F80);
    expect_error([&] { view_as<float>(t, DType::F32); }, {"tensor 'b'", "expected dtype F32", "found BF16"});
    expect_error([&] { f.get("nope"); }, {"x.safetensors", "no tensor 'nope'"});
}

TEST_CASE("1.3 the broken-file corpus: each file gives its own error naming the file, tensor and field") {
    TempDir dir;
    struct Case {
        const char* what;
        std::string bytes;
        std::initializer_list<const char*> parts;
    };
    const std::string good = craft(kGood, 24);
    const std::vector<Case> corpus = {
        {"shorter than 8 bytes", std::string(5, '\0'), {"shorter than the 8-byte header length"}},
        {"header length past end of file", craft(kGood, 24, 1000), {"header length 1000 runs past the end of the file"}},
        {"header length absurd", craft(kGood, 24, 1ull << 40), {"outside [2, 100000000]"}},
        {"truncated data", good.substr(0, good.size() - 3), {"tensor 'b'", "field 'data_offsets'", "ends past the data section (21 bytes)"}},
        {"invalid JSON", craft(R"({"a":{"dtype":"F32",})", 0), {"not valid JSON"}},
        {"not an object", craft(R"(["a"])", 0), {"does not start with '{'"}},
        {"duplicate name", craft(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2),
         {"key 'a' appears twice in the top-level object"}},
        {"a field given twice inside a tensor entry", craft(R"({"a":{"dtype":"U8","dtype":"F64","shape":[1],"data_offsets":[0,1]}})", 1),
         {"key 'dtype' appears twice in the object a"}},
        {"a header padded with NUL bytes", craft(std::string(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})") + std::string(5, '\0'), 1),
         {"byte 53 is a NUL byte"}},
        {"a number past a double's range", craft(R"({"a":{"dtype":"U8","shape":[1e400],"data_offsets":[0,1]}})", 1),
         {"the number \"1e400\" is out of range"}},
        {"a shape nested 100,000 deep", craft(R"({"a":{"dtype":"U8","shape":)" + std::string(100000, '[') + std::string(100000, ']') + R"(,"data_offsets":[0,1]}})", 1),
         {"a.shape[0][0]", "nested more than 64 levels deep"}},
        {"data_offsets nested 100,000 deep", craft(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[)" + std::string(100000, '[') + std::string(100000, ']') + "]}}", 1),
         {"nested more than 64 levels deep"}},
        {"a shape of 2^63 elements", craft(R"({"a":{"dtype":"U8","shape":[3037000500,3037000500,0],"data_offsets":[0,0]}})", 0),
         {"field 'shape'", "overflows a 64-bit element count"}},
        {"a long bad value is quoted only in part", craft(R"({"a":{"dtype":"U8","shape":[")" + std::string(100000, 'x') + R"("],"data_offsets":[0,1]}})", 1),
         {"dimension \"xxxxxxxxxx", "xxx... is not an integer"}},
        {"unknown dtype", craft(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", 1), {"tensor 'a'", "field 'dtype'", "unknown dtype \"F8_E4M3\""}},
        {"missing dtype", craft(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1), {"tensor 'a'", "field 'dtype'", "missing"}},
        {"overflowing shape", craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
         {"tensor 'a'", "field 'shape'", "overflows a 64-bit element count"}},
        {"overflowing byte count", craft(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
         {"tensor 'a'", "field 'shape'", "overflows a 64-bit byte count"}},
        {"negative dimension", craft(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1), {"tensor 'a'", "field 'shape'", "negative"}},
        {"fractional dimension", craft(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1), {"field 'shape'", "not an integer"}},
        {"rank above 8", craft(R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1), {"field 'shape'", "rank 9"}},
        {"size mismatch", craft(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
         {"tensor 'a'", "field 'data_offsets'", "holds 8 bytes but shape [3] of F32 needs 12"}},
        {"offsets out of range", craft(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[100,104]}})", 8), {"tensor 'a'", "ends past the data section (8 bytes)"}},
        {"begin after end", craft(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 8), {"tensor 'a'", "begin > end"}},
        {"offsets not a pair", craft(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 8), {"field 'data_offsets'", "not a pair"}},
        {"overlapping tensors", craft(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})", 10),
         {"tensor 'b'", "field 'data_offsets'", "overlaps tensor 'a' [0, 8]"}},
        {"metadata not strings", craft(R"({"__metadata__":{"k":1}})", 0), {"'__metadata__' value of 'k' is not a string"}},
    };
    int i = 0;
    for (const Case& c : corpus) {
        CAPTURE(c.what);
        const std::string path = dir.file("broken" + std::to_string(i++) + ".safetensors");
        write_bytes(path, c.bytes);
        expect_error([&] { SafetensorsFile f(path); }, c.parts);
        expect_error([&] { SafetensorsFile f(path); }, {path.c_str()});  // the file is always named
    }
    expect_error([&] { SafetensorsFile f(dir.file("missing.safetensors")); }, {"missing.safetensors", "cannot open"});
    // no message quotes more than a few hundred bytes of its input, however long the bad value is
    const std::string long_name = craft(R"({")" + std::string(1 << 20, 'n') + R"(":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1);
    write_bytes(dir.file("long.safetensors"), long_name);
    CHECK(error_of([&] { SafetensorsFile f(dir.file("long.safetensors")); }).size() < 600);
}

TEST_CASE("1.3 parse_json: linear, bounded in depth, no duplicate keys, no NUL, numbers in range; messages quote little") {
    using nlohmann::json;
    CHECK(parse_json(R"({"a":[1,{"b":null}],"c":"d"})", "t.json") == json::parse(R"({"a":[1,{"b":null}],"c":"d"})"));
    CHECK(parse_json("[" + std::string(63, '[') + std::string(64, ']'), "t.json").is_array());  // 64 levels: the limit
    expect_error([&] { parse_json(std::string(65, '[') + std::string(65, ']'), "t.json"); }, {"t.json", "nested more than 64 levels deep"});
    expect_error([&] { parse_json(std::string(100000, '[') + std::string(100000, ']'), "t.json"); }, {"nested more than 64"});
    expect_error([&] { parse_json(R"({"x":{"k":1,"k":2}})", "t.json"); }, {"t.json", "key 'k' appears twice in the object x"});
    expect_error([&] { parse_json(std::string("{}\0{}", 5), "t.json"); }, {"t.json", "byte 2 is a NUL byte"});
    expect_error([&] { parse_json(R"({"x":[1,2,1e400]})", "t.json"); }, {"t.json", "the number \"1e400\" is out of range"});
    expect_error([&] { parse_json(R"({"x":)", "t.json"); }, ErrorKind::format, {"t.json: not valid JSON", "line 1, column 6", "unexpected end of input"});
    const std::string long_token = "[\"" + std::string(1 << 20, 'x');  // an unterminated string of 1 MiB
    CHECK(error_of([&] { parse_json(long_token, "t.json"); }).size() < 400);
    // streaming: each member handed over in order, none kept
    std::vector<std::string> keys;
    for_each_json_member(R"({"b":1,"a":{"c":[2]}})", "t.json", [&](const std::string& k, json& v) { keys.push_back(k + "=" + v.dump()); });
    CHECK(keys == std::vector<std::string>{"b=1", R"(a={"c":[2]})"});
    expect_error([&] { for_each_json_member("[1]", "t.json", [](const std::string&, json&) {}); }, {"t.json", "is not a JSON object"});
    // json_excerpt: at most max characters, then "..."
    CHECK(json_excerpt(json::parse("[1,2,3]")) == "[1,2,3]");
    CHECK(json_excerpt(json(std::vector<int>(1000, 7)), 10) == "[7,7,7,7,7...");
    CHECK(json_excerpt(json(std::string(500, 'x')), 5) == "\"xxxx...");
}

TEST_CASE("1.3 a 100,000-tensor header parses in one linear pass") {
    // 100,000 entries, 10 MB: the callback parser this replaced took minutes (each member rescanned the
    // parent object); linear parsing is timed in the benchmarks, here only the result is checked.
    std::string h = "{";
    for (int i = 0; i < 100000; ++i)
        h += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"U8","shape":[1],"data_offsets":[)" + std::to_string(i) + "," + std::to_string(i + 1) + "]}";
    const Header hd = parse_header(h + "}", "big.safetensors", 100000);
    CHECK(hd.tensors.size() == 100000);
    CHECK(hd.tensors[99999].begin == 99999);
}

TEST_CASE("1.2 only regular files are read: a directory, a FIFO and a device are refused by name, at once") {
    TempDir dir;
    expect_error([&] { open_read(dir.path); }, ErrorKind::format, {dir.path.c_str(), "is a directory, not a regular file"});
    const std::string fifo = dir.file("fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    expect_error([&] { open_read(fifo); }, ErrorKind::format, {"fifo: is a FIFO (named pipe), not a regular file"});  // no writer: would block
    expect_error([&] { open_read("/dev/zero"); }, ErrorKind::format, {"/dev/zero: is a character device"});
    // a symlink loop is a refused input naming the file, never a filesystem_error
    std::filesystem::create_symlink("b", dir.file("a"));
    std::filesystem::create_symlink("a", dir.file("b"));
    CHECK(path_present(dir.file("a")));
    expect_error([&] { open_read(dir.file("a")); }, ErrorKind::format, {"cannot open: Too many levels of symbolic links"});
    CHECK(!path_present(dir.file("none")));
    // read_file_capped refuses a file over its cap before reading it
    write_bytes(dir.file("big.json"), std::string(1000, ' '));
    expect_error([&] { read_file_capped(dir.file("big.json"), 999, "config.json"); }, ErrorKind::format,
                 {"big.json: is 1000 bytes, more than the 999 a config.json may hold"});
    CHECK(read_file_capped(dir.file("big.json"), 1000, "config.json").size() == 1000);
}

TEST_CASE("1.2 faults injected under pread surface as errors, never as data") {
    TempDir dir;
    write_bytes(dir.file("x.safetensors"), craft(kGood, 24));
    SafetensorsFile f(dir.file("x.safetensors"));
    std::vector<std::byte> dst(16, std::byte{0x55});

    // A device that returns at most 3 bytes per call: pread_exact keeps reading, the data is complete.
    detail::pread_hook = [](int fd, void* buf, std::size_t n, off_t off) { return ::pread(fd, buf, std::min<std::size_t>(n, 3), off); };
    f.read_into(f.get("a"), dst.data());
    CHECK(std::to_integer<int>(dst[0]) == 1);  // craft() data byte 0 is 0*7+1

    // A device that hits end of file early.
    detail::pread_hook = [](int, void*, std::size_t, off_t) -> ssize_t { return 0; };
    expect_error([&] { f.read_into(f.get("a"), dst.data()); }, {"x.safetensors", "unexpected end of file", "read of 16 bytes"});

    // A device error.
    detail::pread_hook = [](int, void*, std::size_t, off_t) -> ssize_t { errno = EIO; return -1; };
    expect_error([&] { f.read_into(f.get("b"), dst.data()); }, {"x.safetensors", "failed", "Input/output error"});
    detail::pread_hook = ::pread;
}

TEST_CASE("1.6 a two-shard checkpoint through model.safetensors.index.json, and its broken indexes") {
    TempDir dir;
    SafetensorsWriter s1, s2;
    std::vector<float> x = {1, 2, 3, 4};
    std::vector<float> y = {5, 6};
    s1.add("model.x", DType::F32, {4}, x);
    s2.add("model.y", DType::F32, {2}, y);
    s1.write(dir.file("model-00001-of-00002.safetensors"));
    s2.write(dir.file("model-00002-of-00002.safetensors"));
    const std::string idx = dir.file("model.safetensors.index.json");
    write_bytes(idx, R"({"metadata":{"total_size":24},"weight_map":{"model.x":"model-00001-of-00002.safetensors","model.y":"model-00002-of-00002.safetensors"}})");
    {
        Checkpoint ck(dir.path);
        CHECK(ck.shards().size() == 2);
        CHECK(ck.size() == 2);
        CHECK(to_f32(ck.read("model.x")) == x);
        CHECK(to_f32(ck.read("model.y")) == y);
        expect_error([&] { ck.get("model.z"); }, {"no tensor 'model.z'"});
    }
    write_bytes(idx, R"({"weight_map":{"model.x":"model-00003-of-00002.safetensors"}})");
    expect_error([&] { Checkpoint ck(dir.path); }, {"model.safetensors.index.json", "'model.x'", "model-00003-of-00002.safetensors", "does not exist"});
    write_bytes(idx, R"({"weight_map":{"model.q":"model-00001-of-00002.safetensors"}})");
    expect_error([&] { Checkpoint ck(dir.path); }, {"'model.q'", "whose header has no such tensor"});
    write_bytes(idx, R"({"weight_map":{"model.x":"../etc/passwd"}})");
    expect_error([&] { Checkpoint ck(dir.path); }, {"not a plain file name"});
    write_bytes(idx, R"({"weight_map":{"model.x":"."}})");  // the directory itself: refused, not read (exit 4)
    expect_error([&] { Checkpoint ck(dir.path); }, ErrorKind::format, {"weight_map['model.x'] = \".\" is not a plain file name"});
    write_bytes(idx, R"({"weight_map":{"model.x":"model-00001-of-00002.safetensors","model.x":"model-00002-of-00002.safetensors"}})");
    expect_error([&] { Checkpoint ck(dir.path); }, ErrorKind::format, {"key 'model.x' appears twice in the object weight_map"});
    write_bytes(idx, R"({"weight_map": 3})");
    expect_error([&] { Checkpoint ck(dir.path); }, {"field 'weight_map'"});
    write_bytes(idx, R"({"weight_map": )");
    expect_error([&] { Checkpoint ck(dir.path); }, {"not valid JSON"});
    std::filesystem::remove(idx);
    std::filesystem::create_directory(idx);  // an index that is a directory is refused (exit 2), not a failed read
    expect_error([&] { Checkpoint ck(dir.path); }, ErrorKind::format, {"model.safetensors.index.json: is a directory, not a regular file"});
    std::filesystem::remove(idx);
    std::filesystem::create_symlink("model.safetensors.index.json", dir.file("loop"));  // idx -> loop -> idx: refused naming the file
    std::filesystem::create_symlink("loop", idx);
    expect_error([&] { Checkpoint ck(dir.path); }, ErrorKind::format, {"model.safetensors.index.json: cannot open: Too many levels of symbolic links"});
    std::filesystem::remove(idx);
    std::filesystem::remove(dir.file("loop"));
    expect_error([&] { Checkpoint ck(dir.path); }, {"neither model.safetensors.index.json nor model.safetensors"});
    expect_error([&] { Checkpoint ck(dir.file("nothing-here")); }, {"not a directory"});
}

TEST_CASE("1.7 the writer refuses a byte count that does not match the shape, and writes atomically") {
    TempDir dir;
    SafetensorsWriter w;
    std::vector<float> three = {1, 2, 3};
    expect_error([&] { w.add("t", DType::F32, {4}, three); }, {"tensor 't'", "has 12 bytes but shape [4] needs 16"});
    w.add("t", DType::F32, {3}, three);
    w.write(dir.file("t.safetensors"));
    CHECK(!std::filesystem::exists(dir.file("t.safetensors.tmp")));
    CHECK(to_f32(SafetensorsFile(dir.file("t.safetensors")).read("t")) == three);
    // an empty tensor converts to an empty vector (no memcpy from or to a null pointer)
    SafetensorsWriter e;
    e.add("empty", DType::F32, {0, 5}, nullptr, 0);
    e.write(dir.file("e.safetensors"));
    CHECK(to_f32(SafetensorsFile(dir.file("e.safetensors")).read("empty")).empty());
    // a text file written onto a directory, or under an empty name, fails and leaves no NAME.tmp behind
    std::filesystem::create_directory(dir.file("adir"));
    expect_error([&] { SafetensorsWriter::write_text_atomic(dir.file("adir"), "x"); }, {"adir: is a directory"});
    CHECK(!std::filesystem::exists(dir.file("adir.tmp")));
    expect_error([&] { SafetensorsWriter::write_text_atomic("", "x"); }, {"empty name"});
    CHECK(!std::filesystem::exists(".tmp"));
    // a user's own NAME.tmp is never touched: the temporary file has a unique name, and is gone after
    std::ofstream(dir.file("mine.json.tmp")) << "the user's";
    SafetensorsWriter::write_text_atomic(dir.file("mine.json"), "new");
    CHECK(read_file_capped(dir.file("mine.json.tmp"), 100, "t") == "the user's");
    CHECK(read_file_capped(dir.file("mine.json"), 100, "t") == "new");
    std::size_t left = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path))
        left += e.path().filename().string().find(".tmp.") != std::string::npos;
    CHECK(left == 0);
    // a symlink is written through (its target replaced, the link kept); a dangling one is refused
    std::ofstream(dir.file("target.json")) << "old";
    std::filesystem::create_symlink(dir.file("target.json"), dir.file("link.json"));
    SafetensorsWriter::write_text_atomic(dir.file("link.json"), "through");
    CHECK(std::filesystem::is_symlink(dir.file("link.json")));
    CHECK(read_file_capped(dir.file("target.json"), 100, "t") == "through");
    std::filesystem::create_symlink(dir.file("nowhere.json"), dir.file("dangling.json"));
    expect_error([&] { SafetensorsWriter::write_text_atomic(dir.file("dangling.json"), "x"); }, {"dangling.json: is a symbolic link to a file that does not exist"});
    CHECK(!std::filesystem::exists(dir.file("nowhere.json")));
    // a character device is written as a device (never replaced by a regular file)
    SafetensorsWriter::write_text_atomic("/dev/null", "into the device");
    CHECK(!std::filesystem::is_regular_file("/dev/null"));
    expect_error([&] { w.write("/dev/null"); }, {"/dev/null: is not a regular file"});
    // Shape::numel refuses a product past 2^63 - 1 rather than wrapping
    expect_error([&] { Shape{1ll << 40, 1ll << 40}.numel(); }, {"shape [1099511627776, 1099511627776] has more elements than a 64-bit count holds"});
}
