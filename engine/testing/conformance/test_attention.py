"""Attention backends (``engine.core.interfaces.attention``) against a float64 reference.

Every backend the platform offers runs two steps over a paged cache whose blocks are
scattered by a random block table, exactly as the model runner drives it
(``get_kv_cache_shape`` -> ``allocate_kv_cache`` -> ``build_metadata`` -> ``make_impl``
-> ``forward``): first the requests' history as prefills, then one mixed batch of a fresh
prefill, a chunked prefill over cached history and single-token decodes. The reference
sees only dense K/V, never the cache.

Clauses: ``[attention.varlen]`` (mixed prefill + decode batch, causal positions),
``[attention.paged]`` (K/V stored at ``slot_mapping`` and read back through
``block_tables``), ``[attention.gqa]`` (``num_kv_heads`` < ``num_heads``),
``[attention.sliding_window]``, ``[attention.cache_alloc]`` (zero-filled caches of
``get_kv_cache_shape``), ``[attention.sinks]`` (learned per-head sink logits in the
softmax denominator, ``impl.sinks``; alone and with a sliding window, as GPT-OSS uses
them) and ``[attention.chunked_local]`` (Llama 4's ``attention_chunk_size``: a query at
position ``p`` sees keys ``C * (p // C) ..= p``; a chunk size that is no multiple of the
block size). The last two are checked for every backend that opts in
(``supports_attention_sinks()`` / ``supports_chunked_local_attention()``), and skipped
only when none does.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

from engine.core.interfaces import AttentionBatch, AttentionLayerSpec
from engine.testing.reference import paged_attention_reference

NUM_HEADS = 4
# (query_len, seq_len) of the mixed step: fresh prefill, chunked prefill, decodes.
MIXED_STEP = [(5, 5), (3, 21), (1, 18), (1, 1), (1, 34)]
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# Per-head sink logits: one dominating the scores, one among them, one below, one off.
SINKS = (3.0, 0.25, -2.0, float("-inf"))
CHUNK_SIZE = 12  # no multiple of the block sizes tried: chunks start inside blocks


def _reference(query, keys, values, query_lens, scale, sliding_window=None,
               chunk_size=None, sinks=None) -> torch.Tensor:
    """``paged_attention_reference`` with the chunk mask and the sink column: float64,
    explicit masks, and each head's sink logit one more (value-less) softmax column."""
    if chunk_size is None and sinks is None:
        return paged_attention_reference(query, keys, values, query_lens, scale,
                                         sliding_window)
    num_heads = query.shape[1]
    out, start = [], 0
    for k, v, qlen in zip(keys, values, query_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = query[start:start + qlen].detach().to("cpu", torch.float64)
        kk = k.detach().to("cpu", torch.float64).repeat_interleave(group, dim=1)
        vv = v.detach().to("cpu", torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        pos = torch.arange(seq_len - qlen, seq_len).unsqueeze(1)
        key_pos = torch.arange(seq_len).unsqueeze(0)
        allowed = key_pos <= pos
        if sliding_window is not None:
            allowed &= key_pos > pos - sliding_window
        if chunk_size is not None:
            allowed &= key_pos >= pos // chunk_size * chunk_size
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            column = torch.tensor(sinks, dtype=torch.float64)[:, None, None].expand(-1, qlen, 1)
            probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, vv))
        start += qlen
    return torch.cat(out, dim=0)


def _head_size(backend_cls) -> int:
    sizes = backend_cls.supported_head_sizes()
    if sizes is None or 32 in sizes:
        return 32
    return min(sizes, key=lambda s: abs(s - 32))


def _block_sizes(backend_cls) -> list[int]:
    sizes = backend_cls.supported_block_sizes()
    if sizes is None:
        return [16]
    return sorted(sizes)[:2]


