// Tests for chapter 02: config, binding and the census. Section numbers match the chapter.
#include "../chapters/01b_writer.hpp"
#include "../chapters/02_config.hpp"

#include <fstream>
#include <functional>

#include "fixture.hpp"

using namespace kimik3;
using nlohmann::json;

namespace {

using test::TempDir;
using test::error_of;

const std::string kTiny = test::source_path("fixtures/tiny-k3");

json read_json(const std::string& path) {
    std::ifstream f(path);
    REQUIRE(f.good());
    return json::parse(f);
}

// Walks a dotted path ("text_config.linear_attn_config.head_dim") to its parent object and last key.
std::pair<json*, std::string> walk(json& j, const std::string& path) {
    json* cur = &j;
    std::size_t start = 0, dot;
    while ((dot = path.find('.', start)) != std::string::npos) {
        cur = &(*cur)[path.substr(start, dot - start)];
        start = dot + 1;
    }
    return {cur, path.substr(start)};
}

// Rewrites the tiny K3 into one model.safetensors under dir, letting `edit` change, drop or add tensors.
void write_edited_tiny(const std::string& dir, const std::function<void(const std::string&, const Tensor&, SafetensorsWriter&)>& edit) {
    Checkpoint ck(kTiny);
    std::vector<std::string> names;
    for (const auto& [name, ref] : ck.tensors()) names.push_back(name);
    std::sort(names.begin(), names.end());
    SafetensorsWriter w;
    for (const std::string& n : names) edit(n, ck.read(n), w);
    w.write(dir + "/model.safetensors");
    std::filesystem::copy_file(kTiny + "/config.json", dir + "/config.json");
}

void keep(const std::string& n, const Tensor& t, SafetensorsWriter& w) { w.add(n, t.info.dtype, t.info.shape, t.bytes.data(), t.info.nbytes()); }

}  // namespace

TEST_CASE("2.2 the tiny K3 config: every dimension of docs/kimi-k3.md 3.10 and the schedule KKKMKKKMKKKMM") {
    const Config c = load_config(kTiny);
    CHECK(c.hidden_size == 128);
    CHECK(c.num_hidden_layers == 13);
    CHECK(c.vocab_size == 512);
    CHECK(c.kda_num_heads == 4);
    CHECK(c.kda_head_dim == 32);
    CHECK(c.kda_width() == 128);
    CHECK(c.mla_qk_head_dim() == 48);
    CHECK(c.mla_cache_width() == 48);
    CHECK(c.num_experts == 16);
    CHECK(c.num_experts_per_token == 4);
    CHECK(c.shared_width() == 64);
    CHECK(c.gate_lower_bound == -5.0f);
    CHECK(c.situ_beta == 4.0f);
    CHECK(c.situ_linear_beta == 25.0f);
    CHECK(c.eos_token_id == 482);
    CHECK(c.schedule_string() == "KKKMKKKMKKKMM");
    CHECK(c.layers[0].ffn == FfnKind::Dense);
    for (int l = 1; l < 13; ++l) CHECK(c.layers[std::size_t(l)].ffn == FfnKind::MoE);
    for (int l = 0; l < 13; ++l) CHECK(c.layers[std::size_t(l)].bank == (l % 4 == 0));
    CHECK(describe_schedule(c) ==
          "attention KKKMKKKMKKKMM (K = KDA x9, M = MLA x4)\nffn       DEEEEEEEEEEEE (D = dense x1, E = latent MoE x12)\n"
          "AttnRes   banks at layers 0 4 8 12 (block size 4)");
}

TEST_CASE("2.4 the release config: 69 KDA + 24 MLA, the last two layers both MLA, banks every 12 (trap 5.1.11 of docs/kimi-k3.md)") {
    const Config c = load_config(test::source_path("fixtures/k3-release/config.json"));
    CHECK(c.count(AttnKind::KDA) == 69);
    CHECK(c.count(AttnKind::MLA) == 24);
    const std::string s = c.schedule_string();
    CHECK(s.substr(0, 8) == "KKKMKKKM");
    CHECK(s.substr(88) == "KKKMM");  // layers 88..92: 91 and 92 are MLA
    int banks = 0;
    for (const LayerPlan& p : c.layers) banks += p.bank;
    CHECK(banks == 8);  // 0, 12, ..., 84
    CHECK(c.mla_cache_width() == 576);
    CHECK(c.kda_width() == 12288);
    CHECK(c.shared_width() == 6144);
}

