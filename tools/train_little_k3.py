"""train_little_k3.py - train the little K3: Kimi K3's architecture, small, on real English.

    /usr/bin/python3 tools/train_little_k3.py --data build/little-corpus --work build/little-k3-train \
        --out fixtures/little-k3 [--resume] [--steps N] [--threads 2]

What it builds (every K3 feature on, as the release uses them; widths in CONFIG below):
  * the dense first layer (SiTU-GLU), then latent MoE layers: a sigmoid router whose selection bias
    (`e_score_correction_bias`) is nudged toward under-used experts after every step (the aux-loss-free
    balancing of DeepSeek-V3, arXiv 2412.19437; no auxiliary loss), routed experts in a latent space with
    RMSNorm after the weighted sum, and shared experts on the full-width input;
  * KDA layers (Kimi Linear, arXiv 2510.26692) with short convolutions and the lower-bounded decay gate,
    trained in the CHUNKED (WY) form of docs/kimi-k3.md 3.4.7, which this script checks against the
    token-by-token recurrence of 3.4.5 before it trains (`self_check`);
  * Gated MLA (NoPE) on the latent KV cache, the schedule of K3 (every 4th layer, plus the last: the
    model ends in two MLA layers), Block Attention Residuals with three blocks;
  * routed experts fine-tuned in the last phase with MXFP4 quantization in the loop (the forward uses
    the quantized weight, the gradient passes straight through to the float weight), so the exported
    checkpoint, whose experts ARE those quantized weights, loses little.

The math is the math of tools/k3_reference.py (float32 here, with autograd): the same RMSNorm,
SiTU, AttnRes procedure, router and combine. That they agree is measured after training, not assumed:
the exported checkpoint's reference outputs come from k3_reference.py (tools/make_tiny_k3_reference.py),
the engine's exactness gates compare with them, and fixtures/little-k3/TRAINING.md gives the largest
difference between this module's logits and k3_reference.py's on the same exported weights.

Data: build/little-corpus/{train,heldout}.txt from tools/little_corpus.py (real English documents),
tokenized by the ENGINE's tokenizer (tools/tokenize_jsonl.cpp, compiled here) with the vocabulary in
fixtures/little-k3/, plus two small seeded synthetic parts (section 3): chat turns in K3's XTML format
built from corpus paragraphs (so `kimik3 chat` and `run --prompt` see the format they were trained on),
and recall passages (a fact stated early, asked for later) that make attention's retrieval visible.

Training is seeded and resumable (a checkpoint every --checkpoint-minutes in --work; --resume continues
from it). Float results depend on the BLAS and thread count, so a rerun elsewhere gives a similar model,
not the same bytes; the committed fixture records the run that made it (fixtures/little-k3/TRAINING.md). Speed needs an
optimised BLAS: Debian's python3-torch uses libblas.so.3, which is the slow reference BLAS unless
`libopenblas0-openmp` (or -pthread) is installed (41 vs 2.6 GFLOP/s measured on this project's VM).
"""

import argparse
import base64
import collections
import json
import math
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS_DIR)
sys.path.insert(0, TOOLS_DIR)
import little_chat  # noqa: E402
import mxfp4  # noqa: E402
import st  # noqa: E402

SEED = 20261201

# ================================================================================================
# 1. The configuration (the release's fields and nesting; see docs/kimi-k3.md section 1)
# ================================================================================================

BPE_SIZE = 4096              # tiktoken.model ranks 0..4095 (256 bytes + 3840 merges); --out's file decides
VOCAB = BPE_SIZE + 256       # K3's 256 special ids follow the BPE ranks, as in the release
SPECIAL_OFFSETS = (("[BOS]", 0), ("[EOS]", 1), ("<|end_of_msg|>", 2), ("<|open|>", 3), ("<|close|>", 4),
                   ("<|sep|>", 5), ("<|media_pad|>", 21), ("[PAD]", 255))
SPECIAL = {name: BPE_SIZE + k for name, k in SPECIAL_OFFSETS}
NUM_LAYERS = 9
FULL_ATTN_LAYERS = [4, 8, 9]                        # 1-based: every 4th layer and the last, as in K3
KDA_LAYERS = [l for l in range(1, NUM_LAYERS + 1) if l not in FULL_ATTN_LAYERS]

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                        "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "hidden_size": 192,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": VOCAB,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 48,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "linear_attn_config": {
        "kda_layers": KDA_LAYERS,
        "full_attn_layers": FULL_ATTN_LAYERS,
        "num_heads": 4,
        "head_dim": 48,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "rms_norm_eps": 1e-05,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 512,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 32,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "routed_expert_hidden_size": 96,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "attn_res_block_size": 3,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": SPECIAL["[BOS]"],
    "eos_token_id": SPECIAL["<|end_of_msg|>"],
    "pad_token_id": SPECIAL["[PAD]"],
    "dtype": "bfloat16",
    "quantization_config": QUANTIZATION_CONFIG,
}

CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "bos_token_id": SPECIAL["[BOS]"],
    "eos_token_id": SPECIAL["<|end_of_msg|>"],
    "pad_token_id": SPECIAL["[PAD]"],
    "media_placeholder_token_id": SPECIAL["<|media_pad|>"],
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": TEXT_CONFIG,
    "quantization_config": QUANTIZATION_CONFIG,
}


def set_vocabulary(bpe_size):
    """Point every id and size at a tokenizer of `bpe_size` BPE ranks (the one in --out)."""
    global BPE_SIZE, VOCAB
    BPE_SIZE, VOCAB = bpe_size, bpe_size + 256
    SPECIAL.update({name: bpe_size + k for name, k in SPECIAL_OFFSETS})
    TEXT_CONFIG.update(vocab_size=VOCAB, bos_token_id=SPECIAL["[BOS]"], eos_token_id=SPECIAL["<|end_of_msg|>"],
                       pad_token_id=SPECIAL["[PAD]"])
    CONFIG.update(bos_token_id=SPECIAL["[BOS]"], eos_token_id=SPECIAL["<|end_of_msg|>"], pad_token_id=SPECIAL["[PAD]"],
                  media_placeholder_token_id=SPECIAL["<|media_pad|>"])


class Dims:
    """The widths of TEXT_CONFIG under the names the math uses (docs/kimi-k3.md section 0)."""

    def __init__(self, t):
        la = t["linear_attn_config"]
        self.D, self.V, self.L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
        self.eps = t["rms_norm_eps"]
        self.Hk, self.Dh, self.Wc, self.lb = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"], la["gate_lower_bound"]
        self.P = self.Hk * self.Dh
        self.H, self.Q, self.R = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
        self.N, self.X, self.Dv = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        self.I, self.E, self.K = t["intermediate_size"], t["num_experts"], t["num_experts_per_token"]
        self.F, self.Lt = t["moe_intermediate_size"], t["routed_expert_hidden_size"]
        self.S = t["num_shared_experts"] * self.F
        self.b1, self.b2 = t["activation_situ_beta"], t["activation_situ_linear_beta"]
        self.block = t["attn_res_block_size"]
        self.scaling = t["routed_scaling_factor"]
        self.kinds = ["mla" if (l + 1) in la["full_attn_layers"] else "kda" for l in range(self.L)]
        self.moe = [l >= t["first_k_dense_replace"] and l % t["moe_layer_freq"] == 0 for l in range(self.L)]


# ================================================================================================
# 2. The model (float32, autograd). Names follow the release so export is a rename.
# ================================================================================================


# Training runs the matrix products in bfloat16 (float32 accumulation, a float32 result): on this
# project's VM (AMD EPYC with AVX512-BF16) oneDNN's bfloat16 kernels run 4-5x the float32 rate of
# OpenBLAS (370 vs 75 GFLOP/s for a [4096, 192] x [192, 192] product, one thread), and small batched
# products gain more. Everything else (norms, softmax, the KDA chunk algebra and its state, the loss,
# the optimizer, the master weights) stays float32. Evaluation and export run in float32 throughout:
# `low_precision(False)` is the default, the training loop turns it on.
# A CPU without AVX512-BF16 (AMD Zen 3, Intel before Cooper Lake) has no such kernels: torch then runs
# bfloat16 products in a generic loop, several times slower than float32 (a Zen 3 VM managed fewer
# than 50 steps in 7 CPU-minutes), so there the products stay float32 and the run says so.
def cpu_has_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


BF16_PRODUCTS = cpu_has_bf16()
_LOW_PRECISION = [False]


class low_precision:
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.saved = _LOW_PRECISION[0]
        _LOW_PRECISION[0] = self.on and BF16_PRODUCTS

    def __exit__(self, *exc):
        _LOW_PRECISION[0] = self.saved


def mm(x, w):
    """x [..., in] times w [out, in] transposed, in bfloat16 while training (see above)."""
    if _LOW_PRECISION[0]:
        return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
    return F.linear(x, w)


def bmm(a, b):
    """Batched a @ b, in bfloat16 while training."""
    if _LOW_PRECISION[0]:
        return torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
    return torch.matmul(a, b)


def rms_normalize(x, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def situ(a, b, d):
    """SiTU-GLU's activation: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)] (docs/kimi-k3.md 0.2)."""
    return (d.b1 * torch.tanh(a / d.b1) * torch.sigmoid(a)) * (d.b2 * torch.tanh(b / d.b2))


def mxfp4_round(w):
    """The MXFP4 value of every weight of w [..., in] (float32), computed as tools/mxfp4.py's quantize
    does: per 32-column block the smallest power of two 2^e with max|w| / 2^e <= 6, then the nearest
    E2M1 magnitude, ties to the even code. Exact in float32 (powers of two and E2M1 values)."""
    shape = w.shape
    blocks = w.detach().reshape(-1, shape[-1] // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    e = e + (amax > 6.0 * torch.exp2(e)).float()
    e = e - ((amax > 0) & (amax <= 6.0 * torch.exp2(e - 1))).float()
    unit = torch.exp2(e)
    a = (blocks / unit).abs()
    # thresholds between neighbours 0 .5 1 1.5 2 3 4 6; a tie goes to the even code (0, 1, 2, 4)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    code = torch.bucketize(a, mid, right=False)           # a == mid[i] -> the lower neighbour, code i
    for i in (1, 3, 5):                                    # 0.75, 1.75, 3.5: there the even code is above
        code = torch.where(a == mid[i], code + 1, code)
    q = torch.where(code == 0, torch.zeros_like(a), mags[code] * torch.sign(blocks) * unit)  # -0 encodes as +0
    return q.reshape(shape)


def straight_through(w, r):
    """The straight-through estimator of MXFP4 in the loop: the forward sees r = mxfp4_round(w), the
    gradient reaches w unchanged. (MXFP4 values are exact in bfloat16: a 1-bit mantissa times a power of
    two.) Its value is r bit for bit: r - w is exact (a nonzero r is within a factor of two of w, so
    Sterbenz's lemma applies; a zero r gives -w), and so w + (r - w) is r; self_check checks it."""
    return w + (r - w).detach()


class CausalConv(torch.autograd.Function):
    """Causal depthwise convolution y_t = sum_j w_j x_{t-W+1+j} (x [B, T, C], w [C, W]) as W shifted
    multiply-adds, forward and backward written out: torch's depthwise conv1d is several times slower on
    this CPU at these sizes, and autograd through slices would allocate a zero gradient per slice."""

    @staticmethod
    def forward(ctx, x, w):
        W, T = w.shape[1], x.shape[1]
        ctx.save_for_backward(x, w)
        y = x * w[:, W - 1]
        for j in range(W - 1):                       # tap j reads x_{t - (W-1-j)}
            y[:, W - 1 - j:] += x[:, :T - (W - 1 - j)] * w[:, j]
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        W, T = w.shape[1], x.shape[1]
        gx = gy * w[:, W - 1]
        gw = torch.empty_like(w)
        gw[:, W - 1] = (gy * x).sum(dim=(0, 1))
        for j in range(W - 1):
            s = W - 1 - j
            gx[:, :T - s] += gy[:, s:] * w[:, j]
            gw[:, j] = (gy[:, s:] * x[:, :T - s]).sum(dim=(0, 1))
        return gx, gw


def short_conv(x, taps):
    """KDA's short convolution + SiLU: x [B, T, C], taps [C, 1, W] (the release's conv1d weight)."""
    return F.silu(CausalConv.apply(x.contiguous(), taps[:, 0, :]))


class KDA(torch.nn.Module):
    """Kimi Delta Attention (docs/kimi-k3.md 3.4), chunked for training."""

    CHUNK = 16  # a power of two; within a chunk the decay exponent stays above -5 * 16 = -80: exp(80) fits in float32
    silenced = ()  # heads whose outputs copy_ablation switches off (never in training)

    def __init__(self, d):
        super().__init__()
        self.d = d
        D, P, Dh, H, W = d.D, d.P, d.Dh, d.Hk, d.Wc
        lin = lambda o, i: torch.nn.Parameter(torch.randn(o, i) * (i ** -0.5))  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = lin(P, D), lin(P, D), lin(P, D), lin(P, D)
        self.f_a_proj, self.f_b_proj, self.b_proj = lin(Dh, D), lin(P, Dh), lin(H, D)
        self.o_proj = torch.nn.Parameter(torch.randn(D, P) * (P ** -0.5) / math.sqrt(2 * d.L))
        # conv taps: a near-identity start (current token weighted 1) plus noise
        taps = torch.randn(3, P, 1, W) * 0.1
        taps[:, :, 0, W - 1] += 1.0
        self.q_conv, self.k_conv, self.v_conv = (torch.nn.Parameter(taps[i].clone()) for i in range(3))
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(0.5, 4.0, H)))     # [H] (exported zero-padded to Dh)
        self.dt_bias = torch.nn.Parameter(torch.linspace(-3.0, 1.0, P))              # head-major
        self.o_norm = torch.nn.Parameter(torch.ones(Dh))

    def forward(self, u, record=None, cache=None):
        """u [B, T, D] -> [B, T, D]. With `cache` (a dict, empty at the first call: greedy_batch) u holds the
        tokens after those of the earlier calls: the cache keeps the last W - 1 inputs of the short
        convolution and the state S, so a call costs its own tokens only."""
        d = self.d
        B, T, _ = u.shape
        H, Dh, P = d.Hk, d.Dh, d.P
        # every projection of u in one product: q k v (convolved together), the output gate, beta, f_a
        proj = mm(u, torch.cat([self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.b_proj, self.f_a_proj]))
        # (split, not slices: a slice's gradient is a zero tensor of the whole input, one per slice)
        pre, gate, beta, fa = proj.split([3 * P, P, H, Dh], dim=-1)
        taps = torch.cat([self.q_conv, self.k_conv, self.v_conv])
        if cache is not None:                             # the tokens before (zeros before the first)
            pre = torch.cat([cache.get("conv", pre.new_zeros(B, d.Wc - 1, 3 * P)), pre], dim=1)
            cache["conv"] = pre[:, -(d.Wc - 1):]
            qkv = short_conv(pre, taps)[:, d.Wc - 1:]
        else:
            qkv = short_conv(pre, taps)
        q, k, v = (t.reshape(B, T, H, Dh) for t in qkv.split(P, dim=-1))
        gate = torch.sigmoid(gate).reshape(B, T, H, Dh)
        beta = torch.sigmoid(beta)                                                     # [B, T, H]
        z = (mm(fa, self.f_b_proj) + self.dt_bias).reshape(B, T, H, Dh)
        g = d.lb * torch.sigmoid(torch.exp(self.A_log)[None, None, :, None] * z)       # log decay in (lb, 0)
        q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (Dh ** -0.5))
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        heads = [t.transpose(1, 2) for t in (q, k, v, g)] + [beta.transpose(1, 2)]   # [B, H, T, ...]
        if cache is None:
            o = kda_chunked(*heads, self.CHUNK)
        elif T == 1:                                      # one token: the recurrence; more: chunks
            o, cache["S"] = kda_recurrent(*heads, state=cache.get("S"), return_state=True)
        else:
            o, cache["S"] = kda_chunked(*heads, self.CHUNK, state=cache.get("S"), return_state=True)
        o = o.transpose(1, 2)
        o = rms_normalize(o, d.eps) * self.o_norm * gate
        if self.silenced:                                 # copy_ablation only: these heads' outputs zeroed
            o = o.clone()
            o[:, :, list(self.silenced)] = 0.0
        return mm(o.reshape(B, T, d.P), self.o_proj)


