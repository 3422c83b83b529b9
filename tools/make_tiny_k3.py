"""make_tiny_k3.py - write the project's tiny Kimi K3 (docs/kimi-k3.md 3.10) in the exact release layout (docs/kimi-k3.md section 2).

    /usr/bin/python3 tools/make_tiny_k3.py --out fixtures/tiny-k3

The tiny K3 runs the same graph as the real model with every dimension taken from config.json:
13 layers (KDA except the MLA layers 3, 7, 11, 12, 0-based), hidden 128, vocab 512, layer 0 a dense
SiTU FFN, layers 1..12 latent MoE with 16 MXFP4 experts (top-4) and one shared expert, Block
AttnRes with block size 4. The weights are random but chosen so that the model is "alive": every
mechanism a test wants to see is actually exercised (see the evidence in STATS.txt, which this
script writes after loading the files back through tools/k3_reference.py).

Files written (all byte-for-byte deterministic; no dependence on time, host or thread count):
  config.json                         nested release config (top level kimi_k3, `text_config`, stub `vision_config`)
  model-00001-of-00002.safetensors    embed_tokens, layers 0..6
  model-00002-of-00002.safetensors    layers 7..12, model.norm, output_attn_res_*, lm_head, two vision stubs
  model.safetensors.index.json        metadata.total_size + weight_map (keys sorted)
  STATS.txt                           the "alive" evidence

Layout inside a shard, per layer l (what the C++ pack-trunk and expert loader rely on):
  1. the layer's non-expert ("trunk") tensors as ONE contiguous run, in the order of layer_tensors() below;
  2. then its routed experts, NOT in id order (a seeded permutation per layer), each expert's six
     tensors back to back: w1.weight_packed, w1.weight_scale, w3.weight_packed, w3.weight_scale,
     w2.weight_packed, w2.weight_scale.

Weights: every tensor is drawn from its own torch.Generator seeded from (SEED, tensor name), so
changing one tensor's recipe never changes another's. Values are drawn in float32 and rounded to
bf16 (round-to-nearest-even) for BF16 tensors; routed experts are MXFP4-quantized with
tools/mxfp4.py (block scale from the block max, round to nearest, ties to even code).
"""

import argparse
import hashlib
import json
import math
import os
import sys

import torch

sys.dont_write_bytecode = True  # keep tools/ free of __pycache__ (the sibling modules are imported below)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference  # noqa: E402
import mxfp4  # noqa: E402
import st  # noqa: E402

SEED = 20260731
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))

# ------------------------------------------------------------------------------------------------
# 1. The tiny configuration (docs/kimi-k3.md 3.10). Every text_config field of docs/kimi-k3.md 1.2 is present.
# ------------------------------------------------------------------------------------------------

NUM_LAYERS = 13
FULL_ATTN_LAYERS = [4, 8, 12, 13]                       # 1-based, like the release: MLA at l = 3, 7, 11, 12
KDA_LAYERS = [l for l in range(1, NUM_LAYERS + 1) if l not in FULL_ATTN_LAYERS]

QUANTIZATION_CONFIG = {                                 # docs/kimi-k3.md 2.4, verbatim structure
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
                "observer": "minmax",
            },
            "input_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}

TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "hidden_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "linear_attn_config": {
        "kda_layers": KDA_LAYERS,
        "full_attn_layers": FULL_ATTN_LAYERS,
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "rms_norm_eps": 1e-5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 256,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "attn_res_block_size": 4,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 480,
    "eos_token_id": 482,
    "pad_token_id": 511,
    "dtype": "bfloat16",
    "quantization_config": QUANTIZATION_CONFIG,
}

CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "bos_token_id": 480,                 # [BOS] analogue (reserved ids are 480..511)
    "eos_token_id": 482,                 # <|end_of_msg|> analogue
    "pad_token_id": 511,                 # [PAD] analogue
    "media_placeholder_token_id": 501,   # <|media_pad|> analogue
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": TEXT_CONFIG,
    "vision_config": {                   # a stub: the text engine must ignore it
        "model_type": "kimi_k3_vision",
        "hidden_size": 16,
        "num_hidden_layers": 0,
        "patch_size": 2,
    },
}

def use_config(config):
    """Point the recipes below at the dimensions of `config` (a nested release config). The tiny K3 uses
    CONFIG; tools/make_variant_k3.py uses it for its small checkpoints of other shapes."""
    global D, V, H_K, DH, P, WC, H, RQ, RKV, DN, DR, DV, E, F, LT, FS, FD, NUM_LAYERS, MLA_LAYERS, SHARD1_LAYERS, A_LOG_HEADS
    t = config["text_config"]
    la = t["linear_attn_config"]
    # Short names for the dimensions (the project's legend).
    D, V = t["hidden_size"], t["vocab_size"]
    H_K, DH, WC = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = H_K * DH
    H = t["num_attention_heads"]
    RQ, RKV = t["q_lora_rank"], t["kv_lora_rank"]
    DN, DR, DV = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    E, F, LT = t["num_experts"], t["moe_intermediate_size"], t["routed_expert_hidden_size"]
    FS = F * t["num_shared_experts"]
    FD = t["intermediate_size"]
    NUM_LAYERS = t["num_hidden_layers"]
    MLA_LAYERS = [l - 1 for l in la["full_attn_layers"]]
    SHARD1_LAYERS = range(0, (NUM_LAYERS + 1) // 2)   # the first half of the layers in shard 1 (plus the embedding)
    # A_log: the tiny K3's 4 meaningful per-head values, spread so that per-channel indexing (A_log[i]
    # with i the channel inside a head, which would read the zero padding for i >= 4) gives a visibly
    # different decay; entries 4..31 stay exactly 0 like the release's padding (trap 5.1.1 of docs/kimi-k3.md). Other head
    # counts draw theirs from the same spread.
    A_LOG_HEADS = [-1.5, 0.9, -0.6, 1.8] if H_K == 4 else normal("A_log.heads", (H_K,), 1.2).tolist()


use_config(CONFIG)


# ------------------------------------------------------------------------------------------------
# 2. Random weight recipes. The scale constants were chosen by looking at STATS.txt: each one
#    says which mechanism it keeps alive.
# ------------------------------------------------------------------------------------------------

def generator_for(name):
    """A torch.Generator seeded from SEED and the tensor name (sha256), independent of draw order."""
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def normal(name, shape, std, mean=0.0):
    return torch.randn(shape, generator=generator_for(name), dtype=torch.float32) * std + mean


def norm_gamma(name, shape):
    """RMSNorm weights: around 1 with 10% spread (so a wrong gamma is visible)."""
    return normal(name, shape, 0.1, 1.0)


def row_scaled(name, out_dim, in_dim, log2_low, log2_high):
    """A [out, in] matrix whose rows have norms spread log-uniformly in 2^[low, high] (for an input of
    RMS 1 the row's pre-activation then has std 2^u). Used on FFN gate/up weights so that some rows
    reach the SiTU soft caps (|a| > 8 gate, |b| > 25 up) and most do not."""
    gen = generator_for(name)
    base = torch.randn(out_dim, in_dim, generator=gen, dtype=torch.float32) / math.sqrt(in_dim)
    u = torch.rand(out_dim, 1, generator=gen, dtype=torch.float32)
    return base * torch.exp2(log2_low + (log2_high - log2_low) * u)


def bf16(t):
    return t.to(torch.bfloat16)


def f32(t):
    return t.to(torch.float32)


def attn_res_pair(prefix, name):
    """An AttnRes mixer (docs/kimi-k3.md 3.2): gamma ~ 1 and a score vector with std 0.12 (scores of RMS-1 keys
    then spread by ~1.4, enough to prefer candidates without collapsing onto one)."""
    return [
        (f"{prefix}{name}_norm.weight", bf16(norm_gamma(f"{prefix}{name}_norm.weight", (D,)))),
        (f"{prefix}{name}_proj.weight", bf16(normal(f"{prefix}{name}_proj.weight", (1, D), 0.12))),
    ]


def kda_tensors(p):
    """KDA attention block (docs/kimi-k3.md 2.2 KDA table, in that order)."""
    taps = []
    for which in ("q", "k", "v"):
        # depthwise causal conv taps [P, 1, 4]: mostly the current token (tap 3), some history.
        name = f"{p}{which}_conv1d.weight"
        t = normal(name, (P, 1, WC), 0.35)
        t[:, 0, WC - 1] += 0.8
        taps.append((name, f32(t)))
    a_log = torch.zeros(max(DH, H_K), dtype=torch.float32)   # the release's layout: zero-padded to head_dim
    a_log[:H_K] = torch.tensor(A_LOG_HEADS)
    return [
        (f"{p}q_proj.weight", bf16(normal(f"{p}q_proj.weight", (P, D), 1 / math.sqrt(D)))),
        (f"{p}k_proj.weight", bf16(normal(f"{p}k_proj.weight", (P, D), 1 / math.sqrt(D)))),
        (f"{p}v_proj.weight", bf16(normal(f"{p}v_proj.weight", (P, D), 1 / math.sqrt(D)))),
        *taps,
        (f"{p}f_a_proj.weight", bf16(normal(f"{p}f_a_proj.weight", (DH, D), 1 / math.sqrt(D)))),
        (f"{p}f_b_proj.weight", bf16(normal(f"{p}f_b_proj.weight", (P, DH), 1 / math.sqrt(DH)))),
        (f"{p}A_log", a_log),
        # dt_bias centred below 0: decays from fast (alpha ~ e^-5) to slow (alpha ~ 1) across channels
        (f"{p}dt_bias", f32(normal(f"{p}dt_bias", (P,), 1.5, -1.0))),
        (f"{p}b_proj.weight", bf16(normal(f"{p}b_proj.weight", (H_K, D), 1.5 / math.sqrt(D)))),
        (f"{p}g_proj.weight", bf16(normal(f"{p}g_proj.weight", (P, D), 1 / math.sqrt(D)))),
        (f"{p}o_norm.weight", f32(norm_gamma(f"{p}o_norm.weight", (DH,)))),
        (f"{p}o_proj.weight", bf16(normal(f"{p}o_proj.weight", (D, P), 1 / math.sqrt(P)))),
    ]


def mla_tensors(p):
    """Gated MLA block (docs/kimi-k3.md 2.2 MLA table, in that order). q_b and kv_b are scaled up so that the
    attention is neither uniform nor one-hot (scores of std ~2 before the softmax)."""
    return [
        (f"{p}q_a_proj.weight", bf16(normal(f"{p}q_a_proj.weight", (RQ, D), 1 / math.sqrt(D)))),
        (f"{p}q_a_layernorm.weight", bf16(norm_gamma(f"{p}q_a_layernorm.weight", (RQ,)))),
        (f"{p}q_b_proj.weight", bf16(normal(f"{p}q_b_proj.weight", (H * (DN + DR), RQ), 1.6 / math.sqrt(RQ)))),
        (f"{p}kv_a_proj_with_mqa.weight", bf16(normal(f"{p}kv_a_proj_with_mqa.weight", (RKV + DR, D), 1.2 / math.sqrt(D)))),
        (f"{p}kv_a_layernorm.weight", bf16(norm_gamma(f"{p}kv_a_layernorm.weight", (RKV,)))),
        (f"{p}kv_b_proj.weight", bf16(normal(f"{p}kv_b_proj.weight", (H * (DN + DV), RKV), 1.6 / math.sqrt(RKV)))),
        (f"{p}g_proj.weight", bf16(normal(f"{p}g_proj.weight", (H * DV, D), 1 / math.sqrt(D)))),
        (f"{p}o_proj.weight", bf16(normal(f"{p}o_proj.weight", (D, H * DV), 1 / math.sqrt(H * DV)))),
    ]


def situ_ffn(p, width, in_dim, down_std):
    """gate/up/down of a SiTU-GLU FFN (dense or shared). Gate rows reach |a| > 8 on some inputs,
    up rows reach |b| > 25 on some inputs (2^4.8 ~ 28 at the top of the range)."""
    return [
        (f"{p}gate_proj.weight", bf16(row_scaled(f"{p}gate_proj.weight", width, in_dim, -1.0, 3.3))),
        (f"{p}up_proj.weight", bf16(row_scaled(f"{p}up_proj.weight", width, in_dim, -1.0, 4.8))),
        (f"{p}down_proj.weight", bf16(normal(f"{p}down_proj.weight", (in_dim, width), down_std))),
    ]


def moe_trunk_tensors(p):
    """Non-expert MoE tensors (docs/kimi-k3.md 2.2 MoE table, in that order)."""
    return [
        # router: logits of std ~2.3 for an RMS-1 input, so sigmoid scores spread over (0, 1)
        (f"{p}gate.weight", bf16(normal(f"{p}gate.weight", (E, D), 0.2))),
        # selection bias, comparable to the score spread: reorders the top-k on most tokens (trap 5.1.3 of docs/kimi-k3.md)
        (f"{p}gate.e_score_correction_bias", f32(normal(f"{p}gate.e_score_correction_bias", (E,), 0.25))),
        # latent down-projection: z of RMS ~2, so expert pre-activations reach the SiTU caps sometimes
        (f"{p}routed_expert_down_proj.weight", bf16(normal(f"{p}routed_expert_down_proj.weight", (LT, D), 2 / math.sqrt(D)))),
        (f"{p}routed_expert_norm.weight", bf16(norm_gamma(f"{p}routed_expert_norm.weight", (LT,)))),
        (f"{p}routed_expert_up_proj.weight", bf16(normal(f"{p}routed_expert_up_proj.weight", (D, LT), 1 / math.sqrt(LT)))),
        *situ_ffn(f"{p}shared_experts.", FS, D, 0.25 / math.sqrt(FS)),
    ]


def expert_tensors(p, e):
    """One routed expert, MXFP4 (docs/kimi-k3.md 2.4): the six tensors back to back, w1, w3, w2."""
    q = f"{p}experts.{e}."
    out = []
    for which, out_dim, in_dim, lo, hi in (("w1", F, LT, -2.0, 2.0), ("w3", F, LT, -2.0, 3.5), ("w2", LT, F, -3.0, -1.5)):
        weight = row_scaled(q + which, out_dim, in_dim, lo, hi)
        packed, scale = mxfp4.quantize(weight)
        out += [(f"{q}{which}.weight_packed", packed), (f"{q}{which}.weight_scale", scale)]
    return out


def layer_tensors(l):
    """(trunk run, expert list) of layer l. Trunk order: input_layernorm, self_attention_res_{norm,proj},
    the attention block (docs/kimi-k3.md 2.2 table order), post_attention_layernorm, mlp_res_{norm,proj}, the FFN block."""
    p = f"model.layers.{l}."
    trunk = [(f"{p}input_layernorm.weight", bf16(norm_gamma(f"{p}input_layernorm.weight", (D,))))]
    trunk += attn_res_pair(p, "self_attention_res")       # present at layer 0 too, though unused (docs/kimi-k3.md 2.2)
    trunk += mla_tensors(p + "self_attn.") if l in MLA_LAYERS else kda_tensors(p + "self_attn.")
    trunk += [(f"{p}post_attention_layernorm.weight", bf16(norm_gamma(f"{p}post_attention_layernorm.weight", (D,))))]
    trunk += attn_res_pair(p, "mlp_res")
    experts = []
    if l == 0:
        trunk += situ_ffn(p + "mlp.", FD, D, 0.25 / math.sqrt(FD))
    else:
        trunk += moe_trunk_tensors(p + "block_sparse_moe.")
        # Experts in a seeded, non-id order (the release does not store them in id order either).
        order = torch.randperm(E, generator=generator_for(f"{p}expert_order")).tolist()
        for e in order:
            experts += expert_tensors(p + "block_sparse_moe.", e)
    return trunk, experts


def all_shards():
    """The two shards as lists of (release name, tensor), in file order."""
    prefix = "language_model."
    shard1 = [("model.embed_tokens.weight", bf16(normal("model.embed_tokens.weight", (V, D), 1.0)))]
    shard2 = []
    for l in range(NUM_LAYERS):
        trunk, experts = layer_tensors(l)
        (shard1 if l in SHARD1_LAYERS else shard2).extend(trunk + experts)
    shard2 += [("model.norm.weight", bf16(norm_gamma("model.norm.weight", (D,))))]
    shard2 += attn_res_pair("model.", "output_attn_res")
    # logits of std ~3 for an RMS-1 final hidden state
    shard2 += [("lm_head.weight", bf16(normal("lm_head.weight", (V, D), 0.27)))]
    shards = [[(prefix + n, t) for n, t in shard1], [(prefix + n, t) for n, t in shard2]]
    # Two small vision stubs (not `language_model.`): the text engine must skip them (docs/kimi-k3.md section 2).
    shards[1] += [("vision_tower.patch_embed.proj.weight", bf16(normal("vision_tower.stub", (16, 3, 2, 2), 0.1))),
                  ("mm_projector.proj.0.weight", bf16(normal("mm_projector.stub", (D, 16), 0.1)))]
    return shards


# ------------------------------------------------------------------------------------------------
# 3. Writing
# ------------------------------------------------------------------------------------------------

def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def provenance(script, deps):
    """__metadata__ provenance: the script and the sha256 of it and of every tool file it depends on."""
    files = [script] + deps
    return {"generator": f"tools/{script}",
            "generator_sha256": " ".join(f"tools/{name}:{sha256_of(os.path.join(TOOLS_DIR, name))}" for name in files)}


def write_model(out_dir, shards=None, config=None, meta=None):
    """The shards (default: the tiny K3's), the index and config.json, in the release layout."""
    os.makedirs(out_dir, exist_ok=True)
    meta = meta or {"format": "pt", **provenance("make_tiny_k3.py", ["mxfp4.py", "st.py"])}
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map, total_size = {}, 0
    for shard_name, tensors in zip(shard_names, shards or all_shards()):
        st.write(os.path.join(out_dir, shard_name), tensors, meta)
        for name, tensor in tensors:
            weight_map[name] = shard_name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(json.dumps(config or CONFIG, indent=2) + "\n")
    return shard_names


# ------------------------------------------------------------------------------------------------
# 4. Evidence that the model is alive (STATS.txt): run the float64 reference on a token sequence.
# ------------------------------------------------------------------------------------------------

STATS_TOKENS = 48


def entropy(pi):
    return -(pi * torch.log(pi.clamp_min(1e-300))).sum(dim=-1)


def collect_stats(out_dir):
    torch.set_num_threads(1)
    model = k3_reference.K3Reference(out_dir, torch.float64)
    cfg = model.config
    ids = torch.randint(0, 480, (STATS_TOKENS,), generator=generator_for("stats_ids")).tolist()
    dump = {}
    logits = model.forward(ids, dump=dump)
    lines = [f"# tiny K3 'alive' evidence: float64 reference on {STATS_TOKENS} seeded token ids (0..479)",
             f"# ids: {','.join(map(str, ids))}", ""]

    # (a) AttnRes: per mixer, max softmax weight (mean / max over tokens) and entropy vs log(n).
    lines.append("## AttnRes mixing weights (docs/kimi-k3.md 3.2): per mix, n candidates, max weight mean/max over tokens, "
                 "entropy mean (nats) vs uniform log(n)")
    worst = 0.0
    mixes = []
    for l in range(cfg.num_hidden_layers):
        for side in ("attn", "mlp"):
            key = f"layer.{l}.{side}_mix_weights"
            if key in dump:
                mixes.append((f"layer {l:2d} {side:4s}", dump[key]))
    mixes.append(("final        ", dump["final.mix_weights"]))
    for label, pi in mixes:
        n = pi.shape[1]
        mx = pi.max(dim=1).values
        worst = max(worst, float(mx.max()))
        lines.append(f"{label}  n={n}  max_w mean {float(mx.mean()):.3f} max {float(mx.max()):.3f}  "
                     f"entropy mean {float(entropy(pi).mean()):.3f} / log(n) {math.log(n):.3f}")
    lines.append(f"largest single mixing weight anywhere: {worst:.4f}")
    lines.append("")

    # (b) Routing: expert-usage histogram, distinct top-k sets, tokens where the bias changes the set.
    lines.append(f"## MoE routing (docs/kimi-k3.md 3.6) over {STATS_TOKENS} tokens: usage count per expert 0..{cfg.num_experts - 1}, "
                 "distinct top-k sets, tokens where the biased top-k SET differs from the unbiased one")
    total_diff = 0
    for l in range(cfg.num_hidden_layers):
        if not cfg.is_moe(l):
            continue
        ids_b = dump[f"layer.{l}.moe.topk_ids"]
        ids_u = dump[f"layer.{l}.moe.topk_ids_unbiased"]
        hist = torch.bincount(ids_b.reshape(-1), minlength=cfg.num_experts).tolist()
        sets_b = [tuple(sorted(r)) for r in ids_b.tolist()]
        sets_u = [tuple(sorted(r)) for r in ids_u.tolist()]
        differ = sum(a != b for a, b in zip(sets_b, sets_u))
        total_diff += differ
        lines.append(f"layer {l:2d}  usage {hist}  distinct sets {len(set(sets_b)):2d}  bias changes set on "
                     f"{differ:2d}/{STATS_TOKENS}")
    moe_layers = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
    lines.append(f"bias changes the selected set on {total_diff}/{moe_layers * STATS_TOKENS} (token, layer) pairs")
    lines.append("")

    # (c) SiTU caps (docs/kimi-k3.md 0.2): pre-activations beyond the soft caps.
    lines.append("## SiTU-GLU soft caps (docs/kimi-k3.md 0.2): count |a| > 8 (gate) and |b| > 25 (up) pre-activations")
    groups = {"dense (layer 0)": [("layer.0.ffn.gate_pre", "layer.0.ffn.up_pre")],
              "shared experts": [], "routed experts": []}
    for l in range(1, cfg.num_hidden_layers):
        groups["shared experts"].append((f"layer.{l}.moe.shared_gate_pre", f"layer.{l}.moe.shared_up_pre"))
        groups["routed experts"].append((f"layer.{l}.moe.expert_gate_pre", f"layer.{l}.moe.expert_up_pre"))
    for label, keys in groups.items():
        a = torch.cat([dump[k].reshape(-1) for k, _ in keys])
        b = torch.cat([dump[k].reshape(-1) for _, k in keys])
        lines.append(f"{label:16s} gate |a|>8: {int((a.abs() > 8).sum()):5d}/{a.numel():6d} (max |a| {float(a.abs().max()):6.2f})"
                     f"   up |b|>25: {int((b.abs() > 25).sum()):4d}/{b.numel():6d} (max |b| {float(b.abs().max()):6.2f})")
    lines.append("")

    # (d) KDA decay: per head mean decay alpha = exp(g), and what per-channel A_log indexing would change.
    lines.append("## KDA decay (docs/kimi-k3.md 3.4.3): A_log per head, mean alpha = exp(g) per head over all KDA layers/tokens; "
                 "max |g - g_wrong| if A_log were indexed per channel inside the head (trap 5.1.1 of docs/kimi-k3.md)")
    lb = cfg.gate_lower_bound
    kda_layers = [l for l in range(cfg.num_hidden_layers) if cfg.layer_kinds[l] == "kda"]
    a_log_full = model.w(f"model.layers.{kda_layers[0]}.self_attn.A_log", (cfg.kda_head_dim,))
    g_all = torch.stack([dump[f"layer.{l}.kda.g"] for l in kda_layers])       # [layers, T, P]
    g_all = g_all.reshape(len(kda_layers), STATS_TOKENS, cfg.kda_num_heads, cfg.kda_head_dim)
    alpha = torch.exp(g_all)
    lines.append("A_log[0..3] = " + ", ".join(f"{float(v):+.2f}" for v in a_log_full[:4]) +
                 f"   (entries 4..{cfg.kda_head_dim - 1} all zero: {bool((a_log_full[4:] == 0).all())})")
    lines.append("mean alpha per head: " + ", ".join(f"{float(alpha[:, :, h].mean()):.3f}" for h in range(cfg.kda_num_heads)) +
                 f"   alpha range [{float(alpha.min()):.4f}, {float(alpha.max()):.4f}]")
    # invert g = lb * sigmoid(exp(A_log[h]) * z) to get z, then recompute with A_log[i] (channel index)
    s = (g_all / lb).clamp(1e-300, 1 - 1e-16)
    z = torch.log(s / (1 - s)) / torch.exp(a_log_full[:cfg.kda_num_heads])[None, None, :, None]
    g_wrong = lb * torch.sigmoid(torch.exp(a_log_full)[None, None, None, :] * z)
    lines.append(f"per-channel indexing would change g by up to {float((g_all - g_wrong).abs().max()):.3f} "
                 f"(mean {float((g_all - g_wrong).abs().mean()):.3f})")
    lines.append("")

    # (e) Logits.
    top2 = torch.topk(logits, 2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    argmax = logits.argmax(dim=-1)
    lines.append("## Logits (docs/kimi-k3.md 3.7)")
    lines.append(f"per-position std: mean {float(logits.std(dim=-1).mean()):.3f}  min {float(logits.std(dim=-1).min()):.3f}"
                 f"   range [{float(logits.min()):.2f}, {float(logits.max()):.2f}]")
    lines.append(f"top1-top2 margin: min {float(margin.min()):.4f}  median {float(margin.median()):.4f}")
    lines.append(f"distinct argmax ids over {STATS_TOKENS} positions: {len(set(argmax.tolist()))}")
    lines.append(f"final.mix_out RMS per token: mean {float(dump['final.mix_out'].pow(2).mean(-1).sqrt().mean()):.3f}")
    lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description="Write the tiny Kimi K3 test model (docs/kimi-k3.md 3.10) in the release layout.")
    parser.add_argument("--out", required=True, help="output folder, e.g. fixtures/tiny-k3")
    parser.add_argument("--no-stats", action="store_true", help="skip STATS.txt (faster)")
    args = parser.parse_args()
    shard_names = write_model(args.out)
    if not args.no_stats:
        lines = collect_stats(args.out)
        sizes = ["## Files"]
        total = 0
        for name in ["config.json", "model.safetensors.index.json"] + shard_names:
            size = os.path.getsize(os.path.join(args.out, name))
            total += size
            sizes.append(f"{name:36s} {size:9d} bytes")
        sizes.append(f"{'total (without STATS.txt and reference/)':36s} {total:9d} bytes")
        text = "\n".join(lines + sizes) + "\n"
        with open(os.path.join(args.out, "STATS.txt"), "w") as f:
            f.write(text)
        print(text, end="")


if __name__ == "__main__":
    main()