TEST_CASE("2.2 a flat text config (no nesting) is read the same way") {
    json j = read_json(kTiny + "/config.json");
    json flat = j["text_config"];
    const Config a = parse_config(j, "nested"), b = parse_config(flat, "flat");
    CHECK(a.schedule_string() == b.schedule_string());
    CHECK(a.hidden_size == b.hidden_size);
    CHECK(b.eos_token_id == 482);
}

TEST_CASE("2.2 null betas follow Moonshot's code: beta1 null -> 1.0, beta2 null -> identity (0 here)") {
    json j = read_json(kTiny + "/config.json");
    j["text_config"]["activation_situ_beta"] = nullptr;
    j["text_config"]["activation_situ_linear_beta"] = nullptr;
    const Config c = parse_config(j, "x");
    CHECK(c.situ_beta == 1.0f);
    CHECK(c.situ_linear_beta == 0.0f);
}

TEST_CASE("2.3 every refusal fixture produces its message (fixtures/configs/refusals.json)") {
    const json cases = read_json(test::source_path("fixtures/configs/refusals.json"))["cases"];
    REQUIRE(cases.size() >= 20);
    for (const json& k : cases) {
        json cfg = read_json(kTiny + "/config.json");
        if (k.contains("set"))
            for (const auto& [path, value] : k["set"].items()) {
                auto [parent, key] = walk(cfg, path);
                (*parent)[key] = value;
            }
        if (k.contains("remove"))
            for (const auto& path : k["remove"]) {
                auto [parent, key] = walk(cfg, path.get<std::string>());
                parent->erase(key);
            }
        const std::string msg = error_of([&] { parse_config(cfg, "config.json"); });
        CAPTURE(k["rule"].get<std::string>());
        CAPTURE(msg);
        CHECK(msg.rfind("config.json: the config is refused", 0) == 0);
        for (const auto& part : k["expect"]) CHECK(msg.find(part.get<std::string>()) != std::string::npos);
    }
}

TEST_CASE("2.3 what Moonshot's code runs is accepted: any width, KDA heads > head_dim, top-1, no renormalising, bounds -5..0") {
    const json base = read_json(kTiny + "/config.json");
    const std::vector<std::pair<const char*, json>> accepted = {
        {"text_config.hidden_size", 168},
        {"text_config.linear_attn_config.head_dim", 24},
        {"text_config.qk_nope_head_dim", 24},
        {"text_config.qk_rope_head_dim", 8},
        {"text_config.v_head_dim", 40},
        {"text_config.intermediate_size", 100},
        {"text_config.linear_attn_config.num_heads", 40},  // more heads than head_dim (32)
        {"text_config.num_experts_per_token", 1},
        {"text_config.moe_renormalize", false},
        {"text_config.latent_moe_use_norm", false},
        {"text_config.linear_attn_config.gate_lower_bound", -5.0},
        {"text_config.linear_attn_config.gate_lower_bound", -0.25},
    };
    for (const auto& entry : accepted) {
        const char* path = entry.first;  // not a structured binding: clang 14 cannot capture one (CAPTURE is a lambda)
        json cfg = base;
        auto [parent, key] = walk(cfg, path);
        (*parent)[key] = entry.second;
        CAPTURE(path);
        CHECK_NOTHROW(parse_config(cfg, "config.json"));
    }
    json top1 = base;
    top1["text_config"]["num_experts_per_token"] = 1;
    top1["text_config"]["moe_renormalize"] = false;
    const Config c = parse_config(top1, "config.json");
    CHECK(c.num_experts_per_token == 1);
    CHECK(!c.moe_renormalize);
}

TEST_CASE("2.2 unreadable configs: a missing file and invalid JSON are named") {
    TempDir d;
    CHECK(error_of([&] { load_config(d.path); }).find("config.json: cannot open: No such file or directory") != std::string::npos);
    std::ofstream(d.path + "/config.json") << "{\"text_config\": ";
    CHECK(error_of([&] { load_config(d.path); }).find("config.json: not valid JSON") != std::string::npos);
}

