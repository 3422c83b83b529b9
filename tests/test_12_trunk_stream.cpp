// Tests for chapter 12: trunk streaming. Section numbers match the chapter.
#include "../chapters/12_trunk_stream.hpp"
#include "../chapters/12a_pack_trunk.hpp"
#include "../chapters/12b_trunk_weights.hpp"
#include "../examples/cli/sizes.hpp"  // 12.1: sizes and presets are the command line's

#include <fstream>

#include "tiny.hpp"

using namespace kimik3;
using nlohmann::json;

namespace {

using test::TempDir;
using test::error_of;

const std::string kTiny = test::source_path("fixtures/tiny-k3");

// A file whose byte at offset o is (o * 7 + o / 251) & 0xFF: any misplaced byte is visible.
std::uint8_t pattern(std::uint64_t o) { return std::uint8_t((o * 7 + o / 251) & 0xFF); }

std::string make_pattern_file(const std::string& dir, std::size_t n) {
    const std::string path = dir + "/pattern.bin";
    std::vector<std::uint8_t> b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = pattern(i);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(n));
    return path;
}

}  // namespace

TEST_CASE("12.1 sizes and presets") {
    CHECK(cli::parse_size("8G") == 8'000'000'000ull);  // decimal, like every size the program prints
    CHECK(cli::parse_size("40M") == 40'000'000ull);
    CHECK(cli::parse_size("1.5G") == 1'500'000'000ull);
    CHECK(cli::parse_size("16GiB") == 16ull << 30);
    CHECK(cli::parse_size("4096") == 4096);
    CHECK(cli::preset_bytes("laptop") == 8'000'000'000ull);
    CHECK(cli::preset_bytes("server") == 128'000'000'000ull);
    for (const char* bad : {"", "8X", "-1G", "G", "1e30G", "8gb"})
        CHECK(error_of([&] { cli::parse_size(bad); }).find("is not a size") != std::string::npos);
    CHECK(error_of([] { cli::preset_bytes("phone"); }) == "unknown preset 'phone' (laptop 8G, desktop 32G, server 128G, auto)");
}

TEST_CASE("12.2 the census from a config alone equals the census of the bound checkpoint") {
    test::Tiny tiny;
    const Census a = take_census(tiny.ck, tiny.config, tiny.tensors), b = config_census(tiny.config);
    CHECK(a.layer_trunk_bytes == b.layer_trunk_bytes);
    CHECK(a.expert_bytes == b.expert_bytes);
    CHECK(a.expert_bytes_total == b.expert_bytes_total);
    CHECK(a.embed_bytes == b.embed_bytes);
    CHECK(a.per_token_bytes == b.per_token_bytes);
    CHECK(a.kda_state_bytes == b.kda_state_bytes);
    CHECK(a.bytes - a.other_bytes == b.bytes);  // the checkpoint also holds vision stubs
}

TEST_CASE("12.2 the real K3's floor is under 2 GB at a 4k context; budgets below it are refused with the floor") {
    const Config c = load_config(test::source_path("fixtures/k3-release/config.json"));
    const Census s = config_census(c);
    // 108.81 GB (kimi-k3-in-c's trunk file is the same size), from the release's shapes: 2,341,213,184 (layer 0) + 68 x 1,267,744,256 (KDA + MoE)
    // + 24 x 844,335,616 (MLA + MoE), the per-layer sizes worked out in test 2.7
    CHECK(s.trunk_bytes == 108'811'877'376ull);
    const Plan floor = make_plan(c, s, 0, PlanOptions{});
    CHECK(floor.floor < 2'000'000'000ull);  // 1.16 GB: state 465 MB, MLA cache 226 MB, small tensors as f32 62 MB, metadata of 500k tensors 350 MB
    CHECK(floor.state_bytes > 434'000'000ull);  // the KDA states alone are 434 MB (+ conv history)
    CHECK(plan_error_floor(floor).find("is below the floor of") != std::string::npos);
    // more memory never reads more: pinned bytes grow, bytes read per token shrink, largest units first
    std::uint64_t last_read = UINT64_MAX, last_pinned = 0;
    for (const std::string b : {"2G", "4G", "8G", "32G", "128G", "2T"}) {
        const Plan p = make_plan(c, s, cli::parse_size(b), PlanOptions{});
        CAPTURE(b);
        CHECK(p.total() <= p.budget);
        CHECK(p.trunk_read_per_token <= last_read);
        CHECK(p.pinned_bytes >= last_pinned);
        last_read = p.trunk_read_per_token, last_pinned = p.pinned_bytes;
    }
    const Plan laptop = make_plan(c, s, cli::preset_bytes("laptop"), PlanOptions{});
    CHECK(laptop.lm_head_pinned);  // 2.35 GB, the largest unit; then layer 0 (2.34 GB of matrices)
    CHECK(laptop.pinned[0]);
    CHECK(laptop.expert_slots >= 2);  // the trunk gets the memory first; experts stream two at a time
}

TEST_CASE("12.2 a batch of N conversations is planned: N carried states, N MLA caches, N rows of work buffers") {
    const Config c = load_config(test::source_path("fixtures/k3-release/config.json"));
    const Census s = config_census(c);
    const Plan one = make_plan(c, s, 0, PlanOptions{});
    PlanOptions o;
    o.sessions = 8;
    const Plan eight = make_plan(c, s, 0, o);
    CHECK(eight.sessions == 8);
    CHECK(eight.state_bytes == 8 * one.state_bytes);  // 465 MB of KDA state per conversation at K3
    CHECK(eight.kv_bytes == 8 * one.kv_bytes);        // 55 kB per position per conversation
    CHECK(eight.floor >= one.floor + 7 * (one.state_bytes + one.kv_bytes));
    CHECK(plan_error_floor(eight).find("and 8 conversations") != std::string::npos);
    CHECK(make_plan(c, s, one.floor, o).floor > one.floor);  // the one-conversation floor does not hold eight
}

TEST_CASE("12.2 a ring slot is never larger than the largest matrix, so a small model's floor is below all-resident") {
    // The tiny K3's largest matrix is well under 4 MiB: a 4 MiB chunk would be memory no read can use,
    // and the floor (3 such slots) would exceed the plan that keeps everything resident.
    test::Tiny tiny;
    const Census s = take_census(tiny.ck, tiny.config, tiny.tensors);
    const UnitBytes u = unit_bytes(tiny.config);
    REQUIRE(u.largest_matrix < (4u << 20));
    const Plan floor = make_plan(tiny.config, s, 0, PlanOptions{});
    CHECK(floor.chunk_bytes >= u.largest_matrix);
    CHECK(floor.chunk_bytes < u.largest_matrix + kPageAlign);
    const Plan all = make_plan(tiny.config, s, 1'000'000'000ull, PlanOptions{});
    REQUIRE(all.pinned_layers() == tiny.config.num_hidden_layers);
    REQUIRE(all.lm_head_pinned);
    CHECK(all.ring_bytes == 0);
    const std::uint64_t all_but_cache = all.total() - all.expert_bytes;  // everything pinned, experts streamed
    CHECK(floor.floor < all_but_cache + floor.expert_bytes);
    // at K3's widths the 4 MiB minimum still holds
    const Config k3 = load_config(test::source_path("fixtures/k3-release/config.json"));
    CHECK(make_plan(k3, config_census(k3), 0, PlanOptions{}).chunk_bytes >= (4u << 20));
}

TEST_CASE("12.3 the ring hands out exactly the requested bytes; prefetching follows the learned schedule") {
    TempDir d;
    const std::string path = make_pattern_file(d.path, 1 << 20);
    Fd fd = open_read(path);
    PieceSource src{fd.get(), ::open(path.c_str(), O_RDONLY | O_DIRECT), &path};
    for (int slots : {1, 2, 3}) {
        PieceRing ring(slots, 8192, true);
        std::vector<Piece> pieces;
        for (std::uint32_t i = 0; i < 40; ++i) pieces.push_back(Piece{i % 5, i, 1000 + 7919ull * i, 5000 + (i % 3) * 1000, &src});
        for (int pass = 0; pass < 3; ++pass)
            for (const Piece& p : pieces) {
                const std::byte* b = ring.acquire(p);
                std::size_t wrong = 0;
                for (std::size_t i = 0; i < p.nbytes; ++i) wrong += std::uint8_t(b[i]) != pattern(p.offset + i);
                std::this_thread::sleep_for(std::chrono::microseconds(50));  // let the reader run meanwhile
                for (std::size_t i = 0; i < p.nbytes; ++i) wrong += std::uint8_t(b[i]) != pattern(p.offset + i);  // still intact
                REQUIRE(wrong == 0);
                ring.release(p);
            }
        const RingStats st = ring.stats();
        CAPTURE(slots);
        CHECK(st.busy_slot_reads == 0);  // the reader never aimed at a slot in use (kimi-k3-in-c's reader with a single slot did, and produced wrong tokens)
        CHECK(st.mismatches == 0);
        if (slots > 1) CHECK(st.prefetched > 0);  // passes 2 and 3 were read ahead
    }
    ::close(src.direct_fd);
}

TEST_CASE("12.3 a failed read surfaces as an error at acquire, and the ring recovers") {
    TempDir d;
    const std::string path = make_pattern_file(d.path, 1 << 16);
    Fd fd = open_read(path);
    PieceSource src{fd.get(), -1, &path};
    PieceRing ring(2, 8192, false);
    const Piece p{0, 0, 100, 4000, &src};
    detail::pread_hook = [](int, void*, std::size_t, off_t) -> ssize_t { errno = EIO; return -1; };
    CHECK(error_of([&] { ring.acquire(p); }).find("Input/output error") != std::string::npos);
    detail::pread_hook = ::pread;
    const std::byte* b = ring.acquire(p);
    CHECK(std::uint8_t(b[0]) == pattern(100));
    ring.release(p);
    const Piece past_end{0, 1, (1 << 16) - 100, 4000, &src};  // a piece that runs off the file
    CHECK(error_of([&] { ring.acquire(past_end); }).find("unexpected end of file") != std::string::npos);
}

TEST_CASE("12.4 pack-trunk: aligned layer runs holding the shard bytes verbatim; load_trunk checks them") {
    test::Tiny tiny;
    TempDir d;
    const TrunkLayout t = pack_trunk(tiny.tensors, d.path, {});
    CHECK(t.layers.size() == 13);
    CHECK(std::filesystem::exists(d.path + "/trunk.json"));
    CHECK(!std::filesystem::exists(d.path + "/trunk.bin.tmp"));
    Fd fd = open_read(d.path + "/trunk.bin");
    for (std::size_t l = 0; l < 13; ++l) {
        CHECK(t.layers[l].file_off % 4096 == 0);
        for (const Checkpoint::Ref* r : tiny.tensors.layers[l].all) {
            std::vector<std::byte> got(r->info->nbytes());
            pread_exact(fd.get(), got.data(), got.size(), t.tensor_off.at(r->info->name), "trunk.bin");
            REQUIRE(std::memcmp(got.data(), tiny.bytes(r), got.size()) == 0);
        }
    }
    const TrunkLayout loaded = load_trunk(d.path, tiny.tensors);
    CHECK(loaded.tensor_off == t.tensor_off);
    // a trunk.json from another model (a tensor's size changed) is refused
    json j = json::parse(std::ifstream(d.path + "/trunk.json"));
    j["layers"][2]["tensors"]["language_model.model.layers.2.self_attn.dt_bias"]["nbytes"] = 4;
    std::ofstream(d.path + "/trunk.json") << j.dump();
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("the trunk was packed from another model") != std::string::npos);
    // a truncated trunk.bin is refused
    pack_trunk(tiny.tensors, d.path, {});
    ::truncate((d.path + "/trunk.bin").c_str(), 4096);
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("trunk.bin is 4096 bytes") != std::string::npos);
    // fields of the wrong JSON type, a missing one, or nesting past the bound: refused as malformed, never a crash
    pack_trunk(tiny.tensors, d.path, {});
    json wrong = json::parse(std::ifstream(d.path + "/trunk.json"));
    wrong["layers"][3] = "not a layer";
    std::ofstream(d.path + "/trunk.json", std::ios::trunc) << wrong.dump();
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("trunk.json: malformed (cannot use value() with string)") != std::string::npos);
    pack_trunk(tiny.tensors, d.path, {});
    wrong = json::parse(std::ifstream(d.path + "/trunk.json"));
    wrong["layers"][4].erase("tensors");
    std::ofstream(d.path + "/trunk.json", std::ios::trunc) << wrong.dump();
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("trunk.json: malformed (key 'tensors' not found)") != std::string::npos);
    std::ofstream(d.path + "/trunk.json", std::ios::trunc) << R"({"format":"kimik3-trunk","version":1,"layers":)" << std::string(100000, '[');
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("nested more than 64 levels deep") != std::string::npos);
    // an interrupted pack leaves no trunk.json: nothing looks complete
    std::filesystem::remove(d.path + "/trunk.json");
    CHECK(error_of([&] { load_trunk(d.path, tiny.tensors); }).find("cannot open (run kimik3 pack-trunk first)") != std::string::npos);
}

TEST_CASE("12.3 bytes that arrive at an unaligned offset are moved to the buffer's start, once") {
    // A valid shard may start its data section at an odd byte; an O_DIRECT read then leaves a tensor at
    // buf + skew with skew odd, and every bf16/f32 load from it would be misaligned (undefined).
    AlignedBuffer b(2 * kPageAlign);
    for (int i = 0; i < 100; ++i) b.data()[5 + i] = std::byte(i);
    CHECK(detail::align_piece(b.data(), 5, 100) == 0);
    for (int i = 0; i < 100; ++i) REQUIRE(std::to_integer<int>(b.data()[i]) == i);
    b.data()[32] = std::byte{7};
    CHECK(detail::align_piece(b.data(), 32, 100) == 32);  // already aligned for any element type: untouched
    CHECK(std::to_integer<int>(b.data()[32]) == 7);
}

TEST_CASE("12.4 pack-trunk refuses a layer whose tensors are not one contiguous run") {
    test::Tiny tiny;
    TempDir d;
    // rewrite the tiny K3 with layer 2's dt_bias moved to the end of the file
    SafetensorsWriter w;
    std::vector<std::string> names;
    for (const auto& [name, ref] : tiny.ck.tensors()) names.push_back(name);
    std::sort(names.begin(), names.end());
    const std::string moved = "language_model.model.layers.2.self_attn.dt_bias";
    for (const std::string& n : names)
        if (n != moved) {
            const Tensor t = tiny.ck.read(n);
            w.add(n, t.info.dtype, t.info.shape, t.bytes.data(), t.info.nbytes());
        }
    const Tensor t = tiny.ck.read(moved);
    w.add(moved, t.info.dtype, t.info.shape, t.bytes.data(), t.info.nbytes());
    w.write(d.path + "/model.safetensors");
    std::filesystem::copy_file(kTiny + "/config.json", d.path + "/config.json");
    Checkpoint ck(d.path);
    const ModelTensors m = bind_tensors(ck, tiny.config);
    const std::string msg = error_of([&] { pack_trunk(m, d.path + "/out", {}); });
    CAPTURE(msg);
    CHECK(msg.find("layer 2's non-expert tensors are not one contiguous run") != std::string::npos);
    CHECK(!std::filesystem::exists(d.path + "/out/trunk.json"));
}

TEST_CASE("12.5 embedding rows read on demand equal the resident table's") {
    test::Tiny tiny;
    const Census s = take_census(tiny.ck, tiny.config, tiny.tensors);
    Plan all = make_plan(tiny.config, s, 1ull << 40, PlanOptions{});
    Plan floor = make_plan(tiny.config, s, 0, PlanOptions{});
    floor.budget = floor.floor;
    REQUIRE(all.embed_resident);
    REQUIRE(!floor.embed_resident);
    TrunkWeights a(tiny.tensors, all, nullptr, true), b(tiny.tensors, floor, nullptr, true);
    std::vector<float> ra(128), rb(128);
    for (std::int64_t id : {0, 1, 255, 479, 511}) {
        a.embed_row(ra.data(), id);
        b.embed_row(rb.data(), id);
        CHECK_BITS_EQ(ra, rb);
    }
    CHECK(error_of([&] { b.embed_row(rb.data(), 512); }) == "token id 512 is outside the vocabulary (512)");
}

TEST_CASE("12.5 a streamed matrix reads a row range alone (chapter 17's ranks): the range's bytes, and only them") {
    test::Tiny tiny;
    const Census s = take_census(tiny.ck, tiny.config, tiny.tensors);
    const Plan all = make_plan(tiny.config, s, 1ull << 40, PlanOptions{});
    PlanOptions small;
    small.chunk_bytes = 4096;  // several pieces per range
    Plan floor = make_plan(tiny.config, s, 0, small);
    floor.budget = floor.floor;
    TrunkWeights a(tiny.tensors, all, nullptr, true), b(tiny.tensors, floor, nullptr, true);
    const MatrixRef whole = a.lm_head(), streamed = b.lm_head();
    REQUIRE(whole.data != nullptr);
    REQUIRE(streamed.stream != nullptr);
    const std::size_t rb = whole.row_bytes(), lo = 37, hi = whole.rows - 11;
    for (int pass = 0; pass < 2; ++pass) {  // the second pass: the ring has learned the range's pieces
        const std::uint64_t before = b.ring_stats().bytes;
        std::size_t next = lo, wrong = 0;
        for_each_rows(streamed, lo, hi, [&](std::size_t r0, std::size_t r1, const void* rows) {
            wrong += r0 != next || std::memcmp(rows, static_cast<const std::byte*>(whole.data) + r0 * rb, (r1 - r0) * rb) != 0;
            next = r1;
        });
        CHECK(wrong == 0);
        CHECK(next == hi);
        if (pass == 0) CHECK(b.ring_stats().bytes - before == (hi - lo) * rb);  // nothing outside the range was read
    }
    std::size_t rows = 0;  // the whole matrix still streams whole
    for_each_rows(streamed, 0, streamed.rows, [&](std::size_t r0, std::size_t r1, const void*) { rows += r1 - r0; });
    CHECK(rows == streamed.rows);
    const std::string e = error_of([&] { for_each_rows(streamed, 0, 5, [](std::size_t, std::size_t, const void*) {}); });
    CHECK(e.find("one row range per stream") != std::string::npos);
}
