// Tests for chapter 07: kda. Section numbers match the chapter.
#include "../chapters/07_kda.hpp"

#include <sstream>

#include "tiny.hpp"

using namespace kimik3;

namespace {

const int kKdaLayers[] = {0, 1, 2, 4, 5, 6, 8, 9, 10};

KdaWeights tiny_kda(test::Tiny& tiny, int l) {
    return kda_weights(tiny.tensors.layers[std::size_t(l)], [&](const Checkpoint::Ref* r) { return tiny.mat(r); },
                       [&](const Checkpoint::Ref* r) { return tiny.f32v(r); });
}

// the reference stores S key-major [h][i_k][i_v]; ours is value-major [h][i_v][i_k]
std::vector<float> transpose_heads(const std::vector<float>& s, std::size_t heads, std::size_t dh) {
    std::vector<float> out(s.size());
    for (std::size_t h = 0; h < heads; ++h)
        for (std::size_t a = 0; a < dh; ++a)
            for (std::size_t b = 0; b < dh; ++b) out[(h * dh + b) * dh + a] = s[(h * dh + a) * dh + b];
    return out;
}

}  // namespace

TEST_CASE("7.2 the short convolution worked by hand: taps in time order, tap 3 on the current token") {
    // One channel (of 16) sees x = 1, 2, 3, 4; taps (0.5, 0.25, 0.125, 1). At the 4th token:
    // 0.5*1 + 0.25*2 + 0.125*3 + 1*4 = 5.375 (every product and sum exact), y = SiLU(5.375).
    const std::size_t P = 16, W = 4;
    std::vector<float> taps(P * W, 0.0f), hist((W - 1) * P, 0.0f), x(P, 0.0f), y(P);
    taps[0] = 0.5f, taps[1] = 0.25f, taps[2] = 0.125f, taps[3] = 1.0f;
    for (int t = 1; t <= 4; ++t) {
        x[0] = float(t);
        short_conv_step(y.data(), x.data(), taps.data(), hist.data(), P, W);
    }
    CHECK(y[0] == silu(5.375f));
    CHECK(y[1] == 0.0f);
    // the history now holds the last three inputs, oldest first
    CHECK(hist[0] == 2.0f);
    CHECK(hist[P] == 3.0f);
    CHECK(hist[2 * P] == 4.0f);
}

TEST_CASE("7.4 with beta = 0 a step only decays the state, channel by channel") {
    test::Rng rng(71);
    const std::size_t H = 2, Dh = 32, P = H * Dh;
    auto S = rng.floats(H * Dh * Dh), q = rng.floats(P), k = rng.floats(P), v = rng.floats(P), alpha = rng.floats(P, 0.01f, 1.0f);
    const std::vector<float> before = S, beta = {0.0f, 0.0f};
    std::vector<float> o(P);
    kda_recurrence(o.data(), S.data(), q.data(), k.data(), v.data(), alpha.data(), beta.data(), H, Dh);
    std::vector<float> decayed(S.size()), read(P);
    for (std::size_t h = 0; h < H; ++h)
        for (std::size_t j = 0; j < Dh; ++j) {
            for (std::size_t i = 0; i < Dh; ++i)
                decayed[(h * Dh + j) * Dh + i] = before[(h * Dh + j) * Dh + i] * alpha[h * Dh + i];  // key channel i
            read[h * Dh + j] = dot_ref(&decayed[(h * Dh + j) * Dh], &q[h * Dh], Dh);
        }
    CHECK_BITS_EQ(S, decayed);
    CHECK_BITS_EQ(o, read);
}

TEST_CASE("7.4 the delta rule worked by hand: a key's value is written, then overwritten, not added") {
    // Dh = 16, one head, alpha = 1, beta = 1, k = q = e0. Token 1 writes v into column 0 of S^T:
    // r = v - S^T k = v, S^T[j][0] = v_j, read o = S^T q = v. Token 2 with the same key and v':
    // r = v' - v, S^T[j][0] = v_j + (v'_j - v_j) = v'_j, o = v'. (Small integers: all exact.)
    const std::size_t Dh = 16;
    std::vector<float> S(Dh * Dh, 0.0f), e0(Dh, 0.0f), alpha(Dh, 1.0f), beta = {1.0f}, v(Dh), v2(Dh), o(Dh);
    e0[0] = 1.0f;
    for (std::size_t j = 0; j < Dh; ++j) v[j] = float(j + 1), v2[j] = float(3 * j) - 7.0f;
    kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v.data(), alpha.data(), beta.data(), 1, Dh);
    CHECK(o == v);
    kda_recurrence_ref(o.data(), S.data(), e0.data(), e0.data(), v2.data(), alpha.data(), beta.data(), 1, Dh);
    CHECK(o == v2);
    for (std::size_t j = 0; j < Dh; ++j) CHECK(S[j * Dh + 0] == v2[j]);
}