TEST_CASE("2.2 hostile configs: caps on counts, bounded nesting and messages, numbers that fit, nonsense refused") {
    const json base = read_json(kTiny + "/config.json");
    auto refused = [&](const std::function<void(json&)>& edit) {
        json j = base;
        edit(j);
        return error_of([&] { parse_config(j, "config.json"); });
    };
    // a count far past K3's is refused at once, with a short message (1e8 layers took 23 s, 3.4 GB and an
    // 889 MB message; 1e9 ended in std::bad_alloc)
    const std::string layers = refused([](json& j) { j["text_config"]["num_hidden_layers"] = 100000000; });
    CHECK(layers.find("text_config.num_hidden_layers: 100000000 is more than 1024") != std::string::npos);
    CHECK(layers.size() < 400);
    CHECK(refused([](json& j) { j["text_config"]["hidden_size"] = 1 << 30; }).find("hidden_size: 1073741824 is more than 1048576") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["linear_attn_config"]["kda_layers"] = std::vector<int>(5000, 1); })
              .find("kda_layers: 5000 elements, more than 1024") != std::string::npos);
    // a problem list names the first 20 problems, then how many more
    const std::string many = refused([](json& j) {
        for (const char* k : {"hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                              "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_layer_freq", "num_experts", "num_experts_per_token",
                              "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size", "hidden_act", "mla_use_nope",
                              "mla_use_output_gate", "latent_moe_use_norm", "moe_router_activation_func", "moe_renormalize", "num_key_value_heads"})
            j["text_config"][k] = json::array();
    });
    CHECK(many.find("and ") != std::string::npos);
    CHECK(many.find(" more") != std::string::npos);
    // a long partition problem lists ten layers and a count
    const std::string part = refused([](json& j) {
        j["text_config"]["num_hidden_layers"] = 1000;
    });
    CHECK(part.find("missing [14,15,16,17,18,19,20,21,22,23, and 977 more]") != std::string::npos);
    // values that read but cannot be right
    CHECK(refused([](json& j) { j["text_config"]["rms_norm_eps"] = 1e300; }).find("rms_norm_eps: 1e+300 does not fit a 32-bit float") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["rms_norm_eps"] = 0.5; }).find("rms_norm_eps: 0.500000 is more than 0.01") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["activation_situ_beta"] = 0; }).find("activation_situ_beta: must be positive") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["activation_situ_beta"] = -4; }).find("activation_situ_beta: must be positive") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["activation_situ_linear_beta"] = 0; }).find("activation_situ_linear_beta: must be positive") !=
          std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["routed_scaling_factor"] = 0; }).find("routed_scaling_factor: must be positive") != std::string::npos);
    CHECK(refused([](json& j) { j["text_config"]["routed_scaling_factor"] = -2.5; }).find("routed_scaling_factor: must be positive") != std::string::npos);
    // a group_size far outside an int is compared as JSON, never converted (a double -> int past INT_MAX is undefined)
    CHECK(refused([](json& j) { j["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 1e300; })
              .find("group_size 32 (MXFP4)") != std::string::npos);
    // the MLA cache width kv_lora_rank + qk_rope_head_dim stays in an int
    CHECK(refused([](json& j) { j["text_config"]["kv_lora_rank"] = 1 << 20, j["text_config"]["qk_rope_head_dim"] = 1 << 20; })
              .find("kv_lora_rank + qk_rope_head_dim: 2097152 is more than 1048576") != std::string::npos);
    // a bad value is quoted in part: a 1 MB string, a 100,000-element list
    const std::string quoted = refused([](json& j) { j["text_config"]["hidden_act"] = std::vector<int>(100000, 1); });
    CHECK(quoted.find("hidden_act: [1,1,1,1") != std::string::npos);
    CHECK(quoted.size() < 400);
}

TEST_CASE("2.2 load_config: regular files only, capped, bounded JSON (deep nesting, 1e400, NUL, a 100,000-deep field)") {
    TempDir d;
    auto write = [&](const std::string& text) { std::ofstream(d.path + "/config.json", std::ios::binary | std::ios::trunc) << text; };
    std::string tiny;
    {
        std::ifstream f(kTiny + "/config.json");
        tiny.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    auto with = [&](const std::string& from, const std::string& to) {
        std::string t = tiny;
        const std::size_t at = t.find(from);
        REQUIRE(at != std::string::npos);
        return t.replace(at, from.size(), to);
    };
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    write(with("\"hidden_size\": 128", "\"hidden_size\": " + deep));  // was: exit 139 (stack overflow printing it)
    CHECK(error_of([&] { load_config(d.path); }).find("config.json: text_config.hidden_size[0][0]") != std::string::npos);
    write(with("\"kda_layers\": [", "\"kda_layers\": [" + deep + ","));
    CHECK(error_of([&] { load_config(d.path); }).find("nested more than 64 levels deep") != std::string::npos);
    write(with("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 1e400"));
    CHECK(error_of([&] { load_config(d.path); }).find("the number \"1e400\" is out of range") != std::string::npos);
    write(with("\"hidden_size\": 128", "\"hidden_size\": 128, \"hidden_size\": 256"));
    CHECK(error_of([&] { load_config(d.path); }).find("key 'hidden_size' appears twice in the object text_config") != std::string::npos);
    write(tiny + std::string(17u << 20, ' '));  // 17 MiB of padding: over the 16 MiB cap, refused before it is read
    CHECK(error_of([&] { load_config(d.path); }).find("more than the 16777216 a config.json may hold") != std::string::npos);
    std::filesystem::remove(d.path + "/config.json");
    std::filesystem::create_symlink("/dev/zero", d.path + "/config.json");  // was: read until memory ran out
    CHECK(error_of([&] { load_config(d.path); }).find("config.json: is a character device, not a regular file") != std::string::npos);
}

TEST_CASE("2.6 binding the tiny K3: every tensor found; experts located, contiguous, stored out of id order") {
    const Config c = load_config(kTiny);
    Checkpoint ck(kTiny);
    const ModelTensors m = bind_tensors(ck, c);
    CHECK(m.layers.size() == 13);
    CHECK(m.layers[0].gate_proj != nullptr);
    CHECK(m.layers[0].q_proj != nullptr);
    CHECK(m.layers[3].q_a_proj != nullptr);
    CHECK(m.layers[3].q_proj == nullptr);
    CHECK(m.layers[3].A_log == nullptr);
    CHECK(m.layers[1].A_log->info->shape == Shape{32});  // stored [head_dim] like the release; 4 heads read
    CHECK(m.expert_bytes == 3 * (64 * 32 + 64 * 2));
    CHECK(m.experts[0].empty());
    bool out_of_order = false;
    for (int l = 1; l < 13; ++l) {
        REQUIRE(m.experts[std::size_t(l)].size() == 16);
        for (int e = 0; e < 16; ++e) {
            const ExpertLocation& x = m.experts[std::size_t(l)][std::size_t(e)];
            CHECK(x.contiguous);
            CHECK(x.span_bytes == m.expert_bytes);
            if (e > 0) out_of_order |= x.span_offset < m.experts[std::size_t(l)][std::size_t(e - 1)].span_offset;
        }
    }
    CHECK(out_of_order);  // like the release (docs/kimi-k3.md 2.2): id order is not disk order
}

TEST_CASE("2.6 binding refuses a missing tensor, a wrong shape or dtype, a missing scale, and stray MXFP4") {
    struct Case {
        const char* what;
        std::function<void(const std::string&, const Tensor&, SafetensorsWriter&)> edit;
        std::vector<std::string> expect;
    };
    const std::vector<Case> cases = {
        {"missing tensor",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             if (n != "language_model.model.layers.2.self_attn.dt_bias") keep(n, t, w);
         },
         {"language_model.model.layers.2.self_attn.dt_bias: missing (expected F32 (or BF16/F16) [128])"}},
        {"wrong shape",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             if (n == "language_model.model.layers.5.self_attn.o_norm.weight") {
                 std::vector<float> v(16, 1.0f);
                 w.add(n, DType::F32, {16}, v);
             } else keep(n, t, w);
         },
         {"language_model.model.layers.5.self_attn.o_norm.weight: expected F32 (or BF16/F16) [32], found F32 [16]"}},
        {"wrong dtype (F32 and F16 are accepted; an integer type is not)",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             if (n == "language_model.model.norm.weight") {
                 std::vector<std::int32_t> v(128, 1);
                 w.add(n, DType::I32, {128}, v);
             } else keep(n, t, w);
         },
         {"language_model.model.norm.weight: expected BF16 (or F16/F32) [128], found I32 [128]"}},
        {"A_log shorter than num_heads",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             if (n == "language_model.model.layers.4.self_attn.A_log") {
                 std::vector<float> v(3, 0.5f);
                 w.add(n, DType::F32, {3}, v);
             } else keep(n, t, w);
         },
         {"language_model.model.layers.4.self_attn.A_log: expected F32 (or BF16/F16) [n >= 4], found F32 [3]"}},
        {"expert without its scale",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             if (n != "language_model.model.layers.7.block_sparse_moe.experts.11.w2.weight_scale") keep(n, t, w);
         },
         {"language_model.model.layers.7.block_sparse_moe.experts.11.w2.weight_scale: missing (expected U8 [64, 2])"}},
        {"weight_packed outside the experts",
         [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
             keep(n, t, w);
             if (n == "language_model.lm_head.weight") {
                 std::vector<std::uint8_t> v(8);
                 w.add("language_model.model.layers.1.self_attn.q_proj.weight_packed", DType::U8, {8}, v);
             }
         },
         {"language_model.model.layers.1.self_attn.q_proj.weight_packed: MXFP4 weight_packed outside the routed experts"}},
    };
    const Config c = load_config(kTiny);
    for (const Case& k : cases) {
        TempDir d;
        write_edited_tiny(d.path, k.edit);
        Checkpoint ck(d.path);
        const std::string msg = error_of([&] { bind_tensors(ck, c); });
        CAPTURE(k.what);
        CAPTURE(msg);
        CHECK(msg.find("the checkpoint does not match its config") != std::string::npos);
        for (const std::string& e : k.expect) CHECK(msg.find(e) != std::string::npos);
    }
}

