// kimik3: Kimi K3 on one ordinary computer, as a course. Read the chapters in this order; an APPENDIX
// (NNa, NNb) holds what its lesson needs but a learner can skip: read it when the lesson points at it.
#pragma once
#include "chapters/00_numerics.hpp"          // bf16 and f32 bits, RNE, the 16-lane sum, the SIMD shim, threads
#include "chapters/00a_isa.hpp"               // APPENDIX to 00: instruction sets found at run time; the one rule that picks a kernel
#include "chapters/01_safetensors.hpp"       // the checkpoint format, validated before it is trusted; shards
#include "chapters/01a_bounded_input.hpp"    // APPENDIX to 01: regular files only, exact and direct reads, bounded JSON
#include "chapters/01b_writer.hpp"           // APPENDIX to 01: writing safetensors and small files atomically
#include "chapters/02_config.hpp"            // what config.json says the model is: the Config, the schedule, expected tensors, the census
#include "chapters/02a_refusals.hpp"         // APPENDIX to 02: config.json read and refused with reasons; tensors bound
#include "chapters/03_norms.hpp"             // RMSNorm, the KDA L2 norm, the gated per-head norm
#include "chapters/04_matvec_bf16.hpp"       // y = W x with bf16 weights, bit-identical at any SIMD width
#include "chapters/04a_bf16_kernels.hpp"      // APPENDIX to 04: the bf16 kernels written for one instruction set (AVX-512)
#include "chapters/05_mxfp4.hpp"             // the experts' 4-bit floats, decoded exactly, multiplied in place
#include "chapters/05a_mxfp4_kernels.hpp"     // APPENDIX to 05: the MXFP4 kernels written for one instruction set (AVX2, AVX-512, NEON)
#include "chapters/06_situ_ffn.hpp"          // SiTU-GLU; the dense FFN (bf16) and one routed expert (MXFP4)
#include "chapters/07_kda.hpp"               // Kimi Delta Attention: short conv, decay gate, delta-rule state, prefill = decode
#include "chapters/08_mla.hpp"               // Gated MLA, NoPE: the absorbed attention over a latent KV cache
#include "chapters/08a_mla_naive.hpp"        // APPENDIX to 08: the naive form (the yardstick); the cache saved and loaded
#include "chapters/09_attn_res.hpp"          // Block Attention Residuals: softmax over depth instead of x + f(x)
#include "chapters/10_moe.hpp"               // the router, the latent MoE, the combine order, expert providers
#include "chapters/11_expert_cache.hpp"      // experts read in place (O_DIRECT), a slot cache, read-ahead, retention
#include "chapters/11a_traces.hpp"           // APPENDIX to 11: expert traces written, read and replayed under LRU, LFU, Belady
#include "chapters/12_trunk_stream.hpp"      // the trunk at any budget: the plan, pinned layers, a ring of row chunks
#include "chapters/12a_pack_trunk.hpp"       // APPENDIX to 12: trunk.bin packed, verified and loaded back
#include "chapters/12b_trunk_weights.hpp"    // APPENDIX to 12: carrying out a plan: resident, streamed, the embedding
#include "chapters/13_model.hpp"             // the whole model: sessions, forward steps, teacher forcing, the one decode loop
#include "chapters/13a_batch.hpp"            // APPENDIX to 13: several conversations in one forward step, each exact; the scheduler
#include "chapters/14_tokenizer.hpp"         // tiktoken BPE: K3's pre-tokenizer as a scanner, merges, streaming UTF-8
#include "chapters/14a_tokenizer_files.hpp"  // APPENDIX to 14: tiktoken.model and tokenizer_config.json, read strictly
#include "chapters/15_generate.hpp"          // the XTML chat format, stop tokens, seeded sampling
#include "chapters/15a_reply.hpp"            // APPENDIX to 15: a reply's text by token id, never its markup
#include "chapters/15b_tools.hpp"            // APPENDIX to 15: tools, tool choice and response formats as K3's encoder renders them
#include "chapters/15c_session_file.hpp"     // APPENDIX to 15: sessions on disk, checksummed and tied to the model
#include "chapters/16_speculative.hpp"       // drafts from the sequence itself, verified in one step, rolled back exactly
// chapters/17_mpi.hpp (the model over MPI ranks, the same bits) is not included here: it needs mpi.h,
// so only kimik3-mpi (examples/kimik3_mpi.cpp, built with mpicxx) and its test include it.
