"""float64 references for the CPU plugin's kernels, shared by the native tests and the
self-test of builds for other architectures (test_cpu_selftest.py)."""

from __future__ import annotations

import torch

from engine.core.interfaces import QuantizedLayerSpec, QuantizedWeights
from engine.quantization.numerics import quantize_dequantize

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
UNIT = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}  # half an ulp, relative


def gemm_reference(x, weight, bias):
    """float64 product of the operands' exact values, and how far an output in x's dtype
    may be from it: one rounding to that dtype plus float32 sums over K terms."""
    ref = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    magnitude = x.double().abs() @ weight.double().abs().T
    k = x.shape[-1]
    tol = ref.abs() * UNIT[x.dtype] * 1.01 + magnitude * k * 2.0**-23 + 1e-6
    return ref, tol


def assert_gemm_close(y, x, weight, bias=None):
    ref, tol = gemm_reference(x, weight, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    bad = (y.double() - ref).abs() > tol
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} values off; worst " \
        f"{float(((y.double() - ref).abs() - tol).max()):.3g} over the tolerance"


def attention_reference(query, keys, values, block_tables, seq_lens, scale, window=None):
    """Decode attention of each request's query heads over its first seq_len slots.

    keys / values: ``[slots, kv_heads, D]`` (slot = block * block_size + offset) in the
    cache's dtype; the output in float64, ``[reqs, heads, D]``."""
    reqs, heads, head_size = query.shape
    kv_heads = keys.shape[1]
    block_size = keys.shape[0] // max(int(block_tables.max()) + 1, 1)
    out = torch.empty(reqs, heads, head_size, dtype=torch.float64)
    for r in range(reqs):
        n = int(seq_lens[r])
        pos = torch.arange(n)
        slots = block_tables[r, pos // block_size] * block_size + pos % block_size
        first = max(0, n - window) if window else 0
        k = keys[slots[first:]].double().repeat_interleave(heads // kv_heads, dim=1)
        v = values[slots[first:]].double().repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,khd->hk", query[r].double(), k) * scale).softmax(-1)
        out[r] = torch.einsum("hk,khd->hd", probs, v)
    return out


def attention_tolerance(q_dtype, cache_dtype, pairs: bool) -> float:
    """Absolute tolerance of unit-variance outputs: the output's rounding, or a float32
    query rounded to bf16 for vdpbf16ps (``pairs``)."""
    if q_dtype != cache_dtype and pairs:
        return 3e-2
    return {F32: 1e-5, BF16: 2e-2, F16: 3e-3}[q_dtype]


def rms_norm_reference(x, weight, eps, residual=None):
    """HF's order: sum in the dtype, normalize in float32, round, scale by the weight."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), h


def silu_and_mul_reference(x):
    inter = x.shape[-1] // 2
    gate, up = x[:, :inter].float(), x[:, inter:].float()
    return ((gate * torch.sigmoid(gate)).to(x.dtype).float() * up).to(x.dtype)


def rotary_reference(x, positions, cos_sin, head_size):
    """Rotate-half of every head, with the table's cos | sin rows, rounding per product."""
    half = head_size // 2
    rows = x.view(x.shape[0], -1, head_size).float()
    cos = cos_sin[positions, :half].float()[:, None, :]
    sin = cos_sin[positions, half:].float()[:, None, :]
    x1, x2 = rows[..., :half], rows[..., half:]
    dt = x.dtype
    first = (x1 * cos).to(dt).float() - (x2 * sin).to(dt).float()
    second = (x2 * cos).to(dt).float() + (x1 * sin).to(dt).float()
    return torch.cat((first, second), dim=-1).to(dt).view(x.shape)


# -- quantized GEMM ---------------------------------------------------------------------
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def quantized_weights(gen, encoding, bits, n, k, group, *, zeros=True, act=None, shards=None,
                      act_order=False, act_dtype=torch.float32) -> QuantizedWeights:
    """Random canonical weights of one encoding (engine/core/interfaces/quant.py)."""
    shards = shards or (n,)
    groups = k // group
    if encoding == "int":
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.randint(0, 1 << bits, (n, groups), generator=gen).float() if zeros else None
    elif encoding == "fp8":
        codes = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        zero = None
    else:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        zero = None
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    g_idx = torch.randperm(k, generator=gen) // group if act_order else None
    input_scales = None
    if act is not None and (not act.dynamic or act.encoding == "nvfp4"):
        input_scales = torch.rand(len(shards), generator=gen) * 0.05 + 0.01
    spec = QuantizedLayerSpec("test", encoding, bits, group, k, n, act_dtype, zero is not None,
                              act_order, act, shards)
    return QuantizedWeights(spec, codes, scales, zero, g_idx, input_scales, shards)


def dequantized_f64(w: QuantizedWeights) -> torch.Tensor:
    """float64 [N, K] from the encodings' definitions (engine/core/interfaces/quant.py)."""
    spec = w.spec
    k = spec.in_features
    groups = w.g_idx if w.g_idx is not None else torch.arange(k) // spec.group_size
    scale = w.scales.double()[:, groups]
    if spec.encoding == "int":
        zero = (w.zeros.double()[:, groups] if w.zeros is not None
                else float(1 << (spec.weight_bits - 1)))
        return (w.codes.double() - zero) * scale
    if spec.encoding == "fp8":
        return w.codes.double() * scale
    table = torch.tensor(E2M1, dtype=torch.float64)
    nibbles = torch.stack((w.codes & 15, w.codes >> 4), dim=-1).flatten(-2).long()
    return (table[nibbles] * scale).float().bfloat16().double()  # bf16(e2m1 x scale)


def qgemm_reference(w: QuantizedWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 product of each shard's quantize-dequantized activations (numerics.py, the
    torch reference) with the weights dequantized here."""
    weight = dequantized_f64(w)
    parts, start = [], 0
    for shard, size in enumerate(w.shard_sizes):
        xq = x.float()
        act = w.spec.activation
        if act is not None:
            scale = None if w.input_scales is None else w.input_scales[shard]
            xq = quantize_dequantize(xq, act, static_scale=None if act.dynamic else scale,
                                     global_scale=scale if act.encoding == "nvfp4" else None)
        parts.append(xq.double() @ weight[start:start + size].T)
        start += size
    out = torch.cat(parts, dim=1)
    return out if bias is None else out + bias.double()


def assert_qgemm_close(got, want, act_dtype=torch.float32):
    """float32 outputs within float32 sums of the float64 product; narrow ones within
    their rounding."""
    assert got.dtype == act_dtype
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < (2e-6 if act_dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"