TEST_CASE("2.7 the tiny K3 census agrees with the shard files") {
    const Config c = load_config(kTiny);
    Checkpoint ck(kTiny);
    const ModelTensors m = bind_tensors(ck, c);
    const Census s = take_census(ck, c, m);
    // everything in the census is in the files, and the files hold nothing else but data + headers
    std::uint64_t file_data = 0;
    for (const auto& sh : ck.shards()) file_data += sh->size() - sh->header().data_start;
    CHECK(s.bytes == file_data);
    CHECK(s.embed_bytes + s.lm_head_bytes + s.final_bytes + s.trunk_bytes + s.expert_bytes_total + s.other_bytes == s.bytes);
    CHECK(s.expert_count == 12 * 16);
    CHECK(s.other_tensors == 2);  // the vision stubs, skipped by the text model
    // per-layer trunk bytes, counted here a second way: by name prefix over the whole checkpoint
    for (int l = 0; l < 13; ++l) {
        const std::string p = "language_model.model.layers." + std::to_string(l) + ".";
        std::uint64_t b = 0;
        for (const auto& [name, ref] : ck.tensors())
            if (name.rfind(p, 0) == 0 && name.find(".experts.") == std::string::npos) b += ref.info->nbytes();
        CHECK(s.layer_trunk_bytes[std::size_t(l)] == b);
    }
    CHECK(s.per_token_bytes == s.trunk_bytes + 256 + s.lm_head_bytes + s.final_bytes + 12 * 4 * s.expert_bytes);
}

