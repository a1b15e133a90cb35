"""Fused MoE with ungated experts (Nemotron-H: ``down(relu(up x) ** 2)``, ``w13 [E, I, H]``):
the Triton kernel (interpreted on CPU tensors) and the CPU plugin's kernel against a
float64 reference written from transformers' ``NemotronHExperts`` (token by token, choice
by choice), with choices served by another rank (-1); the FusedMoE layer's ungated weights
(loading per expert and stacked, the gate projection refused) and the kernel selection
refusing kernels without ungated experts."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import engine.kernels.fused_moe as fm
from engine.core.interfaces.moe import FusedMoEKernel, MoELayerSpec
from engine.kernels.fused_moe import FusedMoEConfig, TritonFusedMoEKernel, fused_moe
from engine.model_executor.layers.fused_moe import FusedMoE, RouterConfig, select_moe_kernel
from engine.plugins.cpu.fused_moe import CPUFusedMoE
from tests.helpers.moe_reference import routed_reference

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SMALL_TILES = FusedMoEConfig(block_m=16, block_n=16, block_k=16)
REFERENCE_ACTIVATIONS = {"relu2": lambda x: torch.relu(x).square(), "silu": F.silu,
                         "gelu": F.gelu}


def reference(hidden, w13, w2, weights, ids, activation="relu2", b13=None, b2=None):
    """``out[t] = sum_j weights[t, j] * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e])``."""
    act = REFERENCE_ACTIVATIONS[activation]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        up = w13[e].double() @ x
        if b13 is not None:
            up = up + b13[e].double()
        y = w2[e].double() @ act(up)
        return y if b2 is None else y + b2[e].double()

    return routed_reference(hidden, weights, ids, expert)


def make_inputs(tokens=7, hidden=40, inter=24, experts=6, top_k=2, seed=0,
                dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, inter, hidden, generator=g) * 0.15).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return x, w13, w2, weights.float(), ids.to(torch.int32)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Every Triton intermediate starts as NaN (an unwritten element read shows up)."""

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(fm, "_new_buffer", nan_buffer)


