"""Triton unified paged attention (single pass and split-KV) vs a float64 reference.

Runs on CPU tensors under TRITON_INTERPRET=1 (set in conftest.py); sizes stay tiny
because the interpreter executes every program in numpy.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from attention_reference import hide_blocks_before, make_batch, reference_attention

from engine.kernels import stats
from engine.kernels.unified_attention import (
    choose_num_kv_splits,
    unified_attention,
)

# (query_len, seq_len): prefill chunks with prior context, a first chunk, and decodes;
# contexts cross block boundaries for every block size below.
MIXED = [(5, 21), (1, 40), (7, 7), (1, 1), (3, 19)]
DECODES = [(1, 50), (1, 17), (1, 3)]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _run(batch, scale, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # every row must be written
    result = unified_attention(
        batch.q,
        batch.kv_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
        scale,
        **kwargs,
    )
    assert result is out
    return out


def _check(batch, out, scale, sliding_window=None, soft_cap=None) -> None:
    expected = reference_attention(batch, scale, sliding_window, soft_cap)
    assert not out.isnan().any()
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "requests,heads,kv_heads,head_size,block_size,dtype,extra",
    [
        pytest.param(MIXED, 2, 2, 32, 16, torch.float32, {}, id="mha-bs16-fp32"),
        pytest.param(MIXED, 4, 1, 80, 8, torch.float32, {}, id="gqa4-d80-bs8"),
        pytest.param(MIXED, 4, 2, 48, 32, torch.bfloat16, {}, id="gqa2-d48-bs32-bf16"),
        pytest.param(MIXED, 6, 2, 32, 12, torch.float32, {}, id="gqa3-bs12"),
        pytest.param(MIXED, 4, 2, 32, 8, torch.float32, {"sliding_window": 6}, id="window6-bs8"),
        pytest.param(MIXED, 2, 1, 32, 16, torch.float32, {"logits_soft_cap": 2.0}, id="softcap"),
        pytest.param(DECODES, 8, 2, 64, 64, torch.bfloat16, {}, id="decodes-bs64-bf16"),
    ],
)
def test_single_pass_matches_reference(
    requests, heads, kv_heads, head_size, block_size, dtype, extra
):
    gen = torch.Generator().manual_seed(hash((heads, head_size, block_size)) % 2**31)
    batch = make_batch(requests, heads, kv_heads, head_size, block_size, dtype, gen)
    scale = head_size**-0.5
    before = stats.launches.snapshot()
    out = _run(batch, scale, num_kv_splits=1, block_m=16, tile_size=16, **extra)
    _check(batch, out, scale, extra.get("sliding_window"), extra.get("logits_soft_cap"))
    after = stats.launches.snapshot()
    assert after["unified_attention"] == before["unified_attention"] + 1
    assert after["split_kv_attention"] == before["split_kv_attention"]


def test_default_tiles_prefill_and_decode():
    """The GPU launch heuristics' own tiles (64 query rows x 32 keys; 16 x 64 for decode)."""
    gen = torch.Generator().manual_seed(1)
    prefill = make_batch([(9, 30), (1, 70)], 4, 2, 32, 16, torch.bfloat16, gen)
    _check(prefill, _run(prefill, 0.3, num_kv_splits=1), 0.3)
    decode = make_batch([(1, 70), (1, 5)], 4, 2, 32, 16, torch.bfloat16, gen)
    _check(decode, _run(decode, 0.3, num_kv_splits=1), 0.3)


