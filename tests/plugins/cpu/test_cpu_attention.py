"""CPUAttentionBackend against an independent float64 reference.

The reference keeps every request's full K/V history as a dense tensor, never looks at
the paged cache, and computes causal (optionally windowed, soft-capped) softmax
attention per request and head with ``repeat_interleave`` GQA. The backend under test
sees only the paged cache (history written beforehand, blocks scattered randomly) and
this step's new K/V rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.core.interfaces import AttentionBatch, AttentionLayerSpec
from engine.plugins.cpu import attention as cpu_attention
from engine.plugins.cpu.attention import CPUAttentionBackend
from engine.plugins.cpu.native import CPUKernels, KeyLayout
from tests.plugins.cpu.conftest import LEVELS, kernels_of

CPU = torch.device("cpu")


def key_layout(num_heads: int, num_kv_heads: int, head_size: int, dtype) -> KeyLayout:
    """How the backend stores this layer's K rows (a kernel layout for C kernel layers)."""
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, 1.0)
    kernels = cpu_attention.load_kernels()
    if kernels is None or not CPUKernels.supports_attention(spec):
        return KeyLayout.PLAIN
    return kernels.key_layout(dtype)


def cache_views(kv_cache: torch.Tensor, block_size: int, head_size: int, layout: KeyLayout):
    """The documented layout as ``(keys, values)`` views indexed ``[block, kv_head,
    offset]``: V rows are ``[block_size, head_size]``, so a token is ``[head_size]``; K
    rows are in ``layout``, a token ``[head_size / pack, pack]`` (dims ``2i, 2i + 1`` side
    by side for DIM_PAIRS, else one per row)."""
    num_blocks, kv_heads = kv_cache.shape[1:3]
    values = kv_cache[1].view(num_blocks, kv_heads, block_size, head_size)
    pack = layout.pack
    # Strides of (token j, pair i = d // pack, d % pack) within a row: token-major for
    # PLAIN, else (d // pack) * block_size * pack + j * pack + d % pack.
    if layout is KeyLayout.PLAIN:
        token_stride, pair_stride = head_size, 1
    else:
        token_stride, pair_stride = pack, block_size * pack
    keys = kv_cache[0].as_strided(
        (num_blocks, kv_heads, block_size, head_size // pack, pack),
        (kv_heads * block_size * head_size, block_size * head_size, token_stride, pair_stride, 1),
        kv_cache[0].storage_offset(),
    )
    return keys, values


@dataclass
class Case:
    batch: AttentionBatch
    kv_cache: torch.Tensor
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] new rows
    value: torch.Tensor
    hist_k: list[torch.Tensor]  # per request [seq_len, Hkv, D], the full history
    hist_v: list[torch.Tensor]
    slots: list[torch.Tensor]  # per request, slot of every position