def _check(out, hidden, expected):
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert not out.isnan().any()
    tol = TOLERANCE[hidden.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def _run(kernel: str, x, w13, w2, weights, ids, activation="relu2", **bias):
    if kernel == "triton":
        return fused_moe(x, w13, w2, weights, ids, activation, config=SMALL_TILES,
                         gated=False, **bias)
    return CPUFusedMoE().apply(x, w13, w2, weights, ids, activation, gated=False, **bias)


KERNELS = ["triton", "cpu"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,dtype",
    [
        pytest.param(1, 40, 24, 6, 2, torch.float32, id="T1-decode"),
        pytest.param(7, 40, 24, 6, 2, torch.float32, id="T7-fp32"),
        pytest.param(7, 40, 24, 6, 2, torch.bfloat16, id="T7-bf16"),
        pytest.param(19, 24, 40, 4, 3, torch.float32, id="T19-top3-multiblock"),
    ],
)
def test_relu2_matches_reference(poisoned_buffers, kernel, tokens, hidden, inter, experts,
                                 top_k, dtype):
    x, w13, w2, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k,
                                           seed=tokens, dtype=dtype)
    out = _run(kernel, x, w13, w2, weights, ids)
    _check(out, x, reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("kernel", KERNELS)
def test_expert_parallel_ids(poisoned_buffers, kernel):
    """Choices served by another rank (-1); token 2 has all of them elsewhere: zeros."""
    x, w13, w2, weights, _ = make_inputs(7, 40, 24, 8, 2, seed=3)
    ids = torch.tensor([[0, 5], [5, -1], [-1, -1], [7, 1], [-1, 6], [2, 0], [1, 7]],
                       dtype=torch.int32)
    out = _run(kernel, x, w13, w2, weights, ids)
    _check(out, x, reference(x, w13, w2, weights, ids))
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_other_ungated_activations(kernel, activation):
    x, w13, w2, weights, ids = make_inputs(3, 24, 20, 4, 2, seed=5)
    out = _run(kernel, x, w13, w2, weights, ids, activation)
    _check(out, x, reference(x, w13, w2, weights, ids, activation))


@pytest.mark.parametrize("kernel", KERNELS)
def test_expert_biases(kernel):
    x, w13, w2, weights, ids = make_inputs(5, 24, 20, 4, 2, seed=8)
    g = torch.Generator().manual_seed(1)
    b13, b2 = torch.randn(4, 20, generator=g), torch.randn(4, 24, generator=g)
    out = _run(kernel, x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    _check(out, x, reference(x, w13, w2, weights, ids, b13=b13, b2=b2))


@pytest.mark.parametrize("kernel", KERNELS)
def test_shape_and_activation_checks(kernel):
    x, w13, w2, weights, ids = make_inputs(3, 24, 20, 4, 2, seed=2)
    with pytest.raises(ValueError, match="w13|w2"):  # a gated [E, 2I, H] w13
        _run(kernel, x, torch.cat((w13, w13), 1), w2, weights, ids)
    with pytest.raises(ValueError, match="ungated activation"):
        _run(kernel, x, w13, w2, weights, ids, "swigluoai")


def test_interface_apply_and_can_implement():
    x, w13, w2, weights, ids = make_inputs(4, 40, 24, 6, 2, seed=9, dtype=torch.bfloat16)
    out = TritonFusedMoEKernel().apply(x, w13, w2, weights, ids, "relu2", gated=False)
    _check(out, x, reference(x, w13, w2, weights, ids))
    spec = MoELayerSpec(6, 40, 24, 2, torch.float32, torch.device("cpu"), "relu2",
                        gated=False)
    assert TritonFusedMoEKernel.can_implement(spec) is None
    assert CPUFusedMoE.can_implement(spec) is None
    for kernel in (TritonFusedMoEKernel, CPUFusedMoE):
        # relu2 is an ungated activation only; swigluoai a gated one only
        assert "relu2" in kernel.can_implement(
            MoELayerSpec(6, 40, 24, 2, torch.float32, torch.device("cpu"), "relu2"))
        assert "swigluoai" in kernel.can_implement(
            MoELayerSpec(6, 40, 24, 2, torch.float32, torch.device("cpu"), "swigluoai",
                         gated=False))


class GatedOnly(FusedMoEKernel):
    """A kernel that does not declare ungated experts (a third-party one, say)."""

    name = "gated_only"

    @classmethod
    def can_implement(cls, spec):
        return None

    def apply(self, hidden, w13, w2, topk_weights, topk_ids, activation="silu", **kw):
        raise AssertionError("never called")


def test_selection_refuses_kernels_without_ungated_experts():
    spec = MoELayerSpec(4, 24, 20, 2, torch.float32, torch.device("cpu"), "relu2",
                        gated=False)
    with pytest.raises(ValueError, match="gated_only: it has no ungated experts"):
        select_moe_kernel(spec, [GatedOnly])
    assert isinstance(select_moe_kernel(spec, [GatedOnly, CPUFusedMoE]), CPUFusedMoE)
    gated = MoELayerSpec(4, 24, 20, 2, torch.float32, torch.device("cpu"))
    assert isinstance(select_moe_kernel(gated, [GatedOnly]), GatedOnly)


def _layer(kernels=(CPUFusedMoE,), experts=4, top_k=2):
    return FusedMoE(RouterConfig(experts, top_k, scoring="sigmoid"), 24, 20,
                    dtype=torch.float32, device="cpu", kernels=list(kernels),
                    activation="relu2", gated=False)


@pytest.mark.parametrize("kernels", [(CPUFusedMoE,), (TritonFusedMoEKernel,)],
                         ids=["cpu", "triton"])
def test_layer_loads_and_runs_ungated_experts(kernels):
    layer = _layer(kernels)
    assert layer.w13.shape == (4, 20, 24) and layer.w2.shape == (4, 24, 20)
    assert layer.w13.shard_ids == tuple(("w3", e) for e in range(4))
    x, w13, w2, weights, ids = make_inputs(6, 24, 20, 4, 2, seed=4)
    for e in range(4):  # per-expert checkpoint tensors: up_proj -> w3, down_proj -> w2
        layer.w13.weight_loader(layer.w13, w13[e], ("w3", e))
        layer.w2.weight_loader(layer.w2, w2[e], ("w2", e))
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    with pytest.raises(ValueError, match="no gate projection"):
        layer.w13.weight_loader(layer.w13, w13[0], ("w1", 0))
    out = layer.forward_routed(x, weights, ids.long())
    _check(out, x, reference(x, w13, w2, weights, ids))
    stacked = _layer()
    stacked.load_stacked("w13", w13)
    stacked.load_stacked("w2", w2)
    assert torch.equal(stacked.w13, w13) and torch.equal(stacked.w2, w2)
    assert "ungated relu2" in repr(layer)


def test_layer_refuses_unknown_ungated_activation():
    with pytest.raises(ValueError, match="ungated experts' activation 'swigluoai'"):
        FusedMoE(RouterConfig(4, 2), 24, 20, dtype=torch.float32, device="cpu",
                 kernels=[CPUFusedMoE], activation="swigluoai", gated=False)
