// Example for chapter 06: SiTU against SwiGLU, then one routed expert of the tiny K3 from MXFP4.
//   make run-06
#include <cstdio>

#include "../chapters/02_config.hpp"
#include "../chapters/06_situ_ffn.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main() {
    const Situ s{4.0f, 25.0f};
    std::printf("6.1 the gate branch: SiLU(a) vs SiTU's gate 4 tanh(a/4) sigmoid(a)\n");
    std::printf("  %10s %12s %12s\n", "a", "SiLU", "SiTU gate");
    for (float a : {-8.0f, -2.0f, -0.5f, 0.1f, 0.5f, 2.0f, 4.0f, 8.0f, 20.0f, 1000.0f})
        std::printf("  %10.2f %12.5f %12.5f\n", double(a), double(silu(a)), double(situ_gate(a, s)));
    std::printf("  (small a: the same; large a: SiLU grows without bound, SiTU never passes 4)\n");
    std::printf("\n6.1 the up branch: b vs 25 tanh(b/25), and whole units h = gate * up\n");
    std::printf("  %10s %10s %12s %14s %14s\n", "a", "b", "25tanh(b/25)", "SwiGLU", "SiTU-GLU");
    for (auto [a, b] : {std::pair{0.5f, 1.0f}, {2.0f, 10.0f}, {8.0f, 30.0f}, {30.0f, 100.0f}, {1000.0f, 1000.0f}})
        std::printf("  %10.1f %10.1f %12.4f %14.4f %14.4f\n", double(a), double(b), double(situ_up(b, s)), double(swiglu(a, b)),
                    double(situ_gate(a, s) * situ_up(b, s)));
    std::printf("  (|h| <= 4 x 25 = 100 whatever the inputs)\n");

    std::printf("\n6.3 one routed expert of the tiny K3 (layer 1, expert 0), straight from its MXFP4 bytes\n");
    try {
        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/tiny-k3";
        const Config c = load_config(dir);
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, c);
        const ExpertLocation& x = m.experts[1][0];
        AlignedBuffer buf(x.span_bytes);
        pread_exact(x.file->fd(), buf.data(), x.span_bytes, x.span_offset, x.file->path());  // the six parts: one read
        auto part = [&](int p) { return reinterpret_cast<const std::uint8_t*>(buf.data() + (x.parts[std::size_t(p)]->info->file_offset - x.span_offset)); };
        const ExpertWeights e{part(0), part(1), part(2), part(3), part(4), part(5)};
        const std::size_t F = std::size_t(c.moe_intermediate_size), L = std::size_t(c.routed_expert_hidden_size);
        std::vector<float> z(L), y(L), y_ref(L);
        for (std::size_t i = 0; i < L; ++i) z[i] = float(int(i % 9) - 4) * 0.25f;
        expert_ffn(y.data(), z.data(), 1, e, F, L, Situ{c.situ_beta, c.situ_linear_beta});
        expert_ffn_ref(y_ref.data(), z.data(), 1, e, F, L, Situ{c.situ_beta, c.situ_linear_beta});
        std::printf("  %zu bytes read in one pread at offset %llu; F = %zu, L = %zu\n  y[0..5] =", std::size_t(x.span_bytes),
                    (unsigned long long)x.span_offset, F, L);
        for (int i = 0; i < 6; ++i) std::printf(" %9.5f", double(y[std::size_t(i)]));
        bool same = true;
        for (std::size_t i = 0; i < L; ++i) same = same && std::bit_cast<std::uint32_t>(y[i]) == std::bit_cast<std::uint32_t>(y_ref[i]);
        std::printf("\n  fast kernels and reference kernels give the same bits: %s\n", same ? "yes" : "NO");
    } catch (const Error& err) {
        std::fprintf(stderr, "error: %s\n", err.what());
        return 2;
    }
    return 0;
}
