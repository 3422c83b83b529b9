// The tiny K3 for tests: its config, its bound tensors, and any tensor's bytes on demand (read once,
// kept), plus its reference outputs (fixtures/tiny-k3/reference/*.safetensors).
#pragma once

#include <map>

#include "../chapters/02_config.hpp"
#include "../chapters/06_situ_ffn.hpp"
#include "fixture.hpp"

namespace kimik3::test {

struct Tiny {
    Config config;
    Checkpoint ck;
    ModelTensors tensors;
    std::map<const TensorInfo*, AlignedBuffer> loaded;
    std::map<const TensorInfo*, std::vector<float>> widened;

    Tiny() : config(load_config(source_path("fixtures/tiny-k3"))), ck(source_path("fixtures/tiny-k3")), tensors(bind_tensors(ck, config)) {}

    const std::byte* bytes(const Checkpoint::Ref* r) {
        REQUIRE(r != nullptr);
        auto it = loaded.find(r->info);
        if (it == loaded.end()) {
            AlignedBuffer b(r->info->nbytes());
            r->file->read_into(*r->info, b.data());
            it = loaded.emplace(r->info, std::move(b)).first;
        }
        return it->second.data();
    }
    const bf16* bf16s(const Checkpoint::Ref* r) { return reinterpret_cast<const bf16*>(bytes(r)); }
    const float* f32s(const Checkpoint::Ref* r) { return reinterpret_cast<const float*>(bytes(r)); }
    MatrixRef mat(const Checkpoint::Ref* r) {
        const DType d = r->info->dtype;
        const WeightType t = d == DType::F32 ? WeightType::f32 : d == DType::F16 ? WeightType::f16 : WeightType::bf16;
        return MatrixRef{bytes(r), nullptr, std::size_t(r->info->shape[0]), std::size_t(r->info->shape[1]), t};
    }
    // A vector tensor widened to f32 once and kept (what the engine's TrunkWeights::vec gives).
    const float* f32v(const Checkpoint::Ref* r) {
        REQUIRE(r != nullptr);
        auto it = widened.find(r->info);
        if (it == widened.end()) it = widened.emplace(r->info, vec(r)).first;
        return it->second.data();
    }
    std::vector<float> vec(const Checkpoint::Ref* r) {  // any float vector widened to f32
        return to_f32(Tensor{*r->info, [&] {
                                 AlignedBuffer b(r->info->nbytes());
                                 std::memcpy(b.data(), bytes(r), r->info->nbytes());
                                 return b;
                             }()});
    }
    ExpertWeights expert(int layer, int e) {
        const ExpertLocation& x = tensors.experts[std::size_t(layer)][std::size_t(e)];
        auto p = [&](int i) { return reinterpret_cast<const std::uint8_t*>(bytes(x.parts[std::size_t(i)])); };
        return ExpertWeights{p(0), p(1), p(2), p(3), p(4), p(5)};
    }
    Situ situ() const { return Situ{config.situ_beta, config.situ_linear_beta}; }
};

// The reference's per-layer intermediates for the 10 ids of layer_ids (tests prefill 7, decode 3).
inline Fixture& layer_reference() {
    static Fixture f("fixtures/tiny-k3/reference/layers.safetensors");
    return f;
}

}  // namespace kimik3::test
