"""mxfp4.py - OCP MXFP4 in the compressed-tensors `mxfp4-pack-quantized` layout (docs/kimi-k3.md section 2.4).

Kimi K3 ships its routed experts (w1 gate, w3 up, w2 down) as MXFP4: 4-bit E2M1 codes in blocks of
32 columns, one E8M0 power-of-two scale per block. A weight of logical shape [out, in] is stored as

    weight_packed [out, in/2]  uint8   two codes per byte
    weight_scale  [out, in/32] uint8   one E8M0 exponent per 32-column block

Bit layout of one packed byte (docs/kimi-k3.md 2.4, trap 5.1.6):

        bit  7   6   5   4   3   2   1   0
           +---+---+---+---+---+---+---+---+
           | code of col 2j+1  | code of col 2j    |     byte weight_packed[r, j]
           +---+---+---+---+---+---+---+---+
             high nibble         low nibble

One 4-bit code (OCP FP4 E2M1): bit 3 = sign, bits 2..1 = exponent, bit 0 = mantissa:
    0..7  -> 0, 0.5, 1, 1.5, 2, 3, 4, 6          8..15 -> -0, -0.5, -1, -1.5, -2, -3, -4, -6

One scale byte s (OCP E8M0): the value 2^(s - 127). s = 0 is 2^-127 (a denormal in float32, keep
it); s = 255 is NaN in the OCP spec and is refused here (trap 5.1.7 of docs/kimi-k3.md).

    W[r, c] = E2M1(code(r, c)) * 2^(weight_scale[r, c // 32] - 127)

Every such value is exact in float32 and float64, so dequantization is exact. This module:
  pack_codes / unpack_codes   nibble packing, low nibble = even column
  dequantize                  (packed, scale) -> float64 [out, in], exact
  quantize                    float [out, in] -> (packed, scale): per-block scale so the block's
                              largest magnitude fits in 6, then round to nearest (ties to even code)
  random_mxfp4                random codes and scales drawn directly from a torch.Generator
What it leaves out: activation quantization (K3's checkpoint is weight-only), ggml's repack.
"""

import torch

BLOCK = 32  # columns per E8M0 scale (OCP MX block size)

# E2M1 magnitudes for codes 0..7 (code 8..15 = the same magnitudes, negative; code 8 is -0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float64)


def _check_shapes(packed, scale):
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError("weight_packed and weight_scale must be uint8")
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape[0] != scale.shape[0]:
        raise ValueError(f"bad MXFP4 shapes: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    if packed.shape[1] * 2 != scale.shape[1] * BLOCK:
        raise ValueError(f"packed [out, in/2] = {tuple(packed.shape)} does not match "
                         f"scale [out, in/32] = {tuple(scale.shape)}")


def unpack_codes(packed):
    """[out, in/2] uint8 -> [out, in] codes 0..15: column 2j = low nibble, 2j+1 = high nibble."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_codes(codes):
    """[out, in] codes 0..15 (any integer dtype) -> [out, in/2] uint8, the inverse of unpack_codes."""
    codes = codes.to(torch.uint8)
    if codes.shape[1] % 2 != 0 or int(codes.max()) > 15:
        raise ValueError("codes must be 0..15 with an even number of columns")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def scale_values(scale):
    """E8M0 bytes -> float64 powers of two 2^(s-127); s = 255 (NaN in OCP) is an error."""
    if bool((scale == 255).any()):
        raise ValueError("E8M0 scale byte 255 (NaN) found: refusing to decode")
    # ldexp(1, s - 127) is exact for every s in 0..254 (2^-127 .. 2^127 are normal float64 numbers).
    return torch.ldexp(torch.ones(scale.shape, dtype=torch.float64), scale.to(torch.int64) - 127)


def dequantize(packed, scale):
    """(weight_packed [out, in/2], weight_scale [out, in/32]) -> exact float64 W [out, in]."""
    _check_shapes(packed, scale)
    values = E2M1_VALUES[unpack_codes(packed).to(torch.int64)]            # [out, in]
    block_scale = scale_values(scale).repeat_interleave(BLOCK, dim=1)     # [out, in]
    return values * block_scale                                          # exact: a power-of-two product


def quantize(weight, rng=None):
    """Float weight [out, in] -> (packed, scale), the closest MXFP4 encoding block by block.

    Per 32-column block: s = the smallest exponent with max|w| / 2^(s-127) <= 6 (so no code
    saturates), then each element is rounded to the nearest E2M1 value, ties to the even code
    (mantissa bit 0), like IEEE round-to-nearest-even. An all-zero block gets s = 127 (scale 1).
    `rng` is unused (the rounding is deterministic); it is accepted so callers can pass one.
    """
    del rng
    w = weight.detach().to(torch.float64)
    out_dim, in_dim = w.shape
    if in_dim % BLOCK != 0:
        raise ValueError(f"in = {in_dim} is not a multiple of {BLOCK}")
    blocks = w.reshape(out_dim, in_dim // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)                                      # [out, in/32]
    # First guess from log2, then fix it up exactly with power-of-two comparisons.
    guess = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    exponent = guess.to(torch.int64)
    too_small = amax > 6.0 * torch.ldexp(torch.ones_like(amax), exponent)
    exponent = exponent + too_small.to(torch.int64)
    can_shrink = (amax > 0) & (amax <= 6.0 * torch.ldexp(torch.ones_like(amax), exponent - 1))
    exponent = exponent - can_shrink.to(torch.int64)
    scale_byte = exponent + 127
    if bool((scale_byte < 0).any()) or bool((scale_byte > 254).any()):
        raise ValueError("weight magnitude outside the E8M0 range")
    unit = torch.ldexp(torch.ones_like(amax), exponent).unsqueeze(-1)     # [out, in/32, 1]
    scaled = blocks / unit                                                # |scaled| <= 6, exact
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()            # [..., 8]
    nearest = distance.min(dim=-1, keepdim=True).values
    is_nearest = distance == nearest
    even_code = torch.arange(8) % 2 == 0
    # Prefer an even code among the nearest; argmax returns the first True.
    prefer = is_nearest & even_code
    has_even = prefer.any(dim=-1, keepdim=True)
    choice = torch.where(has_even, prefer, is_nearest).to(torch.int64).argmax(dim=-1)
    sign = (scaled < 0).to(torch.int64) * 8                              # -0 encodes as +0 (code 0)
    codes = (choice + torch.where(choice > 0, sign, torch.zeros_like(sign))).reshape(out_dim, in_dim)
    return pack_codes(codes), scale_byte.to(torch.uint8)


def random_mxfp4(out_dim, in_dim, generator, exponent_low, exponent_high):
    """Random codes (uniform over 0..15) and random block exponents in [exponent_low, exponent_high]
    (the scale byte is exponent + 127). Returns (packed, scale)."""
    codes = torch.randint(0, 16, (out_dim, in_dim), generator=generator)
    exponent = torch.randint(exponent_low, exponent_high + 1, (out_dim, in_dim // BLOCK), generator=generator)
    return pack_codes(codes), (exponent + 127).to(torch.uint8)
