"""make_release_config.py - Kimi K3's release config.json (text part), written from docs/kimi-k3.md section 1.

Usage:  /usr/bin/python3 tools/make_release_config.py --out fixtures/k3-release/config.json

Every field of docs/kimi-k3.md 1.1 and 1.2 with the published values, in the release's nested form (top level
`kimi_k3`, `text_config` = `kimi_linear`), plus the quantization_config of docs/kimi-k3.md 2.4. Used by `kimik3
plan`, `kimik3 synth` and the tests that need the real 93-layer geometry without the 1.56 TB of weights.
The vision_config is a stub: the text engine never reads it.
"""

import argparse
import json
import os

L = 93
FULL_ATTN = [l + 1 for l in range(L) if l % 4 == 3] + [L]   # 1-based: 4, 8, ..., 92, 93 (docs/kimi-k3.md 1.3)
KDA = [n for n in range(1, L + 1) if n not in FULL_ATTN]


def config():
    text = {
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "num_hidden_layers": L,
        "vocab_size": 163840,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "kda_layers": KDA,
            "full_attn_layers": FULL_ATTN,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "rms_norm_eps": 1e-05,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "attn_res_block_size": 12,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                                "observer": "minmax"},
                    "input_activations": None,
                }
            },
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        },
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision"},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(config(), f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}: {len(KDA)} KDA layers, {len(FULL_ATTN)} MLA layers")


if __name__ == "__main__":
    main()
