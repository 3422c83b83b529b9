"""k3_reference.py - the Kimi K3 text forward pass in PyTorch, written from docs/kimi-k3.md.

This is the oracle the C++ engine is checked against. It is written for reading: one function per
section of docs/kimi-k3.md, plain tensor code, the equation in a comment at the top of each function.

Contract
--------
* It computes in ONE dtype chosen by the caller (torch.float64 or torch.float32). Every weight is
  decoded exactly into that dtype (BF16 -> float is exact, F32 is used as is, MXFP4 is dequantized
  exactly, docs/kimi-k3.md 3.8) and every activation stays in it: there is no bf16 rounding anywhere, unlike
  Moonshot's HF code (which rounds to bf16 at the points listed in docs/kimi-k3.md 3.8).
* Where docs/kimi-k3.md gives two equivalent formulations, this file uses the one the C++ engine does NOT
  use, so the two implementations are independent:
    - Block AttnRes: Moonshot's PROCEDURAL form of docs/kimi-k3.md 3.2 (bank list + partial sum); the engine
      uses the closed form.
    - KDA: the token-by-token recurrence of docs/kimi-k3.md 3.4.5 with an explicit state, and the short
      convolution as a plain causal window over the whole sequence (no rolling conv state).
    - MLA: the NAIVE form of docs/kimi-k3.md 3.5.3 (K and V expanded per head through kv_b_proj, full causal
      softmax); the engine uses the absorbed form of 3.5.4.
* Conventions shared with the engine (each is cited where it is used):
    RMSNorm y = gamma * (x * (1 / sqrt(mean(x^2) + eps))), eps = rms_norm_eps, except the MLA
    q_a/kv_a norms (1e-6, trap 5.1.9 of docs/kimi-k3.md); KDA L2 norm x / sqrt(sum(x^2) + 1e-6) (sum, not mean); router
    top-k ties go to the lower expert id; the MoE combine sums experts in slot order.
* It recomputes the whole sequence on every call (no KV cache): greedy decoding re-runs the prefix.
  Causality makes that equal to incremental decoding, and it keeps the code short.
* It can record every intermediate of every layer into a dict (`dump=`), under the names the
  fixtures use (see tools/make_tiny_k3_reference.py).

What it leaves out: vision, the tokenizer, sampling, batching, bf16 emulation, speed.

Usage
-----
    /usr/bin/python3 tools/k3_reference.py MODEL_DIR --ids 1,2,3 --dtype float64
prints the argmax token at every position (add --top 5 for the five best logits, --dump FILE to
write every intermediate as a safetensors file).
"""

import argparse
import json
import os
import sys

import torch

sys.dont_write_bytecode = True  # keep tools/ free of __pycache__ (the sibling modules are imported below)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4  # noqa: E402  (tools/ is not a package; these two modules sit beside this file)
import st  # noqa: E402

# ================================================================================================
# 1. Configuration (docs/kimi-k3.md section 1)
# ================================================================================================


class ConfigError(ValueError):
    """config.json asks for something this reference does not implement (or is malformed)."""


def _require(section, name, kinds, where, minimum=1):
    """Fetch section[name], check its JSON type, fail with a clear message otherwise.
    Integer fields (sizes, counts) must also be >= minimum."""
    if name not in section:
        raise ConfigError(f"{where}: missing field {name!r}")
    value = section[name]
    # bool is a subclass of int in Python: do not let True pass as an integer (or vice versa).
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{where}: field {name!r} = {value!r} has the wrong type")
    if not isinstance(value, kinds):
        raise ConfigError(f"{where}: field {name!r} = {value!r} has the wrong type")
    if kinds == (int,) and value < minimum:
        raise ConfigError(f"{where}: field {name!r} = {value!r} must be an integer >= {minimum}")
    return value


def _require_equal(section, name, expected, where, default=None):
    """Fields whose value is fixed by K3's architecture: anything else is unsupported."""
    value = section.get(name, default)
    if value != expected:
        raise ConfigError(f"{where}: {name} = {value!r} is not supported (this reference implements {expected!r})")
    return value


