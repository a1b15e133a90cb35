"""reshape_and_cache vs direct tensor indexing (Triton interpreter on CPU tensors)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import stats
from engine.kernels.reshape_and_cache import reshape_and_cache

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 5, 4, 3, 24  # non-power-of-two heads/dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_writes_rows_and_skips_negative_slots(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(5)
    num_tokens = 9
    # K and V as strided views of one projection output, as a model produces them.
    kv = torch.randn(num_tokens, 2, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[1, 4, 8]] = -1  # skipped tokens
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), 7.0, dtype=dtype)

    expected = cache.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, KV_HEADS, HEAD_SIZE)
    flat[0, slots[keep]] = key[keep]
    flat[1, slots[keep]] = value[keep]

    before = stats.launches.reshape_and_cache
    reshape_and_cache(key, value, cache, slots.to(slot_dtype))
    assert torch.equal(cache, expected)
    assert stats.launches.reshape_and_cache == before + 1


def test_rejects_mismatched_shapes():
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    key = torch.zeros(3, KV_HEADS, HEAD_SIZE + 1)
    with pytest.raises(ValueError, match="do not match"):
        reshape_and_cache(key, key, cache, torch.zeros(3, dtype=torch.int64))
    key = torch.zeros(3, KV_HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache"):
        reshape_and_cache(key, key, cache[0], torch.zeros(3, dtype=torch.int64))
