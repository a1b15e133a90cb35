"""CPU multi-head latent attention (engine.plugins.cpu.mla_attention) against float64.

The reference keeps every request's latent entries as a dense ``[seq_len, D]`` tensor,
never looks at the paged cache, and computes multi-query causal attention per request
in float64: scores over all ``D`` dims, values the entries' first ``L`` dims. The
backend sees only the paged cache (context entries written beforehand into randomly
scattered blocks; every other slot, the tails of used blocks included, NaN) and this
step's new entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.core.interfaces import AttentionBatch, AttentionLayerSpec, GraphCaptureError
from engine.model_executor.decode_graphs import DecodeGraphs
from engine.model_executor.forward_context import get_forward_context
from engine.model_executor.input_batch import StepIndices
from engine.model_executor.model_runner import KVCacheSpec
from engine.plugins.cpu import mla_attention
from engine.plugins.cpu.attention import CPUAttentionBackend, CPUAttentionImpl
from engine.plugins.cpu.graphs import CPUGraphCapturer
from engine.plugins.cpu.mla_attention import CPUMLAAttentionImpl

CPU = torch.device("cpu")


@dataclass
class MLACase:
    backend: CPUAttentionBackend
    batch: AttentionBatch
    spec: AttentionLayerSpec
    kv_cache: torch.Tensor  # [NB, BS, D]
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, 1, D] the new entries
    entries: list[torch.Tensor]  # per request [seq_len, D], every position (cache dtype)
    slots: list[torch.Tensor]  # per request, the slot of every position
    requests: list[tuple[int, int]]


def make_case(
    requests: list[tuple[int, int]],  # (query_len, seq_len)
    num_heads: int,
    lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    skip_rows: tuple[int, ...] = (),
) -> MLACase:
    """Context entries stored, new ones given as ``key``. ``skip_rows``: new tokens whose
    slot is -1 (their entry already cached, as after a prefix hit): stored beforehand,
    and their ``key`` row is garbage that must not be written."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    entry = lora_rank + rope_dim
    nblocks = [math.ceil(s / block_size) for _, s in requests]
    num_blocks = sum(nblocks) + 3  # never used: stay NaN
    perm = torch.randperm(num_blocks, generator=gen)
    backend = CPUAttentionBackend(block_size=block_size, device=CPU)
    shape = backend.get_mla_kv_cache_shape(num_blocks, block_size, entry)
    kv_cache = backend.allocate_kv_cache(shape, cache_dtype, 1)[0]
    kv_cache.fill_(float("nan"))
    flat = kv_cache.view(-1, entry)
    unused = int(perm[-1])
    width = max(nblocks) + 1  # a padding column: an unused (NaN) block
    block_tables = torch.full((len(requests), width), unused, dtype=torch.int32)
    queries, keys, slot_mapping, entries, slots_all = [], [], [], [], []
    qsl, used = [0], 0
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = perm[used : used + nblocks[r]]
        used += nblocks[r]
        block_tables[r, : nblocks[r]] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        e = torch.randn(seq_len, entry, generator=gen).to(cache_dtype)
        ctx = seq_len - q_len
        flat[slots[:ctx]] = e[:ctx]
        queries.append(torch.randn(q_len, num_heads, entry, generator=gen).to(dtype))
        keys.append(e[ctx:].to(dtype).unsqueeze(1))
        slot_mapping.append(slots[ctx:])
        entries.append(e)
        slots_all.append(slots)
        qsl.append(qsl[-1] + q_len)
    slot_mapping = torch.cat(slot_mapping).to(torch.int64)
    key = torch.cat(keys)
    for row in skip_rows:
        flat[slot_mapping[row]] = key[row, 0].to(cache_dtype)
        slot_mapping[row] = -1
        key[row] = 1e4  # would spoil the output if it were stored
    seq_lens = np.array([s for _, s in requests], dtype=np.int32)
    qsl = np.array(qsl, dtype=np.int32)
    batch = AttentionBatch(
        num_reqs=len(requests),
        num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(q for q, _ in requests),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    spec = AttentionLayerSpec(num_heads, entry, 1, entry**-0.5, kv_lora_rank=lora_rank)
    return MLACase(backend, batch, spec, kv_cache, torch.cat(queries), key, entries,
                   slots_all, requests)


def reference(case: MLACase) -> torch.Tensor:
    """float64 MLA from the dense per-request entries: [T, H, L]."""
    lora = case.spec.kv_lora_rank
    outs, start = [], 0
    for (q_len, seq_len), e in zip(case.requests, case.entries):
        q = case.query[start : start + q_len].double()
        start += q_len
        e = e.double()
        scores = torch.einsum("qhd,sd->hqs", q, e) * case.spec.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqs,sl->qhl", scores.softmax(-1), e[:, :lora]))
    return torch.cat(outs)


def run(case: MLACase) -> torch.Tensor:
    assert case.backend.validate(case.spec, case.backend.block_size) is None
    impl = case.backend.make_impl(case.spec)
    assert isinstance(impl, CPUMLAAttentionImpl)
    metadata = case.backend.build_metadata(case.batch)
    return impl.forward(case.query, case.key, None, case.kv_cache, metadata)


def check_cache(case: MLACase) -> None:
    """Every position's entry is at its slot; every other slot is still NaN."""
    flat = case.kv_cache.view(-1, case.spec.head_size)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for e, slots in zip(case.entries, case.slots):
        torch.testing.assert_close(flat[slots], e, atol=0, rtol=0)
        written[slots] = True
    assert flat[~written].isnan().all()


ATOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2}

