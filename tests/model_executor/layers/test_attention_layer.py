"""The Attention layer shell: backend validation, forward-context lookup, reshapes."""

from __future__ import annotations

import pytest
import torch

from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from engine.model_executor.layers.attention import Attention
from engine.plugins.cpu.attention import CPUAttentionBackend

CPU = torch.device("cpu")


class Head64Backend(CPUAttentionBackend):
    name = "head64"

    @classmethod
    def supported_head_sizes(cls):
        return [64]


def test_backend_refusal_is_a_clear_error():
    backend = Head64Backend(block_size=16, device=CPU)
    with pytest.raises(ValueError, match=r"layer 3.*head sizes \[64\], not 32"):
        Attention(4, 32, 0.1, 2, layer_idx=3, attn_backend=backend)
    with pytest.raises(ValueError, match="multiple"):
        Attention(4, 64, 0.1, 3, layer_idx=0, attn_backend=backend)


def test_forward_outside_a_context_is_a_clear_error():
    layer = Attention(2, 8, 0.3, 1, layer_idx=0, attn_backend=CPUAttentionBackend(4, CPU))
    with pytest.raises(RuntimeError, match="set_forward_context"):
        layer(torch.zeros(1, 16), torch.zeros(1, 8), torch.zeros(1, 8))


def test_forward_uses_its_layer_cache_and_matches_the_impl():
    backend = CPUAttentionBackend(block_size=4, device=CPU)
    layer = Attention(4, 8, 0.3, 2, layer_idx=1, attn_backend=backend)
    shape = backend.get_kv_cache_shape(3, 4, 2, 8)
    caches = [torch.zeros(shape), torch.zeros(shape)]
    batch = AttentionBatch(
        num_reqs=1,
        num_tokens=5,
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[2, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 11, 4]),
        max_query_len=5,
        max_seq_len=5,
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, n, generator=gen) for n in (32, 16, 16))
    metadata = backend.build_metadata(batch)
    with set_forward_context(ForwardContext(metadata, caches)) as ctx:
        assert get_forward_context() is ctx
        out = layer(q, k, v)
    assert out.shape == (5, 32)
    assert caches[0].abs().sum() == 0  # layer 1 wrote only its own cache
    ref_cache = torch.zeros(shape)
    ref = layer.impl.forward(q.view(5, 4, 8), k.view(5, 2, 8), v.view(5, 2, 8), ref_cache, metadata)
    torch.testing.assert_close(out, ref.reshape(5, 32), atol=0, rtol=0)
    torch.testing.assert_close(caches[1], ref_cache, atol=0, rtol=0)
    with pytest.raises(RuntimeError):
        get_forward_context()
