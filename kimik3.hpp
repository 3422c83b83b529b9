// kimik3: Kimi K3 on one ordinary computer, as a course. Read the chapters in this order.
#pragma once
#include "chapters/00_numerics.hpp"     // bf16 and f32 bits, RNE, the 16-lane sum, the SIMD shim, threads
#include "chapters/01_safetensors.hpp"  // the checkpoint format, validated before it is trusted; shards
#include "chapters/01a_bounded_input.hpp"  // APPENDIX to 01: regular files only, exact and direct reads, bounded JSON
#include "chapters/01b_writer.hpp"      // APPENDIX to 01: writing safetensors and small files atomically
#include "chapters/02_config.hpp"       // config.json read and refused with reasons; the schedule; binding; the census
#include "chapters/03_norms.hpp"        // RMSNorm, the KDA L2 norm, the gated per-head norm
#include "chapters/04_matvec_bf16.hpp"  // y = W x with bf16 weights, bit-identical at any SIMD width
#include "chapters/05_mxfp4.hpp"        // the experts' 4-bit floats, decoded exactly, multiplied in place
#include "chapters/06_situ_ffn.hpp"     // SiTU-GLU; the dense FFN (bf16) and one routed expert (MXFP4)
#include "chapters/07_kda.hpp"          // Kimi Delta Attention: short conv, decay gate, delta-rule state, prefill = decode
#include "chapters/08_mla.hpp"          // Gated MLA, NoPE: the absorbed attention over a latent KV cache
#include "chapters/09_attn_res.hpp"     // Block Attention Residuals: softmax over depth instead of x + f(x)
#include "chapters/10_moe.hpp"          // the router, the latent MoE, the combine order, expert providers
#include "chapters/11_expert_cache.hpp" // experts read in place (O_DIRECT), a slot cache, traces, the simulator
#include "chapters/12_trunk_stream.hpp" // the trunk at any budget: the plan, pinned layers, a ring of row chunks
#include "chapters/13_model.hpp"        // the whole model: sessions, forward steps, teacher forcing, generation
#include "chapters/14_tokenizer.hpp"    // tiktoken BPE: K3's pre-tokenizer as a scanner, merges, streaming UTF-8
#include "chapters/15_generate.hpp"     // the XTML chat format, stop tokens, seeded sampling
#include "chapters/15c_session_file.hpp" // APPENDIX to 15: sessions on disk, checksummed and tied to the model
#include "chapters/16_speculative.hpp"  // drafts from the sequence itself, verified in one step, rolled back exactly
