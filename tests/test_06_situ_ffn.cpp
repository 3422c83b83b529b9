// Tests for chapter 06: SiTU FFN. Section numbers match the chapter.
#include "../chapters/06_situ_ffn.hpp"

#include "tiny.hpp"

using namespace kimik3;

TEST_CASE("6.1 SiTU worked by hand: zero, both caps saturated, and the uncapped sigmoid") {
    const Situ s{4.0f, 25.0f};
    // a = b = 1000: tanh(250) = 1 and sigmoid(1000) = 1 in f32, so gate = 4, up = 25, h = 100 exactly.
    CHECK(situ_gate(1000.0f, s) == 4.0f);
    CHECK(situ_up(1000.0f, s) == 25.0f);
    CHECK(situ_gate(1000.0f, s) * situ_up(1000.0f, s) == 100.0f);
    // a = -1000: (4 * tanh(-250)) * sigmoid(-1000) = -4 * 0 = -0: the gate closes, as SiLU's does.
    CHECK(situ_gate(-1000.0f, s) == 0.0f);
    CHECK(situ_gate(0.0f, s) == 0.0f);
    // The sigmoid takes the uncapped a (trap 5.1.5 of docs/kimi-k3.md): at a = 8, sigmoid(8) = 0.99966 while a capped
    // argument, sigmoid(4 tanh(2)) = sigmoid(3.856), would be 0.9793.
    const float a = 8.0f;
    CHECK(situ_gate(a, s) == (4.0f * tanh_f32(2.0f)) * sigmoid(8.0f));
    CHECK(situ_gate(a, s) != (4.0f * tanh_f32(2.0f)) * sigmoid(4.0f * tanh_f32(2.0f)));
    // Small a: SiTU's gate is SiLU to within (a/4)^2/3: at a = 0.1 the relative difference is ~2e-4.
    CHECK(std::fabs(situ_gate(0.1f, s) - silu(0.1f)) / silu(0.1f) < 3e-4);
    // b2 = 0 means the config said null: the up branch is the identity.
    CHECK(situ_up(1000.0f, Situ{1.0f, 0.0f}) == 1000.0f);
}

TEST_CASE("6.1 SiTU agrees with the float64 reference within 2e-7 relative over a 0.1..1000 grid (both caps saturate)") {
    test::Fixture f("fixtures/kernels/situ.safetensors");
    const auto a = f.f32("a"), b = f.f32("b");
    std::vector<float> h(a.size());
    situ_glu(h.data(), a.data(), b.data(), a.size(), Situ{4.0f, 25.0f});
    CHECK_REL_WITHIN(h, f.f32("h"), 2e-7);
    situ_glu(h.data(), a.data(), b.data(), a.size(), Situ{1.0f, 0.0f});
    CHECK_REL_WITHIN(h, f.f32("h_null_betas"), 2e-7);
}

TEST_CASE("6.2 the dense FFN of the tiny K3's layer 0 agrees with the float64 reference within 1e-5 relative") {
    test::Tiny tiny;
    const LayerTensors& lt = tiny.tensors.layers[0];
    const DenseFfnWeights w{tiny.mat(lt.gate_proj), tiny.mat(lt.up_proj), tiny.mat(lt.down_proj)};
    auto& ref = test::layer_reference();
    const auto x = ref.f32("layer.0.mlp_norm_out");
    const std::size_t T = 10, D = 128;
    std::vector<float> y(T * D), y_ref(T * D), one(D);
    dense_ffn(y.data(), x.data(), T, w, tiny.situ());
    CHECK_REL_WITHIN(y, ref.f32("layer.0.mlp_out"), 1e-5);
    dense_ffn_ref(y_ref.data(), x.data(), T, w, tiny.situ());
    CHECK_BITS_EQ(y, y_ref);
    for (std::size_t t = 0; t < T; ++t) {  // ten tokens at once = one at a time, bit for bit
        dense_ffn(one.data(), x.data() + t * D, 1, w, tiny.situ());
        CHECK_BITS_EQ(std::span<const float>(y.data() + t * D, D), one);
    }
}

TEST_CASE("6.3 every routed expert the reference used agrees within 1e-5 relative; ref and fast paths bit-identical") {
    test::Tiny tiny;
    auto& ref = test::layer_reference();
    const std::size_t T = 10, K = 4, Lt = 64, F = 64;
    int checked = 0;
    for (int l = 1; l < 13; ++l) {
        const std::string p = "layer." + std::to_string(l) + ".moe.";
        const auto z = ref.f32(p + "z");
        const auto ids = ref.i64(p + "topk_ids");
        const auto want = ref.f32(p + "expert_out");
        for (std::size_t t = 0; t < T; ++t)
            for (std::size_t k = 0; k < K; ++k) {
                const ExpertWeights e = tiny.expert(l, int(ids[t * K + k]));
                std::vector<float> y(Lt), y_ref(Lt);
                expert_ffn(y.data(), z.data() + t * Lt, 1, e, F, Lt, tiny.situ());
                expert_ffn_ref(y_ref.data(), z.data() + t * Lt, 1, e, F, Lt, tiny.situ());
                CHECK_BITS_EQ(y, y_ref);
                CHECK_REL_WITHIN(y, std::span<const float>(want.data() + (t * K + k) * Lt, Lt), 1e-5);
                ++checked;
            }
    }
    CHECK(checked == 12 * 10 * 4);
}

TEST_CASE("6.3 one expert over T tokens at once gives per token the bits of one token alone") {
    test::Tiny tiny;
    const auto z = test::layer_reference().f32("layer.5.moe.z");
    const ExpertWeights e = tiny.expert(5, 3);
    std::vector<float> all(10 * 64), one(64);
    expert_ffn(all.data(), z.data(), 10, e, 64, 64, tiny.situ());
    for (std::size_t t = 0; t < 10; ++t) {
        expert_ffn(one.data(), z.data() + t * 64, 1, e, 64, 64, tiny.situ());
        CHECK_BITS_EQ(std::span<const float>(all.data() + t * 64, 64), one);
    }
}
