// Tests for chapter 10: moe. Section numbers match the chapter.
#include "../chapters/10_moe.hpp"

#include "tiny_moe.hpp"

using namespace kimik3;

using test::moe_weights;

TEST_CASE("10.1 routing worked by hand: the bias picks, the unbiased scores weigh") {
    // 4 experts, k = 2. Logits 0 for all: scores 0.5 each. Bias (0, 0.3, 0.1, 0.2) picks experts 1 and 3
    // (biased 0.8, 0.7) in that slot order; weights are 0.5 / (0.5 + 0.5) = 0.5 each, NOT 0.8/1.5.
    const float logits[4] = {0, 0, 0, 0}, bias[4] = {0.0f, 0.3f, 0.1f, 0.2f};
    const Routing r = route(logits, bias, 1, 4, 2, 1.0f, 7);
    CHECK(r.ids == std::vector<int>{1, 3});
    CHECK(r.weights == std::vector<float>{0.5f, 0.5f});
    // routed_scaling_factor multiplies after renormalising
    CHECK(route(logits, bias, 1, 4, 2, 2.5f, 7).weights == std::vector<float>{1.25f, 1.25f});
}

TEST_CASE("10.1 planted ties go to the lower expert id, in selection and in slot order") {
    // Experts 2, 5 and 6 tie on the biased score; k = 2 must pick 2 then 5 (lower ids first).
    float logits[8] = {-3, -3, 1, -3, -3, 1, 1, -3};
    const float bias[8] = {};
    const Routing r = route(logits, bias, 1, 8, 2, 1.0f, 0);
    CHECK(r.ids == std::vector<int>{2, 5});
    // A tie the bias makes from different scores: sigmoid(0) = 0.5 and sigmoid(100) = 1 exactly in f32,
    // so 0.5 + 0.25 and 1 - 0.25 are both exactly 0.75; the lower id wins whichever score is higher,
    // and the weights use the unbiased scores (0.5 and 1, renormalised).
    float l2[8] = {0, -9, -9, -9, 100, -9, -9, -9};
    const float b2[8] = {0.25f, 0, 0, 0, -0.25f, 0, 0, 0};
    CHECK(route(l2, b2, 1, 8, 1, 1.0f, 0).ids == std::vector<int>{0});
    const Routing both = route(l2, b2, 1, 8, 2, 1.0f, 0);
    CHECK(both.ids == std::vector<int>{0, 4});
    CHECK(both.weights[0] == 0.5f / (1.5f + 1e-20f));
    CHECK(both.weights[1] == 1.0f / (1.5f + 1e-20f));
    float l3[8] = {-9, 100, -9, -9, 0, -9, -9, -9};  // the same tie with the scores swapped between ids
    const float b3[8] = {0, -0.25f, 0, 0, 0.25f, 0, 0, 0};
    CHECK(route(l3, b3, 1, 8, 1, 1.0f, 0).ids == std::vector<int>{1});
}

TEST_CASE("10.1 route refuses a k it cannot select and a NaN bias, naming the layer") {
    const float logits[4] = {0, 0, 0, 0};
    const float bias[4] = {0, 0, 0, 0}, nan_bias[4] = {0, 0, NAN, 0};
    CHECK_THROWS_WITH_AS(route(logits, bias, 1, 4, 5, 1.0f, 3),
                         "layer 3: top-k of 5 from 4 experts (k must be 1..64 and at most the expert count)", Error);
    CHECK_THROWS_WITH_AS(route(logits, bias, 1, 4, 0, 1.0f, 3),
                         "layer 3: top-k of 0 from 4 experts (k must be 1..64 and at most the expert count)", Error);
    CHECK_THROWS_WITH_AS(route(logits, nan_bias, 1, 4, 2, 1.0f, 3), "layer 3: e_score_correction_bias of expert 2 is NaN", Error);
}

TEST_CASE("10.1 a NaN router logit is an error naming the layer, expert and token") {
    float logits[4] = {0, NAN, 0, 0};
    const float bias[4] = {};
    CHECK_THROWS_WITH_AS(route(logits, bias, 1, 4, 2, 1.0f, 5), "layer 5: router logit of expert 1 is NaN for token 0", Error);
}

TEST_CASE("10.3 every MoE layer of the tiny K3 agrees with the reference: same top-k ids, outputs within 1e-5 relative") {
    test::Tiny tiny;
    ResidentExperts experts(tiny.tensors);
    auto& ref = test::layer_reference();
    const std::size_t T = 10, D = 128;
    int reordered = 0;
    for (int l = 1; l < 13; ++l) {
        const std::string p = "layer." + std::to_string(l) + ".";
        const auto x = ref.f32(p + "mlp_norm_out");
        std::vector<float> y(T * D);
        MoeRecord rec;
        moe_forward(y.data(), x.data(), T, moe_weights(tiny, l), MoeDims::from(tiny.config, l), experts, &rec);
        const auto want_ids = ref.i64(p + "moe.topk_ids");
        for (std::size_t i = 0; i < want_ids.size(); ++i) REQUIRE(rec.routing.ids[i] == want_ids[i]);
        const auto unbiased = ref.i64(p + "moe.topk_ids_unbiased");
        for (std::size_t t = 0; t < T; ++t) {  // how often the bias changed the chosen SET (trap 5.1.3 of docs/kimi-k3.md)
            std::vector<std::int64_t> a(want_ids.begin() + long(t * 4), want_ids.begin() + long(t * 4 + 4)),
                b(unbiased.begin() + long(t * 4), unbiased.begin() + long(t * 4 + 4));
            std::sort(a.begin(), a.end());
            std::sort(b.begin(), b.end());
            reordered += a != b;
        }
        CAPTURE(l);
        CHECK_REL_WITHIN(rec.routing.weights, ref.f32(p + "moe.topk_weights"), 1e-6);
        CHECK_REL_WITHIN(rec.z, ref.f32(p + "moe.z"), 1e-5);
        CHECK_REL_WITHIN(rec.y_lat, ref.f32(p + "moe.y_lat"), 1e-5);
        CHECK_REL_WITHIN(rec.y_routed, ref.f32(p + "moe.y_routed"), 1e-5);
        CHECK_REL_WITHIN(rec.y_shared, ref.f32(p + "moe.y_shared"), 1e-5);
        CHECK_REL_WITHIN(y, ref.f32(p + "mlp_out"), 1e-5);
    }
    CHECK(reordered > 60);  // of 120 (token, layer) pairs: the fixture exercises the bias
}

