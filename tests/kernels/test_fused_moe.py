"""Triton fused MoE (alignment, grouped GEMMs, activation, combine) vs a float64 reference.

Runs on CPU tensors under TRITON_INTERPRET=1 (set in conftest.py); sizes stay tiny
because the interpreter executes every program in numpy. Hidden sizes are not multiples
of BLOCK_K and intermediate sizes not multiples of BLOCK_N, so every tail mask is used.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import engine.kernels.fused_moe as fm
from engine.core.interfaces.moe import MoELayerSpec
from engine.kernels.fused_moe import (
    FusedMoEConfig,
    TritonFusedMoEKernel,
    fused_moe,
    max_padded_rows,
    moe_align,
)
from tests.helpers.moe_reference import routed_reference

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SMALL_TILES = FusedMoEConfig(block_m=16, block_n=16, block_k=16)

REFERENCE_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def reference_moe(hidden, w13, w2, topk_weights, topk_ids, activation="silu") -> torch.Tensor:
    """Token by token, choice by choice, in float64."""
    act = REFERENCE_ACTIVATIONS[activation]
    w13, w2 = w13.double(), w2.double()
    inter = w2.shape[2]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return w2[e] @ (act(w13[e, :inter] @ x) * (w13[e, inter:] @ x))

    return routed_reference(hidden, topk_weights, topk_ids, expert)


def make_inputs(num_tokens, hidden_size, inter, num_experts, top_k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.2).to(dtype)
    scores = torch.randn(num_tokens, num_experts, generator=gen).softmax(-1)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    return hidden, w13, w2, topk_weights.float(), topk_ids.to(torch.int32)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Every intermediate starts as NaN: a valid element left unwritten, or an unwritten
    row read, shows up as NaN in the output."""

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(fm, "_new_buffer", nan_buffer)


def _run_and_check(inputs, activation="silu", config=SMALL_TILES) -> torch.Tensor:
    hidden = inputs[0]
    out = torch.full_like(hidden, float("nan"))
    result = fused_moe(*inputs, activation=activation, config=config, out=out)
    assert result is out
    assert result.dtype == hidden.dtype
    assert not out.isnan().any()
    tol = TOLERANCE[hidden.dtype]
    torch.testing.assert_close(out.double(), reference_moe(*inputs, activation), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize(
    "num_tokens,hidden_size,inter,num_experts,top_k,dtype",
    [
        pytest.param(1, 40, 24, 8, 2, torch.float32, id="T1-decode"),
        pytest.param(7, 40, 24, 8, 2, torch.float32, id="T7-fp32"),
        pytest.param(7, 40, 24, 8, 2, torch.bfloat16, id="T7-bf16"),
        pytest.param(19, 24, 40, 4, 3, torch.float32, id="T19-top3-multiblock"),
    ],
)
def test_matches_reference(
    poisoned_buffers, num_tokens, hidden_size, inter, num_experts, top_k, dtype
):
    inputs = make_inputs(num_tokens, hidden_size, inter, num_experts, top_k, dtype, seed=num_tokens)
    _run_and_check(inputs)


def test_unrouted_expert_and_expert_parallel_ids(poisoned_buffers):
    """Expert 3 gets no token; some choices are served by another rank (-1), and token 2
    has every choice elsewhere, so its row must be exactly zero."""
    hidden, w13, w2, weights, _ = make_inputs(7, 40, 24, 8, 2, torch.float32, seed=3)
    ids = torch.tensor(
        [[0, 5], [5, -1], [-1, -1], [7, 1], [-1, 6], [2, 0], [1, 7]], dtype=torch.int32
    )
    out = _run_and_check((hidden, w13, w2, weights, ids))
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_bf16_expert_parallel_and_int64_ids(poisoned_buffers):
    hidden, w13, w2, weights, ids = make_inputs(5, 40, 24, 8, 2, torch.bfloat16, seed=11)
    ids = ids.to(torch.int64)
    ids[1] = -1
    ids[3, 0] = -1
    out = _run_and_check((hidden, w13, w2, weights, ids))
    assert not out[1].any()


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_activations(activation):
    inputs = make_inputs(3, 24, 24, 4, 2, torch.float32, seed=5)
    _run_and_check(inputs, activation=activation)


def test_default_config_and_kernel_interface():
    """choose_config's own tiles (64 wide, K tiles past H) through FusedMoEKernel.apply."""
    inputs = make_inputs(4, 40, 24, 8, 2, torch.bfloat16, seed=9)
    out = TritonFusedMoEKernel().apply(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == torch.bfloat16
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), reference_moe(*inputs), atol=tol, rtol=tol)


