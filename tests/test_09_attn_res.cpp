// Tests for chapter 09: attn_res. Section numbers match the chapter.
#include "../chapters/09_attn_res.hpp"

#include "tiny.hpp"

using namespace kimik3;

namespace {

std::vector<float> row(const std::vector<float>& m, std::size_t t, std::size_t d) {
    return std::vector<float>(m.begin() + long(t * d), m.begin() + long(t * d + d));
}

AttnResWeights mixer(test::Tiny& tiny, const Checkpoint::Ref* norm, const Checkpoint::Ref* proj) {
    return AttnResWeights{tiny.f32v(norm), tiny.f32v(proj)};
}

}  // namespace

TEST_CASE("9.1 a two-candidate mix worked by hand") {
    // D = 16, w = all ones (norm 1, proj 1). v1 = sixteen 2s: rms 2, keys normalise to ones, s1 = 16.
    // v2 = sixteen -3s: normalised to -1s, s2 = -16. pi = softmax(16, -16) = (1/(1+e^-32), e^-32/(1+e^-32)).
    // The mix of RAW values: pi1 * 2 + pi2 * (-3). With eps = 0 every step is exact up to the exp.
    std::vector<float> v1(16, 2.0f), v2(16, -3.0f), w(16), out(16), pi(2);
    std::vector<float> ones(16, 1.0f);
    attn_res_fold(w.data(), AttnResWeights{ones.data(), ones.data()}, 16);
    for (float x : w) CHECK(x == 1.0f);
    const float* c[2] = {v1.data(), v2.data()};
    attn_res_mix(out.data(), c, 2, w.data(), 16, 0.0f, pi.data());
    const float e = exp_f32(-32.0f);  // e_1 = exp(16 - 16) = 1, e_2 = exp(-16 - 16)
    CHECK(pi[0] == 1.0f / (1.0f + e));
    CHECK(pi[1] == e / (1.0f + e));
    CHECK(out[0] == (0.0f + pi[0] * 2.0f) + pi[1] * -3.0f);
    // Equal scores give equal weights whatever the magnitudes: keys are normalised, values are not.
    std::vector<float> big(16, 1000.0f);
    const float* c2[2] = {v1.data(), big.data()};
    attn_res_mix(out.data(), c2, 2, w.data(), 16, 0.0f, pi.data());
    CHECK(pi[0] == 0.5f);
    CHECK(out[0] == 0.5f * 2.0f + 0.5f * 1000.0f);
}

TEST_CASE("9.2 the residual state follows the closed form: layer 0 skips its mix, blocks bank at l % S == 0") {
    // Block size 2, D = 16: feed constant sublayer outputs and check the bank and partial by hand.
    std::vector<float> x0(16, 1.0f), x(16), w(16, 1.0f);
    ResidualState r;
    r.start(x0.data(), 16);
    r.attn_input(x.data(), 0, 2, w.data(), 1e-5f);      // layer 0: x is the embedding, and it is banked
    CHECK(x == x0);
    CHECK(r.bank.size() == 1);
    CHECK(!r.has_partial);
    std::vector<float> a(16, 2.0f), m(16, 3.0f);
    r.add(a.data());                                     // P = a_0 = 2
    r.add(m.data());                                     // P = 2 + 3 = 5
    CHECK(r.partial[0] == 5.0f);
    r.attn_input(x.data(), 1, 2, w.data(), 1e-5f);      // layer 1: mix(B_0, P), no banking
    CHECK(r.bank.size() == 1);
    r.add(a.data());
    r.add(m.data());                                     // P = 10 = B_1 when layer 2 starts
    r.attn_input(x.data(), 2, 2, w.data(), 1e-5f);      // layer 2: mix(B_0, B_1) then bank B_1
    CHECK(r.bank.size() == 2);
    CHECK(r.bank[1][0] == 10.0f);
    CHECK(!r.has_partial);
    CHECK(r.candidates().size() == 2);                   // the FFN of layer 2 will see B_0, B_1, a_2
}

