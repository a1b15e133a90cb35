"""Independent implementations of the quantized-checkpoint formats, for the tests.

Written from the formats' own definitions, NOT from ``engine.quantization``:

- compressed-tensors 0.19 (``compressors/pack_quantized``, ``compressors/nvfp4``,
  ``quantization/lifecycle/forward*.py``, ``quantization/utils/helpers.py``):
  ``pack-quantized`` stores signed codes plus ``2^(bits-1)`` densely packed into int32
  (element i of a row at global bit ``i * bits``), zero points the same way along the
  output dim; ``float-quantized`` stores e4m3 values and a scale per tensor / channel /
  128 x 128 block; ``nvfp4-pack-quantized`` two e2m1 codes a byte (even element in the low
  nibble, bit 3 the sign), fp8 scales of 16 values and a global scale that divides them.
  Dequantized: ``(q - zp) * scale``; NVFP4 ``bf16(e2m1 * (scale / global))``.
- legacy GPTQ v1 (AutoGPTQ / GPTQModel ``pack``): ``qweight [K / p, N]`` with the codes of
  p consecutive input features of a column at bits ``bits * j``; ``qzeros [K / g, N / p]``
  packed along N storing ``zero - 1``; fp16 ``scales [K / g, N]``; ``g_idx [K]``.
- AWQ GEMM (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight [K, N / 8]`` where bits
  ``4 i`` of a word hold column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of eight; qzeros the same
  (zero itself); fp16 ``scales [K / g, N]``.

Every ``quantize_*`` returns ``(tensors, dequantized)``: the checkpoint tensors of one
linear (names relative to its prefix) and the float32 ``[N, K]`` weight they stand for,
computed from the codes and scales chosen here (float64 arithmetic), so a test's
reference never comes from decoding the file. The ``decode_*`` functions read tensors
back (used on the real fixtures, to show these readings agree with the real tools).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4 i of a word hold column AWQ_ORDER[i]


# ----------------------------------------------------------------------------- bits


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values of 32-bit words -> int32 with two's-complement wraparound."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int, slots: Sequence[int] | None = None) -> torch.Tensor:
    """Pack unsigned ``codes [R, C]`` along dim 1: word w holds elements ``w * p ..``,
    slot i (bits ``bits * i``) holding element ``slots[i]`` of the word's p (default i)."""
    per = 32 // bits
    assert 32 % bits == 0 and codes.shape[1] % per == 0, (bits, codes.shape)
    codes = codes.to(torch.int64)
    assert int(codes.min()) >= 0 and int(codes.max()) < (1 << bits)
    grouped = codes.reshape(codes.shape[0], -1, per)
    slots = list(range(per)) if slots is None else list(slots)
    words = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for slot, element in enumerate(slots):
        words |= grouped[:, :, element] << (bits * slot)
    return _as_int32(words)


