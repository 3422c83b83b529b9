// What a model has read so far, for the benchmarks that count bytes per generated token: the trunk
// (the ring's bytes plus the embedding rows looked up, bf16) and the routed experts (the cache's misses).
#pragma once

#include "../kimik3.hpp"

namespace kimik3::bench {

struct Counters {
    double trunk = 0, experts = 0;  // bytes
};
inline Counters counters(Model& m) {
    Counters c;
    c.trunk = double(m.trunk().ring_stats().bytes) + double(m.trunk().stats().embed_rows) * double(m.config.hidden_size) * 2;
    if (m.experts()) c.experts = double(m.experts()->stats().bytes_read);
    return c;
}

}  // namespace kimik3::bench