PREFILL = [(7, 7), (19, 19), (1, 1)]
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 40), (1, 3)]
# decodes, a first chunk, chunks after cached context (prefix hits), a 1-token request
MIXED = [(1, 1), (7, 7), (1, 33), (5, 21), (1, 16), (16, 40), (1, 17), (2, 9)]


@pytest.mark.parametrize("requests", [PREFILL, DECODE, MIXED], ids=["prefill", "decode", "mixed"])
@pytest.mark.parametrize("block_size", [16, 4, 8])
@pytest.mark.parametrize("num_heads", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(requests, block_size, num_heads, dtype):
    case = make_case(requests, num_heads, 16, 8, block_size, dtype, seed=block_size)
    out = run(case)
    ref = reference(case)
    assert out.shape == ref.shape == (case.query.shape[0], num_heads, 16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=ATOL[dtype], rtol=0)
    check_cache(case)


@pytest.mark.parametrize("lora_rank,rope_dim", [(32, 8), (20, 12), (64, 16)])
def test_entry_widths(lora_rank, rope_dim):
    case = make_case(MIXED, 3, lora_rank, rope_dim, 8, torch.float32, seed=lora_rank)
    torch.testing.assert_close(run(case).double(), reference(case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_float64_and_wide_activations_over_a_bf16_cache(dtype):
    """float32 (or float64) queries over a bf16 cache: new entries are rounded into the
    cache, read back widened, and the output keeps the query dtype."""
    cache_dtype = torch.bfloat16 if dtype == torch.float32 else torch.float64
    case = make_case(MIXED, 4, 16, 8, 8, dtype, cache_dtype=cache_dtype, seed=3)
    out = run(case)
    assert out.dtype == dtype and case.kv_cache.dtype == cache_dtype
    torch.testing.assert_close(out.double(), reference(case), atol=ATOL[dtype], rtol=0)
    check_cache(case)


def test_skipped_slots_are_not_written_and_cached_entries_are_read():
    case = make_case(MIXED, 4, 16, 8, 4, torch.float32, seed=5, skip_rows=(0, 3, 12))
    torch.testing.assert_close(run(case).double(), reference(case), atol=1e-5, rtol=0)
    check_cache(case)


def test_layers_share_the_step_plan():
    """Several MLA layers (each its own cache) in one step: the index plan is built once
    and every layer attends over its own entries."""
    a = make_case(MIXED, 4, 16, 8, 8, torch.float32, seed=6)
    b = make_case(MIXED, 4, 16, 8, 8, torch.float32, seed=6)
    b.kv_cache.mul_(0.5)
    b.key.mul_(0.5)
    b.entries = [e * 0.5 for e in b.entries]
    metadata = a.backend.build_metadata(a.batch)
    layers = [a.backend.make_impl(a.spec) for _ in range(2)]
    out_a = layers[0].forward(a.query, a.key, None, a.kv_cache, metadata)
    plan = metadata.mla_plan
    out_b = layers[1].forward(b.query, b.key, None, b.kv_cache, metadata)
    assert metadata.mla_plan is plan
    torch.testing.assert_close(out_a.double(), reference(a), atol=1e-5, rtol=0)
    torch.testing.assert_close(out_b.double(), reference(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 4])
def test_cache_holds_one_entry_per_token(dtype, block_size):
    entry = 24
    backend = CPUAttentionBackend(block_size=block_size, device=CPU)
    shape = backend.get_mla_kv_cache_shape(10, block_size, entry)
    assert shape == (10, block_size, entry)
    caches = backend.allocate_kv_cache(shape, dtype, 3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for cache in caches:
        assert cache.untyped_storage().nbytes() == 10 * block_size * entry * itemsize
        assert not cache.any()  # zero-filled
    spec = KVCacheSpec(num_layers=3, num_kv_heads=1, head_size=entry, dtype=dtype, mla=True)
    assert spec.cache_shape(backend, 10, block_size) == shape
    assert spec.block_bytes(block_size) == 3 * block_size * entry * itemsize


def test_validation_and_dispatch():
    backend = CPUAttentionBackend(block_size=16, device=CPU)
    mla = AttentionLayerSpec(16, 576, 1, 0.1, kv_lora_rank=512)
    assert backend.validate(mla, 16) is None
    assert isinstance(backend.make_impl(mla), CPUMLAAttentionImpl)
    mha = AttentionLayerSpec(4, 16, 2, 0.1)
    assert isinstance(backend.make_impl(mha), CPUAttentionImpl)
    windowed = AttentionLayerSpec(16, 576, 1, 0.1, sliding_window=64, kv_lora_rank=512)
    capped = AttentionLayerSpec(16, 576, 1, 0.1, logits_soft_cap=30.0, kv_lora_rank=512)
    for spec in (windowed, capped):
        assert "MLA" in backend.validate(spec, 16)
        with pytest.raises(ValueError, match="MLA"):
            backend.make_impl(spec)
    wrong_heads = AttentionLayerSpec(16, 576, 2, 0.1, kv_lora_rank=512)
    assert "latent" in backend.validate(wrong_heads, 16)


def _graph_batch(case: MLACase) -> AttentionBatch:
    """The case's decode step as the runner passes it to build_graph_metadata."""
    b = case.batch
    return AttentionBatch(
        num_reqs=b.num_reqs, num_tokens=b.num_tokens,
        query_start_loc=b.query_start_loc, seq_lens=b.seq_lens.to(torch.int64),
        block_tables=b.block_tables.to(torch.int64), slot_mapping=b.slot_mapping,
        max_query_len=1, max_seq_len=b.max_seq_len,
    )


def test_graph_capture_records_decode_only_steps(engine_kernels):
    """A decode-only step on the C kernels records into a forward graph (store + decode,
    nothing run at capture); its replay stores the entries and matches float64."""
    case = make_case(DECODE, 4, 16, 8, 8, torch.float32, seed=8)
    before = case.kv_cache.clone()
    impl = case.backend.make_impl(case.spec)
    assert impl.kernels is not None
    metadata = case.backend.build_graph_metadata(_graph_batch(case))
    graph = CPUGraphCapturer(engine_kernels).capture(
        lambda: impl.forward(case.query, case.key, None, case.kv_cache, metadata))
    assert graph._plan.kernel_names == ["mla_write_entries", "mla_decode_attention"]
    torch.testing.assert_close(case.kv_cache, before, atol=0, rtol=0, equal_nan=True)
    assert metadata.mla_plan is None
    with torch.inference_mode():
        out = graph.replay()
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=0)
    check_cache(case)


def test_graph_capture_is_refused_before_anything_is_stored(engine_kernels, monkeypatch):
    """On the torch path (no C kernels) a capture raises GraphCaptureError (so the runner
    runs eagerly) and stores nothing; without the layer's own check the capturer's
    torch-op guard refuses too. The graph metadata still serves an eager forward."""
    case = make_case(DECODE, 4, 16, 8, 8, torch.float32, seed=8)
    before = case.kv_cache.clone()
    impl = CPUMLAAttentionImpl(case.spec, kernels=None)
    metadata = case.backend.build_graph_metadata(_graph_batch(case))
    capturer = CPUGraphCapturer(engine_kernels)

    def forward():
        return impl.forward(case.query, case.key, None, case.kv_cache, metadata)

    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="MLA"):
        capturer.capture(forward)
    monkeypatch.setattr(mla_attention, "_capturing", lambda: False)
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="torch op"):
        capturer.capture(forward)
    torch.testing.assert_close(case.kv_cache, before, atol=0, rtol=0, equal_nan=True)
    assert metadata.mla_plan is None
    torch.testing.assert_close(forward().double(), reference(case), atol=1e-5, rtol=0)
    check_cache(case)


def test_mixed_step_capture_is_refused(engine_kernels):
    case = make_case(MIXED, 4, 16, 8, 8, torch.float32, seed=3)
    before = case.kv_cache.clone()
    impl = case.backend.make_impl(case.spec)
    metadata = case.backend.build_metadata(case.batch)
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="decode-only"):
        CPUGraphCapturer(engine_kernels).capture(
            lambda: impl.forward(case.query, case.key, None, case.kv_cache, metadata))
    torch.testing.assert_close(case.kv_cache, before, atol=0, rtol=0, equal_nan=True)


