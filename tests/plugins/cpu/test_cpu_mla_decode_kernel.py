"""The C MLA decode kernel (csrc/mla_decode.c) against float64, at every ISA level.

Each request's context entries sit in shuffled cache blocks whose unused slots hold NaN
(the kernel must never read them); the reference is dense multi-query attention in
float64 over the entries as stored (after rounding to the cache dtype).
"""

from __future__ import annotations

import pytest
import torch


def _case(seq_lens: list[int], heads: int, lora: int, rope: int, block_size: int,
          cache_dtype: torch.dtype, q_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    entry = lora + rope
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 3
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((num_blocks, block_size, entry), float("nan")).to(cache_dtype)
    tables = torch.zeros(len(seq_lens), max(per_req) + 1, dtype=torch.int64)
    entries, used = [], 0
    for r, s in enumerate(seq_lens):
        blocks = order[used:used + per_req[r]]
        used += per_req[r]
        tables[r, :per_req[r]] = blocks
        e = torch.randn(s, entry, generator=gen).to(cache_dtype)
        pos = torch.arange(s)
        cache[blocks[pos // block_size], pos % block_size] = e
        entries.append(e)
    query = torch.randn(len(seq_lens), heads, entry, generator=gen).to(q_dtype)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int64), entries


def _reference(query: torch.Tensor, entries: list[torch.Tensor], lora: int,
               scale: float) -> torch.Tensor:
    out = []
    for q, e in zip(query.double(), entries):
        e = e.double()
        p = torch.softmax(q @ e.T * scale, dim=-1)  # [H, S]
        out.append(p @ e[:, :lora])
    return torch.stack(out)


@pytest.mark.parametrize("seq_lens,heads,block_size,splits", [
    ([1], 5, 16, None),  # one key; heads not a multiple of the register block (4)
    ([7, 1, 16], 3, 16, None),  # partial blocks, one full block
    ([300, 45], 6, 16, None),  # many blocks
    ([1000], 4, 32, 5),  # long enough to split: key ranges merged
    ([130, 2, 600], 7, 8, 3),  # splits with ranges shorter than a tile, one empty
])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference(kernels, seq_lens, heads, block_size, splits, cache_dtype):
    lora, rope = 32, 16
    query, cache, tables, lens, entries = _case(seq_lens, heads, lora, rope, block_size,
                                                cache_dtype, torch.float32)
    scale = (lora + rope) ** -0.5
    out = kernels.mla_decode_attention(query, cache, tables, lens, lora, scale, splits)
    assert out.shape == (len(seq_lens), heads, lora) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(query, entries, lora, scale),
                               atol=2e-5, rtol=2e-5)


def test_deepseek_width_and_bf16_queries(engine_kernels):
    """D = 512 + 64 (DeepSeek-V3), bf16 queries and cache: output rounded to bf16."""
    query, cache, tables, lens, entries = _case([70, 33], 16, 512, 64, 16, torch.bfloat16,
                                                torch.bfloat16, seed=1)
    scale = 576 ** -0.5
    out = engine_kernels.mla_decode_attention(query, cache, tables, lens, 512, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(query, entries, 512, scale),
                               atol=1e-2, rtol=1e-2)


def test_write_entries_round_and_skip(engine_kernels):
    cache = torch.zeros(4, 4, 24, dtype=torch.bfloat16)
    entries = torch.randn(3, 40)[:, :24]  # strided rows, float32 rounded into bf16
    engine_kernels.mla_write_entries(entries, torch.tensor([5, -1, 15]), cache)
    flat = cache.view(-1, 24)
    assert torch.equal(flat[5], entries[0].to(torch.bfloat16))
    assert torch.equal(flat[15], entries[2].to(torch.bfloat16))
    assert int((flat != 0).any(dim=1).sum()) == 2
    with pytest.raises(ValueError, match="slot is outside"):
        engine_kernels.mla_write_entries(entries, torch.tensor([0, 16, 1]), cache)
    assert int((flat != 0).any(dim=1).sum()) == 2  # nothing written


def test_bounds_and_layouts_are_checked(engine_kernels):
    query, cache, tables, lens, _ = _case([20], 4, 32, 16, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        engine_kernels.mla_decode_attention(query, cache, tables, torch.tensor([100]), 32, 1.0)
    bad = tables.clone()
    bad[0, 0] = cache.shape[0]
    with pytest.raises(ValueError, match="outside"):
        engine_kernels.mla_decode_attention(query, cache, bad, lens, 32, 1.0)
    with pytest.raises(ValueError, match="float32, bf16 or fp16"):
        engine_kernels.mla_decode_attention(query, cache.to(torch.float64), tables, lens, 32, 1.0)
    with pytest.raises(ValueError, match="int64"):
        engine_kernels.mla_decode_attention(query, cache, tables.int(), lens, 32, 1.0)
