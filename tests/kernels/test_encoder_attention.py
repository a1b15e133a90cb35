"""Triton encoder (non-causal varlen) attention vs a float64 reference, and its wiring
through TritonAttentionBackend.

Runs on CPU tensors under TRITON_INTERPRET=1 (set in conftest.py); sizes stay tiny
because the interpreter executes every program in numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from attention_reference import make_encoder_batch, reference_encoder_attention

from engine.core.interfaces.attention import AttentionBatch, AttentionLayerSpec
from engine.kernels import stats
from engine.kernels.encoder_attention import encoder_attention
from engine.kernels.triton_backend import TritonAttentionBackend

# Requests of different lengths, a single token among them; 17 crosses 16-row tiles.
LENGTHS = [5, 1, 17, 3]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _check(out: torch.Tensor, batch, scale: float, window=None, soft_cap=None) -> None:
    expected = reference_encoder_attention(
        batch.q, batch.k, batch.v, batch.query_start_loc, scale, window, soft_cap
    )
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert not out.isnan().any(), "a row was never written"
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "lengths,heads,kv_heads,head_size,dtype,window,soft_cap",
    [
        pytest.param(LENGTHS, 2, 2, 32, torch.float32, None, None, id="mha-fp32"),
        pytest.param(LENGTHS, 4, 1, 40, torch.float32, None, None, id="gqa4-d40-fp32"),
        pytest.param(LENGTHS, 4, 2, 32, torch.float32, 6, None, id="gqa2-window6"),
        pytest.param(LENGTHS, 2, 1, 32, torch.float32, None, 2.0, id="softcap"),
        pytest.param(LENGTHS, 6, 2, 40, torch.bfloat16, 9, 5.0, id="gqa3-d40-bf16-window-cap"),
        pytest.param([1], 2, 2, 16, torch.bfloat16, None, None, id="one-token"),
    ],
)
def test_matches_reference(lengths, heads, kv_heads, head_size, dtype, window, soft_cap):
    gen = torch.Generator().manual_seed(len(lengths) * 100 + heads * 10 + head_size)
    batch = make_encoder_batch(lengths, heads, kv_heads, head_size, dtype, gen)
    scale = head_size**-0.5
    out = torch.full_like(batch.q, float("nan"))
    result = encoder_attention(
        batch.q, batch.k, batch.v, batch.query_start_loc, batch.max_query_len, scale,
        sliding_window=window, logits_soft_cap=soft_cap, out=out, block_m=16, tile_size=16,
    )
    assert result is out
    _check(out, batch, scale, window, soft_cap)


def test_default_tiles_and_strided_views_of_a_fused_qkv():
    """The launch config picked from max_seqlen, over q/k/v that are column slices of
    one packed projection (what a model's fused QKV linear produces)."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, lengths = 4, 2, 24, [9, 2]
    total = sum(lengths)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(total, heads, dim), k.view(total, kv_heads, dim), v.view(total, kv_heads, dim)
    assert not q.is_contiguous()
    qsl = torch.tensor([0, 9, 11], dtype=torch.int32)
    out = encoder_attention(q, k, v, qsl, max(lengths), 0.2)
    expected = reference_encoder_attention(q, k, v, qsl, 0.2)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_rejects_bad_inputs():
    q = torch.zeros(4, 3, 16)
    kv = torch.zeros(4, 2, 16)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        encoder_attention(q, kv, kv, qsl, 4, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be int32 or int64"):
        encoder_attention(q[:, :2], kv, kv, qsl.float(), 4, 1.0)


def _encoder_step(batch) -> AttentionBatch:
    """The step the model runner builds for encoder requests: every token is new, no
    cache slots (the backend must not touch block tables or slots)."""
    num_reqs = batch.query_start_loc.shape[0] - 1
    lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    return AttentionBatch(
        num_reqs=num_reqs,
        num_tokens=batch.q.shape[0],
        query_start_loc=batch.query_start_loc,
        seq_lens=lens.to(torch.int32),
        block_tables=torch.zeros(num_reqs, 1, dtype=torch.int32),
        slot_mapping=torch.full((batch.q.shape[0],), -1, dtype=torch.int64),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_query_len,
        query_start_loc_cpu=batch.query_start_loc.numpy(),
        seq_lens_cpu=lens.numpy(),
    )


def test_backend_runs_encoder_layers_without_a_cache():
    assert TritonAttentionBackend.supports_encoder_attention()
    gen = torch.Generator().manual_seed(3)
    batch = make_encoder_batch([6, 1, 11], 4, 2, 40, torch.float32, gen)
    spec = AttentionLayerSpec(num_heads=4, head_size=40, num_kv_heads=2, scale=0.15,
                              sliding_window=8, causal=False)
    backend = TritonAttentionBackend(16, torch.device("cpu"))
    assert backend.validate(spec, 16) is None
    impl = backend.make_impl(spec)
    metadata = backend.build_metadata(_encoder_step(batch))

    before = stats.launches.snapshot()
    out = impl.forward(batch.q, batch.k, batch.v, None, metadata)
    assert stats.launches.snapshot() == before  # no cache write, no paged attention
    _check(out, batch, 0.15, window=8)
    with pytest.raises(ValueError, match="needs its own key and value"):
        impl.forward(batch.q, None, None, None, metadata)


def test_backend_refuses_non_causal_mla():
    mla = AttentionLayerSpec(num_heads=4, head_size=80, num_kv_heads=1, scale=0.1,
                             kv_lora_rank=64, causal=False)
    assert "non-causal (encoder) attention" in TritonAttentionBackend.validate(mla, 16)
    with pytest.raises(ValueError, match="non-causal"):
        TritonAttentionBackend(16, torch.device("cpu")).make_impl(mla)