class _MLAModel(torch.nn.Module):
    """A model whose only computation is one MLA layer over precomputed inputs."""

    def __init__(self, impl, query, key):
        super().__init__()
        self.impl, self.query, self.key = impl, query, key

    def forward(self, input_ids, positions):
        ctx = get_forward_context()
        n = input_ids.shape[0]
        out = self.impl.forward(self.query[:n], self.key[:n], None, ctx.kv_caches[0],
                                ctx.attn_metadata)
        return out.flatten(1)


def _decode_graphs(case: MLACase, impl, engine_kernels) -> tuple[DecodeGraphs, StepIndices]:
    model = _MLAModel(impl, case.query, case.key)
    graphs = DecodeGraphs(CPUGraphCapturer(engine_kernels), model, case.backend,
                          [case.kv_cache], max_batch_size=8,
                          max_blocks_per_seq=case.batch.block_tables.shape[1], device=CPU)
    n = case.batch.num_reqs
    step = StepIndices(
        rows=np.arange(n), num_scheduled=np.ones(n, dtype=np.int32),
        query_start_loc=case.batch.query_start_loc_cpu, positions=np.zeros(n, dtype=np.int64),
        input_ids=np.zeros(n, dtype=np.int64), slot_mapping=case.batch.slot_mapping.numpy(),
        seq_lens=case.batch.seq_lens_cpu, block_tables=case.batch.block_tables.numpy(),
        sample_batch_idx=np.arange(n), logits_indices=np.arange(n),
        max_query_len=1, max_seq_len=case.batch.max_seq_len,
    )
    return graphs, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graphs_replay_mla_steps(engine_kernels, dtype):
    """The runner's DecodeGraphs capture a decode-only MLA step on the C kernels and
    replay it: same output as float64, entries stored."""
    case = make_case(DECODE, 5, 16, 8, 8, dtype, seed=9)
    graphs, step = _decode_graphs(case, case.backend.make_impl(case.spec), engine_kernels)
    assert graphs.covers(step)
    with torch.inference_mode():
        out = graphs.forward(step)
    assert out is not None and graphs.captured_sizes == [case.batch.num_reqs]
    torch.testing.assert_close(out.view(-1, 5, 16).double(), reference(case),
                               atol=ATOL[dtype], rtol=0)
    check_cache(case)


def test_decode_graphs_fall_back_to_eager_steps(engine_kernels, caplog):
    """Without the C kernels the capture of an MLA forward is refused once per batch
    size, with a log line; the step then runs eagerly and matches the reference."""
    case = make_case(DECODE, 4, 16, 8, 8, torch.float32, seed=9)
    impl = CPUMLAAttentionImpl(case.spec, kernels=None)
    graphs, step = _decode_graphs(case, impl, engine_kernels)
    assert graphs.covers(step)
    before = case.kv_cache.clone()
    with torch.inference_mode(), caplog.at_level("INFO", "engine.model_executor.decode_graphs"):
        assert graphs.forward(step) is None
    assert "run eagerly" in caplog.text and "MLA" in caplog.text
    assert not graphs.covers(step) and graphs.captured_sizes == []
    torch.testing.assert_close(case.kv_cache, before, atol=0, rtol=0, equal_nan=True)
    metadata = case.backend.build_metadata(case.batch)
    out = impl.forward(case.query, case.key, None, case.kv_cache, metadata)  # the eager step
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=0)
