"""Fused ops (``engine.core.interfaces.fused_ops``) against float64 torch.

Clauses: ``[fused.rms_norm]`` (with the residual sum written back in place),
``[fused.silu_and_mul]``, ``[fused.rotary_neox]`` (in place), ``[fused.embedding]``,
``[fused.argmax]`` (the first maximum), each for every dtype ``supports()`` accepts.
"""

from __future__ import annotations

import pytest
import torch

from engine.testing.reference import (
    rms_norm_reference,
    rotary_neox_reference,
    silu_and_mul_reference,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture
def fused(engine_platform):
    ops = engine_platform.fused_ops()
    if ops is None:
        pytest.skip("platform offers no fused ops (layers keep their torch op chains)")
    return ops


def _dtypes(engine_platform, ops):
    dtypes = [d for d in (torch.float32, torch.bfloat16) if ops.supports(d)
              and d in engine_platform.supported_dtypes()]
    if not dtypes:
        pytest.skip("fused ops support none of float32 / bfloat16")
    return dtypes


def _close(clause, got, expected, dtype):
    err = ((got.detach().cpu().double() - expected).abs().max()
           / expected.abs().max().clamp_min(1e-12)).item()
    assert err <= TOL[dtype], f"{clause} differs from float64 torch by {err:.3g} ({dtype})"


@pytest.mark.conformance("fused.rms_norm")
def test_rms_norm(engine_platform, fused):
    """[fused.rms_norm] weight * x / rms(x); with residual: of x + residual, the sum
    written back into residual."""
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(0)
    for dtype in _dtypes(engine_platform, fused):
        x = torch.randn(7, 64, generator=gen).to(dtype)
        res = torch.randn(7, 64, generator=gen).to(dtype)
        w = (torch.rand(64, generator=gen) + 0.5).to(dtype)
        _close("[fused.rms_norm]", fused.rms_norm(x.to(device), w.to(device), 1e-5),
               rms_norm_reference(x, w, 1e-5), dtype)
        res_dev = res.to(device)
        out = fused.rms_norm(x.to(device), w.to(device), 1e-5, res_dev)
        summed = x.double() + res.double()
        _close("[fused.rms_norm] (residual)", out, rms_norm_reference(summed, w, 1e-5), dtype)
        _close("[fused.rms_norm] (residual written back)", res_dev, summed, dtype)


@pytest.mark.conformance("fused.silu_and_mul")
def test_silu_and_mul(engine_platform, fused):
    """[fused.silu_and_mul] silu(gate) * up for x = [gate | up]."""
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(1)
    for dtype in _dtypes(engine_platform, fused):
        x = torch.randn(5, 2 * 48, generator=gen).to(dtype)
        _close("[fused.silu_and_mul]", fused.silu_and_mul(x.to(device)),
               silu_and_mul_reference(x), dtype)


@pytest.mark.conformance("fused.rotary_neox")
def test_rotary_neox(engine_platform, fused):
    """[fused.rotary_neox] rotate-half rotary of every head, in place."""
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(2)
    head_size, heads, max_pos = 32, 3, 64
    inv = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    ang = torch.arange(max_pos, dtype=torch.float64).unsqueeze(1) * inv
    for dtype in _dtypes(engine_platform, fused):
        cache = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype)
        x = torch.randn(6, heads * head_size, generator=gen).to(dtype)
        pos = torch.tensor([0, 5, 9, 31, 32, 63], dtype=torch.int64)
        x_dev = x.to(device)
        fused.rotary_neox_(x_dev, pos.to(device), cache.to(device), head_size)
        _close("[fused.rotary_neox]", x_dev, rotary_neox_reference(x, pos, cache, head_size),
               dtype)


@pytest.mark.conformance("fused.embedding", "fused.argmax")
def test_embedding_and_argmax(engine_platform, fused):
    """[fused.embedding] weight[ids]; [fused.argmax] the first maximum of each row."""
    device = engine_platform.device()
    gen = torch.Generator().manual_seed(3)
    for dtype in _dtypes(engine_platform, fused):
        table = torch.randn(50, 32, generator=gen).to(dtype)
        ids = torch.tensor([0, 7, 49, 7], dtype=torch.int64)
        got = fused.embedding(ids.to(device), table.to(device))
        assert torch.equal(got.cpu(), table[ids]), "[fused.embedding] weight[ids] differs"
    logits = torch.randn(4, 300, generator=gen)
    logits[2, 10] = logits[2, 200] = logits[2].max() + 1  # ties: the first one wins
    got = fused.argmax(logits.to(device)).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), (
        f"[fused.argmax] got {got.tolist()}, expected {logits.argmax(dim=-1).tolist()}")