def unpack_rows(words: torch.Tensor, bits: int, slots: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int64 codes ``[R, C]``."""
    per = 32 // bits
    slots = list(range(per)) if slots is None else list(slots)
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*w.shape, per, dtype=torch.int64)
    for slot, element in enumerate(slots):
        out[:, :, element] = (w >> (bits * slot)) & ((1 << bits) - 1)
    return out.reshape(w.shape[0], -1)


def ct_pack_dense(signed: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32``: signed codes + 2^(bits-1), element i of a
    row at global bit i * bits (whole words here: 32 % bits == 0)."""
    unsigned = signed.to(torch.int64) + (1 << (bits - 1))
    if packed_dim == 0:
        return pack_rows(unsigned.t(), bits).t().contiguous()
    return pack_rows(unsigned, bits)


def ct_unpack_dense(words: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    if packed_dim == 0:
        return (unpack_rows(words.t(), bits) - (1 << (bits - 1))).t()
    return unpack_rows(words, bits) - (1 << (bits - 1))


# ----------------------------------------------------------------------------- numbers


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 values (kept as float64), so storing in bf16 is exact."""
    return x.to(torch.bfloat16).to(torch.float64)


def fp16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float64)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value (saturating at 448)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float32).to(FP8)


def nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the e2m1 magnitude nearest |x| (x already clamped to [-6, 6])."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    return (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    assert k % group == 0, (k, group)
    return w.reshape(n, k // group, group)


# ----------------------------------------------------------------------------- compressed-tensors


def quantize_ct_int(w: torch.Tensor, bits: int, group: int | None, symmetric: bool
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors ``pack-quantized`` (W4A16 / W8A16): ``group`` None = channel.

    Scales as compressed-tensors computes them (min/max including 0; symmetric
    ``max|w| / ((qmax - qmin) / 2)``, asymmetric ``(max - min) / (qmax - qmin)`` with a
    rounded, clamped zero point), rounded to bf16 (the checkpoint dtype) before the codes
    are chosen."""
    w = w.double()
    n, k = w.shape
    g = group or k
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    view = _groups(w, g)
    lo = view.amin(-1).clamp(max=0)
    hi = view.amax(-1).clamp(min=0)
    if symmetric:
        scale = bf16_exact(torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2))
        zp = torch.zeros_like(scale)
    else:
        scale = bf16_exact((hi - lo) / (qmax - qmin))
        zp = torch.round(qmin - lo / scale).clamp(qmin, qmax)
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-20), scale)
    q = torch.round(view / scale.unsqueeze(-1) + zp.unsqueeze(-1)).clamp(qmin, qmax)
    deq = ((q - zp.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(n, k)
    tensors = {
        "weight_packed": ct_pack_dense(q.reshape(n, k), bits),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not symmetric:
        tensors["weight_zero_point"] = ct_pack_dense(zp, bits, packed_dim=0)
    return tensors, deq.float()


def quantize_ct_fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] = (128, 128)
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors ``float-quantized`` e4m3 weights: ``strategy`` tensor (scale
    ``[1]``), channel (``[N, 1]``) or block (``[ceil(N / 128), ceil(K / 128)]``)."""
    w = w.double()
    n, k = w.shape
    if strategy == "tensor":
        scale = bf16_exact(w.abs().amax().reshape(1) / FP8_MAX)
        full = scale.reshape(1, 1).expand(n, k)
    elif strategy == "channel":
        scale = bf16_exact(w.abs().amax(dim=1, keepdim=True) / FP8_MAX)
        full = scale.expand(n, k)
    elif strategy == "block":
        rows, cols = block
        assert n % rows == 0 and k % cols == 0, "pad-free blocks only"
        blocks = w.reshape(n // rows, rows, k // cols, cols)
        scale = bf16_exact(blocks.abs().amax(dim=(1, 3)) / FP8_MAX)
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    else:
        raise ValueError(strategy)
    codes = to_fp8(w / full)
    deq = codes.double() * full
    return {"weight": codes, "weight_scale": scale.to(torch.bfloat16)}, deq.float()


def quantize_ct_nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors ``nvfp4-pack-quantized`` weights (group 16): global scale
    ``448 * 6 / max|w|``, fp8 group scale ``fp8(global * max|group| / 6)``; value
    ``e2m1 * scale / global``, decompressed to bf16."""
    w = w.double()
    n, k = w.shape
    gs = torch.tensor([FP8_MAX * 6.0 / float(w.abs().amax())], dtype=torch.float32)
    view = _groups(w, 16)
    scale8 = to_fp8(gs.double() * view.abs().amax(-1) / 6.0)
    scale8 = torch.where(scale8.float() == 0, torch.full_like(scale8, 0.125), scale8)
    eff = (scale8.float() / gs).double()  # float32 division, as decompression does it
    scaled = (view / eff.unsqueeze(-1)).clamp(-6.0, 6.0)
    mag = nearest_e2m1(scaled)
    negative = scaled < 0
    code = (mag | (negative.to(torch.int64) << 3)).reshape(n, k)
    sign = torch.where(negative, -1.0, 1.0)
    value = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[mag] * sign
    deq = (value * eff.unsqueeze(-1)).float().reshape(n, k).to(torch.bfloat16).float()
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": scale8, "weight_global_scale": gs}, deq


def decode_ct(tensors: dict[str, torch.Tensor], fmt: str, weights: dict) -> torch.Tensor:
    """float32 [N, K] of one compressed-tensors linear as its tensors and weight args
    say (the fixtures' way; independent of the engine)."""
    if fmt == "pack-quantized":
        bits = weights["num_bits"]
        n, k = tensors["weight_shape"].tolist()
        q = ct_unpack_dense(tensors["weight_packed"], bits)[:, :k].double()
        scale = tensors["weight_scale"].double()
        zp = torch.zeros_like(scale)
        if "weight_zero_point" in tensors:
            zp = ct_unpack_dense(tensors["weight_zero_point"], bits, packed_dim=0)[:n].double()
        g = k // scale.shape[1]
        return ((q - zp.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)).float()
    if fmt in ("int-quantized", "naive-quantized", "float-quantized"):
        q = tensors["weight"].double()
        n, k = q.shape
        scale = tensors["weight_scale"].double()
        if scale.numel() == 1:
            full = scale.reshape(1, 1)
        elif scale.shape == (n, 1):
            full = scale
        else:
            rows, cols = weights["block_structure"]
            full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        return (q * full).float()
    if fmt == "nvfp4-pack-quantized":
        packed = tensors["weight_packed"].to(torch.int64)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)[codes & 7]
        values = torch.where(codes >= 8, -mags, mags)
        eff = tensors["weight_scale"].float() / tensors["weight_global_scale"].float()
        return (values * eff.repeat_interleave(16, 1)).to(torch.bfloat16).float()
    raise ValueError(fmt)


# ----------------------------------------------------------------------------- GPTQ v1


def quantize_gptq(w: torch.Tensor, bits: int, group: int, symmetric: bool,
                  perm: torch.Tensor | None = None
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Legacy GPTQ (v1, ``checkpoint_format: gptq``). ``perm`` (act-order): the order in
    which GPTQ visits the input features; group ``i // group`` holds features
    ``perm[i]``, so ``g_idx[perm[i]] = i // group``. Quantizer as GPTQ's: min/max with 0,
    symmetric ``zero = (maxq + 1) / 2``, scales rounded to fp16 (the stored dtype)."""
    w = w.double()
    n, k = w.shape
    maxq = (1 << bits) - 1
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    groups = k // group
    scale = torch.empty(groups, n, dtype=torch.float64)
    zero = torch.empty(groups, n, dtype=torch.float64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo = cols.amin(1).clamp(max=0)
        hi = cols.amax(1).clamp(min=0)
        if symmetric:
            hi = torch.maximum(lo.abs(), hi)
            lo = torch.where(lo < 0, -hi, lo)
        s = fp16_exact((hi - lo) / maxq)
        s = torch.where(s == 0, torch.ones_like(s), s)
        scale[g] = s
        zero[g] = torch.full_like(s, (maxq + 1) // 2) if symmetric else torch.round(-lo / s)
    zero = zero.clamp(1, maxq)  # v1 stores zero - 1: keep it non-negative
    s_k = scale[g_idx].t()  # [N, K]
    z_k = zero[g_idx].t()
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq)
    deq = (q - z_k) * s_k
    tensors = {
        "qweight": pack_rows(q, bits).t().contiguous(),  # [K / p, N]
        "qzeros": pack_rows(zero - 1, bits),  # [G, N / p]
        "scales": scale.to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq.float()


def decode_gptq(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    q = unpack_rows(tensors["qweight"].t().contiguous(), bits).double()  # [N, K]
    zero = unpack_rows(tensors["qzeros"], bits).double() + 1  # [G, N]
    scale = tensors["scales"].double()
    g_idx = tensors["g_idx"].long()
    return ((q - zero[g_idx].t()) * scale[g_idx].t()).float()


# ----------------------------------------------------------------------------- AWQ GEMM


def quantize_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ GEMM, asymmetric int4 with zero points (AWQ's quantizer: ``scale = (max -
    min) / 15``, ``zero = clamp(-round(min / scale), 0, 15)``), fp16 scales."""
    w = w.double()
    n, k = w.shape
    view = _groups(w, group)  # [N, G, g]
    lo, hi = view.amin(-1), view.amax(-1)
    scale = fp16_exact(((hi - lo).clamp(min=1e-5)) / 15)
    zero = torch.clamp(-torch.round(lo / scale), 0, 15)
    q = torch.clamp(torch.round(view / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, 15)
    deq = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(n, k)
    tensors = {
        "qweight": pack_rows(q.reshape(n, k).t().contiguous(), 4, AWQ_ORDER),  # [K, N / 8]
        "qzeros": pack_rows(zero.t().contiguous(), 4, AWQ_ORDER),  # [G, N / 8]
        "scales": scale.t().contiguous().to(torch.float16),  # [G, N]
    }
    return tensors, deq.float()


def decode_awq(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    q = unpack_rows(tensors["qweight"], 4, AWQ_ORDER).double()  # [K, N]
    zero = unpack_rows(tensors["qzeros"], 4, AWQ_ORDER).double()  # [G, N]
    scale = tensors["scales"].double()
    g = q.shape[0] // scale.shape[0]
    return ((q - zero.repeat_interleave(g, 0)) * scale.repeat_interleave(g, 0)).t().float()


# ----------------------------------------------------------------------------- vLLM fp8


def quantize_fp8_checkpoint(w: torch.Tensor, block: tuple[int, int] | None = None
                            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """vLLM's ``quant_method: fp8`` serialization: e4m3 ``weight`` and float32
    ``weight_scale [1]`` per tensor, or ``weight_scale_inv [ceil(N / r), ceil(K / c)]``
    (a multiplier despite the name) per block."""
    if block is None:
        tensors, deq = quantize_ct_fp8(w, "tensor")
        return {"weight": tensors["weight"], "weight_scale": tensors["weight_scale"].float()}, deq
    tensors, deq = quantize_ct_fp8(w, "block", block)
    return {"weight": tensors["weight"],
            "weight_scale_inv": tensors["weight_scale"].float()}, deq


# ----------------------------------------------------------------------------- activations


def qdq_activation(x: torch.Tensor, encoding: str, strategy: str, static_scale=None,
                   group: int = 128) -> torch.Tensor:
    """compressed-tensors' activation fake-quant of float32 ``x [..., K]``: symmetric,
    scale ``max|x| / (range / 2)`` (int8 127.5, fp8 448) per token / tensor / group, or
    a static scale; int8 rounds half to even and clamps to [-128, 127]; fp8 rounds to the
    nearest e4m3. Computed in x's dtype (float32 in the references)."""
    if encoding == "int8":
        half, lo, hi = 127.5, -128.0, 127.0
    else:
        half, lo, hi = FP8_MAX, -FP8_MAX, FP8_MAX
    shape = x.shape
    if strategy == "group":
        x = x.unflatten(-1, (-1, group))
    if static_scale is not None:
        scale = torch.as_tensor(static_scale, dtype=x.dtype).reshape(-1)[0]
    elif strategy == "tensor":
        scale = x.abs().amax() / half
    else:
        scale = x.abs().amax(dim=-1, keepdim=True) / half
    eps = torch.finfo(torch.float32).eps
    scale = torch.where(scale == 0, torch.full_like(torch.as_tensor(scale), eps), scale)
    scaled = (x / scale).clamp(lo, hi)
    q = torch.round(scaled) if encoding == "int8" else scaled.to(FP8).to(x.dtype)
    return (q * scale).reshape(shape)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4``: |x| <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1,
    < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6 (sign kept)."""
    mag = x.abs()
    out = torch.full_like(mag, 6.0)
    for bound, value, inclusive in ((5.0, 4.0, True), (3.5, 3.0, False), (2.5, 2.0, True),
                                    (1.75, 1.5, False), (1.25, 1.0, True), (0.75, 0.5, False),
                                    (0.25, 0.0, True)):
        below = mag <= bound if inclusive else mag < bound
        out = torch.where(below, torch.full_like(mag, value), out)
    return out * torch.sign(x)


def qdq_nvfp4_activation(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 activation fake-quant (``tensor_group`` 16, dynamic
    ``local``): group scale ``max|group| / 6`` times the static global scale, rounded to
    e4m3 (a zero becomes e4m3's epsilon 0.125), divided by the global scale again; values
    rounded to e2m1."""
    gs = torch.as_tensor(global_scale, dtype=x.dtype).reshape(-1)[0]
    view = x.unflatten(-1, (-1, 16))
    local = view.abs().amax(-1, keepdim=True) / 6.0
    scale = (gs * local).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, 0.125), scale) / gs
    q = round_e2m1((view / scale).clamp(-6.0, 6.0))
    return (q * scale).flatten(-2)


def fp8_per_row(w: torch.Tensor) -> torch.Tensor:
    """vLLM's online fp8 of a dense weight, dequantized: each output row scaled by
    ``max|row| / 448`` and rounded to e4m3."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    return to_fp8(w.float() / scale).float() * scale

