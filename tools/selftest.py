"""selftest.py - numerical self-checks of the Python side (not part of the C++ build).

    /usr/bin/python3 tools/selftest.py [--model fixtures/tiny-k3]

Each check recomputes something with the OTHER formulation docs/kimi-k3.md gives and compares with
tools/k3_reference.py, in float64, on the tiny K3:
  (a) MLA: the absorbed form of docs/kimi-k3.md 3.5.4 equals the reference's naive form (3.5.3)
  (b) AttnRes: the closed form of docs/kimi-k3.md 3.2 equals the reference's procedural form
  (c) KDA: the chunked WY form of docs/kimi-k3.md 3.4.7 (chunk 4, also 3 and whole-sequence) equals the
      reference's token recurrence (3.4.5): outputs and states
  (d) MXFP4: exhaustive decode vs an independent bit-level formula, pack/unpack and quantize
      roundtrips, E8M0 255 refused, and a swapped-nibble decode differs (per weight and on the logits)
  (e) st.py: every dtype and __metadata__ roundtrip; header padded with spaces to a multiple of 8
  (f) the tiny checkpoint's layout: trunk runs contiguous, experts contiguous and not in id order,
      A_log padding exactly zero, index.json consistent with the shards
  (g) causality: the logits of a prefix equal the first rows of the logits of the whole sequence
  (h) hand-worked values: router tie order, SiTU caps and the uncapped sigmoid, RMSNorm
  (i) config.json refusals: each unsupported setting raises ConfigError
  (j) the reference fixtures (if present) match a fresh float64 run of the current code
Exit status 0 when every check passes its stated tolerance.
"""

import argparse
import json
import os
import sys
import tempfile

import torch

sys.dont_write_bytecode = True  # keep tools/ free of __pycache__ (the sibling modules are imported below)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference  # noqa: E402
import mxfp4  # noqa: E402
import st  # noqa: E402

RESULTS = []