@pytest.mark.parametrize(
    "requests,dtype,splits,extra",
    [
        pytest.param(DECODES, torch.float32, 4, {}, id="decodes-4"),
        pytest.param(DECODES, torch.bfloat16, 3, {}, id="decodes-3-bf16"),
        pytest.param(MIXED, torch.float32, 3, {"sliding_window": 9}, id="mixed-window"),
    ],
)
def test_split_kv_matches_reference(requests, dtype, splits, extra):
    """Forced split-KV, including splits left empty by short requests (3 keys, 4 splits)."""
    gen = torch.Generator().manual_seed(7 + splits)
    batch = make_batch(requests, 4, 2, 48, 8, dtype, gen)
    before = stats.launches.snapshot()
    out = _run(batch, 0.2, num_kv_splits=splits, block_m=16, tile_size=16, **extra)
    _check(batch, out, 0.2, extra.get("sliding_window"))
    after = stats.launches.snapshot()
    assert after["split_kv_attention"] == before["split_kv_attention"] + 1
    assert after["split_kv_reduce"] == before["split_kv_reduce"] + 1
    assert after["unified_attention"] == before["unified_attention"]


def test_auto_split_for_few_long_decodes(monkeypatch):
    """num_kv_splits=None splits one long decode when programs cannot fill the device."""
    import engine.kernels.unified_attention as ua

    monkeypatch.setattr(ua, "compute_units", lambda device: 2)
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([(1, 600)], 2, 1, 32, 16, torch.float32, gen)
    before = stats.launches.split_kv_attention
    out = _run(batch, 0.25, tile_size=64)
    _check(batch, out, 0.25)
    assert stats.launches.split_kv_attention == before + 1  # 600 keys -> 2 splits


def test_choose_num_kv_splits_policy():
    # Few long decodes on a big device: split, bounded by the cap.
    assert choose_num_kv_splits(1, 8, 1, 32768, 132) == 33
    assert choose_num_kv_splits(1, 1, 1, 10**6, 132) == 64
    # Short contexts keep >= 256 keys per split.
    assert choose_num_kv_splits(1, 8, 1, 1024, 132) == 4
    assert choose_num_kv_splits(1, 8, 1, 300, 132) == 1
    # Enough programs already, or any prefill in the batch: no split.
    assert choose_num_kv_splits(64, 8, 1, 32768, 132) == 1
    assert choose_num_kv_splits(1, 8, 2, 32768, 132) == 1


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(2, 4)], 3, 2, 32, 8, torch.float32, gen)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _run(batch, 1.0)
    batch = make_batch([(2, 4)], 2, 2, 32, 8, torch.float32, gen)
    with pytest.raises(ValueError, match="out dtype"):
        unified_attention(
            batch.q,
            batch.kv_cache,
            batch.q.half(),
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            2,
            4,
            1.0,
        )
    with pytest.raises(ValueError, match="query_start_loc"):
        unified_attention(
            batch.q,
            batch.kv_cache,
            batch.q.clone(),
            batch.query_start_loc[:1],
            batch.seq_lens,
            batch.block_tables,
            2,
            4,
            1.0,
        )
    with pytest.raises(ValueError, match="num_kv_splits"):
        _run(batch, 1.0, num_kv_splits=0)


def test_float32_queries_over_a_bf16_cache():
    """The cache may be narrower than the activations (a bf16 checkpoint computed in
    float32): K/V are widened as they load, the output stays float32."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(MIXED, 4, 2, 32, 16, torch.bfloat16, gen)
    wide = dataclasses.replace(batch, q=batch.q.float())
    out = _run(wide, 0.2)
    assert out.dtype == torch.float32
    expected = reference_attention(wide, 0.2, None, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


# -- chunked local attention (Llama 4) and attention sinks (GPT-OSS) -------------------
def _sinks(heads: int) -> torch.Tensor:
    """Sink logits above, among and below the scores, one head's off (-inf)."""
    return torch.tensor([3.0, -1.0, 0.5, float("-inf"), 1.5, -4.0, 0.0, 2.0][:heads])


