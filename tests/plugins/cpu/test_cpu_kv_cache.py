"""The CPU backend's KV cache memory: zero-filled, per layer, and not touched up front."""

from __future__ import annotations

import os

import pytest
import torch

from engine.plugins.cpu.attention import CPUAttentionBackend


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_caches_are_zero_and_independent(dtype):
    backend = CPUAttentionBackend(16, torch.device("cpu"))
    shape = backend.get_kv_cache_shape(num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    caches = backend.allocate_kv_cache(shape, dtype, num_layers=3)
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
        assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    caches[1][0, 2, 1, 3 * 8 + 4] = 7.0
    assert float(caches[1].sum()) == 7.0
    assert float(caches[0].abs().sum()) == 0.0 and float(caches[2].abs().sum()) == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_large_cache_costs_no_memory_until_used():
    backend = CPUAttentionBackend(16, torch.device("cpu"))
    shape = backend.get_kv_cache_shape(
        num_blocks=16384, block_size=16, num_kv_heads=4, head_size=64
    )
    before = _rss_bytes()
    caches = backend.allocate_kv_cache(shape, torch.bfloat16, num_layers=2)  # 2 x 256 MiB
    assert _rss_bytes() - before < 32 << 20
    caches[0][0, :8] = 1.0  # touching a few blocks maps only their pages
    assert _rss_bytes() - before < 32 << 20
