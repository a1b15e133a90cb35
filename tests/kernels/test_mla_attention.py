"""Triton MLA kernels (engine.kernels.mla_attention) and the Triton backend's MLA layers,
against a float64 reference, through Triton's interpreter on CPU tensors (tiny sizes).

The reference keeps every request's latent entries as a dense ``[seq_len, D]`` tensor,
never reads the paged cache, and computes multi-query causal attention per request in
float64 (scores over all ``D`` dims, values the first ``L``). The kernels see a cache
whose every slot outside the requests' contexts -- unused blocks, the tails of used
ones, the block tables' padding block -- is NaN, and an output buffer filled with NaN.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.core.interfaces.attention import AttentionBatch, AttentionLayerSpec
from engine.kernels.mla_attention import launch_config, mla_attention, mla_write_cache
from engine.kernels.triton_backend import TritonAttentionBackend, TritonMLAAttentionImpl

LORA, ROPE = 16, 8  # D = 24: not a power of two
CPU = torch.device("cpu")


@dataclass
class MLABatch:
    requests: list[tuple[int, int]]  # (query_len, seq_len)
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [NB, BS, D], context stored, the rest NaN
    new_entries: torch.Tensor  # [T, 1, D]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_tables: torch.Tensor  # int32 [R, M]
    slot_mapping: torch.Tensor  # int64 [T]
    entries: list[torch.Tensor]  # per request [seq_len, D], every position
    slots: list[torch.Tensor]

    @property
    def max_query_len(self) -> int:
        return max(q for q, _ in self.requests)

    def attention_batch(self) -> AttentionBatch:
        return AttentionBatch(
            num_reqs=len(self.requests), num_tokens=self.q.shape[0],
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping,
            max_query_len=self.max_query_len, max_seq_len=int(self.seq_lens.max()),
            query_start_loc_cpu=self.query_start_loc.numpy(), seq_lens_cpu=self.seq_lens.numpy(),
        )


def make_batch(requests, num_heads, block_size, seed, store_new=True, lora=LORA, rope=ROPE,
               cache_dtype=torch.float32, cache=None) -> MLABatch:
    """Blocks scattered randomly over a NaN cache; ``store_new=False``: only the context
    before this step's tokens is stored (as a backend's forward sees it)."""
    gen = torch.Generator().manual_seed(seed)
    entry = lora + rope
    nblocks = [math.ceil(s / block_size) for _, s in requests]
    num_blocks = sum(nblocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    if cache is None:
        cache = torch.full((num_blocks, block_size, entry), float("nan"), dtype=cache_dtype)
    flat = cache.view(-1, entry)
    width = max(nblocks) + 1
    block_tables = torch.full((len(requests), width), int(perm[-1]), dtype=torch.int32)
    qs, news, slot_mapping, entries, all_slots, qsl, used = [], [], [], [], [], [0], 0
    for r, (q_len, seq) in enumerate(requests):
        blocks = perm[used : used + nblocks[r]]
        used += nblocks[r]
        block_tables[r, : nblocks[r]] = blocks.to(torch.int32)
        pos = torch.arange(seq)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        e = torch.randn(seq, entry, generator=gen).to(cache_dtype)
        stored = seq if store_new else seq - q_len
        flat[slots[:stored]] = e[:stored]
        qs.append(torch.randn(q_len, num_heads, entry, generator=gen))
        news.append(e[seq - q_len :].float().unsqueeze(1))
        slot_mapping.append(slots[seq - q_len :])
        entries.append(e)
        all_slots.append(slots)
        qsl.append(qsl[-1] + q_len)
    return MLABatch(
        requests, torch.cat(qs), cache, torch.cat(news),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor([s for _, s in requests], dtype=torch.int32),
        block_tables, torch.cat(slot_mapping).to(torch.int64), entries, all_slots,
    )


def reference(batch: MLABatch, lora: int, scale: float) -> torch.Tensor:
    outs, start = [], 0
    for (q_len, seq), e in zip(batch.requests, batch.entries):
        q = batch.q[start : start + q_len].double()
        start += q_len
        e = e.double()
        scores = torch.einsum("qhd,sd->hqs", q, e) * scale
        q_pos = torch.arange(seq - q_len, seq)[:, None]
        scores = scores.masked_fill(torch.arange(seq)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqs,sl->qhl", scores.softmax(-1), e[:, :lora]))
    return torch.cat(outs)


def run_kernel(batch: MLABatch, lora=LORA, **overrides) -> torch.Tensor:
    t, h, d = batch.q.shape
    out = torch.full((t, h, lora), float("nan"))
    got = mla_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, batch.max_query_len, lora, d**-0.5, out=out,
                        **overrides)
    assert got is out
    return out


PREFILL = [(5, 5), (9, 9)]
DECODE = [(1, 1), (1, 9), (1, 16), (1, 21)]
MIXED = [(1, 7), (6, 6), (4, 19), (1, 16), (3, 11)]  # (4, 19), (3, 11): prefix-cache hits


@pytest.mark.parametrize(
    "requests,num_heads,block_size,overrides",
    [
        (PREFILL, 4, 16, {}),
        (DECODE, 4, 16, {}),
        (MIXED, 4, 4, {}),
        (MIXED, 16, 8, {}),
        (DECODE, 16, 4, {"head_block": 8}),  # two head groups per token
        (MIXED, 16, 16, {"head_block": 4, "block_m": 16}),  # four groups, 4 tokens each
        (MIXED, 3, 8, {"tile": 32}),  # head padding; key tiles spanning several blocks
    ],
)
def test_attention_matches_reference(requests, num_heads, block_size, overrides):
    batch = make_batch(requests, num_heads, block_size, seed=num_heads + block_size)
    out = run_kernel(batch, **overrides)
    torch.testing.assert_close(out.double(), reference(batch, LORA, (LORA + ROPE) ** -0.5),
                               atol=1e-5, rtol=0)


def test_wide_entries_and_a_bf16_cache():
    """float32 queries over a bf16 cache (read widened), latent and rope widths that are
    not powers of two and exceed the 16-wide minimum tile."""
    batch = make_batch(MIXED, 2, 8, seed=3, lora=40, rope=20, cache_dtype=torch.bfloat16)
    out = run_kernel(batch, lora=40)
    torch.testing.assert_close(out.double(), reference(batch, 40, 60**-0.5), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],
)
def test_write_cache_stores_entries_and_skips_negative_slots(dtype, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    cache = torch.full((4, 4, LORA + ROPE), 7.0, dtype=cache_dtype)
    # [T, 1, D] as a strided view of a wider projection output, as a model makes it.
    wide = torch.randn(6, 1, LORA + ROPE + 5, generator=gen).to(dtype)
    entries = wide[..., : LORA + ROPE]
    slots = torch.tensor([3, -1, 12, 0, -1, 15])
    expected = cache.clone()
    keep = slots >= 0
    expected.view(-1, LORA + ROPE)[slots[keep]] = entries[keep, 0].to(cache_dtype)
    mla_write_cache(entries, cache, slots.to(torch.int32))
    if dtype == cache_dtype:
        assert torch.equal(cache, expected)
    else:  # rounded into the cache (the interpreter truncates where a GPU rounds to even)
        torch.testing.assert_close(cache.float(), expected.float(), atol=0, rtol=2**-7)


def test_launch_configs():
    """Defaults: a decode's program is one head group of >= 16 rows; the 512-wide latent
    of DeepSeek keeps 16 rows per program."""
    deepseek = launch_config(128, 1, 512, torch.bfloat16)
    assert (deepseek.head_block, deepseek.block_m, deepseek.tile) == (16, 16, 32)
    assert launch_config(128, 64, 512, torch.bfloat16).block_m == 16
    small = launch_config(4, 7, 16, torch.float32)
    assert (small.head_block, small.block_m, small.tile) == (4, 64, 16)
    assert launch_config(4, 1, 16, torch.float32).block_m == 16
    with pytest.raises(ValueError, match="power of two"):
        launch_config(4, 1, 16, torch.float32, tile=24)


def test_backend_layout_validation_and_cache_bytes():
    backend = TritonAttentionBackend(16, CPU)
    shape = backend.get_mla_kv_cache_shape(10, 16, 576)
    assert shape == (10, 16, 576)
    for dtype in (torch.bfloat16, torch.float32):
        (cache,) = backend.allocate_kv_cache(shape, dtype, 1)
        per_token = cache.numel() * cache.element_size() // (10 * 16)
        assert per_token == 576 * torch.empty((), dtype=dtype).element_size()
    deepseek = AttentionLayerSpec(128, 576, 1, 0.1, kv_lora_rank=512)
    assert backend.validate(deepseek, 16) is None  # 576 > the MHA kernels' 256 head size
    assert isinstance(backend.make_impl(deepseek), TritonMLAAttentionImpl)
    refused = {
        "sliding window": AttentionLayerSpec(16, 576, 1, 0.1, sliding_window=8,
                                             kv_lora_rank=512),
        "latent": AttentionLayerSpec(16, 576, 2, 0.1, kv_lora_rank=512),
        "kv_lora_rank": AttentionLayerSpec(16, 1088, 1, 0.1, kv_lora_rank=1024),
    }
    for words, spec in refused.items():
        assert words in backend.validate(spec, 16)
        with pytest.raises(ValueError):
            backend.make_impl(spec)


@pytest.mark.parametrize("requests,block_size", [(MIXED, 4), (DECODE, 16)])
def test_backend_forward_writes_then_attends(requests, block_size):
    """Through the backend: the step's entries are written (prefix-hit chunks read the
    context another request of the batch could have written) and attended over; two
    layers share one step's metadata, each with its own cache."""
    backend = TritonAttentionBackend(block_size, CPU)
    spec = AttentionLayerSpec(4, LORA + ROPE, 1, 0.3, kv_lora_rank=LORA)
    impl = backend.make_impl(spec)
    batch = make_batch(requests, 4, block_size, seed=block_size, store_new=False)
    num_blocks = batch.kv_cache.shape[0]
    (cache,) = backend.allocate_kv_cache(
        backend.get_mla_kv_cache_shape(num_blocks, block_size, LORA + ROPE), torch.float32, 1
    )
    cache.fill_(float("nan"))
    other = make_batch(requests, 4, block_size, seed=block_size, store_new=False, cache=cache)
    other.q, other.entries = other.q * 0.5, [e * 2 for e in other.entries]
    other.new_entries = other.new_entries * 2
    cache.mul_(2)
    metadata = backend.build_metadata(batch.attention_batch())
    for b in (batch, other):
        out = impl.forward(b.q, b.new_entries, None, b.kv_cache, metadata)
        assert out.shape == (b.q.shape[0], 4, LORA) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), reference(b, LORA, 0.3), atol=1e-5, rtol=0)
        flat = b.kv_cache.view(-1, LORA + ROPE)
        written = torch.zeros(flat.shape[0], dtype=torch.bool)
        for e, slots in zip(b.entries, b.slots):
            assert torch.equal(flat[slots], e)
            written[slots] = True
        assert flat[~written].isnan().all()
