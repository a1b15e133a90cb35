"""Dense and quantized GEMM kernels (``interfaces.gemm``, ``interfaces.quant``) against
float64 references.

Clauses: ``[gemm.dense]`` prepare() then apply() computes ``x @ W.T (+ b)`` in x's dtype;
``[gemm.keeps_layout]`` a kernel that claims keeps_layout returns the weight unchanged;
``[quant.int]`` the canonical int encoding (codes, group scales, zeros or the midpoint)
multiplied as ``x @ dequant(W).T (+ b)``; ``[quant.can_implement]`` refusals are reasons.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.interfaces import DenseLayerSpec, QuantizedLayerSpec, QuantizedWeights
from engine.testing.reference import dequantize_int_weights, linear_reference

IN, OUT, TOKENS = 64, 48, 5
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _dtypes(platform):
    return [d for d in (torch.float32, torch.bfloat16) if d in platform.supported_dtypes()]


def _rel_err(got, expected):
    return ((got.detach().cpu().double() - expected).abs().max()
            / expected.abs().max().clamp_min(1e-12)).item()


@pytest.mark.conformance("gemm.dense", "gemm.keeps_layout")
def test_dense_gemm_kernels(engine_platform):
    """[gemm.dense] every dense kernel that can_implement a small float32/bfloat16 layer
    matches float64 ``x @ W.T + b`` (and without bias) after prepare()."""
    kernels = engine_platform.dense_gemm_kernels()
    if not kernels:
        pytest.skip("platform offers no dense GEMM kernels (layers use F.linear)")
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(0)
    ran, refusals = 0, []
    for kernel_cls in kernels:
        for dtype in _dtypes(engine_platform):
            spec = DenseLayerSpec(IN, OUT, dtype, device)
            why = kernel_cls.can_implement(spec)
            if why is not None:
                assert isinstance(why, str), f"[gemm.dense] can_implement returned {why!r}"
                refusals.append(f"{kernel_cls.name}/{dtype}: {why}")
                continue
            w = (torch.randn(OUT, IN, generator=gen) * 0.1).to(dtype)
            b = torch.randn(OUT, generator=gen).to(dtype)
            x = torch.randn(TOKENS, IN, generator=gen).to(dtype)
            kernel = kernel_cls()
            packed = kernel.prepare(w.to(device), spec)
            if kernel_cls.keeps_layout:
                assert torch.equal(packed.cpu(), w), (
                    f"[gemm.keeps_layout] {kernel_cls.name} claims keeps_layout but "
                    "prepare() changed the weight")
            for bias in (b, None):
                y = kernel.apply(packed, x.to(device), None if bias is None else bias.to(device))
                engine_platform.synchronize()
                assert tuple(y.shape) == (TOKENS, OUT) and y.dtype == dtype, (
                    f"[gemm.dense] {kernel_cls.name} returned {tuple(y.shape)} {y.dtype}, "
                    f"expected {(TOKENS, OUT)} {dtype}")
                err = _rel_err(y, linear_reference(x, w, bias))
                assert err <= TOL[dtype], (
                    f"[gemm.dense] {kernel_cls.name} ({dtype}, bias={bias is not None}) "
                    f"differs from float64 x @ W.T + b by {err:.3g} relative")
            ran += 1
    if not ran:
        pytest.skip("no dense GEMM kernel accepts the test layers: " + "; ".join(refusals))


QIN, QOUT, GROUP, BITS = 64, 32, 32, 4


@pytest.mark.conformance("quant.int", "quant.can_implement")
@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero_points"])
def test_quantized_gemm_int4_group32(engine_platform, zero_points):
    """[quant.int] every quantized kernel that accepts an int4, group-32 layer (weight-only)
    matches float64 ``x @ ((code - zero) * scale).T + b`` after prepare() on a module."""
    kernels = engine_platform.quantized_gemm_kernels()
    if not kernels:
        pytest.skip("platform offers no quantized kernels")
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(1)
    ran, refusals = 0, []
    for kernel_cls in kernels:
        for dtype in _dtypes(engine_platform):
            spec = QuantizedLayerSpec(
                scheme="conformance w4a16", encoding="int", weight_bits=BITS, group_size=GROUP,
                in_features=QIN, out_features=QOUT, act_dtype=dtype,
                has_zero_points=zero_points, shard_sizes=(QOUT,))
            why = kernel_cls.can_implement(spec)
            if why is not None:
                assert isinstance(why, str) and why, (
                    f"[quant.can_implement] {kernel_cls.name} refused without a reason: {why!r}")
                refusals.append(f"{kernel_cls.name}/{dtype}: {why}")
                continue
            codes = torch.randint(0, 2 ** BITS, (QOUT, QIN), generator=gen, dtype=torch.uint8)
            scales = torch.rand(QOUT, QIN // GROUP, generator=gen) * 0.02 + 0.005
            zeros = (torch.randint(0, 2 ** BITS, (QOUT, QIN // GROUP), generator=gen).float()
                     if zero_points else None)
            weights = QuantizedWeights(
                spec=spec, codes=codes.to(device), scales=scales.to(device),
                zeros=None if zeros is None else zeros.to(device), shard_sizes=(QOUT,))
            layer = torch.nn.Module().to(device)
            kernel = kernel_cls()
            kernel.prepare(layer, weights)
            x = torch.randn(TOKENS, QIN, generator=gen).to(dtype)
            b = torch.randn(QOUT, generator=gen).to(dtype)
            w_ref = dequantize_int_weights(codes, scales, zeros, BITS, GROUP)
            for bias in (b, None):
                y = kernel.apply(layer, x.to(device), None if bias is None else bias.to(device))
                engine_platform.synchronize()
                assert tuple(y.shape) == (TOKENS, QOUT) and y.dtype == dtype, (
                    f"[quant.int] {kernel_cls.name} returned {tuple(y.shape)} {y.dtype}")
                err = _rel_err(y, linear_reference(x, w_ref, bias))
                tol = 1e-3 if dtype == torch.float32 else 3e-2
                assert err <= tol, (
                    f"[quant.int] {kernel_cls.name} ({dtype}, zeros={zero_points}, "
                    f"bias={bias is not None}) differs from the float64 dequantized "
                    f"reference by {err:.3g} relative")
            ran += 1
    if not ran:
        pytest.skip("no quantized kernel accepts an int4 group-32 layer: " + "; ".join(refusals))