def make_case(
    requests: list[tuple[int, int]],  # (query_len, seq_len)
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    skip_rows: tuple[int, ...] = (),
    cache_dtype: torch.dtype | None = None,
) -> Case:
    """``dtype``: the queries' and new K/V rows'; ``cache_dtype`` (default the same): the
    cache's, which every K/V value is exact in (float32 activations over a bf16 cache)."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    nblocks = [math.ceil(s / block_size) for _, s in requests]
    total_blocks = sum(nblocks) + 2
    perm = torch.randperm(total_blocks, generator=gen)
    backend_shape = CPUAttentionBackend.get_kv_cache_shape(
        total_blocks, block_size, num_kv_heads, head_size
    )
    # Unused slots hold finite garbage: a masked key must not contribute.
    kv_cache = (torch.randn(backend_shape, generator=gen) * 100).to(cache_dtype)
    width = max(nblocks)
    block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
    queries, keys, values, slot_mapping, hist_k, hist_v, slots_all = [], [], [], [], [], [], []
    qsl = [0]
    used = 0
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = perm[used : used + nblocks[r]]
        used += nblocks[r]
        block_tables[r, : nblocks[r]] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(cache_dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(cache_dtype)
        ctx = seq_len - q_len
        blk, off = slots[:ctx] // block_size, slots[:ctx] % block_size
        layout = key_layout(num_heads, num_kv_heads, head_size, cache_dtype)
        key_cache, value_cache = cache_views(kv_cache, block_size, head_size, layout)
        key_cache[blk, :, off] = k[:ctx].unflatten(-1, (-1, layout.pack))
        value_cache[blk, :, off] = v[:ctx]
        queries.append(torch.randn(q_len, num_heads, head_size, generator=gen).to(dtype))
        keys.append(k[ctx:].to(dtype))
        values.append(v[ctx:].to(dtype))
        slot_mapping.append(slots[ctx:])
        hist_k.append(k)
        hist_v.append(v)
        slots_all.append(slots)
        qsl.append(qsl[-1] + q_len)
    slot_mapping = torch.cat(slot_mapping).to(torch.int64)
    for row in skip_rows:
        slot_mapping[row] = -1
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    query_lens = [q for q, _ in requests]
    batch = AttentionBatch(
        num_reqs=len(requests),
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
    )
    return Case(
        batch,
        kv_cache,
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        hist_k,
        hist_v,
        slots_all,
    )


def reference(
    case: Case, requests, num_heads: int, scale: float, window: int | None, soft_cap=None,
    chunk: int | None = None, sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chunk``: a query at position p sees keys ``chunk * (p // chunk) ..= p`` only;
    ``sinks`` ([H]): one more (uncapped, value-less) column of each head's softmax;
    ``key_ends`` ([T]): each query's keys end there instead (transformers' Gemma 3 mask:
    AND(window, OR(causal, same image)))."""
    outs = []
    start = 0
    for (q_len, seq_len), k, v in zip(requests, case.hist_k, case.hist_v):
        q = case.query[start : start + q_len].double()  # [q, H, D]
        ends = None if key_ends is None else key_ends[start : start + q_len][:, None]
        start += q_len
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
        kpos = torch.arange(seq_len)[None, :]
        allowed = kpos <= qpos if ends is None else kpos < ends
        if window is not None:
            allowed &= kpos > qpos - window
        if chunk is not None:
            allowed &= kpos >= qpos // chunk * chunk
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # the sink column joins the softmax, then is dropped (it has no value)
            sink_col = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat((scores, sink_col), dim=-1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


@pytest.fixture(autouse=True, params=[f"c_kernel-{level}" for level in LEVELS] + ["torch_ops"])
def decode_path(request, monkeypatch) -> str:
    """Every test runs through the C kernel of every ISA level this CPU runs (where it
    serves the layer: every token, decodes and prefill chunks) and through the torch-op
    path the plugin falls back to without a compiler."""
    if request.param == "torch_ops":
        monkeypatch.setattr(cpu_attention, "load_kernels", lambda: None)
    else:
        kernels = kernels_of(request.param.removeprefix("c_kernel-"))
        monkeypatch.setattr(cpu_attention, "load_kernels", lambda: kernels)
    return request.param


def run_backend(case: Case, spec: AttentionLayerSpec, block_size: int,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    backend = CPUAttentionBackend(block_size=block_size, device=CPU)
    assert backend.validate(spec, block_size) is None
    impl = backend.make_impl(spec)
    impl.sinks = sinks
    uses_c = cpu_attention.load_kernels() is not None and CPUKernels.supports_attention(spec)
    assert (impl.kernels is not None) == uses_c
    metadata = backend.build_metadata(case.batch)
    return impl.forward(case.query, case.key, case.value, case.kv_cache, metadata)


# (query_len, seq_len): decodes, a first chunk, chunks after context, 1-token chunk.
MIXED = [(1, 1), (7, 7), (1, 33), (5, 21), (1, 16), (16, 40), (1, 17)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [
        (4, 4, 16, 16),  # MHA
        (8, 2, 16, 4),  # GQA, many small blocks
        (6, 1, 24, 8),  # MQA, head size not a power of two
        (4, 2, 80, 32),  # one block holds most contexts
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_size, block_size, dtype,
                                       kernel_max_context, monkeypatch):
    """kernel_max_context 20: the C path hands the chunks with longer contexts to SDPA
    (their keys in the kernel's layout) while it attends for the rest itself."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    case = make_case(MIXED, num_heads, num_kv_heads, head_size, block_size, dtype)
    scale = head_size**-0.5
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, scale)
    out = run_backend(case, spec, block_size)
    ref = reference(case, MIXED, num_heads, scale, None)
    assert out.shape == ref.shape and out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_float32_activations_over_a_narrow_cache(cache_dtype, kernel_max_context, monkeypatch):
    """A bf16 / fp16 checkpoint computed in float32: new K/V rows are rounded into the
    cache, every path widens what it reads, and the output stays float32."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    case = make_case(MIXED, 8, 2, 32, 8, torch.float32, seed=4, cache_dtype=cache_dtype)
    spec = AttentionLayerSpec(8, 32, 2, 32**-0.5)
    out = run_backend(case, spec, 8)
    ref = reference(case, MIXED, 8, 32**-0.5, None)
    assert out.dtype == torch.float32
    # the values are exact in the cache; a float32 query scored with vdpbf16ps is rounded
    uses_pairs = key_layout(8, 2, 32, cache_dtype).pack == 2
    torch.testing.assert_close(out.double(), ref, atol=3e-2 if uses_pairs else 1e-5, rtol=0)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [
        (3, 1, 64, 16),  # a group of 3: query heads padded to the kernel's 4
        (10, 2, 128, 32),  # group 5: one full and one padded register block
        (16, 2, 256, 1),  # big heads, one-token blocks
        (8, 8, 48, 5),  # MHA, blocks that cut the kernel's 16-key slices
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_shapes_match_reference(num_heads, num_kv_heads, head_size, block_size, dtype):
    requests = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 70), (1, 3)]
    case = make_case(requests, num_heads, num_kv_heads, head_size, block_size, dtype, seed=7)
    scale = head_size**-0.5
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, scale)
    out = run_backend(case, spec, block_size)
    ref = reference(case, requests, num_heads, scale, None)
    atol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window, block_size, dtype):
    requests = MIXED + [(1, 60), (12, 58)]
    case = make_case(requests, 4, 2, 16, block_size, dtype, seed=1)
    spec = AttentionLayerSpec(4, 16, 2, 0.25, sliding_window=window)
    out = run_backend(case, spec, block_size)
    ref = reference(case, requests, 4, 0.25, window)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_soft_cap(dtype):
    case = make_case(MIXED + [(1, 70)], 4, 2, 16, 8, dtype, seed=2)
    spec = AttentionLayerSpec(4, 16, 2, 0.7, logits_soft_cap=3.0)
    out = run_backend(case, spec, 8)
    ref = reference(case, MIXED + [(1, 70)], 4, 0.7, None, soft_cap=3.0)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("requests", [[(1, 9), (1, 1), (1, 64), (1, 31)], [(30, 30)]])