def kda_recurrent(q, k, v, g, beta, state=None, return_state=False):
    """The token recurrence (docs/kimi-k3.md 3.4.5), [B, H, T, d] in, o [B, H, T, dv] out: the yardstick.
    From the state S [B, H, dk, dv] `state` (zeros if None); with return_state, (o, the state after)."""
    B, H, T, dk = q.shape
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=q.dtype) if state is None else state
    out = []
    for t in range(T):
        Sb = torch.exp(g[:, :, t])[..., None] * S
        r = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", Sb, k[:, :, t])
        S = Sb + beta[:, :, t, None, None] * k[:, :, t, :, None] * r[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return (torch.stack(out, dim=2), S) if return_state else torch.stack(out, dim=2)


def kda_chunked(q, k, v, g, beta, C, state=None, return_state=False):
    """The chunked (WY) form of docs/kimi-k3.md 3.4.7: equal to kda_recurrent up to rounding.
    q, k, g [B, H, T, dk], v [B, H, T, dv], beta [B, H, T]; T is padded to a multiple of C with tokens
    that change nothing after them (k = v = 0, no decay, beta = 0). Float32 (or float64) throughout:
    the factors e^G and e^-G span e^-80..e^80, which bfloat16's 8-bit mantissa would not survive.
    Products that do not depend on the state are batched over all chunks at once (two products for
    q.k and k.k, one for (I + M)^-1 applied to [k | v]); the loop over chunks keeps only the two
    products that carry the state, and the outputs come from one product after it. From the state
    `state` [B, H, dk, dv] (zeros if None); with return_state, (o, the state after the last token): the
    padding tokens leave it as it was."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (t.reshape(B, H, N, C, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(B, H, N, C)
    G = g.cumsum(dim=3)                                   # inclusive cumulative log decay
    eG = torch.exp(G)
    kp, kn, qp = k * eG, k * torch.exp(-G), q * eG        # k e^G, k e^-G, q e^G
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    KQ = torch.cat([kp, qp], dim=3) @ kn.transpose(-1, -2)  # [.., 2C, C]: k_i . k_j and q_i . k_j, times e^(G_i - G_j)
    KK, QK = KQ.split(C, dim=3)
    M = (KK * beta[..., :, None]).masked_fill(~strict, 0.0)  # M[i, j] = beta_i k_i . k_j e^(G_i - G_j)
    A = QK.masked_fill(~causal, 0.0)                         # A[i, j] = q_i . k_j e^(G_i - G_j), j <= i
    # [W | U] = (I + M)^-1 diag(beta) [k e^G | v]: one unit lower-triangular solve per (sequence, head,
    # chunk), its diagonal never read (2x faster here, forward and backward, than the product series
    # (I - M)(I + M^2)(I + M^4)(I + M^8) in batched products)
    WU = torch.linalg.solve_triangular(M, torch.cat([kp, v], dim=-1) * beta[..., None], upper=False, unitriangular=True)
    Wm, U = WU.split([dk, dv], dim=-1)
    decay_to_end = (torch.exp(G[..., -1:, :] - G) * k).transpose(-1, -2)   # [.., dk, C]: e^(G_last - G_j) k_j
    chunk_decay = torch.exp(G[..., -1, :]).unsqueeze(-1)  # [B, H, N, dk, 1]: e^(G_last), the state's decay
    # unbind once: slicing chunk n out of each tensor inside the loop would make autograd allocate a
    # full-size zero gradient per slice (quadratic in the chunk count)
    U, Wm, decay_to_end, chunk_decay = (t.unbind(2) for t in (U, Wm, decay_to_end, chunk_decay))
    S = state
    states, values = [], []
    for n in range(N):
        Vn = U[n] if S is None else U[n] - Wm[n] @ S       # beta_j r_j for every token of the chunk
        states.append(torch.zeros(B, H, dk, dv, dtype=q.dtype) if S is None else S)
        values.append(Vn)
        S = decay_to_end[n] @ Vn if S is None else chunk_decay[n] * S + decay_to_end[n] @ Vn
    # o = q e^G S_before + A V, for every chunk in one product
    o = torch.cat([qp, A], dim=-1) @ torch.cat([torch.stack(states, dim=2), torch.stack(values, dim=2)], dim=-2)
    o = o.reshape(B, H, N * C, dv)[:, :, :T]
    return (o, S) if return_state else o


class MLA(torch.nn.Module):
    """Gated MLA, NoPE, naive form (docs/kimi-k3.md 3.5.3): training needs every position at once."""

    silenced = False  # copy_ablation: the layer's attention output switched off (never in training)

    def __init__(self, d):
        super().__init__()
        self.d = d
        lin = lambda o, i: torch.nn.Parameter(torch.randn(o, i) * (i ** -0.5))  # noqa: E731
        self.q_a_proj = lin(d.Q, d.D)
        self.q_a_layernorm = torch.nn.Parameter(torch.ones(d.Q))
        self.q_b_proj = lin(d.H * (d.N + d.X), d.Q)
        self.kv_a_proj_with_mqa = lin(d.R + d.X, d.D)
        self.kv_a_layernorm = torch.nn.Parameter(torch.ones(d.R))
        self.kv_b_proj = lin(d.H * (d.N + d.Dv), d.R)
        self.g_proj = lin(d.H * d.Dv, d.D)
        self.o_proj = torch.nn.Parameter(torch.randn(d.D, d.H * d.Dv) * (d.H * d.Dv) ** -0.5 / math.sqrt(2 * d.L))

    def forward(self, u, record=None, cache=None):
        """u [B, T, D] -> [B, T, D]; with `cache` (as KDA's) the keys and values of the earlier calls' tokens
        are kept and the new tokens attend to them too."""
        d = self.d
        B, T, _ = u.shape
        proj = mm(u, torch.cat([self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj]))   # q_a | kv_a | gate
        cq, c, kx, gate = proj.split([d.Q, d.R, d.X, d.H * d.Dv], dim=-1)
        q = mm(rms_normalize(cq, 1e-6) * self.q_a_layernorm, self.q_b_proj).reshape(B, T, d.H, d.N + d.X)
        c = rms_normalize(c, 1e-6) * self.kv_a_layernorm
        kv = mm(c, self.kv_b_proj).reshape(B, T, d.H, d.N + d.Dv)
        k_nope, value = kv.split([d.N, d.Dv], dim=-1)
        key = torch.cat([k_nope, kx[:, :, None, :].expand(B, T, d.H, d.X)], dim=-1)
        if cache is not None:
            if "key" in cache:
                key, value = torch.cat([cache["key"], key], dim=1), torch.cat([cache["value"], value], dim=1)
            cache["key"], cache["value"] = key, value
        S = key.shape[1]
        scores = bmm(q.transpose(1, 2), key.permute(0, 2, 3, 1)) * (d.N + d.X) ** -0.5    # [B, H, T, S]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        if record is not None:
            record["mla_probs"] = probs.detach()
        attn = bmm(probs, value.transpose(1, 2)).transpose(1, 2).reshape(B, T, d.H * d.Dv)
        if self.silenced:
            attn = torch.zeros_like(attn)
        return mm(attn * torch.sigmoid(gate), self.o_proj)


class DenseFFN(torch.nn.Module):
    def __init__(self, d, width, prefix=""):
        super().__init__()
        self.d = d
        self.gate_proj = torch.nn.Parameter(torch.randn(width, d.D) * d.D ** -0.5)
        self.up_proj = torch.nn.Parameter(torch.randn(width, d.D) * d.D ** -0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(d.D, width) * width ** -0.5 / math.sqrt(2 * d.L))

    def forward(self, x):
        a, b = mm(x, torch.cat([self.gate_proj, self.up_proj])).split(self.gate_proj.shape[0], dim=-1)
        return mm(situ(a, b, self.d), self.down_proj)


class MoE(torch.nn.Module):
    """Latent MoE + shared experts (docs/kimi-k3.md 3.6)."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.gate = torch.nn.Parameter(torch.randn(d.E, d.D) * d.D ** -0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(d.E))
        self.routed_expert_down_proj = torch.nn.Parameter(torch.randn(d.Lt, d.D) * d.D ** -0.5)
        self.routed_expert_norm = torch.nn.Parameter(torch.ones(d.Lt))
        self.routed_expert_up_proj = torch.nn.Parameter(torch.randn(d.D, d.Lt) * d.Lt ** -0.5 / math.sqrt(2 * d.L))
        self.w1 = torch.nn.Parameter(torch.randn(d.E, d.F, d.Lt) * d.Lt ** -0.5)   # gate
        self.w3 = torch.nn.Parameter(torch.randn(d.E, d.F, d.Lt) * d.Lt ** -0.5)   # up
        self.w2 = torch.nn.Parameter(torch.randn(d.E, d.Lt, d.F) * d.F ** -0.5)    # down
        self.shared = DenseFFN(d, d.S)
        self.quantize = False        # MXFP4 in the loop (QAT phase)
        self.rounded = None          # (the weights' versions, w13 and w2 rounded to MXFP4): rounded_experts
        self.load = None             # tokens per expert in the last forward (for the bias update)

    @torch.no_grad()
    def rounded_experts(self):
        """The experts rounded to MXFP4, [E, 2F, Lt] gate | up and [E, Lt, F], computed again only when a
        weight has changed since (the optimizer's step, a loaded state: every in-place change bumps a
        tensor's version): a training step's forwards, and greedy decoding's, round them once."""
        key = (self.w1._version, self.w3._version, self.w2._version)
        if self.rounded is None or self.rounded[0] != key:
            self.rounded = (key, mxfp4_round(torch.cat([self.w1, self.w3], dim=1)), mxfp4_round(self.w2))
        return self.rounded[1:]

    def forward(self, x, record=None):
        d = self.d
        shape = x.shape
        x = x.reshape(-1, d.D)
        scores = torch.sigmoid(F.linear(x, self.gate))                             # [N, E], float32: it selects
        ids = torch.topk(scores.detach() + self.e_score_correction_bias, d.K, dim=-1).indices  # selection only
        w = torch.gather(scores, 1, ids)
        if d.K > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * d.scaling
        z = mm(x, self.routed_expert_down_proj)                                    # [N, Lt]
        # Every expert runs on the tokens that chose it, all experts in one batched product: the
        # (token, slot) pairs sorted by expert, padded to the busiest expert's count (the balancing bias
        # keeps that near the mean), padding rows point at an extra zero row of z.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=d.E)
        self.load = counts.detach()
        # padded to a multiple of 32: oneDNN compiles and caches a kernel per shape, and a new `cap` every
        # step grew the process by tens of MB a step (5.1 GB after 8 steps, 6.3 GB after about 20)
        cap = -(-int(counts.max()) // 32) * 32
        starts = torch.cumsum(counts, 0) - counts
        sorted_ids = flat[order]
        rank = torch.arange(flat.numel()) - starts[sorted_ids]                     # position within its expert
        slot = torch.full((d.E, cap), z.shape[0], dtype=torch.int64)             # z.shape[0] = the zero row
        slot[sorted_ids, rank] = order // d.K
        gathered = torch.cat([z, z.new_zeros(1, d.Lt)])[slot]                     # [E, cap, Lt]
        w13, w2 = torch.cat([self.w1, self.w3], dim=1), self.w2                   # [E, 2F, Lt]: gate | up
        if self.quantize:                                                         # blocks run along Lt / F
            r13, r2 = self.rounded_experts()
            w13, w2 = (straight_through(w13, r13), straight_through(w2, r2)) if torch.is_grad_enabled() else (r13, r2)
        h = situ(*bmm(gathered, w13.transpose(1, 2)).split(d.F, dim=-1), d)       # [E, cap, F]
        pair_weight = torch.zeros(d.E, cap).index_put((sorted_ids, rank), w.reshape(-1)[order])
        out = bmm(h * pair_weight[..., None], w2.transpose(1, 2))                 # [E, cap, Lt], weighted
        y_lat = torch.zeros(z.shape[0] + 1, d.Lt).index_add(0, slot.reshape(-1), out.reshape(-1, d.Lt))[:-1]
        if record is not None:
            record["moe_ids"] = ids.detach().reshape(*shape[:-1], d.K)
        y = mm(rms_normalize(y_lat, d.eps) * self.routed_expert_norm, self.routed_expert_up_proj)
        return (y + self.shared(x)).reshape(shape)


class Candidate:
    """One AttnRes candidate v [B, T, D] with its 1 / rms(v) [B, T, 1], computed once however many mixes
    read it (a banked block is read by every later layer's two mixes)."""

    def __init__(self, v, eps):
        self.v = v
        self.inv_rms = 1.0 / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps)


def attn_res_mix(cands, norm_w, proj_w):
    """Block AttnRes over depth (docs/kimi-k3.md 3.2): pi = softmax_i((v_i / rms(v_i)) . w), mix = sum_i pi_i v_i
    (keys RMS-normalised, values raw), with w = norm (x) proj. (v_i / rms) . w = (v_i . w) / rms: the
    normalised candidates are never materialised."""
    w = norm_w * proj_w[0]
    scores = torch.cat([(c.v @ w).unsqueeze(-1) * c.inv_rms for c in cands], dim=-1)   # [B, T, n]
    pi = torch.softmax(scores, dim=-1)
    out = cands[0].v * pi[..., 0:1]
    for i in range(1, len(cands)):
        out = out + cands[i].v * pi[..., i:i + 1]
    return out, pi


class Layer(torch.nn.Module):
    def __init__(self, d, l):
        super().__init__()
        D = d.D
        self.input_layernorm = torch.nn.Parameter(torch.ones(D))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(D))
        self.self_attention_res_norm = torch.nn.Parameter(torch.ones(D))
        self.self_attention_res_proj = torch.nn.Parameter(torch.zeros(1, D))
        self.mlp_res_norm = torch.nn.Parameter(torch.ones(D))
        self.mlp_res_proj = torch.nn.Parameter(torch.zeros(1, D))
        self.self_attn = KDA(d) if d.kinds[l] == "kda" else MLA(d)
        self.ffn = MoE(d) if d.moe[l] else DenseFFN(d, d.I)


class LittleK3(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.embed_tokens = torch.nn.Parameter(torch.randn(d.V, d.D))
        self.layers = torch.nn.ModuleList(Layer(d, l) for l in range(d.L))
        self.norm = torch.nn.Parameter(torch.ones(d.D))
        self.output_attn_res_norm = torch.nn.Parameter(torch.ones(d.D))
        self.output_attn_res_proj = torch.nn.Parameter(torch.zeros(1, d.D))
        self.lm_head = torch.nn.Parameter(torch.randn(d.V, d.D) * d.D ** -0.5)

    def forward(self, ids, record=None, cache=None):
        """ids [B, T] -> logits [B, T, V]: Moonshot's AttnRes procedure, as tools/k3_reference.py. With
        `cache` (a list of one empty dict per layer at the first call) ids are the tokens after those of the
        earlier calls, and the attention layers keep what those need (greedy_batch)."""
        d = self.d
        h = Candidate(self.embed_tokens[ids], d.eps)
        bank = []
        for l, layer in enumerate(self.layers):
            rec = {} if record is not None else None
            partial = h
            if bank:
                x, _ = attn_res_mix(bank + [partial], layer.self_attention_res_norm, layer.self_attention_res_proj)
            else:
                x = partial.v
            if l % d.block == 0:
                bank = bank + [partial]
                partial = None
            a = layer.self_attn(rms_normalize(x, d.eps) * layer.input_layernorm, rec, None if cache is None else cache[l])
            partial = Candidate(a if partial is None else partial.v + a, d.eps)
            x, _ = attn_res_mix(bank + [partial], layer.mlp_res_norm, layer.mlp_res_proj)
            u = rms_normalize(x, d.eps) * layer.post_attention_layernorm
            m = layer.ffn(u, rec) if d.moe[l] else layer.ffn(u)
            h = Candidate(partial.v + m, d.eps)
            if record is not None:
                record.append(rec)
        x, _ = attn_res_mix(bank + [h], self.output_attn_res_norm, self.output_attn_res_proj)
        return mm(rms_normalize(x, d.eps) * self.norm, self.lm_head)

    def moe_layers(self):
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]


@torch.no_grad()
def induction_init(model):
    """--induction-init: start every KDA layer able to copy (fixtures/little-k3/TRAINING.md, "How the
    copying recipe was found"). Each channel's decay (before its token-dependent part) spread
    log-uniformly over 0.001-1 nats per token, where the default start forgets everything past ten tokens
    or so; and in the first half of each layer's key channels (heads 0 and 1) a key that is the query of
    the token before: the convolution takes the previous token, the projection is the query's. Then at a
    token seen before, q . k is largest at the token after its last occurrence, and the state returns
    that token's value: an induction memory from step 0. Weights only: the release layout is unchanged."""
    for layer in model.layers:
        a = layer.self_attn
        if not isinstance(a, KDA):
            continue
        d = a.d
        g = torch.exp(torch.linspace(math.log(1e-3), 0.0, d.Dh))   # |g| per channel of a head
        z = torch.log(g / -d.lb) - torch.log1p(g / d.lb)             # g = lb * sigmoid(A z)
        A = torch.exp(a.A_log)
        a.dt_bias.copy_(torch.cat([z / A[h] for h in range(d.Hk)]))
        half = d.P // 2
        a.k_conv[:half, 0, d.Wc - 1] -= 1.0
        a.k_conv[:half, 0, d.Wc - 2] += 1.0
        a.k_proj[:half] = a.q_proj[:half]


# ================================================================================================
# 3. Data: the corpus through the engine's tokenizer, plus the synthetic chat and recall parts
# ================================================================================================


def build_tokenizer_tool(work):
    """Compile tools/tokenize_jsonl.cpp (the engine's chapter-14 tokenizer) into the work folder."""
    exe = os.path.join(work, "tokenize_jsonl")
    src = os.path.join(TOOLS_DIR, "tokenize_jsonl.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["g++", "-std=c++20", "-O2", "-I", REPO, src, "-o", exe], check=True)
    return exe


def tokenize_strings(exe, model_dir, strings):
    """Engine token ids of each string (one process for all of them)."""
    payload = "".join(json.dumps(s) + "\n" for s in strings).encode("utf-8")
    out = subprocess.run([exe, model_dir], input=payload, capture_output=True, check=True).stdout.decode("ascii")
    lines = out.split("\n")[: len(strings)]
    return [[int(t) for t in line.split(",")] if line else [] for line in lines]


def read_documents(data_dir, split):
    """Documents of one split of tools/little_corpus.py's output: the split's text file cut at the byte
    offsets its manifest gives (one paragraph per line); [{"id": name, "text": text}]."""
    with open(os.path.join(data_dir, "manifest.json")) as f:
        entry = json.load(f)["splits"][split]
    with open(os.path.join(data_dir, entry["file"]), "rb") as f:
        data = f.read()
    return [{"id": d["name"], "text": data[d["offset"]:d["offset"] + d["bytes"]].decode("utf-8")} for d in entry["documents"]]


class ChatRenderer:
    """K3's XTML chat format (docs/kimi-k3.md section 4) as token ids, exactly as chapter 15 renders it:
    structural markers are special ids, every text segment is encoded on its own; attributes in the
    order role, type, name, tool, index, values escaped (& -> &amp;, " -> &quot;)."""

    def __init__(self, encode):
        self.encode = encode   # list of strings -> list of id lists (batched)
        self.segments = []     # ("special", id) or ("text", string)
        self.calls = []        # (tool, arguments) of every assistant call, in order
        self.user_end = []     # len(segments) after each user message (evaluation prompts cut there)

    def special(self, name):
        self.segments.append(("special", SPECIAL[name]))

    def text(self, s):
        if s:
            self.segments.append(("text", s))

    def open(self, tag):
        self.special("<|open|>"), self.text(tag), self.special("<|sep|>")

    def close(self, tag):
        self.special("<|close|>"), self.text(tag), self.special("<|sep|>")

    @staticmethod
    def attr(key, value):
        return f' {key}="' + str(value).replace("&", "&amp;").replace('"', "&quot;") + '"'

    def thinking_effort(self, effort):
        """The message that opens a chat with thinking on (chapter 15's thinking_effort_text)."""
        self.message("system", "`thinking_effort` guides on how much to think in your thinking channel (not including "
                     "the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the "
                     f"system is invoked with `thinking_effort={effort}`.", type="thinking-effort")

    def message(self, role, content, think=None, type=None, tool=None, index=None, tool_calls=()):
        tag = "message" + self.attr("role", role) + (self.attr("type", type) if type else "")
        if tool is not None:
            tag += self.attr("tool", tool) + self.attr("index", index)
        self.open(tag)
        if role == "assistant":
            if think is not None:
                self.open("think"), self.text(think), self.close("think")
            self.open("response"), self.text(content), self.close("response")
            if tool_calls:
                self.open("tools")
                for k, (name, args) in enumerate(tool_calls):
                    self.calls.append((name, dict(args)))
                    self.open("call" + self.attr("tool", name) + self.attr("index", k + 1))
                    for key, value in args.items():
                        self.open("argument" + self.attr("key", key) + self.attr("type", "string"))
                        self.text(value), self.close("argument")
                    self.close("call")
                self.close("tools")
        else:
            self.text(content)
        self.close("message")
        self.special("<|end_of_msg|>")
        if role == "user":
            self.user_end.append(len(self.segments))

    def generation_prompt(self, think=False):
        self.open("message" + self.attr("role", "assistant"))
        self.open("think" if think else "response")


def render_many(samples, encode):
    """samples: lists of segments -> id lists, tokenizing every distinct text segment once."""
    texts = sorted({s for sample in samples for kind, s in sample if kind == "text"})
    ids = dict(zip(texts, encode(texts)))
    out = []
    for sample in samples:
        seq = []
        for kind, s in sample:
            seq.extend([s] if kind == "special" else ids[s])
        out.append(seq)
    return out


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


ABBREVIATIONS = {"Mr.", "Mrs.", "Ms.", "Dr.", "St.", "Jr.", "Sr.", "Gov.", "Gen.", "Sen.", "Rep.", "Lt.", "Col.",
                 "Capt.", "Sgt.", "Prof.", "Rev.", "Mt.", "No.", "Co.", "Inc.", "Ltd.", "Vs.", "vs.", "U.S.", "e.g.", "i.e."}


def sentences_of(text):
    """Sentences of a paragraph: cut after . ! ? before a capital or quote, except after a title or a
    single initial (Mr. Dooley, Gov. Price Daniel, I. A. P. A.)."""
    out = []
    for piece in SENTENCE_END.split(text.replace("\n", " ")):
        piece = piece.strip()
        last = out[-1].rsplit(" ", 1)[-1] if out else ""
        if out and (last in ABBREVIATIONS or re.fullmatch(r"[A-Z]\.", last)):
            out[-1] += " " + piece
        elif piece:
            out.append(piece)
    return [s for s in out if len(s) > 1]


def synthetic_parts(train_docs, held_docs, rng):
    """The seeded synthetic data (tools/little_chat.py): chat conversations for the training stream,
    copy passages for the copy stream, and the held-out chat test prompts (from held-out documents)."""
    paragraphs = [p for doc in train_docs for p in doc["text"].split("\n") if len(sentences_of(p)) >= 2]
    held_paragraphs = [p for doc in held_docs for p in doc["text"].split("\n") if len(sentences_of(p)) >= 3]
    words = sorted({w.strip(".,;:!?\"'()") for p in paragraphs[:4000] for w in p.split()
                    if w.strip(".,;:!?\"'()").isalpha() and 3 <= len(w) <= 10})
    return paragraphs, held_paragraphs, words


DATA_VERSION = 2   # part of the token cache's stamp: 2 = little_chat.py's chat, copy stream, test prompts


class Corpus:
    """The training stream, the copy stream and the held-out documents, as token ids (cached in the work
    folder: a resumed run reads the same data back).

    stream       the training documents and seeded chat conversations (a share `chat_share` of the
                 tokens), each followed by [EOS], in a seeded shuffled order
    copy_stream  copy passages (tools/little_chat.py copy_text), as many tokens as `copy_tokens` x the
                 plain tokens; batch() draws a share of each batch from it (the copy curriculum)
    heldout      the held-out documents (no step of training sees them), and chat_tests: 20 chat test
                 prompts made from held-out passages with their own seed."""

    def __init__(self, data_dir, work, model_dir, chat_share=0.15, copy_tokens=0.25):
        cache = os.path.join(work, "tokens.pt")
        manifest = os.path.join(data_dir, "manifest.json")
        key = open(manifest, "rb").read() + open(os.path.join(model_dir, "tiktoken.model"), "rb").read()
        stamp = str(hash_bytes(key)) + repr((chat_share, copy_tokens, DATA_VERSION))
        if os.path.exists(cache):
            c = torch.load(cache)
            if c.get("stamp") == stamp:
                self.__dict__.update(c)
                self.model_dir = model_dir
                return
        exe = build_tokenizer_tool(work)
        encode = lambda strings: tokenize_strings(exe, model_dir, strings)  # noqa: E731
        train_docs = read_documents(data_dir, "train")
        held_docs = read_documents(data_dir, "heldout")
        t0 = time.time()
        train_ids = encode([d["text"] for d in train_docs])
        held_ids = encode([d["text"] for d in held_docs])
        n_plain = sum(len(x) for x in train_ids)
        rng = random.Random(SEED)
        paragraphs, held_paragraphs, words = synthetic_parts(train_docs, held_docs, rng)
        # chat: sampled until it holds chat_share of the stream (a conversation is ~120 tokens)
        want = int(n_plain * chat_share / (1 - chat_share))
        chats, kinds, n_chat = [], collections.Counter(), 0
        while n_chat < want:
            batch = [little_chat.chat_sample(rng, ChatRenderer, paragraphs, sentences_of) for _ in range(2000)]
            ids = render_many([seg for seg, _ in batch], encode)
            for x, (_, kind) in zip(ids, batch):
                chats.append(x)
                kinds[kind] += len(x) + 1
                n_chat += len(x) + 1
        copies, n_copy = [], 0
        while n_copy < copy_tokens * n_plain:
            texts = [little_chat.copy_text(rng, paragraphs, words) for _ in range(2000)]
            for x in encode(texts):
                copies.append(x)
                n_copy += len(x) + 1
        tests = little_chat.eval_chat_prompts(random.Random(SEED + 1), ChatRenderer, held_paragraphs, sentences_of)
        test_ids = render_many([t["segments"] for t in tests], encode)
        eos = SPECIAL["[EOS]"]
        pieces = [ids + [eos] for ids in train_ids] + [ids + [eos] for ids in chats]
        rng.shuffle(pieces)
        dtype = torch.int16 if VOCAB < 32768 else torch.int32
        self.stream = torch.tensor([t for p in pieces for t in p], dtype=dtype)
        self.copy_stream = torch.tensor([t for p in copies for t in p + [eos]], dtype=dtype)
        self.chat_tests = [dict(t, ids=x, segments=None) for t, x in zip(tests, test_ids)]
        self.heldout = [torch.tensor(ids, dtype=torch.int64) for ids in held_ids]
        self.heldout_bytes = [len(d["text"].encode("utf-8")) for d in held_docs]
        self.heldout_names = [d["id"] for d in held_docs]
        self.train_plain_tokens = n_plain
        self.train_bytes = sum(len(d["text"].encode("utf-8")) for d in train_docs)
        self.synthetic_tokens = n_chat
        self.synthetic_kinds = dict(kinds)
        self.copy_tokens = n_copy
        self.train_ids_for_ngrams = train_ids
        self.stamp = stamp
        print(f"tokenized {len(train_docs)} + {len(held_docs)} documents in {time.time() - t0:.1f} s: "
              f"{n_plain} plain + {n_chat} chat training tokens ({dict(kinds)}), copy stream {n_copy}, "
              f"{sum(len(x) for x in held_ids)} held-out tokens", flush=True)
        torch.save(dict((k, v) for k, v in self.__dict__.items()), cache)
        self.model_dir = model_dir        # (not cached: the tokenizer's folder, for evaluations that need its words)

    def batch(self, rng, batch, seq, copy_share=0.0, span_share=0.0, warmup=False):
        """`batch` random windows of seq + 1 tokens: round(copy_share x batch) of them from the copy
        stream, round(span_share x batch) span rows (span_row), the rest from the training stream. In
        the copy warm-up (--copy-warmup), rows of nothing but random spans each written twice."""
        if warmup:
            w = torch.stack([self.span_pairs(rng, seq + 1) for _ in range(batch)])
            return w[:, :-1], w[:, 1:]
        n_copy = int(round(copy_share * batch))
        n_span = min(batch - n_copy, int(round(span_share * batch)))
        starts = torch.randint(0, len(self.stream) - seq - 1, (batch - n_copy,), generator=rng)
        copy_starts = torch.randint(0, len(self.copy_stream) - seq - 1, (n_copy,), generator=rng)
        rows = [self.stream[s:s + seq + 1].to(torch.int64) for s in starts.tolist()]
        for i in range(len(rows) - n_span, len(rows)):   # (no draws at all when span_share is 0: the
            rows[i] = self.span_row(rng, rows[i])        # batches without span rows are drawn as before)
        w = torch.stack(rows + [self.copy_stream[s:s + seq + 1].to(torch.int64) for s in copy_starts.tolist()])
        return w[:, :-1], w[:, 1:]

    def span_row(self, rng, text):
        """A window of training text with a span of 8-100 word tokens drawn at random from the vocabulary
        (a space and two or more letters) written into it twice, text before, between and after: only
        copying predicts the second span (--span-start, --span-end). The held-out figure's rows
        (random_span_rows) are made alike from held-out text: spans of 24-100 words of four or more letters."""
        n = len(text)
        length = draw(rng, 8, min(100, (n - 8) // 2))
        gap = draw(rng, 0, n - 2 * length - 8)
        pre = draw(rng, 0, n - 2 * length - gap)
        span = self.random_words(rng, length)
        return torch.cat([text[:pre], span, text[pre:pre + gap], span, text[pre + gap:]])[:n]

    def span_pairs(self, rng, n):
        """n tokens of random spans of 8-64 word tokens, each written twice in a row (the copy warm-up)."""
        parts, have = [], 0
        while have < n:
            span = self.random_words(rng, draw(rng, 8, 64))
            parts += [span, span]
            have += 2 * len(span)
        return torch.cat(parts)[:n]

    def random_words(self, rng, length):
        if getattr(self, "span_pool", None) is None:
            self.span_pool = torch.tensor(word_tokens(self.model_dir, 2))
        return self.span_pool[torch.randint(0, len(self.span_pool), (length,), generator=rng)]


def draw(rng, lo, hi):
    """A uniform integer in [lo, hi] from the torch generator rng (the batches' one: a resumed run
    draws the same)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=rng))


def copy_share_at(step, steps, start=0.3, end=0.05, until=0.5):
    """The copy curriculum: the share of each batch drawn from the copy stream, `start` at step 0 falling
    linearly to `end` at `until` of the run, `end` after that (induction heads form early; later the
    text itself has enough repeats to keep them)."""
    f = step / max(1, steps)
    return end if f >= until else start + (end - start) * f / until


def hash_bytes(b):
    import hashlib
    return hashlib.sha256(b).hexdigest()


# ================================================================================================
# 4. Evaluation: bits per byte on held-out text, and the n-gram baselines
# ================================================================================================


def heldout_windows(corpus, seq, limit_docs=None):
    """Each held-out document cut into consecutive windows of at most seq tokens (the first token of a
    document is not predicted: it has no context). Returns (inputs, targets) lists and total bytes."""
    pairs, nbytes = [], 0
    docs = list(range(len(corpus.heldout)))
    if limit_docs is not None:
        docs = docs[:limit_docs]
    for i in docs:
        ids = corpus.heldout[i]
        nbytes += corpus.heldout_bytes[i]
        for s in range(0, len(ids) - 1, seq):
            chunk = ids[s:s + seq + 1]
            if len(chunk) >= 2:
                pairs.append((chunk[:-1], chunk[1:]))
    return pairs, nbytes


@torch.no_grad()
def bits_per_byte(model, corpus, seq, limit_docs=None, batch=16):
    """Held-out cross-entropy in bits per byte of text: total nats / ln 2 / total UTF-8 bytes."""
    model.eval()
    pairs, nbytes = heldout_windows(corpus, seq, limit_docs)
    total = 0.0
    for i in range(0, len(pairs), batch):
        group = pairs[i:i + batch]
        n = max(len(x) for x, _ in group)
        x = torch.stack([F.pad(a, (0, n - len(a))) for a, _ in group])
        y = torch.stack([F.pad(b, (0, n - len(b)), value=-100) for _, b in group])
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum"))
    model.train()
    return total / math.log(2) / nbytes


def ngram_bits_per_byte(corpus, seq, order, limit_docs=None):
    """Unigram (order 1) or bigram (order 2) token model fitted on the training split's plain documents
    (add-one smoothing for the unigram; interpolated with the unigram for the bigram, weight tuned on
    nothing: lambda = 0.9 for seen contexts), scored on exactly the held-out positions the model is."""
    counts1 = torch.zeros(VOCAB, dtype=torch.float64)
    pair_counts = {}
    for ids in corpus.train_ids_for_ngrams:
        t = torch.tensor(ids)
        counts1 += torch.bincount(t, minlength=VOCAB).double()
        if order == 2:
            for a, b in zip(ids, ids[1:]):
                pair_counts[(a, b)] = pair_counts.get((a, b), 0) + 1
    p1 = (counts1 + 1) / (counts1.sum() + VOCAB)
    ctx = {}
    for (a, _b), c in pair_counts.items():
        ctx[a] = ctx.get(a, 0) + c
    pairs, nbytes = heldout_windows(corpus, seq, limit_docs)
    nats = 0.0
    for x, y in pairs:
        for a, b in zip(x.tolist(), y.tolist()):
            p = float(p1[b])
            if order == 2 and ctx.get(a):
                p = 0.9 * pair_counts.get((a, b), 0) / ctx[a] + 0.1 * p
            nats -= math.log(p)
    return nats / math.log(2) / nbytes


# ================================================================================================
# 5. Export: the release layout (docs/kimi-k3.md section 2)
# ================================================================================================


def bf16(t):
    return t.detach().to(torch.float32).to(torch.bfloat16)


def f32(t):
    return t.detach().to(torch.float32).contiguous()


def export_tensors(model, quantize=True):
    """Release names -> tensors, per layer in the order the shards store them, experts last (scattered).
    quantize=False leaves the experts out (for loading, which only needs the trunk's names)."""
    d = model.d
    per_layer = []
    for l, layer in enumerate(model.layers):
        p = f"language_model.model.layers.{l}."
        trunk = {p + "input_layernorm.weight": bf16(layer.input_layernorm),
                 p + "post_attention_layernorm.weight": bf16(layer.post_attention_layernorm),
                 p + "self_attention_res_norm.weight": bf16(layer.self_attention_res_norm),
                 p + "self_attention_res_proj.weight": bf16(layer.self_attention_res_proj),
                 p + "mlp_res_norm.weight": bf16(layer.mlp_res_norm),
                 p + "mlp_res_proj.weight": bf16(layer.mlp_res_proj)}
        a, s = layer.self_attn, p + "self_attn."
        if isinstance(a, KDA):
            A_log = torch.zeros(d.Dh)
            A_log[: d.Hk] = a.A_log.detach()        # stored [head_dim], zero-padded past num_heads, as the release
            trunk.update({s + "q_proj.weight": bf16(a.q_proj), s + "k_proj.weight": bf16(a.k_proj),
                          s + "v_proj.weight": bf16(a.v_proj), s + "q_conv1d.weight": f32(a.q_conv),
                          s + "k_conv1d.weight": f32(a.k_conv), s + "v_conv1d.weight": f32(a.v_conv),
                          s + "f_a_proj.weight": bf16(a.f_a_proj), s + "f_b_proj.weight": bf16(a.f_b_proj),
                          s + "A_log": f32(A_log), s + "dt_bias": f32(a.dt_bias), s + "b_proj.weight": bf16(a.b_proj),
                          s + "g_proj.weight": bf16(a.g_proj), s + "o_norm.weight": f32(a.o_norm),
                          s + "o_proj.weight": bf16(a.o_proj)})
        else:
            trunk.update({s + "q_a_proj.weight": bf16(a.q_a_proj), s + "q_a_layernorm.weight": bf16(a.q_a_layernorm),
                          s + "q_b_proj.weight": bf16(a.q_b_proj),
                          s + "kv_a_proj_with_mqa.weight": bf16(a.kv_a_proj_with_mqa),
                          s + "kv_a_layernorm.weight": bf16(a.kv_a_layernorm), s + "kv_b_proj.weight": bf16(a.kv_b_proj),
                          s + "g_proj.weight": bf16(a.g_proj), s + "o_proj.weight": bf16(a.o_proj)})
        experts = []
        f = layer.ffn
        if isinstance(f, MoE):
            m = p + "block_sparse_moe."
            shared = {}
            if d.S > 0:
                shared = {m + "shared_experts.gate_proj.weight": bf16(f.shared.gate_proj),
                          m + "shared_experts.up_proj.weight": bf16(f.shared.up_proj),
                          m + "shared_experts.down_proj.weight": bf16(f.shared.down_proj)}
            trunk.update({m + "gate.weight": bf16(f.gate), m + "gate.e_score_correction_bias": f32(f.e_score_correction_bias),
                          m + "routed_expert_down_proj.weight": bf16(f.routed_expert_down_proj),
                          m + "routed_expert_norm.weight": bf16(f.routed_expert_norm),
                          m + "routed_expert_up_proj.weight": bf16(f.routed_expert_up_proj), **shared})
            order = torch.randperm(d.E, generator=torch.Generator().manual_seed(SEED + l)).tolist()  # not in id order
            for e in order if quantize else ():
                ex = {}
                for name, w in (("w1", f.w1[e]), ("w3", f.w3[e]), ("w2", f.w2[e])):
                    packed, scale = mxfp4.quantize(w.detach().to(torch.float64))
                    ex[f"{m}experts.{e}.{name}.weight_packed"] = packed
                    ex[f"{m}experts.{e}.{name}.weight_scale"] = scale
                experts.append(ex)
        else:
            trunk.update({p + "mlp.gate_proj.weight": bf16(f.gate_proj), p + "mlp.up_proj.weight": bf16(f.up_proj),
                          p + "mlp.down_proj.weight": bf16(f.down_proj)})
        per_layer.append((trunk, experts))
    return per_layer


def export(model, out_dir, provenance):
    """Write config.json, two shards and the index; the tokenizer files are already there."""
    os.makedirs(out_dir, exist_ok=True)
    per_layer = export_tensors(model)
    split = (len(per_layer) + 1) // 2
    shards = [{"language_model.model.embed_tokens.weight": bf16(model.embed_tokens)}, {}]
    for l, (trunk, experts) in enumerate(per_layer):
        shard = shards[0 if l < split else 1]
        shard.update(trunk)
        for ex in experts:
            shard.update(ex)
    shards[1].update({"language_model.model.norm.weight": bf16(model.norm),
                      "language_model.model.output_attn_res_norm.weight": bf16(model.output_attn_res_norm),
                      "language_model.model.output_attn_res_proj.weight": bf16(model.output_attn_res_proj),
                      "language_model.lm_head.weight": bf16(model.lm_head)})
    names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map, total = {}, 0
    for name, tensors in zip(names, shards):
        st.write(os.path.join(out_dir, name), tensors, {"format": "pt", **provenance})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")


def load_model(model_dir):
    """A checkpoint in the release layout (this script's export, or fixtures/tiny-k3) as a LittleK3 of its
    config: bf16 widened, MXFP4 dequantized, A_log sliced to num_heads. Evaluated with this module's
    forward, it is the model the engine runs."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    m = LittleK3(Dims(cfg.get("text_config", cfg)))
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors") and name.startswith("model"):
            tensors.update(st.read(os.path.join(model_dir, name))[0])
    with torch.no_grad():
        for l, (trunk, experts) in enumerate(export_tensors(m, quantize=False)):
            layer = m.layers[l]
            for name in trunk:
                t = tensors[name].to(torch.float32)
                short = name.split(f"layers.{l}.")[1]
                target = resolve(layer, short, m.d)
                if short.endswith("A_log"):
                    t = t[: m.d.Hk]
                target.copy_(t.reshape(target.shape))
            if isinstance(layer.ffn, MoE):
                p = f"language_model.model.layers.{l}.block_sparse_moe.experts."
                for e in range(m.d.E):
                    for wn in ("w1", "w2", "w3"):
                        w = mxfp4.dequantize(tensors[f"{p}{e}.{wn}.weight_packed"], tensors[f"{p}{e}.{wn}.weight_scale"])
                        getattr(layer.ffn, wn)[e].copy_(w.to(torch.float32))
        m.embed_tokens.copy_(tensors["language_model.model.embed_tokens.weight"].float())
        for name in ("norm", "output_attn_res_norm", "output_attn_res_proj"):
            getattr(m, name).copy_(tensors[f"language_model.model.{name}.weight"].float().reshape(getattr(m, name).shape))
        m.lm_head.copy_(tensors["language_model.lm_head.weight"].float())
    return m


def resolve(layer, short, d):
    """The parameter of a Layer behind a release name relative to the layer ('self_attn.q_proj.weight')."""
    table = {"input_layernorm.weight": layer.input_layernorm,
             "post_attention_layernorm.weight": layer.post_attention_layernorm,
             "self_attention_res_norm.weight": layer.self_attention_res_norm,
             "self_attention_res_proj.weight": layer.self_attention_res_proj,
             "mlp_res_norm.weight": layer.mlp_res_norm, "mlp_res_proj.weight": layer.mlp_res_proj}
    if short in table:
        return table[short]
    if short.startswith("self_attn."):
        attr = short[len("self_attn."):].replace(".weight", "").replace("_conv1d", "_conv")
        return getattr(layer.self_attn, attr)
    if short.startswith("mlp."):
        return getattr(layer.ffn, short[len("mlp."):].replace(".weight", ""))
    rest = short[len("block_sparse_moe."):]
    if rest == "gate.e_score_correction_bias":
        return layer.ffn.e_score_correction_bias
    if rest.startswith("shared_experts."):
        return getattr(layer.ffn.shared, rest[len("shared_experts."):].replace(".weight", ""))
    return getattr(layer.ffn, rest.replace(".weight", ""))


# ================================================================================================
# 6. Self-checks (run before training; --self-check runs only them)
# ================================================================================================


def self_check():
    """The chunked KDA equals the recurrence, the MXFP4 rounding equals tools/mxfp4.py, and export +
    reload round-trips a (random) model exactly."""
    g = torch.Generator().manual_seed(1)
    B, H, T, dk = 2, 3, 37, 16
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-4)):
        q = torch.randn(B, H, T, dk, generator=g, dtype=dtype)
        k = torch.randn(B, H, T, dk, generator=g, dtype=dtype)
        q, k = q / q.norm(dim=-1, keepdim=True) * dk ** -0.5, k / k.norm(dim=-1, keepdim=True)
        v = torch.randn(B, H, T, dk, generator=g, dtype=dtype)
        gate = -5.0 * torch.sigmoid(torch.randn(B, H, T, dk, generator=g, dtype=dtype) * 3)
        beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=dtype))
        ref = kda_recurrent(q, k, v, gate, beta)
        for C in (4, 8, 16):
            err = float((kda_chunked(q, k, v, gate, beta, C) - ref).abs().max() / ref.abs().max())
            print(f"self-check: chunked KDA (C={C}) vs recurrence, {dtype}: max rel error {err:.2e}")
            if not err < tol:
                raise SystemExit(f"self-check failed: chunked KDA disagrees with the recurrence ({err:.2e} >= {tol})")
        # gradients too (training differentiates the chunked form): float64, every input
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, gate, beta)]
        ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, gate, beta)]
        probe = torch.randn(ref.shape, generator=g, dtype=dtype)
        (kda_chunked(*inputs, 16) * probe).sum().backward()
        (kda_recurrent(*ref_inputs) * probe).sum().backward()
        err = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in zip(inputs, ref_inputs))
        print(f"self-check: chunked KDA gradients vs the recurrence's, {dtype}: max rel error {err:.2e}")
        if not err < tol:
            raise SystemExit(f"self-check failed: chunked KDA gradients disagree with the recurrence ({err:.2e} >= {tol})")
    # greedy decoding's cached forward (a prompt, then one token at a time) against the whole forward, on a
    # small random model with every kind of layer
    torch.manual_seed(2)
    small = LittleK3(Dims(TEXT_CONFIG))
    ids = torch.randint(0, VOCAB, (2, 21), generator=g)
    with torch.no_grad():
        whole = small(ids)
        cache = [{} for _ in small.layers]
        parts = [small(ids[:, :17], cache=cache)] + [small(ids[:, t:t + 1], cache=cache) for t in range(17, 21)]
    err = float((torch.cat(parts, dim=1) - whole).abs().max() / whole.abs().max())
    print(f"self-check: cached forward (17 tokens, then 1 at a time) vs the whole forward: max rel error {err:.2e}")
    if not err < 1e-5:
        raise SystemExit(f"self-check failed: the cached forward disagrees with the whole forward ({err:.2e})")
    # the short convolution against torch's conv1d (the definition), values and gradients
    x = torch.randn(2, 11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    taps = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 11, 6, generator=g, dtype=torch.float64)
    (short_conv(x, taps) * probe).sum().backward()
    mine = (short_conv(x, taps).detach(), x.grad.clone(), taps.grad.clone())
    x.grad, taps.grad = None, None
    defined = F.silu(F.conv1d(x.transpose(1, 2), taps, padding=3, groups=6)[..., :11].transpose(1, 2))
    (defined * probe).sum().backward()
    err = max(float((a - b).abs().max()) for a, b in zip(mine, (defined.detach(), x.grad, taps.grad)))
    print(f"self-check: short convolution vs conv1d (values, gradients), float64: max abs error {err:.2e}")
    if not err < 1e-12:
        raise SystemExit(f"self-check failed: the short convolution differs from conv1d ({err:.2e})")
    w = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g).float())
    w[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)   # every tie, exactly
    w[1] = 0.0
    r = mxfp4_round(w)
    theirs = mxfp4.dequantize(*mxfp4.quantize(w.double()))
    if not torch.equal(r.double(), theirs):
        raise SystemExit("self-check failed: mxfp4_round differs from tools/mxfp4.py")
    if not torch.equal(straight_through(w, r), r):
        raise SystemExit("self-check failed: the straight-through weight's value is not the rounded weight")
    print("self-check: MXFP4 rounding equals tools/mxfp4.py (ties included); the straight-through value is it")
    # the loop mask of --unlikelihood-steps: prompt 1 2 3 4 5, then 1 2 3 4 again and a 4-gram (3 4 9 3) once
    got = repeat_mask([1, 2, 3, 4, 5, 1, 2, 3, 4, 9, 3, 4, 9, 3], 5).tolist()
    if got != [0.0] * 5 + [1.0] * 4 + [0.0] + [1.0] * 4:
        raise SystemExit(f"self-check failed: repeat_mask marks {got}")
    # a reply's mask: the prompt's 1 2 3 4 copied is no loop, 7 8 9 6 twice is, and nothing after the stop 0
    got = repeat_mask([1, 2, 3, 4, 5, 1, 2, 3, 4, 7, 8, 9, 6, 7, 8, 9, 6, 0, 7, 8, 9, 6], 5, since=5, stop=(0,)).tolist()
    if got != [0.0] * 13 + [1.0] * 4 + [0.0] * 5:
        raise SystemExit(f"self-check failed: repeat_mask (reply) marks {got}")


# ================================================================================================
# 7. Training
# ================================================================================================


def update_router_bias(model, speed):
    """Aux-loss-free balancing: each expert's selection bias moves by `speed` toward the mean load."""
    for moe in model.moe_layers():
        load = moe.load.float()
        moe.e_score_correction_bias += speed * torch.sign(load.mean() - load)


class DataParallel:
    """--procs P: P processes on one machine, each running this script with --rank r; every step each computes
    the gradients of its micro-batches, and one all-reduce (gloo, in float32) sums them, with the loss and the
    experts' loads. With two processes and two micro-batches that sum is g0 + g1, exactly what one process
    accumulates, so every process applies the same step and holds the same weights; rank 0 alone logs,
    evaluates and checkpoints. The helpers die with rank 0 (PR_SET_PDEATHSIG)."""

    def __init__(self, args, argv):
        import torch.distributed as dist
        self.dist = dist
        self.helpers = []
        init = os.path.join(os.path.abspath(args.work), f"dist-{os.getppid() if args.rank else os.getpid()}")
        if args.rank == 0:
            if os.path.exists(init):
                os.remove(init)
            base = [sys.executable, os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None else argv)
            for r in range(1, args.procs):
                self.helpers.append(subprocess.Popen(base + ["--rank", str(r)], preexec_fn=self._die_with_parent))
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=args.rank, world_size=args.procs)

    @staticmethod
    def _die_with_parent():
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG

    def sum_step(self, model, losses, loads):
        # a parameter no process gave a gradient keeps none (AdamW then skips it, as in one process)
        present = torch.tensor([float(p.grad is not None) for p in model.parameters()])
        self.dist.all_reduce(present)
        params = [p for p, n in zip(model.parameters(), present.tolist()) if n > 0]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.dist.all_reduce(flat)
        at = 0
        for p in params:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        extra = torch.cat([torch.tensor(list(losses), dtype=torch.float64)] + [l.to(torch.float64).reshape(-1) for l in loads])
        self.dist.all_reduce(extra)
        out, at = [], len(losses)
        for l in loads:
            out.append(extra[at:at + l.numel()].to(l.dtype).view_as(l))
            at += l.numel()
        return tuple(float(v) for v in extra[:len(losses)]), out

    def close(self):
        self.dist.destroy_process_group()
        for h in self.helpers:
            h.wait()


def lr_at(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# --unlikelihood-steps: each step's text prompts (paragraph starts), their greedy continuation, the n-gram
# that counts as a loop; and its chat prompts (the stream's last tokens before an assistant's reply)
UL_PROMPTS, UL_PROMPT_LEN, UL_CONTINUE, UL_NGRAM = 16, 16, 48, 4
UL_CHAT_PROMPTS, UL_CHAT_PROMPT_LEN = 8, 96


def paragraph_starts(corpus):
    """Positions in the training stream just after a newline or [EOS] (the prompts of unlikelihood_part;
    kept on the corpus object, not in its cache)."""
    if getattr(corpus, "paragraph_start", None) is None:
        ends = [i for i, b in token_bytes(corpus.model_dir).items() if b.endswith(b"\n")] + [SPECIAL["[EOS]"]]
        s = corpus.stream[:-UL_PROMPT_LEN - 1].to(torch.int64)
        corpus.paragraph_start = torch.nonzero(torch.isin(s, torch.tensor(ends))).flatten() + 1
    return corpus.paragraph_start


def reply_starts(corpus):
    """Positions in the training stream where an assistant's response text begins (just after
    <|open|>response<|sep|>), with at least UL_CHAT_PROMPT_LEN tokens before them."""
    if getattr(corpus, "reply_start", None) is None:
        tail = corpus.chat_tests[0]["ids"]          # a generation prompt: it ends with <|open|>response<|sep|>
        tail = tail[len(tail) - 1 - tail[::-1].index(SPECIAL["<|open|>"]):]
        s = corpus.stream.to(torch.int64)
        hit = torch.ones(len(s) - len(tail) + 1, dtype=torch.bool)
        for j, t in enumerate(tail):
            hit &= s[j:len(s) - len(tail) + 1 + j] == t
        pos = torch.nonzero(hit).flatten() + len(tail)
        corpus.reply_start = pos[(pos >= UL_CHAT_PROMPT_LEN) & (pos < len(s) - 1)]
    return corpus.reply_start


def repeat_mask(row, start, n=UL_NGRAM, since=0, stop=()):
    """1.0 at the tokens of `row` from `start` on that belong to an n-gram seen earlier in the row at or
    after `since` (0: the whole row, prompt included; start: repeats inside the continuation only),
    nothing from the first token in `stop` on."""
    m = torch.zeros(len(row))
    seen = set()
    end = next((i for i in range(start, len(row)) if row[i] in stop), len(row))
    for i in range(since, end - n + 1):
        g = tuple(row[i:i + n])
        if g in seen and i + n > start:
            m[max(i, start):i + n] = 1.0
        seen.add(g)
    return m


def unlikelihood_part(model, corpus, rng, procs=1, rank=0):
    """Sequence-level unlikelihood training (Welleck et al. 2019, "Neural Text Generation with Unlikelihood
    Training", arXiv:1908.04319), the --unlikelihood-steps after the main run. The model continues
    UL_PROMPTS training-paragraph starts greedily for UL_CONTINUE tokens; every continuation token that
    belongs to a 4-gram seen earlier in its row is a token of a loop, and the loss -log(1 - p(token)) at
    each of them pushes its probability down, where it was chosen. The same for UL_CHAT_PROMPTS replies:
    the UL_CHAT_PROMPT_LEN stream tokens before an assistant's response text (the conversation so far)
    continued until the reply's text ends (its first special token), where only a 4-gram repeated inside
    the reply counts: a reply that quotes the passage it was given is doing its job. A text continuation
    ends at its first special token too: a paragraph inside a chat conversation runs into the next turn,
    where the closing tokens said once more are a repeated 4-gram, and pushing them down taught replies
    not to end. Both decode with the cache (greedy_batch). Tokens that are not
    part of a repeat add nothing, and the step's ordinary batch (the mix of the run's end, span rows
    included) holds on to the text and the copying learned; what the steps cost in both,
    fixtures/little-k3/TRAINING.md measures. Adds its gradient; returns its loss (this process's share;
    the shares sum to the step's)."""
    specials = tuple(SPECIAL.values())
    total = 0.0
    for starts, n, plen, chat in ((paragraph_starts(corpus), UL_PROMPTS, UL_PROMPT_LEN, False),
                                  (reply_starts(corpus), UL_CHAT_PROMPTS, UL_CHAT_PROMPT_LEN, True)):
        pick = starts[torch.randint(0, len(starts), (n,), generator=rng)].tolist()   # drawn alike by all
        if chat:
            prompts = [corpus.stream[p - plen:p].tolist() for p in pick][rank::procs]
        else:
            prompts = [corpus.stream[p:p + plen].tolist() for p in pick][rank::procs]
        if not prompts:                                   # more processes than prompts: none for this one
            continue
        conts = greedy_batch(model, prompts, UL_CONTINUE, specials)
        width = max(len(c) for c in conts)
        rows = [p + c + [c[-1]] * (width - len(c)) for p, c in zip(prompts, conts)]   # padding: masked out
        mask = torch.stack([repeat_mask(r, plen, since=plen if chat else 0, stop=specials)
                            for r in rows])[:, 1:]
        if not bool(mask.any()):
            continue
        rows = torch.tensor(rows)
        logp = F.log_softmax(model(rows[:, :-1]), -1).gather(-1, rows[:, 1:, None])[..., 0]
        loss = -(torch.log(torch.clamp(1 - logp.exp(), min=1e-5)) * mask).sum() / (n * UL_CONTINUE)
        loss.backward()
        total += float(loss)
    return total


def svg_curves(path, train_points, eval_points, title):
    """Training loss (bits per token, smoothed) and held-out bits per byte against tokens seen."""
    W, Hh, pad = 720, 360, 50
    xs = [p[0] for p in train_points + eval_points] or [1]
    xmax = max(xs)
    ys_t = [p[1] for p in train_points]
    ys_e = [p[1] for p in eval_points]
    ymax = max(ys_t + ys_e + [1.0])
    ymin = min(ys_t + ys_e + [0.0])

    def pt(x, y):
        return f"{pad + (W - 2 * pad) * x / xmax:.1f},{Hh - pad - (Hh - 2 * pad) * (y - ymin) / (ymax - ymin):.1f}"

    def line(points, color):
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(pt(x, y) for x, y in points)}"/>'

    ticks = "".join(f'<text x="{pad - 8}" y="{Hh - pad - (Hh - 2 * pad) * (v - ymin) / (ymax - ymin) + 4:.1f}" '
                    f'text-anchor="end" font-size="11">{v:.1f}</text>'
                    for v in [ymin + (ymax - ymin) * i / 5 for i in range(6)])
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif">'
           f'<rect width="100%" height="100%" fill="white"/>'
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>'
           f'<line x1="{pad}" y1="{Hh - pad}" x2="{W - pad}" y2="{Hh - pad}" stroke="black"/>'
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{Hh - pad}" stroke="black"/>{ticks}'
           f'<text x="{W / 2}" y="{Hh - 12}" text-anchor="middle" font-size="12">training tokens seen '
           f'(0 .. {xmax / 1e6:.1f} M)</text>'
           f'{line(train_points, "#1f77b4")}{line(eval_points, "#d62728")}'
           f'<text x="{W - pad - 250}" y="{pad + 10}" font-size="12" fill="#1f77b4">training loss, bits per byte (smoothed)</text>'
           f'<text x="{W - pad - 250}" y="{pad + 26}" font-size="12" fill="#d62728">held-out, bits per byte</text></svg>\n')
    with open(path, "w") as f:
        f.write(svg)


# glibc returns every large freed block to the OS and page-faults it back on the next allocation: with
# PyTorch allocating a fresh tensor per operation that made elementwise ops 10-20x slower on this
# project's VM (8 ms vs 0.4 ms for a 3 MB multiply). These keep freed memory in the process. glibc reads
# them at start-up, so main() re-executes the script once with them set.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736",
              "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}   # and oneDNN's kernel cache bounded (default 1024)


RUN_ARGS = ("steps", "qat_steps", "batch", "seq", "lr", "bias_speed", "threads", "procs", "micro_batch",
            "copy_curriculum", "copy_start", "copy_end", "induction_init", "span_start", "span_end",
            "copy_warmup", "unlikelihood_steps")
HOW_ARGS = ("threads", "procs", "micro_batch")   # recorded, but a resume may change them: the same steps


def main(argv=None):
    # OpenBLAS (the float32 products) keeps its own thread pool, sized to the machine unless told: give it
    # --threads too, before it loads.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=2)
    env = {**MALLOC_ENV, "OPENBLAS_NUM_THREADS": str(pre.parse_known_args(argv)[0].threads)}
    if argv is None and any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **env})
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="build/little-corpus", help="tools/little_corpus.py's output folder")
    ap.add_argument("--work", default="build/little-k3-train", help="checkpoints, token cache, logs")
    ap.add_argument("--out", default="fixtures/little-k3", help="the model folder (tokenizer files already there)")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--qat-steps", type=int, default=600, help="the last N steps train with MXFP4 experts in the loop")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bias-speed", type=float, default=1e-3, help="router bias step per training step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward (gradients summed over the batch)")
    ap.add_argument("--procs", type=int, default=1,
                    help="processes that share each step's micro-batches (data parallel over gloo, gradients summed: "
                         "the same step as one process; each runs --threads threads)")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)   # set for the helper processes
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--checkpoint-minutes", type=float, default=10.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no-copy-curriculum", dest="copy_curriculum", action="store_false",
                    help="draw no batch rows from the copy stream (copy_share_at gives the schedule)")
    ap.add_argument("--copy-start", type=float, default=0.3, help="share of each batch from the copy stream at step 0")
    ap.add_argument("--copy-end", type=float, default=0.05,
                    help="the share from mid-run on (it falls linearly from --copy-start until then)")
    ap.add_argument("--span-start", type=float, default=0.0,
                    help="share of each batch that is span rows (text with a random span written twice) at step 0")
    ap.add_argument("--span-end", type=float, default=0.0,
                    help="the span rows' share from mid-run on (it falls linearly from --span-start until then)")
    ap.add_argument("--copy-warmup", type=int, default=0,
                    help="the first N steps train on nothing but random spans written twice (span_pairs)")
    ap.add_argument("--unlikelihood-steps", type=int, default=0,
                    help="after --steps, N more steps at the final learning rate that also push down the tokens of "
                         "the model's own greedy loops (unlikelihood_part)")
    ap.add_argument("--induction-init", action="store_true",
                    help="start the KDA layers able to copy (induction_init: an induction memory from step 0)")
    ap.add_argument("--no-finish", action="store_true",
                    help="train and checkpoint only; export and measure later with --finish-only")
    ap.add_argument("--self-check", action="store_true", help="run the self-checks and stop")
    ap.add_argument("--bench", type=int, default=0, help="time N training steps and stop")
    ap.add_argument("--finish-only", action="store_true", help="export and measure the checkpoint in --work again")
    ap.add_argument("--eval-docs", type=int, default=None, help="measure on the first N held-out documents only (quick checks)")
    ap.add_argument("--measure", default=None, metavar="MODEL_DIR",
                    help="measure an exported model (bits per byte, copy accuracy, loops, router, chat) and stop")
    args = ap.parse_args(argv)
    micro_batches = -(-args.batch // args.micro_batch)
    if args.procs < 1 or args.procs > micro_batches:
        ap.error(f"--procs {args.procs}: each process takes whole micro-batches, and a batch of {args.batch} in "
                 f"micro-batches of {args.micro_batch} has {micro_batches}: give 1 to {micro_batches}")

    torch.set_num_threads(args.threads)
    if args.rank == 0:
        self_check()
    if args.self_check:
        return 0
    os.makedirs(args.work, exist_ok=True)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        if not os.path.exists(os.path.join(args.out, f)):
            raise SystemExit(f"{args.out}/{f} is missing: train the tokenizer first (see fixtures/README.md)")
    with open(os.path.join(args.out, "tiktoken.model"), "rb") as f:
        set_vocabulary(sum(1 for line in f if line.strip()))
    corpus = Corpus(args.data, args.work, args.out)
    if args.measure:
        m = load_model(args.measure)
        t = time.time()
        result = {"model": args.measure, "bits_per_byte": bits_per_byte(m, corpus, args.seq, limit_docs=args.eval_docs),
                  "router": router_stats(m, corpus, args.seq, limit_docs=args.eval_docs or 40),
                  **behaviour(m, corpus, args.measure, args.seq, args.eval_docs)}
        with open(os.path.join(args.work, "measure.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps({k: result[k] for k in ("bits_per_byte", "copy", "copy_ablation", "loops", "chat", "router_specialisation")}, indent=1))
        print(f"measured in {time.time() - t:.0f} s; all in {args.work}/measure.json", flush=True)
        return 0
    dp = DataParallel(args, argv) if args.procs > 1 and not args.finish_only else None
    torch.manual_seed(SEED)
    d = Dims(TEXT_CONFIG)
    model = LittleK3(d)
    if args.induction_init:
        induction_init(model)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "res_proj" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "res_proj" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data_rng = torch.Generator().manual_seed(SEED)
    state = {"step": 0, "seconds": 0.0, "train_points": [], "eval_points": [], "log": []}
    ckpt = os.path.join(args.work, "checkpoint.pt")
    ckpt_preqat = os.path.join(args.work, "checkpoint-before-qat.pt")
    if args.resume and os.path.exists(ckpt):
        c = torch.load(ckpt)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        data_rng.set_state(c["data_rng"])
        state = c["state"]
        if args.rank == 0:
            print(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)", flush=True)
    # what decides the run's steps: recorded at its start; a resumed run must be given the same (a changed
    # schedule would make a run no command describes), and --finish-only reports the recorded ones
    run_args = {k: getattr(args, k) for k in RUN_ARGS}
    if "run_args" not in state:
        if args.finish_only and state["step"] > 0:
            print("note: this checkpoint predates recorded run arguments: the summary gives this command's", flush=True)
        state["run_args"] = run_args
    elif not args.finish_only:
        changed = {k: (state["run_args"].get(k), v) for k, v in run_args.items()
                   if k not in HOW_ARGS and state["run_args"].get(k, v) != v}
        if changed:
            raise SystemExit(f"{ckpt}: this run was started with other arguments; resume it with the same ones: "
                             + ", ".join(f"--{k.replace('_', '-')} {a} (given {b})" for k, (a, b) in changed.items()))
    if args.rank == 0:
        print(f"little K3: {n_params / 1e6:.2f} M parameters; stream {len(corpus.stream)} tokens; "
              f"{args.steps} steps{f' + {args.unlikelihood_steps} unlikelihood steps' if args.unlikelihood_steps else ''} "
              f"of {args.batch} x {args.seq}; matrix products in "
              f"{'bfloat16 (AVX512-BF16)' if BF16_PRODUCTS else 'float32 (this CPU has no AVX512-BF16)'}; "
              f"{args.procs} process{'es' if args.procs > 1 else ''} of {args.threads} thread{'s' if args.threads > 1 else ''}", flush=True)
    tokens_per_step = args.batch * args.seq
    bytes_per_token = corpus.train_bytes / corpus.train_plain_tokens
    last_ckpt = time.time()
    smooth = None

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data_rng": data_rng.get_state(), "state": state},
                   ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    t_start = time.time() - state["seconds"]
    total_steps = args.steps + args.unlikelihood_steps
    while state["step"] < total_steps and not args.finish_only:
        step = state["step"]
        qat = step >= args.steps - args.qat_steps
        if qat and step == args.steps - args.qat_steps and not os.path.exists(ckpt_preqat):
            torch.save({"model": model.state_dict()}, ckpt_preqat)   # the float32 model, for the quality table
        for moe in model.moe_layers():
            moe.quantize = qat
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, min(200, max(1, args.steps // 15)))
        share = copy_share_at(step, args.steps, args.copy_start, args.copy_end) if args.copy_curriculum else 0.0
        x, y = corpus.batch(data_rng, args.batch, args.seq, share,
                            copy_share_at(step, args.steps, args.span_start, args.span_end), step < args.copy_warmup)
        t0, c0 = time.time(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss, loads, ul = 0.0, None, 0.0
        with low_precision(True):
            # micro-batches of --micro-batch rows, gradients summed: the same step in less memory
            # with --procs P, process r takes micro-batches r, r + P, ... (the batch is drawn alike by all)
            for k, i in enumerate(range(0, args.batch, args.micro_batch)):
                if k % args.procs != args.rank:
                    continue
                part = F.cross_entropy(model(x[i:i + args.micro_batch]).reshape(-1, VOCAB),
                                       y[i:i + args.micro_batch].reshape(-1)) * (len(x[i:i + args.micro_batch]) / args.batch)
                part.backward()
                loss += float(part)
                step_loads = [m.load for m in model.moe_layers()]
                loads = step_loads if loads is None else [a + b for a, b in zip(loads, step_loads)]
            if step >= args.steps:                       # after the main steps: the loops pushed down
                ul = unlikelihood_part(model, corpus, data_rng, args.procs, args.rank)
        if dp:
            (loss, ul), loads = dp.sum_step(model, (loss, ul), loads)
        for m, l in zip(model.moe_layers(), loads):
            m.load = l                                   # the bias update sees the whole batch's load
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            update_router_bias(model, args.bias_speed)
        dt = time.time() - t0
        state["step"] += 1
        state["seconds"] = time.time() - t_start
        bpb = loss / math.log(2) / bytes_per_token
        smooth = bpb if smooth is None else 0.98 * smooth + 0.02 * bpb
        if args.rank != 0:                                # a helper: no logging, evaluation or checkpoints
            if args.bench and state["step"] >= args.bench:
                return 0
            continue
        if args.bench:
            cpu = time.process_time() - c0
            print(f"step {step}: {dt:.3f} s, {tokens_per_step / dt:.0f} tokens/s, {cpu:.3f} s CPU "
                  f"({tokens_per_step / cpu:.0f} tokens per CPU second), loss {loss:.3f}, "
                  f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB", flush=True)
            if state["step"] >= args.bench:
                return 0
            continue
        if state["step"] % 25 == 0:
            state["train_points"].append((state["step"] * tokens_per_step, smooth))
        if state["step"] % 50 == 0:
            loads = [m.load.float() for m in model.moe_layers()]
            imbalance = max(float(l.max() / l.mean()) for l in loads)
            line = (f"step {state['step']}/{total_steps} {'QAT ' if qat else ''}loss {loss:.3f} "
                    + (f"unlikelihood {ul:.4f} " if step >= args.steps else "") +
                    f"(~{smooth:.3f} bits/byte) lr {opt.param_groups[0]['lr']:.2e} {tokens_per_step / dt:.0f} tok/s "
                    f"max/mean expert load {imbalance:.2f} elapsed {state['seconds'] / 60:.1f} min")
            print(line, flush=True)
            state["log"].append(line)
        if state["step"] % args.eval_every == 0 or state["step"] in (args.steps, total_steps):
            ev = bits_per_byte(model, corpus, args.seq, limit_docs=12)
            cp = copy_accuracy(model, corpus, args.seq, limit_docs=12)
            state["eval_points"].append((state["step"] * tokens_per_step, ev))
            state.setdefault("copy_points", []).append((state["step"] * tokens_per_step, cp["copy_accuracy"], cp["repeat_accuracy"]))
            top = max((v for heads in cp["repeat_induction_attention"].values() for v in heads), default=0.0)
            print(f"  held-out (first 12 documents): {ev:.4f} bits/byte, copy accuracy {cp['copy_accuracy']:.3f} "
                  f"({cp['copy_positions']} positions), on repeated spans {cp['repeat_accuracy']:.3f}, on random spans "
                  f"{cp['random_span_accuracy']:.3f} (the most induction "
                  f"attention of an MLA head {top:.3f}, uniform {cp['repeat_uniform_attention']:.3f})", flush=True)
            svg_curves(os.path.join(args.work, "loss.svg"), state["train_points"], state["eval_points"], "little K3 training")
        if time.time() - last_ckpt > args.checkpoint_minutes * 60:
            save()
            last_ckpt = time.time()
    if dp:
        dp.close()
    if args.rank != 0:
        return 0
    if not args.finish_only:
        save()
    if args.no_finish:
        print(f"trained {state['step']} steps in {state['seconds'] / 60:.1f} min; --no-finish: stopping", flush=True)
        return 0
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ra = {**run_args, **state["run_args"]}
    summary = {"steps": state["step"], "seconds": state["seconds"], "peak_rss_mb": peak_rss_mb,
               "tokens": state["step"] * ra["batch"] * ra["seq"], "params": n_params, "batch": ra["batch"], "seq": ra["seq"],
               "lr": ra["lr"], "qat_steps": ra["qat_steps"], "threads": ra["threads"], "bias_speed": ra["bias_speed"],
               "procs": ra["procs"], "copy_start": ra["copy_start"], "copy_end": ra["copy_end"],
               **{k: ra.get(k, 0) for k in ("induction_init", "span_start", "span_end", "copy_warmup", "unlikelihood_steps")}}
    summary_path = os.path.join(args.work, "train_summary.json")
    if args.finish_only and os.path.exists(summary_path):
        summary = json.load(open(summary_path))
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"trained {state['step']} steps in {state['seconds'] / 60:.1f} min, peak RSS {peak_rss_mb:.0f} MB", flush=True)
    finish(args, model, corpus, state, summary, ckpt_preqat)
    return 0


# ================================================================================================
# 8. After training: export, the quality table, router statistics, samples (for TRAINING.md)
# ================================================================================================


@torch.no_grad()
def router_stats(model, corpus, seq, limit_docs=40):
    """Per MoE layer on held-out text: max/mean expert load and the entropy of the load (bits; log2 E is
    perfectly even)."""
    model.eval()
    pairs, _ = heldout_windows(corpus, seq, limit_docs)
    counts = None
    full = [x for x, _y in pairs if len(x) == seq]            # whole windows only: no padding to route
    for i in range(0, len(full), 16):
        rec = []
        model(torch.stack(full[i:i + 16]), record=rec)
        layer_counts = [torch.bincount(r["moe_ids"].reshape(-1), minlength=model.d.E) for r in rec if "moe_ids" in r]
        counts = layer_counts if counts is None else [a + b for a, b in zip(counts, layer_counts)]
    rows = []
    for c in counts:
        p = c.double() / c.sum()
        entropy = float(-(p[p > 0] * torch.log2(p[p > 0])).sum())
        rows.append({"max_over_mean": float(c.max() / c.double().mean()), "entropy_bits": entropy,
                     "unused": int((c == 0).sum())})
    model.train()
    return rows


@torch.no_grad()
def greedy_continue(model, ids, steps):
    return greedy_batch(model, [list(ids)], steps, (SPECIAL["[EOS]"], SPECIAL["<|end_of_msg|>"]))[0]


def decode_ids(model_dir, ids):
    """Text of ids with the vocabulary in model_dir (BPE bytes; specials by name), for TRAINING.md."""
    ranks = token_bytes(model_dir)
    names = {v: k for k, v in SPECIAL.items()}
    out = b""
    for i in ids:
        out += ranks[i] if i in ranks else names.get(i, f"<|reserved_token_{i}|>").encode()
    return out.decode("utf-8", errors="replace")


def token_bytes(model_dir):
    ranks = {}
    with open(os.path.join(model_dir, "tiktoken.model")) as f:
        for line in f:
            if line.strip():
                b64, rank = line.split()
                ranks[int(rank)] = base64.b64decode(b64)
    return ranks


def word_tokens(model_dir, min_letters):
    """The vocabulary's word tokens, sorted: a space and at least min_letters letters (the spans of
    random_span_rows and of the training's span rows are drawn from these)."""
    return sorted(i for i, b in token_bytes(model_dir).items()
                  if i >= 256 and len(b) > min_letters and b[:1] == b" " and b[1:].isalpha())


def random_span_rows(corpus, seq, n=32, seed=SEED + 2):
    """n rows of seq + 1 tokens: held-out text, a span of 24-100 word tokens drawn at random from the
    vocabulary (a space and four or more letters), more held-out text, the same span again, held-out text
    to the end. Text cannot predict the second span; only copying from the first can. Returns the rows
    and, per row, (where the second span starts, its length)."""
    pool = word_tokens(corpus.model_dir, 4)
    rng = random.Random(seed)
    text = torch.cat(corpus.heldout).tolist()
    rows, marks = [], []
    for _ in range(n):
        length = rng.randint(24, 100)
        gap = rng.randint(0, seq + 1 - 2 * length - 8)
        pre = rng.randint(0, seq + 1 - 2 * length - gap)
        s = rng.randint(0, len(text) - 2 * seq)
        span = [rng.choice(pool) for _ in range(length)]
        row = text[s:s + pre] + span + text[s + pre:s + pre + gap] + span
        marks.append((len(row) - length, length))
        rows.append(row + text[s + pre + gap:s + pre + gap + seq + 1 - len(row)])
    return torch.tensor(rows, dtype=torch.int64), marks


def repeated_span_rows(full):
    """copy_accuracy's repeated spans: from the held-out windows `full`, 48 rows of a span A (64 tokens),
    another span B, then A again."""
    spans = [x[:64] for x, _ in full[: 2 * 48]]
    return [torch.cat([spans[2 * k], spans[2 * k + 1], spans[2 * k]]) for k in range(len(spans) // 2)]


@torch.no_grad()
def random_span_score(model, corpus, seq, batch=16):
    """On random_span_rows: at the second span's i-th token (i >= 1, having seen two of its tokens), is
    the argmax its (i+1)-th? Returns (hits, positions)."""
    hits = total = 0
    xs, marks = random_span_rows(corpus, seq)
    for i in range(0, len(xs), batch):
        pred = model(xs[i:i + batch, :-1]).argmax(-1)
        for p, y, (at, length) in zip(pred.tolist(), xs[i:i + batch, 1:].tolist(), marks[i:i + batch]):
            for t in range(at + 1, at + length - 1):
                total += 1
                hits += p[t] == y[t]
    return hits, total


@torch.no_grad()
def copy_ablation(model, corpus, seq, batch=16):
    """Which parts of the model copy: the random-span and repeated-span accuracies of copy_accuracy with
    chosen outputs switched off: heads of the KDA layers (their outputs zeroed before o_proj) or the
    MLA layers' attention (zeroed before the output gate). Layers are numbered from 1, as the schedule.
    Returns a list of (what was switched off, random-span accuracy, repeated-span accuracy)."""
    model.eval()
    pairs, _ = heldout_windows(corpus, seq)
    rows = torch.stack(repeated_span_rows([(x, y) for x, y in pairs if len(x) == seq]))
    kda = [(l + 1, layer.self_attn) for l, layer in enumerate(model.layers) if isinstance(layer.self_attn, KDA)]
    mla = [layer.self_attn for layer in model.layers if isinstance(layer.self_attn, MLA)]
    H = model.d.Hk
    low, high = tuple(range(H // 2)), tuple(range(H // 2, H))
    cases = [("nothing", [], False),
             (f"KDA heads {low[0]}-{low[-1]}, every KDA layer", [(a, low) for _, a in kda], False),
             (f"KDA heads {high[0]}-{high[-1]}, every KDA layer", [(a, high) for _, a in kda], False)]
    cases += [(f"KDA heads {low[0]}-{low[-1]} of layer {l}", [(a, low)], False) for l, a in kda]
    cases.append(("the attention of every MLA layer", [], True))
    out = []
    for name, heads, no_mla in cases:
        for a, hs in heads:
            a.silenced = hs
        for a in mla:
            a.silenced = no_mla
        span_hits, span_total = random_span_score(model, corpus, seq, batch)
        rep_hits = rep_total = 0
        for i in range(0, len(rows), batch):
            pred = model(rows[i:i + batch, :-1]).argmax(-1)[:, 128 + 1:191]
            rep_hits += int((pred == rows[i:i + batch, 1:][:, 128 + 1:191]).sum())
            rep_total += pred.numel()
        for _, a in kda:
            a.silenced = ()
        for a in mla:
            a.silenced = False
        out.append((name, round(span_hits / max(1, span_total), 3), round(rep_hits / max(1, rep_total), 3)))
    model.train()
    return out


@torch.no_grad()
def copy_accuracy(model, corpus, seq, limit_docs=None, batch=16):
    """Held-out copy accuracy. In every window of the held-out documents (as bits_per_byte cuts them),
    the positions t whose last two tokens (x[t-1], x[t]) occurred earlier in the window, at (x[j-1], x[j])
    for the latest such j < t, and where the token that followed there, x[j+1], is the true next token
    x[t+1]: the share of them where the model's argmax at t is x[t+1]. A model that copies gets these
    right; one that only knows common bigrams gets the share where the copy is also the likeliest bigram.
    Also: the same on repeated spans (a held-out span A of 64 tokens, another span B, then A again: the
    positions of the second A after its first two tokens), and there, for each MLA layer and head, the
    mean attention on the induction target (at A's i-th token the second time, the position of A's
    (i+1)-th the first time: what an induction head looks at) beside what uniform attention would give.
    And on random spans said twice (random_span_rows), which only copying predicts. Returns a dict."""
    model.eval()
    pairs, _ = heldout_windows(corpus, seq, limit_docs)
    full = [(x, y) for x, y in pairs if len(x) == seq]
    hits = total = 0
    for i in range(0, len(full), batch):
        xs = torch.stack([x for x, _ in full[i:i + batch]])
        ys = torch.stack([y for _, y in full[i:i + batch]])
        pred = model(xs).argmax(-1)
        for x, y, p in zip(xs.tolist(), ys.tolist(), pred.tolist()):
            last = {}
            for t in range(1, len(x)):
                j = last.get((x[t - 1], x[t]))
                if j is not None and x[j + 1] == y[t]:
                    total += 1
                    hits += p[t] == y[t]
                last[(x[t - 1], x[t])] = t
    rep_hits = rep_total = 0
    rows = repeated_span_rows(full)
    queries = torch.arange(129, 191)   # the second A's tokens 1..62: they predict tokens 130..191
    targets = queries - 128 + 1        # where the first A has the token each should predict
    mass = {}
    for i in range(0, len(rows), batch):
        xs = torch.stack(rows[i:i + batch])
        rec = []
        pred = model(xs[:, :-1], rec).argmax(-1)
        tgt = xs[:, 1:]
        sl = slice(128 + 1, 191)     # predictions of tokens 130..191 (the second A from its third token)
        rep_hits += int((pred[:, sl] == tgt[:, sl]).sum())
        rep_total += pred[:, sl].numel()
        for l, r in enumerate(rec):
            if "mla_probs" in r:   # [B, H, T, S]
                on = r["mla_probs"][:, :, queries, targets].sum(dim=(0, 2))
                mass[l + 1] = on if l + 1 not in mass else mass[l + 1] + on
    n = max(1, len(rows)) * len(queries)
    # random spans said twice (random_span_rows): at the second span's i-th token (i >= 1, having seen
    # two of its tokens), is the argmax its (i+1)-th?
    span_hits, span_total = random_span_score(model, corpus, seq, batch)
    model.train()
    return {"copy_accuracy": hits / max(1, total), "copy_positions": total,
            "random_span_accuracy": span_hits / max(1, span_total), "random_span_positions": span_total,
            "repeat_accuracy": rep_hits / max(1, rep_total), "repeat_positions": rep_total,
            "repeat_induction_attention": {f"layer {l}": [round(float(v) / n, 4) for v in m] for l, m in sorted(mass.items())},
            "repeat_uniform_attention": round(float((1.0 / (queries + 1).double()).mean()), 4)}


@torch.no_grad()
def greedy_batch(model, prompts, steps, stop=()):
    """Greedy continuations of equal-length prompts, all at once, each cut after its first token in
    `stop`; done when every row has stopped. The prompts run as one forward that fills a cache (KDA's
    state and convolution inputs, MLA's keys and values: LittleK3.forward), then each new token is one
    token's forward; self_check holds this to the whole forward (in training's bfloat16 products the two
    orders of work round a little differently, so a continuation can part from the whole forward's).
    (The experts' MXFP4 rounding, in the loop while training, is done once for all of it:
    MoE.rounded_experts.)"""
    if not prompts:
        return []
    ids = torch.tensor(prompts)
    out = []
    stopped = torch.zeros(len(prompts), dtype=torch.bool)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.int64)
    cache = [{} for _ in model.layers]
    for _ in range(steps):
        nxt = model(ids, cache=cache)[:, -1].argmax(-1)
        out.append(nxt)
        ids = nxt[:, None]
        stopped |= torch.isin(nxt, stop_ids)
        if bool(stopped.all()):
            break
    rows = torch.stack(out, dim=1).tolist()
    cut = []
    for r in rows:
        for k, t in enumerate(r):
            if t in stop:
                r = r[:k + 1]
                break
        cut.append(r)
    return cut


def has_repeat(ids, n=8):
    seen = set()
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i:i + n])
        if g in seen:
            return True
        seen.add(g)
    return False


@torch.no_grad()
def loop_share(model, corpus, n_prompts=40, prompt_len=16, steps=48):
    """The share of greedy continuations (48 tokens) of held-out prompts (16 tokens from the start of
    held-out paragraphs, spread over the documents) that contain a repeated 8-gram."""
    model.eval()
    nl = set(i for i, b in token_bytes_cache().items() if b.endswith(b"\n"))
    prompts = []
    for doc in corpus.heldout:
        ids = doc.tolist()
        starts = [0] + [k + 1 for k, t in enumerate(ids[:-prompt_len - 1]) if t in nl]
        prompts += [ids[s:s + prompt_len] for s in starts[::max(1, len(starts) // 3)][:3]]
    step = max(1, len(prompts) // n_prompts)
    prompts = prompts[::step][:n_prompts]
    conts = []
    for i in range(0, len(prompts), 20):
        conts += greedy_batch(model, prompts[i:i + 20], steps)
    model.train()
    return {"loop_share": sum(has_repeat(c) for c in conts) / len(conts), "prompts": len(conts)}, prompts, conts


_TOKEN_BYTES = {}


def token_bytes_cache():
    return _TOKEN_BYTES


FUNCTION_WORDS = {b" the", b" of", b" and", b" to", b" a", b" in", b" is", b" that", b" for", b" it", b" was",
                  b" on", b" with", b" as", b" he", b" his", b" by", b" at", b" be", b" this", b" not", b" or",
                  b" from", b" but", b" an", b" they", b" which", b" you", b" she", b" her", b" had", b" are"}


@torch.no_grad()
def router_specialisation(model, corpus, seq, limit_docs=40):
    """Per MoE layer, how far the experts chosen for digit tokens, punctuation tokens and function words
    are from the experts chosen for all tokens: the total variation distance between the two
    distributions of choices (0 = the same experts, 1 = disjoint)."""
    model.eval()
    tb = token_bytes_cache()
    classes = {"digits": lambda b: b.strip().isdigit(),
               "punctuation": lambda b: bool(b.strip()) and not any(chr(c).isalnum() for c in b),
               "function words": lambda b: b in FUNCTION_WORDS}
    pairs, _ = heldout_windows(corpus, seq, limit_docs)
    full = [x for x, _ in pairs if len(x) == seq]
    E = model.d.E
    counts = None
    for i in range(0, len(full), 16):
        xs = torch.stack(full[i:i + 16])
        rec = []
        model(xs, record=rec)
        ids = [r["moe_ids"] for r in rec if "moe_ids" in r]
        flat_tok = xs.reshape(-1)
        masks = {"all": torch.ones_like(flat_tok, dtype=torch.bool)}
        for name, f in classes.items():
            good = torch.tensor([f(tb.get(t, b"")) for t in range(VOCAB)])
            masks[name] = good[flat_tok]
        c = [{k: torch.bincount(l.reshape(-1, l.shape[-1])[m].reshape(-1), minlength=E).double() for k, m in masks.items()}
             for l in ids]
        counts = c if counts is None else [{k: a[k] + b[k] for k in a} for a, b in zip(counts, c)]
    rows = []
    for c in counts:
        p_all = c["all"] / c["all"].sum()
        rows.append({k: float(0.5 * (c[k] / c[k].sum().clamp(min=1) - p_all).abs().sum()) for k in classes})
    model.train()
    return rows


CLEAN_END = re.compile(r"^(?:(?!<\|open\|>|<\|close\|>).)*?<\|close\|>response<\|sep\|>"
                       r"(<\|open\|>tools<\|sep\|>.*<\|close\|>tools<\|sep\|>)?<\|close\|>message<\|sep\|><\|end_of_msg\|>$", re.S)
CALL_RE = re.compile(r'<\|open\|>call tool="([^"]*)" index="1"<\|sep\|>((?:<\|open\|>argument key="[^"]*" type="string"<\|sep\|>'
                     r'(?:(?!<\|).)*<\|close\|>argument<\|sep\|>)*)<\|close\|>call<\|sep\|>', re.S)
ARG_RE = re.compile(r'<\|open\|>argument key="([^"]*)" type="string"<\|sep\|>((?:(?!<\|).)*)<\|close\|>argument<\|sep\|>', re.S)


@torch.no_grad()
def chat_eval(model, corpus, model_dir, steps=96):
    """The held-out chat test prompts (greedy, thinking off): how many replies end cleanly (response,
    optional tools block, close of the message, <|end_of_msg|>), how many tool prompts get a well-formed
    call of the declared tool with its argument keys (and the right values), how many passage questions
    are answered (the reply contains the expected text)."""
    model.eval()
    stop = (SPECIAL["<|end_of_msg|>"], SPECIAL["[EOS]"])
    rows = []
    for t in corpus.chat_tests:
        out = greedy_batch(model, [t["ids"]], steps, stop)[0]
        text = decode_ids(model_dir, out)
        row = {"kind": t["kind"], "reply": text, "clean": bool(CLEAN_END.match(text))}
        if t["kind"] == "tool":
            m = CALL_RE.search(text)
            args = dict(ARG_RE.findall(m.group(2))) if m else {}
            row["well_formed"] = bool(m) and m.group(1) == t["tool"] and set(args) == set(t["args"]) and all(args.values())
            row["right_arguments"] = bool(m) and m.group(1) == t["tool"] and args == t["args"]
        if t["kind"] == "passage":
            row["answered"] = t["expect"].lower() in text.lower()
        rows.append(row)
    model.train()
    summary = {"clean": sum(r["clean"] for r in rows), "prompts": len(rows),
               "tool_well_formed": sum(r.get("well_formed", False) for r in rows),
               "tool_right_arguments": sum(r.get("right_arguments", False) for r in rows),
               "tool_prompts": sum(r["kind"] == "tool" for r in rows),
               "passage_answered": sum(r.get("answered", False) for r in rows),
               "passage_prompts": sum(r["kind"] == "passage" for r in rows)}
    return summary, rows


def behaviour(model, corpus, model_dir, seq, limit_docs=None):
    """Everything issue 26 measures beyond bits per byte, in one dict."""
    _TOKEN_BYTES.clear()
    _TOKEN_BYTES.update(token_bytes(model_dir))
    loops, prompts, conts = loop_share(model, corpus)
    chat, chat_rows = chat_eval(model, corpus, model_dir) if getattr(corpus, "chat_tests", None) else ({}, [])
    return {"copy": copy_accuracy(model, corpus, seq, limit_docs), "copy_ablation": copy_ablation(model, corpus, seq),
            "loops": loops,
            "loop_samples": [(decode_ids(model_dir, p), decode_ids(model_dir, c)) for p, c in list(zip(prompts, conts))[:8]],
            "router_specialisation": router_specialisation(model, corpus, seq), "chat": chat, "chat_replies": chat_rows}


def finish(args, model, corpus, state, summary, ckpt_preqat):
    """Export the model, measure it (finish.json in --work: the numbers TRAINING.md reports), write the loss curves."""
    t0 = time.time()
    for moe in model.moe_layers():
        moe.quantize = False
    provenance = {"generator": "tools/train_little_k3.py", "generator_sha256": hash_bytes(open(__file__, "rb").read()),
                  "corpus_manifest_sha256": hash_bytes(open(os.path.join(args.data, "manifest.json"), "rb").read())}
    export(model, args.out, provenance)
    exported = load_model(args.out)
    rows = []
    print(f"exported in {time.time() - t0:.0f} s", flush=True)

    def full(m):
        t = time.time()
        bpb = bits_per_byte(m, corpus, args.seq, limit_docs=args.eval_docs)
        print(f"  held-out bits per byte {bpb:.4f} ({time.time() - t:.0f} s)", flush=True)
        return bpb

    rows.append(("unigram token model (training split)", ngram_bits_per_byte(corpus, args.seq, 1, args.eval_docs)))
    rows.append(("bigram token model (training split)", ngram_bits_per_byte(corpus, args.seq, 2, args.eval_docs)))
    print(f"n-gram baselines done at {time.time() - t0:.0f} s", flush=True)
    if os.path.exists(ckpt_preqat):
        before = LittleK3(model.d)
        before.load_state_dict(torch.load(ckpt_preqat)["model"], strict=False)
        for moe, trained in zip(before.moe_layers(), model.moe_layers()):
            moe.e_score_correction_bias.copy_(trained.e_score_correction_bias)
        rows.append(("little K3, float32, before the MXFP4 fine-tune", full(before)))
    rows.append(("little K3, float32 weights after the MXFP4 fine-tune", full(model)))
    exported_bpb = full(exported)
    rows.append(("little K3, exported (bf16 trunk, MXFP4 experts): what the engine runs", exported_bpb))
    stats = router_stats(exported, corpus, args.seq, limit_docs=args.eval_docs or 40)
    beh = behaviour(exported, corpus, args.out, args.seq, args.eval_docs)
    print(json.dumps({k: beh[k] for k in ("copy", "copy_ablation", "loops", "chat", "router_specialisation")}), flush=True)
    # greedy continuations of held-out prompts (the first 12 tokens of held-out documents)
    samples = []
    for i in range(0, len(corpus.heldout), max(1, len(corpus.heldout) // 6))[:6]:
        prompt = corpus.heldout[i][:12].tolist()
        cont = greedy_continue(exported, prompt, 40)
        samples.append((decode_ids(args.out, prompt), decode_ids(args.out, cont)))
    svg_curves(os.path.join(args.out, "training-curves.svg"), state["train_points"], state["eval_points"],
               "little K3: training and held-out loss")
    result = {"quality": rows, "router": stats, "samples": samples, "summary": summary, "behaviour": beh,
              "heldout_bytes": sum(corpus.heldout_bytes), "heldout_tokens": sum(len(x) for x in corpus.heldout),
              "train_bytes": corpus.train_bytes, "train_plain_tokens": corpus.train_plain_tokens,
              "synthetic_tokens": corpus.synthetic_tokens}
    with open(os.path.join(args.work, "finish.json"), "w") as f:
        json.dump(result, f, indent=2)
    for name, bpb in rows:
        print(f"{bpb:7.4f} bits/byte  {name}")
    for l, r in enumerate(stats):
        print(f"MoE layer {l + 1}: max/mean load {r['max_over_mean']:.2f}, entropy {r['entropy_bits']:.2f} bits, "
              f"{r['unused']} unused")
    for p, c in samples:
        print(f"PROMPT {p!r}\n  -> {c!r}")
    print(f"finished in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