class TextConfig:
    """The text_config fields the forward pass reads (docs/kimi-k3.md 1.2), validated, plus derived values.

    Accepts the release's nested config.json (top level model_type "kimi_k3" with a `text_config`)
    or a flat text config. Anything the math below does not implement is refused (ConfigError).
    """

    def __init__(self, raw):
        if "text_config" in raw:
            if raw.get("model_type") != "kimi_k3":
                raise ConfigError(f"config.json: top-level model_type {raw.get('model_type')!r}, expected 'kimi_k3'")
            text = raw["text_config"]
            where = "config.json text_config"
        else:
            text = raw
            where = "config.json"
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"{where}: model_type {text.get('model_type')!r}, expected 'kimi_linear'")
        self.raw = raw
        pos_int = (int,)

        # --- sizes (docs/kimi-k3.md sections 0 and 1.2) ---
        self.hidden_size = _require(text, "hidden_size", pos_int, where)                      # D
        self.num_hidden_layers = _require(text, "num_hidden_layers", pos_int, where)          # L
        self.vocab_size = _require(text, "vocab_size", pos_int, where)                        # V
        self.rms_norm_eps = float(_require(text, "rms_norm_eps", (int, float), where))
        # --- MLA (docs/kimi-k3.md 3.5) ---
        self.num_attention_heads = _require(text, "num_attention_heads", pos_int, where)      # H (MLA)
        if text.get("num_key_value_heads", self.num_attention_heads) != self.num_attention_heads:
            raise ConfigError(f"{where}: num_key_value_heads != num_attention_heads (GQA) is not supported")
        self.q_lora_rank = _require(text, "q_lora_rank", pos_int, where)
        self.kv_lora_rank = _require(text, "kv_lora_rank", pos_int, where)
        self.qk_nope_head_dim = _require(text, "qk_nope_head_dim", pos_int, where)
        self.qk_rope_head_dim = _require(text, "qk_rope_head_dim", pos_int, where)
        self.v_head_dim = _require(text, "v_head_dim", pos_int, where)
        _require_equal(text, "mla_use_nope", True, where)          # no rotary embedding at all (trap 5.1.2 of docs/kimi-k3.md)
        _require_equal(text, "mla_use_output_gate", True, where)   # the sigmoid g_proj gate of 3.5.5
        # --- KDA (docs/kimi-k3.md 3.4) ---
        linear = _require(text, "linear_attn_config", (dict,), where)
        lwhere = where + " linear_attn_config"
        self.kda_num_heads = _require(linear, "num_heads", pos_int, lwhere)                   # H_k
        self.kda_head_dim = _require(linear, "head_dim", pos_int, lwhere)                     # Dh
        self.conv_size = _require(linear, "short_conv_kernel_size", pos_int, lwhere)          # W_c
        _require_equal(linear, "use_full_rank_gate", True, lwhere)
        self.gate_lower_bound = float(_require(linear, "gate_lower_bound", (int, float), lwhere))
        if not -5 <= self.gate_lower_bound < 0:   # the range fla's chunk_kda accepts
            raise ConfigError(f"{lwhere}: gate_lower_bound must be in [-5, 0) (the decay is lower_bound * sigmoid(...))")
        kda_layers = _require(linear, "kda_layers", (list,), lwhere)
        full_layers = _require(linear, "full_attn_layers", (list,), lwhere)
        # The config's lists are 1-based (trap 5.1.11 of docs/kimi-k3.md): layer l is KDA when (l+1) is in kda_layers.
        if sorted(kda_layers + full_layers) != list(range(1, self.num_hidden_layers + 1)):
            raise ConfigError(f"{lwhere}: kda_layers and full_attn_layers must partition 1..num_hidden_layers (1-based)")
        self.layer_kinds = ["kda" if (l + 1) in kda_layers else "mla" for l in range(self.num_hidden_layers)]
        # --- FFN (docs/kimi-k3.md 0.2 and 3.6) ---
        _require_equal(text, "hidden_act", "situ", where)
        beta1 = text.get("activation_situ_beta")
        beta2 = text.get("activation_situ_linear_beta")
        self.situ_beta = 1.0 if beta1 is None else float(beta1)                   # null -> 1.0 (docs/kimi-k3.md 0.2)
        self.situ_linear_beta = None if beta2 is None else float(beta2)           # null -> identity
        self.intermediate_size = _require(text, "intermediate_size", pos_int, where)
        self.first_k_dense_replace = _require(text, "first_k_dense_replace", pos_int, where, minimum=0)
        self.moe_layer_freq = _require(text, "moe_layer_freq", pos_int, where)
        self.num_experts = _require(text, "num_experts", pos_int, where)                      # E
        self.num_experts_per_token = _require(text, "num_experts_per_token", pos_int, where)  # K
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"{where}: num_experts_per_token must be in 1..num_experts")
        self.num_shared_experts = _require(text, "num_shared_experts", pos_int, where)
        self.moe_intermediate_size = _require(text, "moe_intermediate_size", pos_int, where)  # F
        if text.get("routed_expert_hidden_size") is None:
            raise ConfigError(f"{where}: routed_expert_hidden_size missing: only the latent MoE of K3 is implemented")
        self.routed_expert_hidden_size = _require(text, "routed_expert_hidden_size", pos_int, where)  # latent
        self.latent_moe_use_norm = _require(text, "latent_moe_use_norm", (bool,), where)
        _require_equal(text, "moe_router_activation_func", "sigmoid", where)
        self.moe_renormalize = _require(text, "moe_renormalize", (bool,), where)
        self.routed_scaling_factor = float(_require(text, "routed_scaling_factor", (int, float), where))
        # Group-limited selection is only active when num_expert_group > 1 (docs/kimi-k3.md 1.2): refuse it.
        if text.get("num_expert_group", 1) not in (1, None):
            raise ConfigError(f"{where}: num_expert_group > 1 (group-limited routing) is not supported")
        if text.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{where}: topk_method {text.get('topk_method')!r} is not supported")
        # --- AttnRes (docs/kimi-k3.md 3.2) ---
        self.attn_res_block_size = _require(text, "attn_res_block_size", pos_int, where)      # S
        # --- head ---
        if raw.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False):
            raise ConfigError(f"{where}: tie_word_embeddings = true is not supported (K3 has a separate lm_head)")
        if text.get("num_nextn_predict_layers", 0) not in (0, None):
            raise ConfigError(f"{where}: MTP layers (num_nextn_predict_layers > 0) are not supported")
        self.quantization_config = text.get("quantization_config", raw.get("quantization_config"))
        if self.quantization_config is not None:
            _check_quantization(self.quantization_config)
        # The routed experts' widths are MXFP4 `in` dimensions: multiples of the 32-column block.
        for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
            if getattr(self, name) % mxfp4.BLOCK != 0:
                raise ConfigError(f"{where}: {name} must be a multiple of {mxfp4.BLOCK} (MXFP4 blocks)")

    def is_moe(self, layer):
        """docs/kimi-k3.md 1.2: MoE when l >= first_k_dense_replace and l % moe_layer_freq == 0."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _check_quantization(qc):
    """docs/kimi-k3.md 2.4: only compressed-tensors mxfp4-pack-quantized (4-bit float, group 32) is supported."""
    where = "quantization_config"
    _require_equal(qc, "quant_method", "compressed-tensors", where)
    _require_equal(qc, "format", "mxfp4-pack-quantized", where)
    groups = _require(qc, "config_groups", (dict,), where)
    for group_name, group in groups.items():
        weights = _require(group, "weights", (dict,), f"{where} {group_name}")
        for key, expected in (("num_bits", 4), ("type", "float"), ("group_size", 32)):
            _require_equal(weights, key, expected, f"{where} {group_name} weights")
        if group.get("input_activations") is not None:
            raise ConfigError(f"{where} {group_name}: activation quantization is not supported (weight-only)")


# ================================================================================================
# 2. Checkpoint (docs/kimi-k3.md section 2): release layout, `language_model.` prefix, shards + index
# ================================================================================================


class Checkpoint:
    """Tensor access by release name. Reads lazily, only the tensors asked for."""

    PREFIX = "language_model."

    def __init__(self, model_dir):
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        single_path = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        elif os.path.exists(single_path):
            shard_names = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors")
        # name -> SafetensorsFile, from the shard headers themselves (the index is only a hint).
        self.files = {}
        for shard in shard_names:
            st_file = st.SafetensorsFile(os.path.join(model_dir, shard))
            for name in st_file.keys():
                self.files[name] = st_file
        # Release names carry `language_model.`; accept a bare text checkpoint too.
        self.prefix = self.PREFIX if any(n.startswith(self.PREFIX) for n in self.files) else ""

    def has(self, name):
        return self.prefix + name in self.files

    def dtype_of(self, name):
        full = self.prefix + name
        return self.files[full].entries[full]["dtype"]

    def raw(self, name):
        """The stored tensor, undecoded."""
        full = self.prefix + name
        if full not in self.files:
            raise KeyError(f"tensor {full!r} not found in the checkpoint")
        return self.files[full].get(full)


# ================================================================================================
# 3. Building blocks (docs/kimi-k3.md 0.1, 0.2, 3.2)
# ================================================================================================


def rms_normalize(x, eps):
    """n(x) = x * (1 / sqrt(mean_j x_j^2 + eps)) over the last axis (docs/kimi-k3.md 0.1)."""
    return x * (1.0 / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def rmsnorm(x, gamma, eps):
    """RMSNorm_{gamma,eps}(x) = gamma * n(x) (docs/kimi-k3.md 0.1)."""
    return gamma * rms_normalize(x, eps)


def softmax(scores, dim=-1):
    """exp(s - max) / sum exp(s - max); -inf entries give exactly 0."""
    shifted = scores - scores.amax(dim=dim, keepdim=True)
    e = torch.exp(shifted)
    return e / e.sum(dim=dim, keepdim=True)


def situ_glu(x, w_gate, w_up, w_down, beta1, beta2, dump=None, prefix=""):
    """SiTU-GLU, docs/kimi-k3.md 0.2 (trap 5.1.5):
        a = x W_g^T,  b = x W_u^T
        h = [beta1 * tanh(a / beta1) * sigmoid(a)] * [beta2 * tanh(b / beta2)]
        y = h W_d^T
    beta1 caps the GATE branch, and the sigmoid takes the UNCAPPED a; beta2 caps the UP branch
    (beta2 None = identity up branch)."""
    a = x @ w_gate.T
    b = x @ w_up.T
    gate_branch = beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)
    up_branch = b if beta2 is None else beta2 * torch.tanh(b / beta2)
    h = gate_branch * up_branch
    if dump is not None:
        dump[prefix + "gate_pre"] = a
        dump[prefix + "up_pre"] = b
        dump[prefix + "h"] = h
    return h @ w_down.T


def attn_res_mix(candidates, norm_weight, proj_weight, eps):
    """Block AttnRes mix over depth, docs/kimi-k3.md 3.2, for every token at once.

        w     = res_norm.weight * res_proj.weight[0]                 (gamma folded into the 1xD proj)
        s_i   = sum_j n(v_i)[j] * w[j]                                (keys: RMS-normalised candidates)
        pi    = softmax_i(s)
        mix   = sum_i pi_i * v_i                                      (values: the RAW candidates)

    candidates: list of n tensors [T, D]. Returns (mix [T, D], pi [T, n])."""
    w = norm_weight * proj_weight[0]                                          # [D]
    stacked = torch.stack(candidates, dim=1)                                  # [T, n, D]
    scores = (rms_normalize(stacked, eps) * w).sum(dim=-1)                    # [T, n]
    pi = softmax(scores, dim=-1)                                              # [T, n]
    mixed = candidates[0] * pi[:, 0:1]
    for i in range(1, len(candidates)):                                       # candidate order
        mixed = mixed + candidates[i] * pi[:, i:i + 1]
    return mixed, pi


# ================================================================================================
# 4. The model
# ================================================================================================


class K3Reference:
    """Kimi K3 text model, all arithmetic in `dtype` (torch.float64 or torch.float32)."""

    def __init__(self, model_dir, dtype=torch.float64):
        if dtype not in (torch.float64, torch.float32):
            raise ValueError("dtype must be torch.float64 or torch.float32")
        self.dtype = dtype
        self.model_dir = model_dir
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = TextConfig(json.load(f))
        self.ckpt = Checkpoint(model_dir)
        self._cache = {}

    # --- weights ------------------------------------------------------------------------------

    def w(self, name, shape):
        """A dense weight decoded exactly to self.dtype, with its shape checked against config."""
        key = (name, "dense")
        if key not in self._cache:
            raw = self.ckpt.raw(name)
            if tuple(raw.shape) != tuple(shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(raw.shape)}, config implies {tuple(shape)}")
            if not raw.is_floating_point():
                raise ValueError(f"tensor {name!r} has dtype {raw.dtype}, expected a float dtype")
            self._cache[key] = raw.to(self.dtype)  # BF16/F16 -> float widening is exact
        return self._cache[key]

    def expert_w(self, name, out_dim, in_dim):
        """A routed-expert weight: MXFP4 (`.weight_packed` + `.weight_scale`, docs/kimi-k3.md 2.4) dequantized
        exactly, or a plain `.weight` if the checkpoint is not quantized."""
        key = (name, "expert")
        if key not in self._cache:
            if self.ckpt.has(name + ".weight_packed"):
                packed = self.ckpt.raw(name + ".weight_packed")
                scale = self.ckpt.raw(name + ".weight_scale")
                if tuple(packed.shape) != (out_dim, in_dim // 2) or tuple(scale.shape) != (out_dim, in_dim // mxfp4.BLOCK):
                    raise ValueError(f"{name}: packed {tuple(packed.shape)} / scale {tuple(scale.shape)} do not "
                                     f"match the logical shape [{out_dim}, {in_dim}]")
                self._cache[key] = mxfp4.dequantize(packed, scale).to(self.dtype)  # exact
            else:
                self._cache[key] = self.w(name + ".weight", (out_dim, in_dim))
        return self._cache[key]

    def a_log(self, name, heads):
        """A_log's first `heads` entries. Moonshot's module declares it [num_heads]; the release stores it
        zero-padded to [head_dim]. Any 1-D length >= heads is accepted; entries past `heads` are never read."""
        raw = self.ckpt.raw(name)
        if raw.dim() != 1 or raw.shape[0] < heads or not raw.is_floating_point():
            raise ValueError(f"tensor {name!r} has shape {tuple(raw.shape)}, expected a float vector of >= {heads} entries")
        return raw[:heads].to(self.dtype)

    # --- 3.4 KDA ------------------------------------------------------------------------------

    def kda(self, layer, u, dump, state_points):
        """Kimi Delta Attention over a whole sequence u [T, D] -> [T, D] (docs/kimi-k3.md 3.4)."""
        c = self.config
        p = f"model.layers.{layer}.self_attn."
        d = f"layer.{layer}.kda."
        T, D = u.shape
        H, Dh, W = c.kda_num_heads, c.kda_head_dim, c.conv_size
        P = H * Dh

        # 3.4.1 projections and the depthwise causal conv + SiLU, as a plain window over the sequence:
        #   y_t[c] = SiLU( sum_{j=0}^{W-1} w[c, j] * x_{t-W+1+j}[c] ),  x_{tau<0} = 0, tap W-1 = current token
        def short_conv(x, taps):                                           # x [T, P], taps [P, 1, W]
            padded = torch.cat([torch.zeros(W - 1, P, dtype=x.dtype), x], dim=0)   # [T+W-1, P]
            acc = taps[:, 0, 0] * padded[0:T]
            for j in range(1, W):
                acc = acc + taps[:, 0, j] * padded[j:j + T]
            return acc * torch.sigmoid(acc)                                # SiLU

        q_conv = short_conv(u @ self.w(p + "q_proj.weight", (P, D)).T, self.w(p + "q_conv1d.weight", (P, 1, W)))
        k_conv = short_conv(u @ self.w(p + "k_proj.weight", (P, D)).T, self.w(p + "k_conv1d.weight", (P, 1, W)))
        v_conv = short_conv(u @ self.w(p + "v_proj.weight", (P, D)).T, self.w(p + "v_conv1d.weight", (P, 1, W)))

        # 3.4.2 beta = sigmoid(b_proj(u)), the plain sigmoid (not 2*sigmoid).
        beta = torch.sigmoid(u @ self.w(p + "b_proj.weight", (H, D)).T)             # [T, H]

        # 3.4.3 decay gate, lower-bounded form:
        #   z = f_b(f_a(u)) + dt_bias;  g[h, i] = lower_bound * sigmoid(exp(A_log[h]) * z[h, i])
        # A_log is stored zero-padded to head_dim entries (trap 5.1.1 of docs/kimi-k3.md): use entries 0..H-1, per HEAD.
        f = (u @ self.w(p + "f_a_proj.weight", (Dh, D)).T) @ self.w(p + "f_b_proj.weight", (P, Dh)).T
        z = (f + self.w(p + "dt_bias", (P,))).reshape(T, H, Dh)                      # head-major
        a_log = self.a_log(p + "A_log", H)                                           # [H]
        g = c.gate_lower_bound * torch.sigmoid(torch.exp(a_log)[None, :, None] * z)  # [T, H, Dh], in (lb, 0)
        alpha = torch.exp(g)                                                         # per-key-channel decay

        # 3.4.4 L2 norm per head, eps inside the sqrt on the SUM; q also times Dh^-1/2.
        def l2norm(x):
            return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

        q_hat = l2norm(q_conv.reshape(T, H, Dh)) * (Dh ** -0.5)
        k_hat = l2norm(k_conv.reshape(T, H, Dh))
        v = v_conv.reshape(T, H, Dh)

        # 3.4.5 the recurrence, token by token; state S [H, Dk, Dv] key-major, zero-initialised:
        #   S_bar = diag(alpha_t) S;  r = v_t - S_bar^T k_t;  S = S_bar + beta_t k_t (x) r;  o_t = S^T q_t
        S = torch.zeros(H, Dh, Dh, dtype=u.dtype)
        o = torch.zeros(T, H, Dh, dtype=u.dtype)
        for t in range(T):
            S_bar = alpha[t][:, :, None] * S                                         # decay row i_k
            prediction = torch.einsum("hkv,hk->hv", S_bar, k_hat[t])                  # S_bar^T k
            r = v[t] - prediction                                                    # prediction error
            S = S_bar + beta[t][:, None, None] * (k_hat[t][:, :, None] * r[:, None, :])
            o[t] = torch.einsum("hkv,hk->hv", S, q_hat[t])                           # uses the UPDATED S
            if dump is not None and (t + 1) in state_points:
                dump[d + f"state_after_{t + 1}"] = S.clone()

        # 3.4.6 per-head RMSNorm (eps = rms_norm_eps), times o_norm.weight, times sigmoid(g_proj(u)).
        gate = torch.sigmoid(u @ self.w(p + "g_proj.weight", (P, D)).T).reshape(T, H, Dh)
        o_gated = rms_normalize(o, c.rms_norm_eps) * self.w(p + "o_norm.weight", (Dh,)) * gate
        out = o_gated.reshape(T, P) @ self.w(p + "o_proj.weight", (D, P)).T

        if dump is not None:
            dump[d + "q_conv"], dump[d + "k_conv"], dump[d + "v_conv"] = q_conv, k_conv, v_conv
            dump[d + "q_hat"], dump[d + "k_hat"] = q_hat.reshape(T, P), k_hat.reshape(T, P)
            dump[d + "beta"], dump[d + "g"] = beta, g.reshape(T, P)
            dump[d + "o"], dump[d + "o_gated"] = o.reshape(T, P), o_gated.reshape(T, P)
        return out

    # --- 3.5 Gated MLA (NoPE), naive form -----------------------------------------------------

    def mla(self, layer, u, dump):
        """Gated MLA over a whole sequence u [T, D] -> [T, D] (docs/kimi-k3.md 3.5), the naive form of 3.5.3."""
        c = self.config
        p = f"model.layers.{layer}.self_attn."
        d = f"layer.{layer}.mla."
        T, D = u.shape
        H, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        dqk, rq, rkv = dn + dr, c.q_lora_rank, c.kv_lora_rank

        # 3.5.1 query: c_q = RMSNorm_{q_a_layernorm, 1e-6}(q_a_proj u);  Q = q_b_proj c_q  -> [T, H, dn+dr]
        c_q = rmsnorm(u @ self.w(p + "q_a_proj.weight", (rq, D)).T, self.w(p + "q_a_layernorm.weight", (rq,)), 1e-6)
        q = (c_q @ self.w(p + "q_b_proj.weight", (H * dqk, rq)).T).reshape(T, H, dqk)

        # 3.5.2 key/value latent: [c~ ; k_x] = kv_a_proj_with_mqa u;  c = RMSNorm_{kv_a_layernorm, 1e-6}(c~)
        kv_a = u @ self.w(p + "kv_a_proj_with_mqa.weight", (rkv + dr, D)).T
        latent = rmsnorm(kv_a[:, :rkv], self.w(p + "kv_a_layernorm.weight", (rkv,)), 1e-6)   # [T, rkv]
        k_x = kv_a[:, rkv:]                          # [T, dr]: not normalised, never rotated, head-shared
        kv = (latent @ self.w(p + "kv_b_proj.weight", (H * (dn + dv), rkv)).T).reshape(T, H, dn + dv)
        k_nope, v = kv[:, :, :dn], kv[:, :, dn:]     # per head: rows 0..dn-1 = W_UK, dn.. = W_UV

        # 3.5.3 naive attention: k_s[h] = [k_nope_s[h] ; k_x_s] (the rope part shared by all heads)
        k = torch.cat([k_nope, k_x[:, None, :].expand(T, H, dr)], dim=-1)          # [T, H, dqk]
        scores = torch.einsum("thd,shd->hts", q, k) * (dqk ** -0.5)                 # [H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()                          # s <= t
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = softmax(scores, dim=-1)                                              # zeros above the diagonal
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(T, H * dv)

        # 3.5.5 output gate G = sigmoid(g_proj u), applied before o_proj.
        gate = torch.sigmoid(u @ self.w(p + "g_proj.weight", (H * dv, D)).T)
        out = (attn * gate) @ self.w(p + "o_proj.weight", (D, H * dv)).T

        if dump is not None:
            dump[d + "c"], dump[d + "k_x"], dump[d + "q"] = latent, k_x, q
            dump[d + "probs"], dump[d + "attn"], dump[d + "gate"] = probs, attn, gate
        return out

    # --- 3.6 FFN ------------------------------------------------------------------------------

    def dense_ffn(self, layer, u, dump):
        """Dense SiTU-GLU (layer 0 in K3), docs/kimi-k3.md 3.6 / 0.2."""
        c = self.config
        p = f"model.layers.{layer}.mlp."
        D, F = c.hidden_size, c.intermediate_size
        return situ_glu(u, self.w(p + "gate_proj.weight", (F, D)), self.w(p + "up_proj.weight", (F, D)),
                        self.w(p + "down_proj.weight", (D, F)), c.situ_beta, c.situ_linear_beta,
                        dump, f"layer.{layer}.ffn.")

    @staticmethod
    def topk_lower_id_first(values, k):
        """Top-k indices per row, by value descending, ties broken toward the LOWER id (docs/kimi-k3.md 3.6 step 2).
        A stable descending sort keeps equal values in id order."""
        return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]

    def moe(self, layer, x, dump):
        """Latent MoE + shared experts, docs/kimi-k3.md 3.6 steps 1..9, for every token of x [T, D]."""
        c = self.config
        p = f"model.layers.{layer}.block_sparse_moe."
        d = f"layer.{layer}.moe."
        T, D = x.shape
        E, K, F, Lt = c.num_experts, c.num_experts_per_token, c.moe_intermediate_size, c.routed_expert_hidden_size

        # 1. router: logits = x W_r^T, scores = sigmoid(logits)
        logits = x @ self.w(p + "gate.weight", (E, D)).T                           # [T, E]
        scores = torch.sigmoid(logits)
        # 2. selection on the BIASED scores (the bias affects selection only, trap 5.1.3 of docs/kimi-k3.md)
        bias = self.w(p + "gate.e_score_correction_bias", (E,))
        topk_ids = self.topk_lower_id_first(scores + bias, K)                      # [T, K] slot order
        # 3. weights from the UNBIASED scores of the selected set, renormalised (Moonshot's gate: only when
        #    top_k > 1 and moe_renormalize), times the scaling factor
        selected = torch.gather(scores, 1, topk_ids)                               # [T, K]
        if c.moe_renormalize and K > 1:
            topk_weights = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            topk_weights = selected
        topk_weights = topk_weights * c.routed_scaling_factor
        # 4. latent down-projection
        z = x @ self.w(p + "routed_expert_down_proj.weight", (Lt, D)).T             # [T, Lt]
        # 5./6. each selected expert on the latent z; combine in slot order
        expert_out = torch.zeros(T, K, Lt, dtype=x.dtype)
        gate_pre = torch.zeros(T, K, F, dtype=x.dtype)
        up_pre = torch.zeros(T, K, F, dtype=x.dtype)
        for t in range(T):
            for slot in range(K):
                e = int(topk_ids[t, slot])
                q = f"{p}experts.{e}."
                parts = {}
                expert_out[t, slot] = situ_glu(
                    z[t:t + 1], self.expert_w(q + "w1", F, Lt), self.expert_w(q + "w3", F, Lt),
                    self.expert_w(q + "w2", Lt, F), c.situ_beta, c.situ_linear_beta, parts)[0]
                gate_pre[t, slot], up_pre[t, slot] = parts["gate_pre"][0], parts["up_pre"][0]
        y_lat = topk_weights[:, 0:1] * expert_out[:, 0]
        for slot in range(1, K):
            y_lat = y_lat + topk_weights[:, slot:slot + 1] * expert_out[:, slot]
        # 7. latent RMSNorm (after the weighted sum, trap 5.1.4 of docs/kimi-k3.md), then the up-projection
        y_norm = rmsnorm(y_lat, self.w(p + "routed_expert_norm.weight", (Lt,)), c.rms_norm_eps) \
            if c.latent_moe_use_norm else y_lat
        y_routed = y_norm @ self.w(p + "routed_expert_up_proj.weight", (D, Lt)).T
        # 8. shared experts on the full-width x (not the latent), fused width F * num_shared
        Fs = F * c.num_shared_experts
        shared_parts = {}
        y_shared = situ_glu(x, self.w(p + "shared_experts.gate_proj.weight", (Fs, D)),
                            self.w(p + "shared_experts.up_proj.weight", (Fs, D)),
                            self.w(p + "shared_experts.down_proj.weight", (D, Fs)),
                            c.situ_beta, c.situ_linear_beta, shared_parts)
        if dump is not None:
            dump[d + "router_logits"], dump[d + "scores"] = logits, scores
            dump[d + "topk_ids"] = topk_ids
            dump[d + "topk_ids_unbiased"] = self.topk_lower_id_first(scores, K)
            dump[d + "topk_weights"], dump[d + "z"] = topk_weights, z
            dump[d + "expert_gate_pre"], dump[d + "expert_up_pre"] = gate_pre, up_pre
            dump[d + "expert_out"], dump[d + "y_lat"] = expert_out, y_lat
            dump[d + "y_routed"], dump[d + "y_shared"] = y_routed, y_shared
            dump[d + "shared_gate_pre"], dump[d + "shared_up_pre"] = shared_parts["gate_pre"], shared_parts["up_pre"]
        # 9. sum
        return y_routed + y_shared

    # --- 3.2 / 3.9 / 3.7 the whole pass -------------------------------------------------------

    def mix(self, which, candidates):
        """One AttnRes mixer: which = 'model.layers.{l}.self_attention_res', '...mlp_res' or
        'model.output_attn_res'."""
        D = self.config.hidden_size
        return attn_res_mix(candidates, self.w(which + "_norm.weight", (D,)), self.w(which + "_proj.weight", (1, D)),
                            self.config.rms_norm_eps)

    def forward(self, ids, dump=None, state_points=()):
        """Logits [T, V] for token ids (list or 1-D tensor), every position.

        dump: optional dict, filled with every intermediate (names as in tools/make_tiny_k3_reference.py).
        state_points: token counts n after which each KDA layer's state is recorded as
                      `layer.{l}.kda.state_after_{n}` (the final state is always recorded)."""
        c = self.config
        ids = torch.as_tensor(ids, dtype=torch.int64)
        T, D, V = ids.shape[0], c.hidden_size, c.vocab_size
        if T == 0 or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"token ids must be a non-empty list of values in 0..{V - 1}")
        state_points = set(state_points) | {T}

        # 3.1 embedding (no scaling)
        h = self.w("model.embed_tokens.weight", (V, D))[ids]                       # [T, D]

        # 3.2 Moonshot's procedure, literally: `bank` holds completed block summaries; `partial`
        # is the running sum of sublayer outputs inside the current block; h is what flows on.
        bank = []
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            d = f"layer.{layer}."
            partial = h
            if dump is not None:
                dump[d + "partial_in"] = h
            if bank:                                                            # only layer 0 skips
                x, attn_pi = self.mix(p + "self_attention_res", bank + [partial])
                if dump is not None:
                    dump[d + "attn_mix_weights"] = attn_pi
            else:
                x = partial
            if layer % c.attn_res_block_size == 0:                              # bank the raw layer input
                bank = bank + [partial]
                partial = None
            # attention sublayer (3.3 pre-norm, then 3.4 KDA or 3.5 MLA)
            u = rmsnorm(x, self.w(p + "input_layernorm.weight", (D,)), c.rms_norm_eps)
            if c.layer_kinds[layer] == "kda":
                a = self.kda(layer, u, dump, state_points)
            else:
                a = self.mla(layer, u, dump)
            if dump is not None:
                dump[d + "attn_mix_out"], dump[d + "attn_norm_out"], dump[d + "attn_out"] = x, u, a
            partial = a if partial is None else partial + a
            # FFN sublayer: the mlp-side mix is never skipped
            x, mlp_pi = self.mix(p + "mlp_res", bank + [partial])
            u = rmsnorm(x, self.w(p + "post_attention_layernorm.weight", (D,)), c.rms_norm_eps)
            m = self.moe(layer, u, dump) if c.is_moe(layer) else self.dense_ffn(layer, u, dump)
            if dump is not None:
                dump[d + "mlp_mix_weights"], dump[d + "mlp_mix_out"] = mlp_pi, x
                dump[d + "mlp_norm_out"], dump[d + "mlp_out"] = u, m
            partial = partial + m
            h = partial                                 # only the partial sum flows to the next layer

        # 3.7 output: final mix over bank ++ [h], model.norm, lm_head (no soft-cap, no scaling)
        x, final_pi = self.mix("model.output_attn_res", bank + [h])
        x_norm = rmsnorm(x, self.w("model.norm.weight", (D,)), c.rms_norm_eps)
        logits = x_norm @ self.w("lm_head.weight", (V, D)).T
        if dump is not None:
            dump["final.mix_weights"], dump["final.mix_out"] = final_pi, x
            dump["final.norm_out"], dump["final.logits"] = x_norm, logits
        return logits

    def greedy(self, prompt_ids, steps):
        """Greedy continuation: `steps` tokens, each the argmax given prompt + previous tokens.
        Returns (generated ids [steps], the logits that produced each [steps, V])."""
        ids = list(int(i) for i in prompt_ids)
        generated, step_logits = [], []
        for _ in range(steps):
            logits = self.forward(ids)[-1]
            token = int(torch.argmax(logits))
            generated.append(token)
            step_logits.append(logits)
            ids.append(token)
        return torch.tensor(generated, dtype=torch.int64), torch.stack(step_logits)


# ================================================================================================
# 5. Command line
# ================================================================================================


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Kimi K3 text forward pass (PyTorch reference, float64 or float32). "
                    "Prints the argmax token at every position.")
    parser.add_argument("model_dir", help="checkpoint folder: config.json + model.safetensors[.index.json]")
    parser.add_argument("--ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--top", type=int, default=1, help="print the N best (id, logit) pairs per position")
    parser.add_argument("--gen", type=int, default=0, help="also generate N tokens greedily")
    parser.add_argument("--dump", metavar="FILE", help="write every intermediate to this safetensors file")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # reproducible reductions
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    try:
        model = K3Reference(args.model_dir, dtype)
        ids = [int(s) for s in args.ids.split(",") if s.strip()]
        dump = {} if args.dump else None
        logits = model.forward(ids, dump=dump)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for t in range(len(ids)):
        best = torch.topk(logits[t], args.top)
        pairs = "  ".join(f"{int(i)}:{float(v):.6f}" for v, i in zip(best.values, best.indices))
        print(f"pos {t:4d}  id {ids[t]:6d}  argmax {int(torch.argmax(logits[t])):6d}   {pairs}")
    if args.gen:
        generated, _ = model.greedy(ids, args.gen)
        print("greedy:", ",".join(str(int(i)) for i in generated))
    if args.dump:
        st.write(args.dump, dict(sorted(dump.items())), {"generator": "tools/k3_reference.py", "dtype": args.dtype})
        print(f"wrote {len(dump)} tensors to {args.dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