def _batch(platform, requests, block_tables, block_size) -> AttentionBatch:
    device = platform.device()
    qlens = [q for q, _ in requests]
    seq_lens = np.array([s for _, s in requests], dtype=np.int32)
    qsl = np.zeros(len(requests) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(qlens)
    slots = []
    for r, (q, s) in enumerate(requests):
        for pos in range(s - q, s):
            slots.append(int(block_tables[r, pos // block_size]) * block_size + pos % block_size)
    return AttentionBatch(
        num_reqs=len(requests),
        num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def check_attention_backend(
    platform,
    backend_cls,
    *,
    num_kv_heads: int = 2,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    seed: int = 0,
    attention_chunk_size: int | None = None,
    sinks: bool = False,
) -> None:
    """Run the two-step paged check on ``backend_cls``; AssertionError naming the clause.

    ``sinks``: the layer has learned sinks (``SINKS``, handed over as ``impl.sinks``);
    ``attention_chunk_size``: chunked local attention. Callable directly (a vendor's own
    test, or a test of the kit itself)."""
    head_size = _head_size(backend_cls)
    plain = AttentionLayerSpec(NUM_HEADS, head_size, num_kv_heads,
                               1.0 / math.sqrt(head_size), sliding_window=sliding_window)
    why = backend_cls.validate(plain, block_size)
    if why is not None:
        pytest.skip(f"backend {backend_cls.name!r} refuses this layer: {why}")
    spec = dataclasses.replace(plain, attention_chunk_size=attention_chunk_size,
                               use_sinks=sinks)
    clauses = (["[attention.sinks]"] if sinks else []) + (
        ["[attention.chunked_local]"] if attention_chunk_size else [])
    why = backend_cls.validate(spec, block_size)
    if why is not None:  # it opted in (or the case would not run): refusing breaks that
        raise AssertionError(
            f"{''.join(clauses)} backend {backend_cls.name!r} claims support but its "
            f"validate() refuses the layer: {why}")
    device = platform.device()
    gen = torch.Generator().manual_seed(seed)
    clause = "".join(clauses) or ("[attention.sliding_window]" if sliding_window else (
        "[attention.gqa]" if num_kv_heads < NUM_HEADS else "[attention.varlen]"))
    where = (f"backend {backend_cls.name!r}, {dtype}, block_size {block_size}, "
             f"kv heads {num_kv_heads}/{NUM_HEADS}, window {sliding_window}, "
             f"chunk {attention_chunk_size}, sinks {SINKS if sinks else None}")

    # Random block table: every request gets distinct, shuffled physical blocks.
    blocks_per_req = [-(-s // block_size) for _, s in MIXED_STEP]
    width = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks - 1, generator=gen).numpy() + 1  # keep block 0 free
    block_tables = np.zeros((len(MIXED_STEP), width), dtype=np.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = perm[used:used + n]
        used += n

    backend = backend_cls(block_size, device)
    shape = backend_cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    caches = backend.allocate_kv_cache(tuple(shape), dtype, 1)
    assert len(caches) == 1 and tuple(caches[0].shape) == tuple(shape), (
        f"[attention.cache_alloc] allocate_kv_cache returned {len(caches)} tensors of "
        f"shape {[tuple(c.shape) for c in caches]}, expected one of {tuple(shape)} ({where})")
    kv_cache = caches[0]
    assert kv_cache.dtype == dtype and kv_cache.device.type == device.type, (
        f"[attention.cache_alloc] cache is {kv_cache.dtype} on {kv_cache.device} ({where})")
    assert not torch.any(kv_cache.float() != 0), (
        f"[attention.cache_alloc] allocate_kv_cache must return zero-filled caches ({where})")
    impl = backend.make_impl(spec)
    sink_logits = SINKS[:NUM_HEADS] if sinks else None
    if sinks:  # what the attention layer hands over once its weights are loaded
        impl.sinks = torch.tensor(sink_logits, dtype=torch.float32, device=device)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32)).to(dtype)

    hist_k = [rand(s, num_kv_heads, head_size) for _, s in MIXED_STEP]
    hist_v = [rand(s, num_kv_heads, head_size) for _, s in MIXED_STEP]

    def run_step(step_reqs, rows, step_clause):
        # step_reqs: (query_len, seq_len) per request in ``rows`` (indices into MIXED_STEP)
        batch = _batch(platform, step_reqs, block_tables[rows], block_size)
        q = rand(batch.num_tokens, NUM_HEADS, head_size)
        k = torch.cat([hist_k[r][s - ql:s] for r, (ql, s) in zip(rows, step_reqs)])
        v = torch.cat([hist_v[r][s - ql:s] for r, (ql, s) in zip(rows, step_reqs)])
        metadata = backend.build_metadata(batch)
        out = impl.forward(q.to(device), k.to(device), v.to(device), kv_cache, metadata)
        platform.synchronize()
        assert tuple(out.shape) == (batch.num_tokens, NUM_HEADS, head_size), (
            f"{step_clause} output shape {tuple(out.shape)}, expected "
            f"{(batch.num_tokens, NUM_HEADS, head_size)} ({where})")
        expected = _reference(
            q, [hist_k[r][:s] for r, (_, s) in zip(rows, step_reqs)],
            [hist_v[r][:s] for r, (_, s) in zip(rows, step_reqs)],
            [ql for ql, _ in step_reqs], spec.scale, sliding_window,
            attention_chunk_size, sink_logits)
        err = (out.detach().to("cpu", torch.float64) - expected).abs().max().item()
        tol = TOLERANCE.get(dtype, 3e-2)
        assert err <= tol, (
            f"{step_clause} attention output differs from the float64 reference by "
            f"{err:.3g} (tolerance {tol:g}) ({where})")

    # Step 1: the history of every request that has one, as prefills.
    hist_rows = [r for r, (q, s) in enumerate(MIXED_STEP) if s > q]
    run_step([(MIXED_STEP[r][1] - MIXED_STEP[r][0],) * 2 for r in hist_rows], hist_rows,
             f"{clause}[attention.paged] (history prefill)")
    # Step 2: the mixed batch, reading the history back from the paged cache.
    run_step(list(MIXED_STEP), list(range(len(MIXED_STEP))),
             f"{clause}[attention.paged] (mixed prefill + decode)")


def _backends(platform):
    backends = platform.attention_backends()
    assert backends, "[platform.attention_backends] the platform offers no attention backend"
    return backends


def _run_all(platform, cases) -> None:
    """Run ``cases`` ((backend_cls, kwargs) pairs). The preferred (first) backend must run
    every case it validates; a fallback backend that raises an error other than a failed
    check (e.g. a GPU kernel offered on a host without that GPU) is reported as a skip
    naming ``[attention.usable]``, since the engine only takes it when selected by name."""
    preferred = platform.attention_backends()[0]
    unusable, ran = [], 0
    for backend_cls, kwargs in cases:
        try:
            check_attention_backend(platform, backend_cls, **kwargs)
            ran += 1
        except (AssertionError, pytest.skip.Exception, pytest.fail.Exception):
            raise
        except Exception as exc:  # noqa: BLE001
            if backend_cls is preferred:
                raise AssertionError(
                    f"[attention.usable] preferred backend {backend_cls.name!r} raised "
                    f"{type(exc).__name__}: {exc}") from exc
            unusable.append(f"{backend_cls.name}: {type(exc).__name__}: {exc}")
    if unusable:
        message = ("[attention.usable] fallback backend(s) cannot run on this host "
                   "(validate() accepted the layer): " + "; ".join(sorted(set(unusable))))
        if ran:
            warnings.warn(message, stacklevel=2)
            return
        pytest.skip("[attention.usable] fallback backend(s) cannot run on this host "
                    "(validate() accepted the layer): " + "; ".join(sorted(set(unusable))))


def _dtypes(platform):
    wanted = [d for d in (torch.float32, torch.bfloat16) if d in platform.supported_dtypes()]
    return wanted or platform.supported_dtypes()[:1]


@pytest.mark.conformance("attention.varlen", "attention.gqa", "attention.paged")
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=lambda kv: f"kv{kv}")
def test_varlen_paged_attention(engine_platform, num_kv_heads):
    """[attention.varlen] [attention.gqa] [attention.paged] mixed prefill/decode batches
    over a randomly paged cache, MHA and GQA (4 query heads over 4, 2, 1 KV heads), for
    every backend, block size and dtype (float32, bfloat16) it supports."""
    _run_all(engine_platform, [
        (backend_cls, dict(num_kv_heads=num_kv_heads, block_size=block_size, dtype=dtype))
        for backend_cls in _backends(engine_platform)
        for block_size in _block_sizes(backend_cls)
        for dtype in _dtypes(engine_platform)])


@pytest.mark.conformance("attention.sliding_window")
def test_sliding_window_attention(engine_platform):
    """[attention.sliding_window] a window of 7 keys, for every backend that claims
    ``supports_sliding_window()``."""
    cases = [(b, dict(num_kv_heads=2, block_size=_block_sizes(b)[0], sliding_window=7))
             for b in _backends(engine_platform) if b.supports_sliding_window()]
    if not cases:
        pytest.skip("no attention backend of the platform supports sliding windows")
    _run_all(engine_platform, cases)


@pytest.mark.conformance("attention.sinks")
@pytest.mark.parametrize("sliding_window", [None, 7], ids=["full", "window7"])
def test_attention_sinks(engine_platform, sliding_window):
    """[attention.sinks] per-head sink logits (``impl.sinks``, float32 [num_heads]) join
    each row's softmax denominator without a value, alone and with a sliding window
    (GPT-OSS), GQA, for every backend that claims ``supports_attention_sinks()``, every
    block size and dtype it supports."""
    cases = [(b, dict(num_kv_heads=2, block_size=block_size, dtype=dtype, sinks=True,
                      sliding_window=sliding_window))
             for b in _backends(engine_platform) if b.supports_attention_sinks()
             and (sliding_window is None or b.supports_sliding_window())
             for block_size in _block_sizes(b) for dtype in _dtypes(engine_platform)]
    if not cases:
        pytest.skip("no attention backend of the platform supports attention sinks"
                    + ("" if sliding_window is None else " with a sliding window"))
    _run_all(engine_platform, cases)


@pytest.mark.conformance("attention.chunked_local")
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_chunked_local_attention(engine_platform, sinks):
    """[attention.chunked_local] each query attends only within its chunk of
    ``CHUNK_SIZE`` positions (chunks start inside cache blocks), GQA, for every backend
    that claims ``supports_chunked_local_attention()`` (with sinks too where it claims
    both)."""
    cases = [(b, dict(num_kv_heads=2, block_size=block_size, dtype=dtype, sinks=sinks,
                      attention_chunk_size=CHUNK_SIZE))
             for b in _backends(engine_platform) if b.supports_chunked_local_attention()
             and (not sinks or b.supports_attention_sinks())
             for block_size in _block_sizes(b) for dtype in _dtypes(engine_platform)]
    if not cases:
        pytest.skip("no attention backend of the platform supports chunked local attention"
                    + (" with sinks" if sinks else ""))
    _run_all(engine_platform, cases)