def report(label, value, tolerance):
    """Record one check: value must be <= tolerance (use tolerance 0 for exact checks)."""
    ok = value <= tolerance
    RESULTS.append(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {label}: {value:.3e} (tolerance {tolerance:.0e})")


def require(label, condition):
    RESULTS.append(bool(condition))
    print(f"[{'PASS' if condition else 'FAIL'}] {label}")


def rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


# ------------------------------------------------------------------------------------------------
# (a) absorbed MLA, docs/kimi-k3.md 3.5.4
# ------------------------------------------------------------------------------------------------

def check_mla_absorbed(model, dump, T):
    """q_bar[h] = W_UK[h]^T q_nope[h];  score = (q_bar . c_s + q_x . k_x_s) / sqrt(dn + dr);
    out[h] = W_UV[h] (sum_s p c_s), with kv_b_proj viewed as [H, dn + dv, kv_lora_rank]."""
    c = model.config
    H, dn, dr, dv, rkv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    worst_p, worst_o = 0.0, 0.0
    for l in [l for l in range(c.num_hidden_layers) if c.layer_kinds[l] == "mla"]:
        w_kvb = model.w(f"model.layers.{l}.self_attn.kv_b_proj.weight", (H * (dn + dv), rkv)).reshape(H, dn + dv, rkv)
        w_uk, w_uv = w_kvb[:, :dn, :], w_kvb[:, dn:, :]                 # [H, dn, rkv], [H, dv, rkv]
        q = dump[f"layer.{l}.mla.q"]                                    # [T, H, dn + dr]
        latent, k_x = dump[f"layer.{l}.mla.c"], dump[f"layer.{l}.mla.k_x"]
        q_bar = torch.einsum("hnr,thn->thr", w_uk, q[:, :, :dn])         # [T, H, rkv]
        scores = (torch.einsum("thr,sr->hts", q_bar, latent) + torch.einsum("thd,sd->hts", q[:, :, dn:], k_x))
        scores = scores * (dn + dr) ** -0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        probs = k3_reference.softmax(scores)
        context = torch.einsum("hts,sr->thr", probs, latent)            # attention over the latent
        out = torch.einsum("hvr,thr->thv", w_uv, context).reshape(T, H * dv)
        worst_p = max(worst_p, float((probs - dump[f"layer.{l}.mla.probs"]).abs().max()))
        worst_o = max(worst_o, rel(out, dump[f"layer.{l}.mla.attn"]))
    report("(a) MLA absorbed vs naive: max |probs diff|", worst_p, 1e-12)
    report("(a) MLA absorbed vs naive: attention output, max |diff| / max |value|", worst_o, 1e-12)


# ------------------------------------------------------------------------------------------------
# (b) closed-form AttnRes, docs/kimi-k3.md 3.2
# ------------------------------------------------------------------------------------------------

def check_attnres_closed_form(model, dump, ids):
    """B_0 = x0, B_n = sum of (a_l + m_l) over block n-1; attention input at l > 0 mixes
    B_0..B_{floor((l-1)/S)} and the current partial; FFN input mixes B_0..B_{floor(l/S)} and P_l + a_l;
    the final mix has B_0..B_last and the running block."""
    c = model.config
    S, L = c.attn_res_block_size, c.num_hidden_layers
    x0 = model.w("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))[torch.as_tensor(ids)]
    a = [dump[f"layer.{l}.attn_out"] for l in range(L)]
    m = [dump[f"layer.{l}.mlp_out"] for l in range(L)]

    def block_sum(first, last):
        """sum_{l=first}^{last-1} (a_l + m_l), accumulated a, m, a, m, ... like the partial sum."""
        total = None
        for l in range(first, last):
            total = a[l] if total is None else total + a[l]
            total = total + m[l]
        return total

    blocks = [x0] + [block_sum(S * (n - 1), S * n) for n in range(1, (L - 1) // S + 1)]
    worst_x, worst_w = 0.0, 0.0
    for l in range(L):
        start = S * (l // S)                                             # first layer of l's block
        if l > 0:
            if l % S == 0:
                cands = blocks[:l // S + 1]                               # the just-completed block, no partial
            else:
                cands = blocks[:(l - 1) // S + 1] + [block_sum(start, l)]
            x, pi = model.mix(f"model.layers.{l}.self_attention_res", cands)
            worst_x = max(worst_x, float((x - dump[f"layer.{l}.attn_mix_out"]).abs().max()))
            worst_w = max(worst_w, float((pi - dump[f"layer.{l}.attn_mix_weights"]).abs().max()))
        partial = a[l] if l == start else block_sum(start, l) + a[l]
        x, pi = model.mix(f"model.layers.{l}.mlp_res", blocks[:l // S + 1] + [partial])
        worst_x = max(worst_x, float((x - dump[f"layer.{l}.mlp_mix_out"]).abs().max()))
        worst_w = max(worst_w, float((pi - dump[f"layer.{l}.mlp_mix_weights"]).abs().max()))
    last_start = S * ((L - 1) // S)
    x, pi = model.mix("model.output_attn_res", blocks + [block_sum(last_start, L)])
    worst_x = max(worst_x, float((x - dump["final.mix_out"]).abs().max()))
    worst_w = max(worst_w, float((pi - dump["final.mix_weights"]).abs().max()))
    report("(b) AttnRes closed form vs procedure: max |mix output diff|", worst_x, 0.0)
    report("(b) AttnRes closed form vs procedure: max |mix weight diff|", worst_w, 0.0)


# ------------------------------------------------------------------------------------------------
# (c) chunked WY KDA, docs/kimi-k3.md 3.4.7
# ------------------------------------------------------------------------------------------------

def kda_chunked(q, k, v, g, beta, chunk):
    """One head. q, k [T, Dk] (normalised, q scaled), v [T, Dv], g [T, Dk] log decay, beta [T].
    Returns (O [T, Dv], final state S [Dk, Dv]), docs/kimi-k3.md 3.4.7 literally."""
    T, Dk = k.shape
    S = torch.zeros(Dk, v.shape[1], dtype=q.dtype)
    outputs = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        Q, K, Vc, B = q[s:e], k[s:e], v[s:e], beta[s:e]
        G = torch.cumsum(g[s:e], dim=0)                                  # inclusive cumulative log-decay
        decay = torch.exp(G[:, None, :] - G[None, :, :])                 # [i, j, d] = e^{G_i[d] - G_j[d]}
        strictly_lower = torch.ones(n, n, dtype=torch.bool).tril(-1)
        M = torch.where(strictly_lower, B[:, None] * torch.einsum("id,jd,ijd->ij", K, K, decay), torch.zeros(()))
        Tm = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype) + M, torch.diag(B), upper=False)
        Wm = Tm @ (torch.exp(G) * K)
        U = Tm @ Vc
        Vn = U - Wm @ S                                                  # the new values r of every token
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        A = torch.where(lower, torch.einsum("id,jd,ijd->ij", Q, K, decay), torch.zeros(()))
        outputs.append((Q * torch.exp(G)) @ S + A @ Vn)
        S = torch.exp(G[-1])[:, None] * S + (torch.exp(G[-1][None, :] - G) * K).T @ Vn
    return torch.cat(outputs), S


def check_kda_chunked(model, dump, T):
    c = model.config
    H, Dh = c.kda_num_heads, c.kda_head_dim
    for chunk in (4, 3, T):
        worst_o, worst_s = 0.0, 0.0
        for l in [l for l in range(c.num_hidden_layers) if c.layer_kinds[l] == "kda"]:
            d = f"layer.{l}.kda."
            q, k, v, g = (dump[d + n].reshape(T, H, Dh) for n in ("q_hat", "k_hat", "v_conv", "g"))
            beta = dump[d + "beta"]
            for h in range(H):
                o, S = kda_chunked(q[:, h], k[:, h], v[:, h], g[:, h], beta[:, h], chunk)
                worst_o = max(worst_o, rel(o, dump[d + "o"].reshape(T, H, Dh)[:, h]))
                worst_s = max(worst_s, rel(S, dump[d + f"state_after_{T}"][h]))
        report(f"(c) KDA chunked (C={chunk}) vs recurrence: output, max |diff| / max |value|", worst_o, 1e-12)
        report(f"(c) KDA chunked (C={chunk}) vs recurrence: final state, max |diff| / max |value|", worst_s, 1e-12)


# ------------------------------------------------------------------------------------------------
# (d) MXFP4, docs/kimi-k3.md 2.4
# ------------------------------------------------------------------------------------------------

def e2m1_from_bits(code):
    """Independent decode of one E2M1 code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
    Exponent 0 is subnormal: 0.5 * mantissa."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = 0.5 * mantissa if exponent == 0 else (1.0 + 0.5 * mantissa) * 2.0 ** (exponent - 1)
    return sign * magnitude


def check_mxfp4(model):
    # Exhaustive: every code (as the low and as the high nibble) with every valid scale byte.
    codes = torch.arange(16, dtype=torch.uint8)
    worst = 0.0
    for s in range(255):
        row = torch.full((1, 32), 0, dtype=torch.uint8)
        row[0, :16] = codes                       # low nibble = even columns 0, 2, ..., 30
        row[0, 16:] = codes << 4                  # high nibble = odd columns 33, 35, ..., 63
        w = mxfp4.dequantize(row, torch.full((1, 2), s, dtype=torch.uint8))
        expect = torch.zeros(1, 64, dtype=torch.float64)
        for i in range(16):
            expect[0, 2 * i] = e2m1_from_bits(i) * 2.0 ** (s - 127)
            expect[0, 32 + 2 * i + 1] = e2m1_from_bits(i) * 2.0 ** (s - 127)
        worst = max(worst, float((w - expect).abs().max()))
        if s == 0:
            require("(d) MXFP4 scale byte 0 is 2^-127: code 1 (0.5) decodes to 2^-128, not flushed to 0",
                    float(w[0, 2]) == 2.0 ** -128)
    report("(d) MXFP4 exhaustive decode (16 codes x 255 scales, both nibbles) vs bit formula", worst, 0.0)
    minus_zero = mxfp4.dequantize(torch.full((1, 16), 8, dtype=torch.uint8), torch.full((1, 1), 127, dtype=torch.uint8))
    require("(d) MXFP4 code 8 decodes to -0.0", str(float(minus_zero[0, 0])) == "-0.0")
    try:
        mxfp4.dequantize(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))
        require("(d) MXFP4 scale byte 255 is refused", False)
    except ValueError:
        require("(d) MXFP4 scale byte 255 is refused", True)

    gen = torch.Generator().manual_seed(7)
    packed, scale = mxfp4.random_mxfp4(64, 96, gen, -8, 4)
    codes = mxfp4.unpack_codes(packed)
    require("(d) MXFP4 pack(unpack(x)) == x", torch.equal(mxfp4.pack_codes(codes), packed))
    w = mxfp4.dequantize(packed, scale)
    p2, s2 = mxfp4.quantize(w)
    report("(d) MXFP4 dequantize(quantize(W)) == W for representable W: max |diff|",
           float((mxfp4.dequantize(p2, s2) - w).abs().max()), 0.0)
    x = torch.randn(64, 96, generator=gen, dtype=torch.float64)
    p3, s3 = mxfp4.quantize(x)
    # Rounding error bound: half of the largest E2M1 step (2, between 4 and 6) times the block scale.
    step = mxfp4.scale_values(s3).repeat_interleave(32, dim=1)
    report("(d) MXFP4 quantize error / block scale (must be <= 1, half of the 4..6 step)",
           float(((mxfp4.dequantize(p3, s3) - x).abs() / step).max()), 1.0)
    swapped = (packed >> 4) | (packed << 4)                              # the nibble-order mistake
    w_swapped = mxfp4.dequantize(swapped, scale)
    differ = int((w_swapped != w).sum())
    require(f"(d) swapped-nibble decode differs ({differ}/{w.numel()} elements differ, same multiset per row: "
            f"{torch.equal(w_swapped.sort(dim=1).values, w.sort(dim=1).values)})", differ > 0)

    # On the whole tiny model: decode every expert with swapped nibbles and compare logits.
    class SwappedNibbles(k3_reference.K3Reference):
        def expert_w(self, name, out_dim, in_dim):
            key = (name, "expert")
            if key not in self._cache:
                p = self.ckpt.raw(name + ".weight_packed")
                self._cache[key] = mxfp4.dequantize((p >> 4) | (p << 4), self.ckpt.raw(name + ".weight_scale")).to(self.dtype)
            return self._cache[key]

    ids = list(range(0, 480, 37))
    good = model.forward(ids)
    bad = SwappedNibbles(model.model_dir, torch.float64).forward(ids)
    diff = float((good - bad).abs().max())
    require(f"(d) swapped-nibble experts change the tiny model's logits (max |diff| {diff:.3f}, "
            f"argmax differs at {int((good.argmax(-1) != bad.argmax(-1)).sum())}/{len(ids)} positions)", diff > 1e-2)


# ------------------------------------------------------------------------------------------------
# (e) st.py
# ------------------------------------------------------------------------------------------------

def check_safetensors():
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for name, (dtype, _) in st.DTYPES.items():
        if dtype.is_floating_point:
            t = torch.randn(3, 5, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (7,), generator=gen).to(torch.bool)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -1000), min(info.max, 1000), (2, 3), generator=gen).to(dtype)
        tensors[f"t_{name}"] = t
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.float32)
    meta = {"generator": "selftest", "note": "x"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "a.safetensors")
        st.write(path, tensors, meta)
        back, meta_back = st.read(path)
        with open(path, "rb") as f:
            raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n]
    same = all(torch.equal(back[k].view(torch.int16) if v.dtype == torch.bfloat16 else back[k],
                           v.view(torch.int16) if v.dtype == torch.bfloat16 else v) and back[k].dtype == v.dtype
               for k, v in tensors.items())
    require(f"(e) st.py roundtrip of all {len(st.DTYPES)} dtypes + an empty tensor, order kept",
            same and list(back) == list(tensors))
    require("(e) st.py __metadata__ roundtrip", meta_back == meta)
    require("(e) st.py header length is a multiple of 8 and padded with spaces",
            n % 8 == 0 and header.rstrip(b" ") == json.dumps(json.loads(header), separators=(",", ":")).encode())
    require("(e) st.py output is deterministic", st.serialize(tensors, meta) == raw)


# ------------------------------------------------------------------------------------------------
# (f) checkpoint layout
# ------------------------------------------------------------------------------------------------

def check_layout(model_dir, model):
    c = model.config
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = {}
    for shard in sorted(set(index["weight_map"].values())):
        files[shard] = st.SafetensorsFile(os.path.join(model_dir, shard))
    where = {name: shard for shard, sf in files.items() for name in sf.keys()}
    total = sum(sf.offset_of(n)[1] for sf in files.values() for n in sf.keys())
    require("(f) index weight_map matches the shard headers", where == index["weight_map"])
    require("(f) index metadata.total_size is the sum of tensor bytes", index["metadata"]["total_size"] == total)
    trunk_ok, expert_ok, order_scrambled = True, True, 0
    for l in range(c.num_hidden_layers):
        prefix = f"language_model.model.layers.{l}."
        names = [n for n in where if n.startswith(prefix)]
        shards = {where[n] for n in names}
        if len(shards) != 1:
            trunk_ok = False
            continue
        sf = files[shards.pop()]
        order = sf.keys()
        trunk = [n for n in names if ".experts." not in n]
        positions = sorted(order.index(n) for n in trunk)
        trunk_ok &= positions == list(range(positions[0], positions[0] + len(positions)))
        if c.is_moe(l):
            ids_in_file = []
            for e in range(c.num_experts):
                q = f"{prefix}block_sparse_moe.experts.{e}."
                six = [q + w + s for w in ("w1", "w3", "w2") for s in (".weight_packed", ".weight_scale")]
                pos = [order.index(n) for n in six]
                expert_ok &= pos == list(range(pos[0], pos[0] + 6))
                offsets = [sf.offset_of(n) for n in six]
                expert_ok &= all(offsets[i][0] + offsets[i][1] == offsets[i + 1][0] for i in range(5))
                ids_in_file.append((pos[0], e))
            order_scrambled += [e for _, e in sorted(ids_in_file)] != list(range(c.num_experts))
    require("(f) every layer lives in one shard and its non-expert tensors are one contiguous run", trunk_ok)
    require("(f) every expert's six tensors are back to back (w1 packed/scale, w3 ..., w2 ...)", expert_ok)
    moe_layers = sum(c.is_moe(l) for l in range(c.num_hidden_layers))
    require(f"(f) experts are not in id order in {order_scrambled}/{moe_layers} MoE layers", order_scrambled == moe_layers)
    pads = [model.ckpt.raw(f"model.layers.{l}.self_attn.A_log") for l in range(c.num_hidden_layers) if c.layer_kinds[l] == "kda"]
    require("(f) A_log is F32 [head_dim] with entries >= num_heads exactly 0 and the first ones distinct",
            all(p.dtype == torch.float32 and p.shape == (c.kda_head_dim,) and bool((p[c.kda_num_heads:] == 0).all())
                and len(set(p[:c.kda_num_heads].tolist())) == c.kda_num_heads for p in pads))


# ------------------------------------------------------------------------------------------------
# (h) hand-worked values of the small conventions, (i) config refusals, (j) fixtures up to date
# ------------------------------------------------------------------------------------------------

def check_conventions():
    # Router ties go to the lower id: scores 0.5, 0.7, 0.7, 0.1, 0.7 -> top-2 = ids 1, 2 (not 4).
    ids = k3_reference.K3Reference.topk_lower_id_first(torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7]]), 2)
    require("(h) top-k ties go to the lower expert id: [0.5,0.7,0.7,0.1,0.7] -> [1, 2]", ids.tolist() == [[1, 2]])
    # SiTU-GLU with identity weights (D = F = 1): h(a, b) = 4 tanh(a/4) sigmoid(a) * 25 tanh(b/25).
    one = torch.ones(1, 1, dtype=torch.float64)

    def situ(a, b):
        return float(k3_reference.situ_glu(torch.tensor([[1.0]], dtype=torch.float64), a * one, b * one, one, 4.0, 25.0))

    # a = 100: 4 * tanh(25) * sigmoid(100) = 4 (to 1e-15); b = 1000: 25 * tanh(40) = 25 -> h = 100.
    report("(h) SiTU caps: h(a=100, b=1000) = 4 * 25 = 100, |diff|", abs(situ(100.0, 1000.0) - 100.0), 1e-12)
    # a = -100: the sigmoid takes the UNCAPPED a: h = -4 * sigmoid(-100) * 25 = -3.7e-42. Feeding it the
    # capped gate 4 tanh(-25) = -4 instead would give -4 * sigmoid(-4) * 25 = -1.8.
    report("(h) SiTU sigmoid takes the uncapped gate: |h(a=-100, b=1000)|", abs(situ(-100.0, 1000.0)), 1e-40)
    # a = 2, b = 3 by hand: 4 tanh(0.5) = 1.848469..., sigmoid(2) = 0.880797..., 25 tanh(0.12) = 2.985682...
    by_hand = 4 * 0.46211715726000974 * 0.8807970779778823 * 25 * 0.11942729853438588
    report("(h) SiTU h(a=2, b=3) vs the hand computation 4.86107", abs(situ(2.0, 3.0) - by_hand), 1e-14)
    # RMSNorm: x = [3, 4], eps 0: mean(x^2) = 12.5, n(x) = x / sqrt(12.5) = [0.848528, 1.131371].
    x = torch.tensor([3.0, 4.0], dtype=torch.float64)
    report("(h) RMSNorm([3, 4], eps 0) = [3, 4] / sqrt(12.5)",
           float((k3_reference.rms_normalize(x, 0.0) - x / 12.5 ** 0.5).abs().max()), 1e-15)


def check_config_refusals(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        good = json.load(f)
    k3_reference.TextConfig(good)
    cases = [
        ("hidden_act silu", ["hidden_act"], "silu"),
        ("num_expert_group 2", ["num_expert_group"], 2),
        ("moe_router_activation_func softmax", ["moe_router_activation_func"], "softmax"),
        ("mla_use_nope false", ["mla_use_nope"], False),
        ("use_full_rank_gate false", ["linear_attn_config", "use_full_rank_gate"], False),
        ("full_attn_layers 0-based", ["linear_attn_config", "full_attn_layers"], [3, 7, 11, 12]),
        ("num_key_value_heads 2 (GQA)", ["num_key_value_heads"], 2),
        ("missing attn_res_block_size", ["attn_res_block_size"], None),
        ("tie_word_embeddings true", ["tie_word_embeddings"], True),
    ]
    refused = []
    for label, path, value in cases:
        cfg = json.loads(json.dumps(good))
        section = cfg["text_config"]
        for key in path[:-1]:
            section = section[key]
        if value is None:
            del section[path[-1]]
        else:
            section[path[-1]] = value
        try:
            k3_reference.TextConfig(cfg)
        except k3_reference.ConfigError:
            refused.append(label)
    require(f"(i) unsupported configs are refused ({len(refused)}/{len(cases)}: {', '.join(refused)})",
            len(refused) == len(cases))


def check_fixtures_current(model, reference_dir):
    """If the reference fixtures exist, recompute their logits with the current code."""
    path = os.path.join(reference_dir, "model.safetensors")
    if not os.path.exists(path):
        print(f"[skip] (j) no {path}")
        return
    fx, _ = st.read(path)
    tf = model.forward(fx["tf_ids"])
    report("(j) fixtures up to date: |tf_logits - fresh float64 logits rounded to f32|",
           float((tf.to(torch.float32) - fx["tf_logits"]).abs().max()), 0.0)
    full = model.forward(torch.cat([fx["prompt_ids"], fx["greedy_ids"][:-1]]))
    require("(j) fixtures up to date: greedy_ids are the argmax of a fresh pass",
            torch.equal(full[len(fx["prompt_ids"]) - 1:].argmax(-1), fx["greedy_ids"]))


def main():
    parser = argparse.ArgumentParser(description="Numerical self-checks of the Python reference and tools.")
    parser.add_argument("--model", default="fixtures/tiny-k3", help="tiny K3 folder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = k3_reference.K3Reference(args.model, torch.float64)
    ids = [17, 300, 5, 5, 421, 99, 250, 3, 77, 460]
    T = len(ids)
    dump = {}
    logits = model.forward(ids, dump=dump, state_points=(T,))
    check_mla_absorbed(model, dump, T)
    check_attnres_closed_form(model, dump, ids)
    check_kda_chunked(model, dump, T)
    check_mxfp4(model)
    check_safetensors()
    check_layout(args.model, model)
    prefix_logits = model.forward(ids[:6])
    report("(g) causality: logits of the first 6 ids vs the first 6 rows of the 10-id pass, max |diff|",
           float((prefix_logits - logits[:6]).abs().max()), 1e-12)
    check_conventions()
    check_config_refusals(args.model)
    check_fixtures_current(model, os.path.join(args.model, "reference"))
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