TEST_CASE("9.2 every AttnRes mix of the tiny K3 agrees with the float64 reference within 1e-5 relative") {
    // Drive the per-token state with the reference's own sublayer outputs (attn_out, mlp_out), so each
    // mix is compared from the same inputs; weights within 1e-5, mixed vectors within 1e-5.
    test::Tiny tiny;
    auto& ref = test::layer_reference();
    const std::size_t T = 10, D = 128;
    const int S = tiny.config.attn_res_block_size;
    const float eps = tiny.config.rms_norm_eps;
    const auto x0 = ref.f32("layer.0.attn_mix_out");  // layer 0's input is the embedding
    std::vector<float> wa(D), wm(D), wf(D), x(D), pi(16);
    for (std::size_t t = 0; t < T; ++t) {
        ResidualState r;
        r.start(&x0[t * D], D);
        for (int l = 0; l < tiny.config.num_hidden_layers; ++l) {
            const LayerTensors& lt = tiny.tensors.layers[std::size_t(l)];
            const std::string p = "layer." + std::to_string(l) + ".";
            CHECK_REL_WITHIN(r.has_partial ? r.partial : r.bank.back(), row(ref.f32(p + "partial_in"), t, D), 1e-5);
            attn_res_fold(wa.data(), mixer(tiny, lt.attn_res_norm, lt.attn_res_proj), D);
            const std::size_t n_attn = r.candidates().size();
            r.attn_input(x.data(), l, S, wa.data(), eps, pi.data());
            CHECK_REL_WITHIN(x, row(ref.f32(p + "attn_mix_out"), t, D), 1e-5);
            if (l > 0) CHECK_REL_WITHIN(std::vector<float>(pi.begin(), pi.begin() + long(n_attn)), row(ref.f32(p + "attn_mix_weights"), t, n_attn), 1e-5);
            r.add(row(ref.f32(p + "attn_out"), t, D).data());
            attn_res_fold(wm.data(), mixer(tiny, lt.mlp_res_norm, lt.mlp_res_proj), D);
            const std::size_t n_mlp = r.candidates().size();
            r.mix(x.data(), wm.data(), eps, pi.data());
            CHECK_REL_WITHIN(x, row(ref.f32(p + "mlp_mix_out"), t, D), 1e-5);
            CHECK_REL_WITHIN(std::vector<float>(pi.begin(), pi.begin() + long(n_mlp)), row(ref.f32(p + "mlp_mix_weights"), t, n_mlp), 1e-5);
            r.add(row(ref.f32(p + "mlp_out"), t, D).data());
        }
        attn_res_fold(wf.data(), AttnResWeights{tiny.f32v(tiny.tensors.out_res_norm), tiny.f32v(tiny.tensors.out_res_proj)}, D);
        CHECK(r.candidates().size() == 5);  // B_0..B_3 + the partial of layer 12 (docs/kimi-k3.md 3.10)
        r.mix(x.data(), wf.data(), eps, pi.data());
        CHECK_REL_WITHIN(x, row(ref.f32("final.mix_out"), t, D), 1e-5);
        CHECK_REL_WITHIN(std::vector<float>(pi.begin(), pi.begin() + 5), row(ref.f32("final.mix_weights"), t, 5), 1e-5);
    }
}

TEST_CASE("9.1 more than 16 candidates, or none, is refused") {
    std::vector<float> v(16, 1.0f), w(16, 1.0f), out(16);
    std::vector<const float*> c(17, v.data());
    CHECK_THROWS_WITH_AS(attn_res_mix(out.data(), c.data(), 17, w.data(), 16, 1e-5f), "attn_res_mix: 17 candidates (1..16 supported)", Error);
    CHECK_THROWS_AS(attn_res_mix(out.data(), c.data(), 0, w.data(), 16, 1e-5f), Error);
}