def test_empty_batch():
    hidden, w13, w2, weights, ids = make_inputs(3, 24, 24, 4, 2, torch.float32, seed=1)
    out = fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 24)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_invariants(block_m):
    num_experts, top_k = 6, 2
    gen = torch.Generator().manual_seed(block_m)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(9)])
    ids[ids == 4] = 5  # expert 4 gets nothing (expert 5 may now appear twice: irrelevant)
    ids[2] = -1  # served elsewhere
    ids[6, 1] = -1
    flat = ids.reshape(-1)
    num_pairs = flat.numel()

    sorted_ids, block_experts, num_valid = moe_align(ids.to(torch.int32), num_experts, block_m)
    capacity = max_padded_rows(num_pairs, num_experts, block_m)
    assert sorted_ids.shape == (capacity,) and capacity % block_m == 0
    assert block_experts.shape == (capacity // block_m,)
    assert sorted_ids.dtype == block_experts.dtype == torch.int32

    valid = sorted_ids < num_pairs
    assert torch.all(sorted_ids[~valid] == num_pairs)  # padding is marked by one id
    assert sorted(sorted_ids[valid].tolist()) == torch.nonzero(flat >= 0).flatten().tolist()

    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    expected_rows = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_valid) == expected_rows
    used_blocks = expected_rows // block_m
    assert torch.all(block_experts[used_blocks:] == -1)
    assert torch.all(sorted_ids[expected_rows:] == num_pairs)
    experts_in_order = block_experts[:used_blocks].tolist()
    assert experts_in_order == sorted(experts_in_order)  # one run per expert
    assert 4 not in experts_in_order
    for block, expert in enumerate(experts_in_order):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        pairs = rows[rows < num_pairs]
        assert len(pairs) > 0  # no block is all padding
        assert torch.all(flat[pairs.long()] == expert)  # single-expert block
        assert pairs.tolist() == sorted(pairs.tolist())  # tokens in order


def test_moe_align_all_elsewhere():
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    sorted_ids, block_experts, num_valid = moe_align(ids, 4, 16)
    assert int(num_valid) == 0
    assert torch.all(block_experts == -1)
    assert torch.all(sorted_ids == 6)


def test_can_implement():
    spec = MoELayerSpec(
        num_experts=8,
        hidden_size=64,
        intermediate_size=32,
        top_k=2,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    assert TritonFusedMoEKernel.name == "triton_fused_moe"
    assert TritonFusedMoEKernel.can_implement(spec) is None  # CPU allowed: interpreted
    for field, value, words in (
        ("activation", "relu2", "activation"),
        ("dtype", torch.float64, "dtype"),
        ("device", torch.device("meta"), "meta"),
    ):
        reason = TritonFusedMoEKernel.can_implement(MoELayerSpec(**{**spec.__dict__, field: value}))
        assert reason is not None and words in reason


def test_can_implement_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(fm, "_INTERPRETED", False)
    spec = MoELayerSpec(8, 64, 32, 2, torch.float16, torch.device("cpu"))
    assert "TRITON_INTERPRET" in TritonFusedMoEKernel.can_implement(spec)
    gpu = MoELayerSpec(8, 64, 32, 2, torch.float16, torch.device("cuda", 0))
    assert TritonFusedMoEKernel.can_implement(gpu) is None


def test_can_implement_without_triton(monkeypatch):
    monkeypatch.setattr(fm, "triton", None)
    spec = MoELayerSpec(8, 64, 32, 2, torch.float16, torch.device("cuda", 0))
    assert "triton" in TritonFusedMoEKernel.can_implement(spec)


def test_rejects_bad_shapes():
    hidden, w13, w2, weights, ids = make_inputs(3, 24, 24, 4, 2, torch.float32, seed=2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(hidden, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(hidden, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(hidden, w13, w2, weights, ids, activation="relu")


def test_strided_inputs(poisoned_buffers):
    """Views: hidden every other column of a wider tensor, weights stored K-major."""
    hidden, w13, w2, weights, ids = make_inputs(6, 40, 24, 4, 2, torch.float32, seed=21)
    wide = torch.zeros(6, 80)
    wide[:, ::2] = hidden
    w13_k_major = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_k_major = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert w13_k_major.stride(2) != 1
    _run_and_check((wide[:, ::2], w13_k_major, w2_k_major, weights, ids))
