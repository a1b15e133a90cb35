"""TritonAttentionBackend: layout, validation, split-KV planning, forward end to end."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from attention_reference import make_batch, reference_attention

from engine.core.interfaces.attention import AttentionBatch, AttentionLayerSpec
from engine.kernels import stats
from engine.kernels.triton_backend import NUM_KV_SPLITS_ENV, TritonAttentionBackend


def _attention_batch(batch) -> AttentionBatch:
    return AttentionBatch(
        num_reqs=len(batch.keys),
        num_tokens=batch.q.shape[0],
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        query_start_loc_cpu=batch.query_start_loc.numpy(),
        seq_lens_cpu=batch.seq_lens.numpy(),
    )


def _new_rows(batch, tensors):
    """The K (or V) rows of this step's tokens, in batch order."""
    rows = []
    for r, full in enumerate(tensors):
        q_len = int(batch.query_start_loc[r + 1] - batch.query_start_loc[r])
        rows.append(full[full.shape[0] - q_len :])
    return torch.cat(rows)


def test_layout_and_validation():
    assert TritonAttentionBackend.name == "triton"
    assert TritonAttentionBackend.get_kv_cache_shape(10, 16, 4, 80) == (2, 10, 16, 4, 80)
    ok = AttentionLayerSpec(num_heads=8, head_size=80, num_kv_heads=2, scale=0.1)
    assert TritonAttentionBackend.validate(ok, 16) is None
    small = AttentionLayerSpec(num_heads=8, head_size=8, num_kv_heads=2, scale=0.1)
    assert "head sizes" in TritonAttentionBackend.validate(small, 16)
    uneven = AttentionLayerSpec(num_heads=6, head_size=64, num_kv_heads=4, scale=0.1)
    backend = TritonAttentionBackend(16, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        backend.make_impl(uneven)


def test_build_metadata_plans_split_kv_once_per_step():
    gen = torch.Generator().manual_seed(0)
    backend = TritonAttentionBackend(16, torch.device("cpu"), num_compute_units=132)
    backend.make_impl(AttentionLayerSpec(num_heads=8, head_size=64, num_kv_heads=2, scale=1.0))
    decode = _attention_batch(make_batch([(1, 40)], 8, 2, 64, 16, torch.float32, gen))
    decode.max_seq_len = 4096  # planning reads host ints only
    assert backend.build_metadata(decode).num_kv_splits == 16
    mixed = _attention_batch(make_batch([(3, 40), (1, 9)], 8, 2, 64, 16, torch.float32, gen))
    assert backend.build_metadata(mixed).num_kv_splits == 1


def test_split_count_forced_by_env_unless_given(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    mixed = _attention_batch(make_batch([(3, 40), (1, 9)], 4, 2, 16, 8, torch.float32, gen))
    monkeypatch.setenv(NUM_KV_SPLITS_ENV, "5")
    assert TritonAttentionBackend(8, torch.device("cpu")).build_metadata(mixed).num_kv_splits == 5
    explicit = TritonAttentionBackend(8, torch.device("cpu"), num_kv_splits=2)
    assert explicit.build_metadata(mixed).num_kv_splits == 2
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv(NUM_KV_SPLITS_ENV, bad)
        with pytest.raises(ValueError, match=f"{NUM_KV_SPLITS_ENV} must be a positive integer"):
            TritonAttentionBackend(8, torch.device("cpu"))
    monkeypatch.setenv(NUM_KV_SPLITS_ENV, "")
    assert TritonAttentionBackend(8, torch.device("cpu")).build_metadata(mixed).num_kv_splits == 1


@pytest.mark.parametrize(
    "dtype,splits,window", [(torch.float32, None, None), (torch.bfloat16, 3, 5)]
)
def test_forward_writes_cache_then_attends(dtype, splits, window):
    gen = torch.Generator().manual_seed(11)
    requests = [(4, 13), (1, 20), (6, 6)]
    batch = make_batch(requests, 4, 2, 32, 8, dtype, gen, store_new_tokens=False)
    key, value = _new_rows(batch, batch.keys), _new_rows(batch, batch.values)
    spec = AttentionLayerSpec(
        num_heads=4, head_size=32, num_kv_heads=2, scale=0.3, sliding_window=window
    )
    backend = TritonAttentionBackend(8, torch.device("cpu"), num_kv_splits=splits)
    impl = backend.make_impl(spec)
    metadata = backend.build_metadata(_attention_batch(batch))

    before = stats.launches.snapshot()
    out = impl.forward(batch.q, key, value, batch.kv_cache, metadata)
    after = stats.launches.snapshot()

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    expected = reference_attention(batch, 0.3, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert after["reshape_and_cache"] == before["reshape_and_cache"] + 1
    kernel = "split_kv_attention" if splits else "unified_attention"
    assert after[kernel] == before[kernel] + 1
    # The new rows landed in the cache at their slots.
    flat = batch.kv_cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, batch.slot_mapping], key)
    assert torch.equal(flat[1, batch.slot_mapping], value)
    # A layer sharing this cache (no K/V of its own) sees the same keys.
    shared = impl.forward(batch.q, None, None, batch.kv_cache, metadata)
    assert torch.equal(shared, out)
    assert np.array_equal(metadata.seq_lens.numpy(), [13, 20, 6])


@pytest.mark.parametrize("splits", [None, 3])
def test_forward_with_sinks_and_chunks(splits):
    """The layer's impl.sinks and spec.attention_chunk_size reach the kernels (split-KV:
    the sinks are added once, at the merge); a layer without its sinks set, or an encoder
    layer asking for either, is refused clearly."""
    gen = torch.Generator().manual_seed(12)
    requests = [(4, 13), (1, 20), (6, 6)]
    batch = make_batch(requests, 4, 2, 32, 8, torch.bfloat16, gen, store_new_tokens=False)
    key, value = _new_rows(batch, batch.keys), _new_rows(batch, batch.values)
    spec = AttentionLayerSpec(num_heads=4, head_size=32, num_kv_heads=2, scale=0.3,
                              attention_chunk_size=6, use_sinks=True)
    assert TritonAttentionBackend.supports_attention_sinks()
    assert TritonAttentionBackend.supports_chunked_local_attention()
    backend = TritonAttentionBackend(8, torch.device("cpu"), num_kv_splits=splits)
    impl = backend.make_impl(spec)
    metadata = backend.build_metadata(_attention_batch(batch))
    with pytest.raises(ValueError, match="sinks were never set"):
        impl.forward(batch.q, key, value, batch.kv_cache, metadata)
    impl.sinks = torch.tensor([1.0, -2.0, 0.5, 3.0])
    out = impl.forward(batch.q, key, value, batch.kv_cache, metadata)
    expected = reference_attention(batch, 0.3, chunk_size=6, sinks=impl.sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    encoder = AttentionLayerSpec(4, 32, 2, 0.3, causal=False, use_sinks=True)
    assert "encoder" in TritonAttentionBackend.validate(encoder, 8)


def test_module_imports_without_triton_and_fails_clearly_on_use():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from engine.kernels.triton_backend import TritonAttentionBackend\n"
        "try:\n"
        "    TritonAttentionBackend(16, torch.device('cpu'))\n"
        "except ImportError as exc:\n"
        "    print('ERR', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "ERR" in result.stdout and "'triton' package" in result.stdout
