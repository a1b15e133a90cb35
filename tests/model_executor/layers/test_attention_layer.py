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


class NoSinksBackend(CPUAttentionBackend):
    name = "plain"

    @classmethod
    def supports_attention_sinks(cls):
        return False

    @classmethod
    def supports_chunked_local_attention(cls):
        return False


def test_sinks_and_chunks_the_backend_lacks_are_clear_errors():
    backend = NoSinksBackend(block_size=4, device=CPU)
    with pytest.raises(ValueError, match=r"'plain' cannot run layer 2: .*no attention sinks"):
        Attention(4, 16, 0.1, 2, layer_idx=2, attn_backend=backend, use_sinks=True)
    with pytest.raises(ValueError, match="no chunked local attention"):
        Attention(4, 16, 0.1, 2, layer_idx=0, attn_backend=backend, attention_chunk_size=8)
    with pytest.raises(ValueError, match="attention_chunk_size must be positive"):
        Attention(4, 16, 0.1, 2, layer_idx=0, attn_backend=CPUAttentionBackend(4, CPU),
                  attention_chunk_size=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_sinks_load_this_ranks_slice_and_reach_the_kernel(rank):
    """Two tensor-parallel ranks of a 4-head model hold 2 heads each: each keeps its
    slice of the checkpoint's [4] sinks, and attends with them."""
    backend = CPUAttentionBackend(block_size=4, device=CPU)
    layer = Attention(2, 16, 0.25, 1, layer_idx=0, attn_backend=backend, use_sinks=True,
                      sinks_head_offset=2 * rank, attention_chunk_size=3)
    assert layer.spec.use_sinks and layer.spec.attention_chunk_size == 3
    assert layer.sinks.shape == (2,) and layer.sinks.dtype == torch.float32
    assert "sinks" in layer.extra_repr() and "chunk=3" in layer.extra_repr()
    full = torch.tensor([0.5, -1.0, 2.0, 1.5], dtype=torch.bfloat16)
    layer.sinks.weight_loader(layer.sinks, full)
    want = full.float()[2 * rank:2 * rank + 2]
    torch.testing.assert_close(layer.impl.sinks, want, atol=0, rtol=0)
    # A decode at position 4 (chunk [3, 4]) over two cached keys.
    gen = torch.Generator().manual_seed(rank)
    keys, values = torch.randn(5, 1, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    cache = torch.zeros(backend.get_kv_cache_shape(2, 4, 1, 16))
    key_rows = cache[0].view(2, 1, 4, 16)  # the torch-op layout is token-major...
    if layer.impl.kernels is not None:  # ...the C kernel's dims-major
        key_rows = cache[0].view(2, 1, 16, 4).transpose(2, 3)
    key_rows[0, 0] = keys[:4, 0]  # positions 0..3 in block 0; the layer writes 4
    cache[1].view(8, 16)[:4] = values[:4, 0]
    batch = AttentionBatch(
        num_reqs=1, num_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([4]), max_query_len=1, max_seq_len=5,
    )
    q = torch.randn(1, 32, generator=gen)
    with set_forward_context(ForwardContext(backend.build_metadata(batch), [cache])):
        out = layer(q, keys[4].reshape(1, 16), values[4].reshape(1, 16))
    scores = q.view(2, 16).double() @ keys[3:, 0].double().T * 0.25  # [heads, 2 keys]
    probs = torch.cat((scores, want.double()[:, None]), 1).softmax(-1)[:, :2]
    ref = (probs @ values[3:, 0].double()).reshape(1, 32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_bad_sinks_are_clear_errors():
    layer = Attention(2, 16, 0.25, 1, layer_idx=5, attn_backend=CPUAttentionBackend(4, CPU),
                      use_sinks=True, sinks_head_offset=2)
    with pytest.raises(ValueError, match=r"layer 5.*at least 4 .* heads 2..3"):
        layer.sinks.weight_loader(layer.sinks, torch.zeros(3))
    with pytest.raises(ValueError, match="one logit per query head"):
        layer.sinks.weight_loader(layer.sinks, torch.zeros(4, 1))
    with pytest.raises(ValueError, match="NaN"):
        layer.sinks.weight_loader(layer.sinks, torch.tensor([0.0, 0.0, float("nan"), 1.0]))
    assert layer.impl.sinks is None  # nothing handed over from a bad checkpoint