TEST_CASE("2.7 a real-size header-only K3 (sparse data): the census matches docs/kimi-k3.md section 2 byte for byte") {
    // Four layers of the release's real geometry (dense+KDA, MoE+KDA, MoE+KDA, MoE+MLA), all 896 experts
    // per MoE layer, in two shards whose data regions are holes: ~57 GB of apparent size, no disk used.
    json j = read_json(test::source_path("fixtures/k3-release/config.json"));
    j["text_config"]["num_hidden_layers"] = 4;
    j["text_config"]["linear_attn_config"]["kda_layers"] = {1, 2, 3};
    j["text_config"]["linear_attn_config"]["full_attn_layers"] = {4};
    const Config c = parse_config(j, "k3-4-layers");
    TempDir d;
    std::ofstream(d.path + "/config.json") << j.dump();
    SafetensorsWriter w1, w2;
    json index = {{"weight_map", json::object()}};
    auto put = [&](SafetensorsWriter& w, const std::string& file, const std::string& name, DType dt, const Shape& sh) {
        w.add_sparse(name, dt, sh);
        index["weight_map"][name] = file;
    };
    const std::string f1 = "model-00001-of-00002.safetensors", f2 = "model-00002-of-00002.safetensors";
    put(w1, f1, "language_model.model.embed_tokens.weight", DType::BF16, {163840, 7168});
    const auto parts = expert_part_shapes(c);
    for (int l = 0; l < 4; ++l) {
        SafetensorsWriter& w = l < 2 ? w1 : w2;
        const std::string& f = l < 2 ? f1 : f2;
        for (const Expected& e : expected_layer_tensors(c, l)) put(w, f, e.name, e.dtypes[0], e.shape);
        if (l > 0)
            for (int e = 0; e < 896; ++e)
                for (int p = 0; p < 6; ++p) put(w, f, expert_name(l, e, p), DType::U8, parts[std::size_t(p)]);
    }
    put(w2, f2, "language_model.model.norm.weight", DType::BF16, {7168});
    put(w2, f2, "language_model.model.output_attn_res_norm.weight", DType::BF16, {7168});
    put(w2, f2, "language_model.model.output_attn_res_proj.weight", DType::BF16, {1, 7168});
    put(w2, f2, "language_model.lm_head.weight", DType::BF16, {163840, 7168});
    w1.write(d.path + "/" + f1);
    w2.write(d.path + "/" + f2);
    std::ofstream(d.path + "/model.safetensors.index.json") << index.dump();

    Checkpoint ck(d.path);
    const ModelTensors m = bind_tensors(ck, c);
    const Census s = take_census(ck, c, m);
    CHECK(m.expert_bytes == 17'547'264);  // docs/kimi-k3.md 2.2: 3 x (5,505,024 + 344,064)
    CHECK(m.experts[1][0].contiguous);
    // Worked by hand from docs/kimi-k3.md 2.2 (bf16 = 2 bytes, F32 = 4):
    //   norms + AttnRes: 6 x 7168 x 2                                            =        86,016
    //   KDA: (4 x 12288x7168 + 7168x12288 + 128x7168 + 12288x128 + 96x7168) x 2    =   887,160,832
    //        + F32 (3 x 12288x4 + 128 + 12288 + 128) x 4                          =       640,000
    //   dense FFN (layer 0): 3 x 33792 x 7168 x 2                                 = 1,453,326,336
    //   MoE trunk: (896x7168 + 2 x 3584x7168 + 3584 + 3 x 6144x7168) x 2 + 896 x 4 =   379,857,408
    //   MLA: (1536x7168 + 1536 + 18432x1536 + 576x7168 + 512 + 24576x512 + 2 x 12288x7168) x 2 = 464,392,192
    CHECK(s.layer_trunk_bytes[0] == 86'016ull + 887'160'832 + 640'000 + 1'453'326'336);  // 2.34 GB, the largest layer
    CHECK(s.layer_trunk_bytes[1] == 86'016ull + 887'160'832 + 640'000 + 379'857'408);
    CHECK(s.layer_trunk_bytes[2] == s.layer_trunk_bytes[1]);
    CHECK(s.layer_trunk_bytes[3] == 86'016ull + 464'392'192 + 379'857'408);
    CHECK(s.embed_bytes == 163840ull * 7168 * 2);
    CHECK(s.lm_head_bytes == s.embed_bytes);
    CHECK(s.expert_count == 3 * 896);
    CHECK(s.expert_bytes_total == 3ull * 896 * 17'547'264);
    std::uint64_t file_data = 0;
    for (const auto& sh : ck.shards()) file_data += sh->size() - sh->header().data_start;
    CHECK(s.bytes == file_data);
    // The full 93-layer trunk extrapolated from these per-kind sizes: 108.81 GB, the size of kimi-k3-in-c's trunk file.
    const double trunk93 = double(s.layer_trunk_bytes[0]) + 68.0 * double(s.layer_trunk_bytes[1]) + 24.0 * double(s.layer_trunk_bytes[3]);
    CHECK(trunk93 / 1e9 == doctest::Approx(108.81).epsilon(0.001));
}
