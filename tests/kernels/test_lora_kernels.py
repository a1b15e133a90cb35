"""Batched multi-LoRA kernels (engine/core/interfaces/lora.py): the portable torch kernel
and the Triton one (under TRITON_INTERPRET=1, set by conftest.py) against a float64
reference, token by token."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.lora_torch import TorchLoRAKernel
from engine.kernels.lora_triton import MAX_SHARDS, TritonLoRAKernel, group_by_slot
from tests.helpers.lora_kernel_reference import lora_reference

SHARDS = {"one shard": (0, 61), "three unequal shards": (0, 20, 23, 61)}
RANK, IN, NUM_SLOTS = 8, 77, 5


def token_slots(pattern: str, t: int, gen: torch.Generator) -> torch.Tensor:
    """``random``: any slot or -1 per token (decode); ``runs``: a few contiguous runs
    (prefill); ``none``: no adapter at all."""
    if pattern == "random":
        return torch.randint(-1, NUM_SLOTS, (t,), generator=gen, dtype=torch.int32)
    if pattern == "none":
        return torch.full((t,), -1, dtype=torch.int32)
    slots = torch.full((t,), 2, dtype=torch.int32)
    slots[t // 3:] = -1
    slots[t // 2:] = 0
    slots[(5 * t) // 6:] = 2
    return slots


def make_case(t: int, bounds: tuple[int, ...], dtype: torch.dtype, pattern: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n, k = bounds[-1], (len(bounds) - 1) * RANK
    x = torch.randn(t, IN, generator=gen).to(dtype)
    lora_a = (torch.randn(NUM_SLOTS, k, IN, generator=gen) * 0.2).to(dtype)
    lora_b = (torch.randn(NUM_SLOTS, RANK, n, generator=gen) * 0.2).to(dtype)
    slots = token_slots(pattern, t, gen)
    wide = torch.randn(t, n + 10, generator=gen).to(dtype)  # y: a column slice of it
    return x, lora_a, lora_b, slots, wide


def tolerances(dtype: torch.dtype) -> dict:
    # y is rounded once to its dtype (the interpreter's bf16 store truncates: 1 ulp);
    # float32 sums of <= 77 products, in any order, on any CPU.
    return {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
            torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
            torch.float16: {"rtol": 2e-3, "atol": 1e-3}}[dtype]


def check_kernel(kernel, t, bounds, dtype, pattern):
    x, lora_a, lora_b, slots, wide = make_case(t, bounds, dtype, pattern)
    y = wide.narrow(1, 3, bounds[-1])
    before = wide.clone()
    s_ref, y_ref = lora_reference(x, lora_a, lora_b, slots, bounds, y)
    out = torch.full((t, lora_a.shape[1]), float("nan"))
    kernel.shrink(x, lora_a, slots, out)
    torch.testing.assert_close(out.double(), s_ref, rtol=1e-5, atol=1e-5)
    kernel.expand(out, lora_b, slots, bounds, y)
    torch.testing.assert_close(y.double(), y_ref, **tolerances(dtype))
    outside = torch.ones_like(wide, dtype=torch.bool)
    outside[:, 3:3 + bounds[-1]] = False
    assert torch.equal(wide[outside], before[outside])  # columns beside the slice
    assert torch.equal(wide[slots < 0], before[slots < 0])  # tokens without an adapter


@pytest.mark.parametrize("pattern", ["random", "runs", "none"])
@pytest.mark.parametrize("bounds", SHARDS.values(), ids=SHARDS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 40])
def test_torch_kernel_matches_the_reference(t, dtype, bounds, pattern):
    check_kernel(TorchLoRAKernel(), t, bounds, dtype, pattern)


def test_torch_kernel_sorts_many_runs():
    """Enough alternating runs that the kernel sorts (decode) rather than slicing runs."""
    check_kernel(TorchLoRAKernel(), 96, SHARDS["three unequal shards"], torch.float32, "random")


@pytest.mark.parametrize("pattern", ["random", "runs"])
@pytest.mark.parametrize("bounds", SHARDS.values(), ids=SHARDS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 20])  # 20 > the 16-token tile
def test_triton_kernel_matches_the_reference(t, dtype, bounds, pattern):
    check_kernel(TritonLoRAKernel(), t, bounds, dtype, pattern)


def test_triton_kernel_takes_more_shards_than_one_launch():
    # narrow shards, one of them empty, over two launches
    bounds = (0, 1, 1, *range(2, MAX_SHARDS + 2), MAX_SHARDS + 5)
    shards = len(bounds) - 1
    assert shards > MAX_SHARDS
    gen = torch.Generator().manual_seed(1)
    t, big_n = 5, bounds[-1]
    x = torch.randn(t, IN, generator=gen)
    lora_a = torch.randn(2, shards * RANK, IN, generator=gen) * 0.2
    lora_b = torch.randn(2, RANK, big_n, generator=gen) * 0.2
    slots = torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32)
    y = torch.randn(t, big_n, generator=gen)
    s_ref, y_ref = lora_reference(x, lora_a, lora_b, slots, bounds, y)
    out = torch.empty(t, shards * RANK)
    kernel = TritonLoRAKernel()
    kernel.shrink(x, lora_a, slots, out)
    torch.testing.assert_close(out.double(), s_ref, rtol=1e-5, atol=1e-5)
    kernel.expand(out, lora_b, slots, bounds, y)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)


def test_group_by_slot_buckets_tokens_without_host_reads():
    slots = torch.tensor([2, -1, 0, 2, 7, 0], dtype=torch.int32)  # 7: outside 3 slots
    groups = group_by_slot(slots, 3)
    assert groups.order.tolist() == [2, 5, 0, 3, 1, 4]
    assert groups.count.tolist() == [2, 0, 2, 2]
    assert groups.start.tolist() == [0, 2, 2, 4]


def test_can_implement_says_why_not():
    assert TorchLoRAKernel.can_implement(torch.bfloat16, torch.device("cpu")) is None
    assert TorchLoRAKernel.can_implement(torch.int8, torch.device("cpu")) is not None
    assert TritonLoRAKernel.can_implement(torch.float32, torch.device("cpu")) is None
    assert "not supported" in TritonLoRAKernel.can_implement(torch.float64,
                                                              torch.device("cpu"))
    assert "meta" in TritonLoRAKernel.can_implement(torch.float32, torch.device("meta"))
