"""make_variant_k3.py - small release-layout checkpoints of the shapes and options Moonshot's code runs
but the release does not use, so the engine is tested on them (fixtures/variants/NAME).

    /usr/bin/python3 tools/make_variant_k3.py --out fixtures/variants [--only NAME]

Each variant is a 5-layer Kimi K3 (schedule KKKMM: every 4th layer and the last are MLA, as in K3;
layer 0 dense, layers 1..4 latent MoE; AttnRes blocks of 2, so banks at 0, 2, 4), random weights from
the tiny K3's recipes (tools/make_tiny_k3.py, which keep every mechanism alive), written in the exact
release layout: two shards, the index, experts stored out of id order and back to back. What each
variant changes:

  top1            num_experts_per_token 1: Moonshot's gate renormalises only when top_k > 1, so the one
                  expert's weight is sigmoid(score) * routed_scaling_factor (here 2.0, to make it count)
  no-renormalize  moe_renormalize false (weights are the raw sigmoid scores) and latent_moe_use_norm false
                  (the combined latent goes up without its RMSNorm)
  kda-heads       20 KDA heads of head_dim 8 (more heads than head_dim), A_log stored [20] as Moonshot's
                  module declares it, gate_lower_bound -3
  alog-pad        A_log stored [24] for 20 heads with NON-zero padding (the official code reads the first
                  20; so must the engine; kimik3 inspect warns)
  odd-widths      no width a multiple of 16: hidden 84, KDA head_dim 24 (3 heads), MLA qk_nope 24,
                  qk_rope 8, v 40, q_lora 40, kv_lora 24, dense FFN 100 (MXFP4 widths stay 32-multiples)
  dtypes          float tensors at other precisions: F32 norms and AttnRes vectors, F16 and F32 matrices
                  (attention, router, latent, shared, dense FFN), BF16 and F16 conv taps / A_log / dt_bias /
                  o_norm / router bias, an F16 embedding and an F32 lm_head

Every variant gets reference outputs from the float64 PyTorch reference (tools/k3_reference.py) through
tools/make_tiny_k3_reference.py (--ids-below, --no-layers): the exactness gates of chapter 13 run on them.
"""

import argparse
import copy
import json
import os
import re
import sys

import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_k3 as tiny  # noqa: E402

VOCAB = 256


def base_config():
    """The tiny K3's config, cut down to 5 layers and a few experts (every feature still on)."""
    c = copy.deepcopy(tiny.CONFIG)
    c.pop("vision_config")
    t = c["text_config"]
    t.update(hidden_size=64, num_hidden_layers=5, vocab_size=VOCAB, intermediate_size=128, num_experts=8,
             num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2,
             bos_token_id=248, eos_token_id=250, pad_token_id=255)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4, 5], num_heads=4, head_dim=16)
    t.update(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_attention_heads=4)
    c.update(bos_token_id=248, eos_token_id=250, pad_token_id=255, media_placeholder_token_id=253)
    return c


def variant_configs():
    out = {}
    c = base_config()
    c["text_config"].update(num_experts_per_token=1, routed_scaling_factor=2.0)
    out["top1"] = c
    c = base_config()
    c["text_config"].update(moe_renormalize=False, latent_moe_use_norm=False)
    out["no-renormalize"] = c
    for name in ("kda-heads", "alog-pad"):
        c = base_config()
        c["text_config"]["linear_attn_config"].update(num_heads=20, head_dim=8, gate_lower_bound=-3.0)
        out[name] = c
    c = base_config()
    t = c["text_config"]
    t.update(hidden_size=84, intermediate_size=100, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=24, qk_rope_head_dim=8,
             v_head_dim=40, num_attention_heads=3, num_key_value_heads=3, moe_intermediate_size=64, routed_expert_hidden_size=64)
    t["linear_attn_config"].update(num_heads=3, head_dim=24)
    out["odd-widths"] = c
    out["dtypes"] = base_config()
    return out


# dtype changes of the `dtypes` variant: (regex on the name after language_model., dtype)
DTYPE_RULES = [
    (r"layernorm\.weight$|_norm\.weight$|res_proj\.weight$|model\.norm\.weight$", torch.float32),  # norms, AttnRes
    (r"layers\.[0-2]\.self_attn\.(q|k|v|g|o)_proj\.weight$", torch.float16),          # KDA projections F16
    (r"layers\.3\.self_attn\..*proj.*\.weight$", torch.float32),                        # MLA layer 3 projections F32
    (r"layers\.4\.self_attn\.kv_b_proj\.weight$", torch.float16),                       # kv_b (absorbed) F16
    (r"layers\.[12]\.block_sparse_moe\.gate\.weight$", torch.float32),                  # router F32
    (r"routed_expert_(down|up)_proj\.weight$", torch.float16),                          # latent projections F16
    (r"layers\.3\.block_sparse_moe\.shared_experts\..*\.weight$", torch.float32),       # shared experts F32
    (r"layers\.0\.mlp\.(gate|up)_proj\.weight$", torch.float16),                        # dense FFN F16
    (r"layers\.0\.mlp\.down_proj\.weight$", torch.float32),
    (r"conv1d\.weight$", torch.bfloat16),                                                # released as F32
    (r"A_log$|dt_bias$", torch.float16),
    (r"o_norm\.weight$", torch.bfloat16),
    (r"e_score_correction_bias$", torch.float16),
    (r"embed_tokens\.weight$", torch.float16),
    (r"lm_head\.weight$", torch.float32),
]


def retype(name, t):
    """The `dtypes` variant's tensor: the first matching rule's dtype (a float value converted once; the
    checkpoint then holds exactly what the engine and the reference read)."""
    short = name[len("language_model."):]
    for pattern, dtype in DTYPE_RULES:
        if re.search(pattern, short) and t.is_floating_point():
            return t.to(torch.float32).to(dtype)
    return t


def a_log_layout(name, t, heads, pad, nonzero):
    """A_log as [heads] (pad 0) or [heads + pad]; the padding zero or, for alog-pad, not."""
    if not name.endswith("self_attn.A_log"):
        return t
    out = torch.zeros(heads + pad, dtype=t.dtype)
    out[:heads] = t[:heads]
    if nonzero:
        out[heads:] = torch.linspace(3.0, 5.0, pad)   # large: if read, the decays would change a lot
    return out


def make(name, config, out_root):
    tiny.use_config(config)
    shards = tiny.all_shards()
    shards[1] = [(n, t) for n, t in shards[1] if n.startswith("language_model.")]   # no vision stubs
    heads = config["text_config"]["linear_attn_config"]["num_heads"]
    for s in shards:
        for i, (n, t) in enumerate(s):
            if name == "dtypes":
                t = retype(n, t)
            elif name == "kda-heads":
                t = a_log_layout(n, t, heads, 0, False)
            elif name == "alog-pad":
                t = a_log_layout(n, t, heads, 4, True)
            s[i] = (n, t)
    out = os.path.join(out_root, name)
    meta = {"format": "pt", **tiny.provenance("make_variant_k3.py", ["make_tiny_k3.py", "mxfp4.py", "st.py"]),
            "variant": name}
    tiny.write_model(out, shards, config, meta)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if os.path.isfile(os.path.join(out, f)))
    print(f"{out}: {size} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="e.g. fixtures/variants")
    ap.add_argument("--only", help="one variant")
    args = ap.parse_args()
    for name, config in variant_configs().items():
        if args.only and name != args.only:
            continue
        make(name, config, args.out)


if __name__ == "__main__":
    main()