TEST_CASE("7.4 kda_recurrence_simd is bit-identical to kda_recurrence_ref over many tokens; 1 or 2 threads") {
    test::Rng rng(72);
    for (std::size_t dh : {1u, 15u, 16u, 17u, 24u, 32u, 33u, 128u}) {
        const std::size_t H = 3, P = H * dh;
        std::vector<float> Sa(H * dh * dh, 0.0f), Sb = Sa, oa(P), ob(P);
        for (int t = 0; t < 6; ++t) {
            auto q = rng.floats(P), k = rng.floats(P), v = rng.floats(P, -3, 3), alpha = rng.floats(P, 0.0067f, 1.0f),
                 beta = rng.floats(H, 0.0f, 1.0f);
            set_threads(t % 2 + 1);
            kda_recurrence_ref(oa.data(), Sa.data(), q.data(), k.data(), v.data(), alpha.data(), beta.data(), H, dh);
            set_threads(2 - t % 2);
            kda_recurrence_simd(ob.data(), Sb.data(), q.data(), k.data(), v.data(), alpha.data(), beta.data(), H, dh);
            CHECK_BITS_EQ(ob, oa);
        }
        CHECK_BITS_EQ(Sb, Sa);
    }
    set_threads(2);
}

TEST_CASE("7.3 A_log is read per head: per-channel indexing of the padded tensor would move g by a lot (trap 5.1.1 of docs/kimi-k3.md)") {
    test::Tiny tiny;
    const KdaDims d = KdaDims::from(tiny.config);
    const KdaWeights w = tiny_kda(tiny, 1);
    const auto f = std::vector<float>(d.width(), 0.5f);
    std::vector<float> alpha(d.width()), g(d.width()), g_wrong(d.width());
    kda_decay(alpha.data(), g.data(), f.data(), w.A_log, w.dt_bias, d);
    float worst = 0;
    for (std::size_t c = 0; c < d.width(); ++c) {  // the mistake: A_log indexed by the channel within the head
        const float a = exp_f32(w.A_log[c % d.head_dim]);
        g_wrong[c] = d.lower_bound * sigmoid(a * (f[c] + w.dt_bias[c]));
        worst = std::max(worst, std::fabs(g_wrong[c] - g[c]));
    }
    for (std::size_t i = d.heads; i < d.head_dim; ++i) CHECK(w.A_log[i] == 0.0f);  // the zero padding is there
    CHECK(worst > 0.5f);
}

TEST_CASE("7.5 every KDA layer of the tiny K3 agrees with the float64 reference within 1e-5 relative") {
    test::Tiny tiny;
    auto& ref = test::layer_reference();
    const KdaDims d = KdaDims::from(tiny.config);
    const std::size_t T = 10, D = 128, H = d.heads, Dh = d.head_dim;
    for (int l : kKdaLayers) {
        const std::string p = "layer." + std::to_string(l) + ".";
        const auto u = ref.f32(p + "attn_norm_out");
        KdaState st(d);
        KdaRecord r7, r3;
        std::vector<float> y(T * D);
        kda_forward(y.data(), u.data(), 7, tiny_kda(tiny, l), d, st, &r7);  // prefill 7
        CHECK_REL_WITHIN(transpose_heads(st.S, H, Dh), ref.f32(p + "kda.state_after_7"), 1e-5);
        kda_forward(y.data() + 7 * D, u.data() + 7 * D, 3, tiny_kda(tiny, l), d, st, &r3);  // then decode 3
        CHECK_REL_WITHIN(transpose_heads(st.S, H, Dh), ref.f32(p + "kda.state_after_10"), 1e-5);
        CAPTURE(l);
        CHECK_REL_WITHIN(y, ref.f32(p + "attn_out"), 1e-5);
        auto both = [](const std::vector<float>& a, const std::vector<float>& b) {
            std::vector<float> c = a;
            c.insert(c.end(), b.begin(), b.end());
            return c;
        };
        CHECK_REL_WITHIN(both(r7.q_conv, r3.q_conv), ref.f32(p + "kda.q_conv"), 1e-5);
        CHECK_REL_WITHIN(both(r7.k_hat, r3.k_hat), ref.f32(p + "kda.k_hat"), 1e-5);
        CHECK_REL_WITHIN(both(r7.q_hat, r3.q_hat), ref.f32(p + "kda.q_hat"), 1e-5);
        CHECK_REL_WITHIN(both(r7.beta, r3.beta), ref.f32(p + "kda.beta"), 1e-6);
        CHECK_REL_WITHIN(both(r7.g, r3.g), ref.f32(p + "kda.g"), 1e-6);
        CHECK_REL_WITHIN(both(r7.o, r3.o), ref.f32(p + "kda.o"), 1e-5);
        CHECK_REL_WITHIN(both(r7.o_gated, r3.o_gated), ref.f32(p + "kda.o_gated"), 1e-5);
    }
}