def test_pure_decode_and_pure_prefill(requests):
    case = make_case(requests, 8, 4, 32, 16, torch.float32, seed=3)
    spec = AttentionLayerSpec(8, 32, 4, 32**-0.5)
    out = run_backend(case, spec, 16)
    torch.testing.assert_close(
        out.double(), reference(case, requests, 8, 32**-0.5, None), atol=1e-5, rtol=0
    )


def test_new_rows_are_written_to_their_slots():
    case = make_case(MIXED, 4, 2, 16, 8, torch.float32, seed=4)
    run_backend(case, AttentionLayerSpec(4, 16, 2, 0.25), 8)
    for (q_len, seq_len), k, v, slots in zip(MIXED, case.hist_k, case.hist_v, case.slots):
        blk, off = slots // 8, slots % 8
        layout = key_layout(4, 2, 16, torch.float32)
        key_cache, value_cache = cache_views(case.kv_cache, 8, 16, layout)
        torch.testing.assert_close(key_cache[blk, :, off].flatten(-2), k, atol=0, rtol=0)
        torch.testing.assert_close(value_cache[blk, :, off], v, atol=0, rtol=0)


def test_skipped_slots_are_not_written():
    requests = [(1, 5), (4, 4), (1, 3)]
    case = make_case(requests, 2, 1, 8, 4, torch.float32, seed=5, skip_rows=(5,))
    before = case.kv_cache.clone()
    spec = AttentionLayerSpec(2, 8, 1, 8**-0.5)
    out = run_backend(case, spec, 4)
    skipped_slot = case.slots[2][-1]  # the last request's only new token (row 5)
    blk = skipped_slot // 4
    for now, then in zip(case.kv_cache, before):  # K, V planes
        torch.testing.assert_close(now[blk], then[blk])  # the whole block is untouched
    # Every other request is unaffected and exact.
    ref = reference(case, requests, 2, 8**-0.5, None)
    torch.testing.assert_close(out[:5].double(), ref[:5], atol=1e-5, rtol=0)