TEST_CASE("10.3 the MoE output has the same bits for any provider capacity, thread count, and T") {
    test::Tiny tiny;
    const auto x = test::layer_reference().f32("layer.6.mlp_norm_out");
    const std::size_t T = 10, D = 128;
    const MoeWeights w = moe_weights(tiny, 6);
    const MoeDims d = MoeDims::from(tiny.config, 6);
    std::vector<float> base(T * D), y(T * D);
    ResidentExperts all(tiny.tensors);
    moe_forward(base.data(), x.data(), T, w, d, all, nullptr);
    for (std::size_t cap : {1u, 2u, 4u, 5u, 16u}) {
        for (int threads : {1, 2}) {
            set_threads(threads);
            ResidentExperts limited(tiny.tensors, cap);
            moe_forward(y.data(), x.data(), T, w, d, limited, nullptr);
            CAPTURE(cap);
            CAPTURE(threads);
            CHECK_BITS_EQ(y, base);
        }
    }
    set_threads(2);
    for (std::size_t t = 0; t < T; ++t) {  // one token at a time
        std::vector<float> one(D);
        moe_forward(one.data(), x.data() + t * D, 1, w, d, all, nullptr);
        CHECK_BITS_EQ(std::span<const float>(base.data() + t * D, D), one);
    }
}

namespace {
// ResidentExperts that reads ahead (in name): it records every call, and hands out a prefetched group's
// weights only after checking that the fetch asks for exactly that group.
class RecordingProvider : public ExpertProvider {
  public:
    RecordingProvider(const ModelTensors& m, std::size_t cap) : all_(m), cap_(cap) {}
    std::size_t capacity() const override { return cap_; }
    bool reads_ahead() const override { return true; }
    void fetch(int layer, std::span<const int> ids, ExpertWeights* out) override {
        calls.push_back("F" + list(ids));
        if (!ahead_.empty() && ahead_ != std::vector<int>(ids.begin(), ids.end())) calls.push_back("MISMATCH");
        ahead_.clear();
        all_.fetch(layer, ids, out);
    }
    void prefetch(int, std::span<const int> ids) override {
        calls.push_back("P" + list(ids));
        ahead_.assign(ids.begin(), ids.end());
    }
    std::vector<std::string> calls;

  private:
    static std::string list(std::span<const int> ids) {
        std::string s;
        for (int id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
        return s;
    }
    ResidentExperts all_;
    std::size_t cap_;
    std::vector<int> ahead_;
};
}  // namespace

TEST_CASE("10.3 when a layer's experts do not fit, a provider that reads ahead gets half its capacity per group, each next group before computing") {
    CHECK(expert_group_size(2, true, 16) == 1);      // the floor: one computes, one reads
    CHECK(expert_group_size(100, true, 300) == 50);  // a prefill chunk that overflows a cache
    CHECK(expert_group_size(200, true, 16) == 200);  // they all fit: one group, all hits found first
    CHECK(expert_group_size(1, true, 16) == 1);      // no room for two groups: no read-ahead
    CHECK(expert_group_size(5, false, 16) == 5);     // a provider that does not read ahead: its whole capacity
    test::Tiny tiny;
    const auto x = test::layer_reference().f32("layer.6.mlp_norm_out");
    const std::size_t D = 128;
    const MoeWeights w = moe_weights(tiny, 6);
    const MoeDims d = MoeDims::from(tiny.config, 6);
    ResidentExperts all(tiny.tensors);
    std::vector<float> base(D), y(D);
    moe_forward(base.data(), x.data(), 1, w, d, all, nullptr);
    MoeRecord rec;
    for (std::size_t cap : {1u, 2u, 3u, 4u}) {
        CAPTURE(cap);
        RecordingProvider p(tiny.tensors, cap);
        moe_forward(y.data(), x.data(), 1, w, d, p, &rec);
        CHECK_BITS_EQ(y, base);
        std::vector<int> ids(rec.routing.ids.begin(), rec.routing.ids.end());  // 4 distinct experts, ascending
        std::sort(ids.begin(), ids.end());
        const std::string a = std::to_string(ids[0]), b = std::to_string(ids[1]), c = std::to_string(ids[2]), e = std::to_string(ids[3]);
        std::vector<std::string> want;
        if (cap == 1) want = {"F" + a, "F" + b, "F" + c, "F" + e};  // no room to read ahead
        if (cap == 2 || cap == 3) want = {"F" + a, "P" + b, "F" + b, "P" + c, "F" + c, "P" + e, "F" + e};
        if (cap == 4) want = {"F" + a + "," + b + "," + c + "," + e};  // all fit: one group
        CHECK(p.calls == want);
    }
}
