"""Fused MoE with expert biases and GPT-OSS's clamped SwiGLU (``swigluoai``): the Triton
kernel (interpreted on CPU tensors) and the CPU plugin's kernel against a float64
reference written from transformers' ``GptOssExperts`` (token by token, choice by choice),
including choices served by another rank (-1) and a rank without the down bias."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.core.interfaces.moe import FusedMoEKernel, MoELayerSpec
from engine.kernels.fused_moe import FusedMoEConfig, TritonFusedMoEKernel, fused_moe
from engine.model_executor.layers.fused_moe import select_moe_kernel
from engine.plugins.cpu.fused_moe import CPUFusedMoE
from tests.helpers.moe_reference import routed_reference

ALPHA, LIMIT = 1.702, 7.0  # transformers' GptOssConfig defaults


def reference(hidden, w13, w2, b13, b2, weights, ids, activation):
    """``w13`` gate rows then up rows; the activation as GptOssExperts._apply_gate (or
    silu(gate) * up)."""
    inter = w2.shape[2]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = w13[e].double() @ x
        if b13 is not None:
            gate_up = gate_up + b13[e].double()
        gate, up = gate_up[:inter], gate_up[inter:]
        if activation == "swigluoai":
            gate = gate.clamp(max=LIMIT)
            up = up.clamp(min=-LIMIT, max=LIMIT)
            h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
        else:
            h = torch.nn.functional.silu(gate) * up
        y = w2[e].double() @ h
        return y if b2 is None else y + b2[e].double()

    return routed_reference(hidden, weights, ids, expert)


def inputs(tokens=7, hidden=24, inter=20, experts=5, top_k=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.9  # gate/up beyond +-7
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    b13 = torch.randn(experts, 2 * inter, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    cast = [t.to(dtype) for t in (x, w13, w2, b13, b2)]
    return (*cast, weights, ids)


def _kernels():
    def triton_apply(x, w13, w2, weights, ids, act, b13, b2):
        config = FusedMoEConfig(block_m=16, block_n=16, block_k=16)
        return fused_moe(x, w13, w2, weights, ids, act, config, w13_bias=b13, w2_bias=b2)

    def cpu_apply(x, w13, w2, weights, ids, act, b13, b2):
        return CPUFusedMoE().apply(x, w13, w2, weights, ids, act, w13_bias=b13, w2_bias=b2)

    return {"triton": triton_apply, "cpu": cpu_apply}


@pytest.mark.parametrize("kernel", ["triton", "cpu"])
@pytest.mark.parametrize(("activation", "biases"), [
    ("swigluoai", "both"), ("swigluoai", "gate_up_only"), ("swigluoai", "none"),
    ("silu", "both")])
def test_biases_and_swigluoai_match_reference(kernel, activation, biases):
    x, w13, w2, b13, b2, weights, ids = inputs()
    if biases != "both":
        b2 = None
    if biases == "none":
        b13 = None
    got = _kernels()[kernel](x, w13, w2, weights, ids, activation, b13, b2)
    want = reference(x, w13, w2, b13, b2, weights, ids, activation)
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    if activation == "swigluoai":  # the clamps were exercised
        gate_up = torch.einsum("eoh,th->teo", w13.double(), x.double())
        assert bool((gate_up.abs() > LIMIT).any())


@pytest.mark.parametrize("kernel", ["triton", "cpu"])
def test_choices_of_other_ranks_contribute_nothing(kernel):
    x, w13, w2, b13, b2, weights, ids = inputs(seed=3)
    ids = ids.clone()
    ids[::2, 0] = -1  # served elsewhere: neither the product nor the bias counts here
    ids[1] = -1  # a token with no choice here gets exact zeros
    got = _kernels()[kernel](x, w13, w2, weights, ids, "swigluoai", b13, b2)
    want = reference(x, w13, w2, b13, b2, weights, ids, "swigluoai")
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    assert bool((got[1] == 0).all())


def test_bf16_swigluoai_with_biases_triton_matches_cpu():
    x, w13, w2, b13, b2, weights, ids = inputs(seed=5, dtype=torch.bfloat16)
    kernels = _kernels()
    got = kernels["triton"](x, w13, w2, weights, ids, "swigluoai", b13, b2)
    want = reference(x, w13, w2, b13, b2, weights, ids, "swigluoai")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.15, rtol=3e-2)


def test_kernel_selection_for_biased_layers():
    spec = MoELayerSpec(4, 32, 32, 2, torch.float32, torch.device("cpu"), "swigluoai",
                        has_bias=True)
    assert isinstance(select_moe_kernel(spec, [CPUFusedMoE]), CPUFusedMoE)
    assert TritonFusedMoEKernel.can_implement(spec) is None

    class NoBias(CPUFusedMoE):  # an older kernel: accepts the shape, has no biases
        name = "no_bias"
        supports_expert_bias = False

    assert FusedMoEKernel.supports_expert_bias is False
    with pytest.raises(ValueError, match="no_bias: it has no expert biases"):
        select_moe_kernel(spec, [NoBias])
    plain = MoELayerSpec(4, 32, 32, 2, torch.float32, torch.device("cpu"), "silu")
    assert isinstance(select_moe_kernel(plain, [NoBias]), NoBias)
    with pytest.raises(ValueError, match="w2_bias must be"):
        x, w13, w2, b13, b2, weights, ids = inputs()
        fused_moe(x, w13, w2, weights, ids, "swigluoai", w13_bias=b13, w2_bias=b2[:, :3])