def test_request_reads_blocks_written_by_another_request_this_step():
    """Prefix sharing: request 1's block table starts with request 0's first block,
    whose contents request 0 writes in the same step."""
    bs, hkv, d = 4, 1, 8
    gen = torch.Generator().manual_seed(6)
    k0 = torch.randn(6, hkv, d, generator=gen)
    v0 = torch.randn(6, hkv, d, generator=gen)
    k1_tail = torch.randn(2, hkv, d, generator=gen)
    v1_tail = torch.randn(2, hkv, d, generator=gen)
    cache = torch.zeros(CPUAttentionBackend.get_kv_cache_shape(4, bs, hkv, d))
    # Request 0: 6 new tokens in blocks [2, 3]. Request 1: shares block 2 (first 4
    # tokens), then 2 new tokens in block 1; context 6.
    batch = AttentionBatch(
        num_reqs=2,
        num_tokens=8,
        query_start_loc=torch.tensor([0, 6, 8], dtype=torch.int32),
        seq_lens=torch.tensor([6, 6], dtype=torch.int32),
        block_tables=torch.tensor([[2, 3], [2, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 11, 12, 13, 4, 5]),
        max_query_len=6,
        max_seq_len=6,
    )
    q = torch.randn(8, 2, d, generator=gen)
    key = torch.cat([k0, k1_tail])
    value = torch.cat([v0, v1_tail])
    backend = CPUAttentionBackend(block_size=bs, device=CPU)
    impl = backend.make_impl(AttentionLayerSpec(2, d, hkv, 0.5))
    out = impl.forward(q, key, value, cache, backend.build_metadata(batch))
    # Request 1's full history: request 0's first 4 tokens, then its own 2.
    k1 = torch.cat([k0[:4], k1_tail]).double().repeat_interleave(2, 1)
    v1 = torch.cat([v0[:4], v1_tail]).double().repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q[6:].double(), k1) * 0.5
    allowed = torch.arange(6)[None, :] <= torch.tensor([4, 5])[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v1)
    torch.testing.assert_close(out[6:].double(), ref, atol=1e-6, rtol=0)


def test_bad_batches_are_rejected():
    case = make_case([(3, 3)], 2, 1, 8, 4, torch.float32)
    backend = CPUAttentionBackend(block_size=4, device=CPU)
    case.batch.block_tables = case.batch.block_tables[:, :0]
    with pytest.raises(ValueError, match="blocks"):
        backend.build_metadata(case.batch)
    bad = make_case([(3, 3)], 2, 1, 8, 4, torch.float32).batch
    bad.seq_lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_len"):
        backend.build_metadata(bad)
    with pytest.raises(ValueError, match="multiple"):
        backend.make_impl(AttentionLayerSpec(3, 8, 2, 1.0))


def test_cache_shape():
    assert CPUAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 2, 16 * 64)