TEST_CASE("7.5 prefill then decode = one token at a time, bit for bit (outputs and final state), any thread count") {
    test::Tiny tiny;
    const KdaDims d = KdaDims::from(tiny.config);
    const auto u = test::layer_reference().f32("layer.5.attn_norm_out");
    const std::size_t T = 10, D = 128;
    const KdaWeights w = tiny_kda(tiny, 5);
    KdaState a(d), b(d);
    std::vector<float> ya(T * D), yb(T * D);
    set_threads(2);
    kda_forward(ya.data(), u.data(), 7, w, d, a);
    kda_forward(ya.data() + 7 * D, u.data() + 7 * D, 3, w, d, a);
    set_threads(1);
    for (std::size_t t = 0; t < T; ++t) kda_forward(yb.data() + t * D, u.data() + t * D, 1, w, d, b);
    set_threads(2);
    CHECK_BITS_EQ(ya, yb);
    CHECK_BITS_EQ(a.S, b.S);
    CHECK_BITS_EQ(a.history, b.history);
}

TEST_CASE("7.5 kda_advance over kept inputs leaves the state kda_forward leaves, for every prefix, bit for bit") {
    // (chapter 16 replays the tokens it keeps from a verify step this way)
    test::Tiny tiny;
    const KdaDims d = KdaDims::from(tiny.config);
    const auto u = test::layer_reference().f32("layer.5.attn_norm_out");
    const std::size_t T = 10, D = 128;
    const KdaWeights w = tiny_kda(tiny, 5);
    KdaState start(d);
    std::vector<float> y(T * D), y_kept(T * D);
    kda_forward(y.data(), u.data(), 3, w, d, start);  // a state with a history
    KdaState a = start;
    KdaInputs kept;
    kda_forward(y.data(), u.data() + 3 * D, 7, w, d, a, nullptr, &kept);
    KdaState same = start;
    kda_forward(y_kept.data(), u.data() + 3 * D, 7, w, d, same);
    CHECK_BITS_EQ(std::span<const float>(y.data(), 7 * D), std::span<const float>(y_kept.data(), 7 * D));  // keeping changes nothing
    CHECK(kept.tokens == 7);
    for (std::size_t n = 0; n <= 7; ++n) {
        CAPTURE(n);
        KdaState replayed = start, direct = start;
        kda_advance(replayed, kept, n, w, d);
        if (n) kda_forward(y.data(), u.data() + 3 * D, n, w, d, direct);
        CHECK_BITS_EQ(replayed.S, direct.S);
        CHECK_BITS_EQ(replayed.history, direct.history);
    }
    // it needs only the small tensors: no matrix is read
    KdaWeights small{};
    small.q_conv = w.q_conv, small.k_conv = w.k_conv, small.v_conv = w.v_conv, small.A_log = w.A_log, small.dt_bias = w.dt_bias;
    KdaState b = start;
    kda_advance(b, kept, 7, small, d);
    CHECK_BITS_EQ(b.S, a.S);
    CHECK_THROWS_WITH_AS(kda_advance(b, kept, 8, small, d), "kda_advance: 8 tokens asked for, the inputs hold 7", Error);
}

TEST_CASE("7.1 the carried state copies, resets, saves and loads; loading another shape is refused") {
    test::Tiny tiny;
    const KdaDims d = KdaDims::from(tiny.config);
    const auto u = test::layer_reference().f32("layer.2.attn_norm_out");
    const KdaWeights w = tiny_kda(tiny, 2);
    KdaState st(d);
    std::vector<float> y(4 * 128), y_copy(128), y_loaded(128);
    kda_forward(y.data(), u.data(), 3, w, d, st);
    KdaState fork = st;  // a copy continues exactly like the original
    std::stringstream buf;
    st.save(buf);
    KdaState loaded(d);
    loaded.load(buf);
    kda_forward(y.data() + 3 * 128, u.data() + 3 * 128, 1, w, d, st);
    kda_forward(y_copy.data(), u.data() + 3 * 128, 1, w, d, fork);
    kda_forward(y_loaded.data(), u.data() + 3 * 128, 1, w, d, loaded);
    CHECK_BITS_EQ(std::span<const float>(y.data() + 3 * 128, 128), y_copy);
    CHECK_BITS_EQ(y_copy, y_loaded);
    st.reset();
    CHECK(std::all_of(st.S.begin(), st.S.end(), [](float x) { return x == 0.0f; }));
    KdaDims other = d;
    other.head_dim = 16;
    KdaState wrong(other);
    std::stringstream buf2;
    fork.save(buf2);
    CHECK_THROWS_WITH_AS(wrong.load(buf2), "KDA state: saved for 4 heads x 32, conv 4; this layer has 4 x 16, conv 4", Error);
    std::stringstream empty;
    CHECK_THROWS_WITH_AS(loaded.load(empty), "KDA state: the saved state is truncated (no header)", Error);
    // a state of another shape is refused before kda_forward reads or writes anything
    const std::vector<float> before = wrong.S;
    CHECK_THROWS_WITH_AS(kda_forward(y.data(), u.data(), 1, w, d, wrong), "kda_forward: the state is for 4 heads x 16, conv 4; the layer has 4 x 32, conv 4", Error);
    CHECK_BITS_EQ(wrong.S, before);
    KdaWeights bad = w;
    bad.o_proj.cols = 64;
    CHECK_THROWS_WITH_AS(kda_forward(y.data(), u.data(), 1, bad, d, st), "kda_forward: o_proj is [128, 64], the dims want [128, 128]", Error);
}
