"""make_kernel_fixtures.py - float64 reference outputs for the kernel chapters 03, 04 and 05.

Usage:  /usr/bin/python3 tools/make_kernel_fixtures.py --out fixtures/kernels

Each fixture holds f32 inputs (exactly what the C++ test feeds its kernel) and the expected output
computed in float64 from those same f32 inputs, then rounded to f32 for storage. The C++ tests
compare with a stated tolerance: the engine works in f32, so it differs from exact arithmetic by
rounding only. (Bit-identity is a different claim, tested between the C++ paths themselves.)

Deterministic: a fixed torch.Generator seed per file; the same command always writes the same bytes.

Files
  norms.safetensors         3.1 RMSNorm (D = 128, three rows spanning 1e-3 .. 1e3 in magnitude),
                            3.2 the KDA L2 norm with the q scale 32^-1/2 (4 heads x 32),
                            3.3 the gated per-head norm (4 heads x 32, shared weight, sigmoid gate)
  matvec_bf16.safetensors   4.x y = W x, W bf16 [48, 64], three tokens
  mxfp4.safetensors         5.x y = W x, W MXFP4 [40, 96] in the compressed-tensors layout, with every
                            code present, scale bytes 0 (the 2^-127 denormal) and 100..140, two tokens
  situ.safetensors          6.1 SiTU-GLU h = [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)] on a grid of gate
                            and up pre-activations spanning +-0.1 .. +-1000 (both soft caps saturate),
                            with b1 = 4, b2 = 25, and the null-beta variants (b1 = 1, up = identity)
"""

import argparse
import hashlib
import os
import sys

import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4  # noqa: E402
import st  # noqa: E402

EPS = 1e-5      # rms_norm_eps (docs/kimi-k3.md 1.2)
L2_EPS = 1e-6   # the KDA L2 norm's epsilon, inside the square root of the SUM (docs/kimi-k3.md 3.4.4)


def provenance():
    paths = [os.path.abspath(__file__)] + [os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                                           for f in ("st.py", "mxfp4.py")]
    parts = []
    for p in paths:
        with open(p, "rb") as f:
            parts.append(f"tools/{os.path.basename(p)}:{hashlib.sha256(f.read()).hexdigest()}")
    return {"generator": "tools/make_kernel_fixtures.py", "generator_sha256": " ".join(parts)}


def f32(t):
    return t.to(torch.float32)


def rmsnorm64(x, gamma, eps):
    """docs/kimi-k3.md 0.1 in float64: gamma * x / sqrt(mean(x^2) + eps), per row."""
    x = x.double()
    return gamma.double() * x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def norms(gen):
    out = {}
    # 3.1 RMSNorm: rows of very different scale so that eps matters in one of them
    x = torch.randn(3, 128, generator=gen, dtype=torch.float64)
    x[0] *= 1e-3
    x[2] *= 1e3
    x = f32(x)
    gamma = (1.0 + 0.5 * torch.randn(128, generator=gen, dtype=torch.float64)).to(torch.bfloat16).float()
    out["rms.x"], out["rms.gamma"] = x, gamma
    out["rms.y"] = f32(rmsnorm64(x, gamma, EPS))
    # 3.2 L2 norm over heads of 32 with the query scale 32^-1/2 (row 3 is tiny: eps dominates)
    q = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    q[3] *= 1e-4
    q = f32(q)
    out["l2.x"] = q
    scale = 32.0 ** -0.5
    out["l2.y"] = f32(q.double() / torch.sqrt((q.double() ** 2).sum(dim=-1, keepdim=True) + L2_EPS) * scale)
    # 3.3 gated per-head norm: 4 heads x 32, one weight for all heads, sigmoid of the gate
    o = f32(torch.randn(4, 32, generator=gen, dtype=torch.float64) * 3.0)
    g = f32(torch.randn(4, 32, generator=gen, dtype=torch.float64) * 4.0)
    w = f32(1.0 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64))
    out["gated.o"], out["gated.g"], out["gated.w"] = o, g, w
    out["gated.y"] = f32(rmsnorm64(o, w, EPS) * torch.sigmoid(g.double()))
    return out


def matvec_bf16(gen):
    w = torch.randn(48, 64, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    x = f32(torch.randn(3, 64, generator=gen, dtype=torch.float64))
    y = x.double() @ w.double().t()
    return {"w": w, "x": x, "y": f32(y)}


def mxfp4_case(gen):
    rows, cols = 40, 96
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    codes[0, :16] = torch.arange(16)          # every code, in order, at a known place
    scale = torch.randint(100, 141, (rows, cols // 32), generator=gen)
    scale[1, 0] = 0                           # 2^-127: a float32 denormal, must not be flushed
    scale[2, :] = 127                         # scale 1: the raw E2M1 values
    packed, scale = mxfp4.pack_codes(codes), scale.to(torch.uint8)
    x = f32(torch.randn(2, cols, generator=gen, dtype=torch.float64))
    x[:, 32:64] *= 1e30                       # makes row 1's denormal block visible in its output
    w = mxfp4.dequantize(packed, scale)       # exact float64
    y = x.double() @ w.t()
    return {"packed": packed, "scale": scale, "x": x, "y": f32(y), "w": f32(w)}


def situ64(a, b, beta1, beta2):
    """docs/kimi-k3.md 0.2 in float64: the sigmoid takes the UNCAPPED gate; beta2 = None means the up branch is b."""
    a, b = a.double(), b.double()
    gate = beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)
    up = b if beta2 is None else beta2 * torch.tanh(b / beta2)
    return gate * up


def situ(gen):
    mags = torch.tensor([0.1, 0.3, 1.0, 2.0, 4.0, 8.0, 20.0, 25.0, 50.0, 100.0, 300.0, 1000.0], dtype=torch.float64)
    vals = torch.cat([mags, -mags])                       # 24 values, both signs
    a = vals.repeat_interleave(len(vals))                 # every (a, b) pair: 576 of them
    b = vals.repeat(len(vals))
    a, b = f32(a), f32(b)
    return {"a": a, "b": b, "h": f32(situ64(a, b, 4.0, 25.0)), "h_null_betas": f32(situ64(a, b, 1.0, None))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder, e.g. fixtures/kernels")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    meta = provenance()
    for name, make, seed in (("norms", norms, 3), ("matvec_bf16", matvec_bf16, 4), ("mxfp4", mxfp4_case, 5), ("situ", situ, 6)):
        gen = torch.Generator().manual_seed(seed)
        path = os.path.join(args.out, f"{name}.safetensors")
        n = st.write(path, make(gen), meta)
        print(f"wrote {path} ({n} bytes)")


if __name__ == "__main__":
    main()