@pytest.mark.parametrize(
    "requests,heads,kv_heads,block_size,splits,extra",
    [
        # chunk 5 over blocks of 8: chunk starts inside blocks; prefill rows of one query
        # block sit in different chunks
        pytest.param(MIXED, 4, 2, 8, 1, {"attention_chunk_size": 5}, id="chunk5-bs8"),
        pytest.param(MIXED, 4, 1, 4, 1, {"attention_chunk_size": 16}, id="chunk16-bs4"),
        pytest.param(MIXED, 4, 2, 8, 1, {"sinks": True}, id="sinks"),
        pytest.param(MIXED, 4, 2, 8, 1, {"sinks": True, "sliding_window": 6,
                                         "logits_soft_cap": 2.0}, id="window-sinks-softcap"),
        pytest.param(MIXED, 2, 2, 8, 1, {"sinks": True, "attention_chunk_size": 7},
                     id="chunk7-sinks"),
        # split-KV: the sink is added once, at the merge (3 or 4 splits, some empty)
        pytest.param(DECODES, 4, 2, 8, 4, {"sinks": True}, id="split4-sinks"),
        pytest.param(MIXED, 4, 2, 8, 3, {"sinks": True, "sliding_window": 9},
                     id="split3-window-sinks"),
        pytest.param(DECODES, 4, 2, 8, 3, {"sinks": True, "attention_chunk_size": 12},
                     id="split3-chunk12-sinks"),
    ],
)
def test_chunked_local_attention_and_sinks(requests, heads, kv_heads, block_size, splits,
                                           extra):
    """Blocks before each request's first needed key are NaN and their table entries
    name a NaN block: neither may be read."""
    gen = torch.Generator().manual_seed(21 + splits)
    batch = make_batch(requests, heads, kv_heads, 32, block_size, torch.float32, gen)
    extra = dict(extra)
    sinks = _sinks(heads) if extra.pop("sinks", False) else None
    chunk, window = extra.get("attention_chunk_size"), extra.get("sliding_window")

    def first_key(q_len, seq_len):
        first = seq_len - q_len
        start = 0 if window is None else max(0, first - window + 1)
        return start if chunk is None else max(start, first // chunk * chunk)

    hide_blocks_before(batch, first_key)
    out = _run(batch, 0.3, num_kv_splits=splits, block_m=16, tile_size=16, sinks=sinks,
               **extra)
    expected = reference_attention(batch, 0.3, window, extra.get("logits_soft_cap"),
                                   chunk_size=chunk, sinks=sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    if sinks is not None:  # the sinks matter
        plain = reference_attention(batch, 0.3, window, extra.get("logits_soft_cap"),
                                    chunk_size=chunk)
        assert (plain - expected).abs().max() > 0.05


def test_chunk_and_sink_arguments_are_checked():
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(2, 4)], 2, 2, 32, 8, torch.float32, gen)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        _run(batch, 1.0, attention_chunk_size=0)
    with pytest.raises(ValueError, match="sinks"):
        _run(batch, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        _run(batch, 1.0, sinks=torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("splits,window", [(1, None), (1, 5), (3, None)])
def test_key_ends_let_image_tokens_see_their_whole_image(splits, window):
    """``key_ends`` (Gemma 3's image blocks): tokens of an image attend to the image's
    later tokens too; the window still counts from each query; other rows stay causal."""
    gen = torch.Generator().manual_seed(31 + splits)
    requests = [(9, 21), (1, 40), (7, 7)]
    batch = make_batch(requests, 4, 2, 32, 8, torch.float32, gen)
    ends = []
    for q_len, seq in requests:
        pos = torch.arange(seq - q_len, seq)
        ends.append(pos + 1)
    ends[0][3:8] = 20  # positions 15..19 form an image ending at 20
    ends[2][1:4] = 4  # positions 1..3 form an image ending at 4
    key_ends = torch.cat(ends).to(torch.int32)
    out = _run(batch, 0.3, num_kv_splits=splits, block_m=16, tile_size=16,
               sliding_window=window, key_ends=key_ends)
    expected = reference_attention(batch, 0.3, window, key_ends=key_ends.long())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    causal = reference_attention(batch, 0.3, window)
    assert (causal - expected).abs().max() > 1e-3
