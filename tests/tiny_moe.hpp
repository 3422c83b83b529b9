// The tiny K3's MoE weights for one layer, as chapter 10's moe_forward takes them (tests 10 and 11).
#pragma once

#include "../chapters/10_moe.hpp"
#include "tiny.hpp"

namespace kimik3::test {

inline MoeWeights moe_weights(Tiny& tiny, int l) {
    const LayerTensors& lt = tiny.tensors.layers[std::size_t(l)];
    return MoeWeights{tiny.mat(lt.router),
                      tiny.f32v(lt.router_bias),
                      tiny.mat(lt.latent_down),
                      tiny.f32v(lt.latent_norm),
                      tiny.mat(lt.latent_up),
                      DenseFfnWeights{tiny.mat(lt.shared_gate), tiny.mat(lt.shared_up), tiny.mat(lt.shared_down)}};
}

}  // namespace kimik3::test
