"""The CPU plugin's batched multi-LoRA kernel (csrc/lora.c via cpu.lora) at every ISA
level this CPU runs: against a float64 reference, replayed in a forward graph with new
slots, and batch invariant."""

from __future__ import annotations

import pytest
import torch

from engine.plugins.cpu.graphs import CPUGraphCapturer
from engine.plugins.cpu.lora import CPULoRAKernel
from engine.plugins.cpu.platform import CPUPlatform
from tests.helpers.lora_kernel_reference import lora_reference

NUM_SLOTS = 5
# (tokens, in, rank, shard bounds): tails of every vector / tile size; the last one runs
# the parallel path with several token tiles of one slot and several column tiles.
SHAPES = {
    "one token": (1, 77, 8, (0, 61)),
    "tails, three unequal shards": (40, 77, 5, (0, 20, 23, 61)),
    "parallel tiles": (150, 300, 16, (0, 128, 160, 290)),
}


def make_case(t, n_in, rank, bounds, dtype, pattern, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, k = bounds[-1], (len(bounds) - 1) * rank
    x = torch.randn(t, n_in, generator=gen).to(dtype)
    lora_a = (torch.randn(NUM_SLOTS, k, n_in, generator=gen) / n_in ** 0.5).to(dtype)
    lora_b = (torch.randn(NUM_SLOTS, rank, n, generator=gen) * 0.3).to(dtype)
    if pattern == "random":  # decode: any slot or none per token
        slots = torch.randint(-1, NUM_SLOTS, (t,), generator=gen, dtype=torch.int32)
    else:  # prefill: contiguous runs
        slots = torch.full((t,), 3, dtype=torch.int32)
        slots[t // 4:] = -1
        slots[t // 2:] = 1
    wide = torch.randn(t, n + 7, generator=gen).to(dtype)
    return x, lora_a, lora_b, slots, wide


TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
              torch.bfloat16: {"rtol": 8e-3, "atol": 1e-3},  # y rounded once: half an ulp
              torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


@pytest.mark.parametrize("pattern", ["random", "runs"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_reference(kernels, dtype, shape, pattern):
    t, n_in, rank, bounds = shape
    x, lora_a, lora_b, slots, wide = make_case(t, n_in, rank, bounds, dtype, pattern)
    y = wide.narrow(1, 2, bounds[-1])  # a fused layer's column slice: strided rows
    before = wide.clone()
    s_ref, y_ref = lora_reference(x, lora_a, lora_b, slots, bounds, y)
    kernel = CPULoRAKernel(kernels)
    out = torch.full((t, lora_a.shape[1]), float("nan"))
    kernel.shrink(x, lora_a, slots, out)
    torch.testing.assert_close(out.double(), s_ref, rtol=1e-5, atol=1e-5)
    kernel.expand(out, lora_b, slots, bounds, y)
    torch.testing.assert_close(y.double(), y_ref, **TOLERANCES[dtype])
    assert torch.equal(wide[:, :2], before[:, :2])
    assert torch.equal(wide[:, 2 + bounds[-1]:], before[:, 2 + bounds[-1]:])
    assert torch.equal(wide[slots < 0], before[slots < 0])


def test_a_slot_outside_the_adapters_is_refused_before_anything_is_written(kernels):
    x, lora_a, lora_b, slots, wide = make_case(6, 32, 4, (0, 16), torch.float32, "runs")
    slots[3] = NUM_SLOTS
    out = torch.zeros(6, 4)
    kernel = CPULoRAKernel(kernels)
    with pytest.raises(ValueError, match="lora_shrink"):
        kernel.shrink(x, lora_a, slots, out)
    y = wide[:, :16]
    before = y.clone()
    with pytest.raises(ValueError, match="lora_expand"):
        kernel.expand(torch.ones(6, 4), lora_b, slots, (0, 16), y)
    assert torch.count_nonzero(out) == 0 and torch.equal(y, before)


def test_the_cpu_platform_offers_the_c_kernel(engine_kernels):
    assert CPUPlatform().lora_kernels() == [CPULoRAKernel]
    assert CPULoRAKernel.can_implement(torch.bfloat16, torch.device("cpu")) is None
    assert CPULoRAKernel.can_implement(torch.float32, torch.device("meta")) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_graph_reads_the_slots_and_inputs_of_each_step(kernels, dtype):
    t, n_in, rank, bounds = 12, 64, 8, (0, 40, 48, 96)
    x, lora_a, lora_b, slots, wide = make_case(t, n_in, rank, bounds, dtype, "random")
    y = wide.narrow(1, 2, bounds[-1])
    kernel = CPULoRAKernel(kernels)
    k = lora_a.shape[1]

    def forward():
        s = torch.empty((t, k), dtype=torch.float32)
        kernel.shrink(x, lora_a, slots, s)
        kernel.expand(s, lora_b, slots, bounds, y)
        return s

    graph = CPUGraphCapturer(kernels).capture(forward)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):  # new slots and activations in the same buffers
        slots.copy_(torch.randint(-1, NUM_SLOTS, (t,), generator=gen, dtype=torch.int32))
        x.copy_(torch.randn(t, n_in, generator=gen))
        wide.copy_(torch.randn(wide.shape, generator=gen))
        y_eager = y.clone()
        s_eager = torch.empty(t, k)
        kernel.shrink(x, lora_a, slots, s_eager)
        kernel.expand(s_eager, lora_b, slots, bounds, y_eager)
        got = graph.replay()
        assert torch.equal(got, s_eager)
        assert torch.equal(y, y_eager)
        s_ref, _ = lora_reference(x, lora_a, lora_b, slots, bounds, y_eager)
        torch.testing.assert_close(got.double(), s_ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def invariant(kernels):
    kernels.set_batch_invariant(True)
    yield kernels
    kernels.set_batch_invariant(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_does_not_depend_on_its_batch(invariant, dtype):
    """A token alone gives the bits it gives at any place in a batch of mixed slots (a
    long run of its own slot, other slots, tokens without an adapter)."""
    t, n_in, rank, bounds = 70, 300, 16, (0, 128, 160, 290)
    x, lora_a, lora_b, _, wide = make_case(t, n_in, rank, bounds, dtype, "random")
    slots = torch.full((t,), 2, dtype=torch.int32)  # a run of 2 around random slots
    slots[:9] = torch.tensor([0, -1, 4, 2, 1, 1, -1, 3, 2], dtype=torch.int32)
    slots[50:] = torch.randint(-1, NUM_SLOTS, (20,), generator=torch.Generator().manual_seed(3),
                               dtype=torch.int32)
    kernel = CPULoRAKernel(invariant)
    k, n = lora_a.shape[1], bounds[-1]
    s_batch = torch.empty(t, k)
    y_batch = wide[:, :n].clone()
    kernel.shrink(x, lora_a, slots, s_batch)
    kernel.expand(s_batch, lora_b, slots, bounds, y_batch)
    for i in (0, 3, 8, 9, 31, 49, 60):
        s_one, y_one = torch.empty(1, k), wide[i:i + 1, :n].clone()
        kernel.shrink(x[i:i + 1], lora_a, slots[i:i + 1], s_one)
        kernel.expand(s_one, lora_b, slots[i:i + 1], bounds, y_one)
        assert torch.equal(s_one[0], s_batch[i]), i
        assert torch.equal(y_one[0], y_batch[i]), i