# -- chunked local attention (Llama 4) and attention sinks (GPT-OSS) -------------------
def sink_logits(num_heads: int, seed: int = 11) -> torch.Tensor:
    """Sinks from well below to well above the scores (-inf: a head whose sink is off)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_heads, generator=gen) * 3
    sinks[0] = 6.0  # dominates most rows: the keys' share shrinks a lot
    if num_heads > 2:
        sinks[-1] = float("-inf")
    return sinks.float()


def poison_before(case: Case, requests, block_size: int, first_key) -> None:
    """NaN into every cache block that lies wholly before a request's first needed key
    (``first_key(q_len, seq_len)``): a backend that touched one would return NaN (the
    blocks before a chunk's or window's start may be freed and reused)."""
    for (q_len, seq_len), slots in zip(requests, case.slots):
        first = first_key(q_len, seq_len)
        for blk in set((slots[: first // block_size * block_size] // block_size).tolist()):
            case.kv_cache[:, blk] = float("nan")


# (query_len, seq_len): decodes on chunk edges, prefill chunks crossing chunk starts.
CHUNKED = MIXED + [(1, 60), (12, 58), (1, 24), (1, 25), (9, 33)]


@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 100])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_chunked_local_attention(chunk, block_size, dtype, kernel_max_context, monkeypatch):
    """Chunk sizes below, equal to, not a multiple of and above the block size; the
    blocks before each request's first query's chunk hold NaN."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    case = make_case(CHUNKED, 4, 2, 16, block_size, dtype, seed=8)
    poison_before(case, CHUNKED, block_size, lambda q, s: (s - q) // chunk * chunk)
    spec = AttentionLayerSpec(4, 16, 2, 0.25, attention_chunk_size=chunk)
    out = run_backend(case, spec, block_size)
    ref = reference(case, CHUNKED, 4, 0.25, None, chunk=chunk)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 16, 16), (8, 2, 16, 4), (6, 1, 32, 8), (10, 2, 64, 5)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_attention_sinks(num_heads, num_kv_heads, head_size, block_size, dtype,
                         kernel_max_context, monkeypatch):
    """MHA, GQA, MQA, a padded group of 5; decodes, chunks after context, first chunks."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    requests = MIXED + [(1, 70)]
    case = make_case(requests, num_heads, num_kv_heads, head_size, block_size, dtype, seed=9)
    sinks = sink_logits(num_heads)
    scale = head_size**-0.5
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, scale, use_sinks=True)
    out = run_backend(case, spec, block_size, sinks)
    ref = reference(case, requests, num_heads, scale, None, sinks=sinks)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    # the sinks matter: without them the result is another one
    assert (reference(case, requests, num_heads, scale, None) - ref).abs().max() > 0.1


@pytest.mark.parametrize("window", [5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_sliding_window_with_sinks_and_soft_cap(window, dtype, kernel_max_context,
                                                monkeypatch):
    """GPT-OSS: windowed layers with sinks (the sink uncapped when scores are capped);
    blocks before each window hold NaN."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    requests = MIXED + [(1, 60), (12, 58)]
    case = make_case(requests, 8, 2, 16, 4, dtype, seed=10)
    poison_before(case, requests, 4, lambda q, s: max(0, s - q - window + 1))
    sinks = sink_logits(8)
    for cap in (None, 2.0):
        spec = AttentionLayerSpec(8, 16, 2, 0.25, sliding_window=window, logits_soft_cap=cap,
                                  use_sinks=True)
        out = run_backend(case, spec, 4, sinks)
        ref = reference(case, requests, 8, 0.25, window, soft_cap=cap, sinks=sinks)
        atol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def test_chunked_attention_with_sinks_and_long_decodes():
    """Both at once on long contexts (the C kernel splits their keys: the sink is added
    once, at the merge)."""
    requests = [(1, 2000), (1, 1500), (1, 3)]
    case = make_case(requests, 4, 1, 16, 16, torch.float32, seed=12)
    poison_before(case, requests, 16, lambda q, s: (s - 1) // 700 * 700)
    sinks = sink_logits(4)
    spec = AttentionLayerSpec(4, 16, 1, 0.25, attention_chunk_size=700, use_sinks=True)
    out = run_backend(case, spec, 16, sinks)
    ref = reference(case, requests, 4, 0.25, None, chunk=700, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_long_prefills_with_sinks_go_a_block_of_rows_at_a_time(monkeypatch):
    """The torch-op path materializes capped / sink scores for at most a budget of
    elements: a long chunk is cut into row blocks, with the same result."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", 20)
    monkeypatch.setattr(cpu_attention, "EXPLICIT_SCORES_BUDGET", 8 * 60 * 4)  # 16 rows
    requests = [(50, 60), (1, 30), (40, 40)]
    case = make_case(requests, 4, 2, 16, 8, torch.float32, seed=13)
    sinks = sink_logits(4)
    spec = AttentionLayerSpec(4, 16, 2, 0.25, attention_chunk_size=24, logits_soft_cap=4.0,
                              use_sinks=True)
    out = run_backend(case, spec, 8, sinks)
    ref = reference(case, requests, 4, 0.25, None, soft_cap=4.0, chunk=24, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_sinks_must_be_set_and_encoders_refuse_them():
    case = make_case([(1, 5)], 2, 1, 16, 4, torch.float32)
    spec = AttentionLayerSpec(2, 16, 1, 0.25, use_sinks=True)
    with pytest.raises(ValueError, match="sinks"):
        run_backend(case, spec, 4)
    with pytest.raises(ValueError, match="one logit per query head"):
        run_backend(case, spec, 4, torch.zeros(3))
    for bad in (AttentionLayerSpec(2, 16, 1, 0.25, causal=False, use_sinks=True),
                AttentionLayerSpec(2, 16, 1, 0.25, causal=False, attention_chunk_size=4)):
        assert "encoder" in CPUAttentionBackend.validate(bad, 4)
    assert CPUAttentionBackend.supports_attention_sinks()
    assert CPUAttentionBackend.supports_chunked_local_attention()


def image_key_ends(requests, blocks: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """Per token, position + 1, or its image's end for the tokens of an image block
    ``(start, end)`` (positions) of request ``r``."""
    ends = []
    for r, (q_len, seq_len) in enumerate(requests):
        pos = torch.arange(seq_len - q_len, seq_len)
        end = pos + 1
        for lo, hi in blocks.get(r, ()):
            end = torch.where((pos >= lo) & (pos < hi), torch.tensor(hi), end)
        ends.append(end)
    return torch.cat(ends).to(torch.int64)


@pytest.mark.parametrize("window", [None, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_image_tokens_attend_both_ways_within_their_image(window, dtype, kernel_max_context,
                                                           monkeypatch):
    """AttentionBatch.key_ends_cpu (Gemma 3): an image's tokens see each other both ways,
    the window still counts back from each token's own position; other requests of the
    step (decodes, plain chunks) stay causal."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    requests = [(1, 33), (16, 40), (7, 7), (1, 17), (12, 30)]
    blocks = {1: [(27, 33), (35, 38)], 2: [(2, 5)], 4: [(18, 30)]}
    case = make_case(requests, 4, 2, 16, 8, dtype, seed=5)
    ends = image_key_ends(requests, blocks)
    case.batch.key_ends_cpu = ends.numpy()
    spec = AttentionLayerSpec(4, 16, 2, 0.25, sliding_window=window)
    out = run_backend(case, spec, 8)
    ref = reference(case, requests, 4, 0.25, window, key_ends=ends)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    causal = reference(case, requests, 4, 0.25, window)
    assert not torch.allclose(ref, causal)  # the blocks change the result


def test_key_ends_past_the_context_are_refused():
    requests = [(4, 10)]
    case = make_case(requests, 4, 2, 16, 8, torch.float32)
    case.batch.key_ends_cpu = np.array([8, 11, 11, 11])
    with pytest.raises(ValueError, match="key_ends"):
        CPUAttentionBackend(block_size=8, device=CPU).build_metadata(case.batch)
