"""fp8 KV caches in the Triton kernels (engine.kernels.fp8_kv), under TRITON_INTERPRET=1.

The conversions are exhaustive (every code; every code's neighbourhood and ties for the
rounding) against torch's own fp8 values and ``quantize_kv``; reshape_and_cache must
store ``quantize_kv`` bit for bit; unified attention (single pass and split-KV, decodes
and prefill chunks) is held to a float64 reference on the dequantized cache values, with
every unused slot a NaN code that a masked load never reads.
"""

from __future__ import annotations

import dataclasses
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from attention_reference import make_batch, reference_attention

from engine.core.interfaces.attention import (
    AttentionBatch,
    AttentionLayerSpec,
    dequantize_kv,
    quantize_kv,
)
from engine.kernels.fp8_kv import E4M3, E5M2, cache_format, float_to_fp8, fp8_to_float
from engine.kernels.reshape_and_cache import reshape_and_cache
from engine.kernels.triton_backend import TritonAttentionBackend
from engine.kernels.unified_attention import unified_attention

F8_E4M3, F8_E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {F8_E4M3: E4M3, F8_E5M2: E5M2}
SCALES = {F8_E4M3: (0.043, 1.7), F8_E5M2: (2.5, 0.31)}  # (k_scale, v_scale)
NAMES = {F8_E4M3: "fp8_e4m3", F8_E5M2: "fp8_e5m2"}
DTYPE_OF = {name: dtype for dtype, name in NAMES.items()}


@triton.jit
def _round_trip_kernel(x_ptr, codes_ptr, values_ptr, n, scale, FMT: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(codes_ptr + offs, float_to_fp8(x / scale, FMT), mask=mask)
    codes = tl.load(codes_ptr + offs, mask=mask, other=0)
    tl.store(values_ptr + offs, fp8_to_float(codes, FMT), mask=mask)


def _round_trip(x: torch.Tensor, dtype, scale: float = 1.0):
    n = x.numel()
    codes, values = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    _round_trip_kernel[(triton.cdiv(n, 4096),)](x, codes, values, n, scale,
                                                FMT=FORMATS[dtype], BLOCK=4096)
    return codes, values


def _sweep(dtype) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randn(6000, generator=gen) * torch.logspace(-12, 6, 6000)
    edges = torch.tensor([math.inf, -math.inf, 1e30, -1e30, 448.0, 464.0, 57344.0, 61440.0,
                          1e-45, 0.0, -0.0, math.nan])
    return torch.cat([finite, mids, mids.nextafter(torch.tensor(math.inf)),
                      mids.nextafter(torch.tensor(-math.inf)), rnd, edges])


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, fp8_to_float(tl.load(codes_ptr + offs), FMT))


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
def test_every_code_decodes_to_its_value(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(dtype).float()
    out = torch.empty(256)
    _decode_kernel[(1,)](codes, out, FMT=FORMATS[dtype])
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(out.signbit(), want.signbit())  # -0.0 too


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_encoding_is_quantize_kv_bit_for_bit(dtype, scale):
    x = _sweep(dtype)
    codes, values = _round_trip(x, dtype, scale)
    want = quantize_kv(x, scale, dtype)
    nan = x.isnan()
    assert torch.equal(codes[~nan], want.view(torch.uint8)[~nan])
    assert values[nan].isnan().all()
    assert torch.equal(values[~nan], want.float()[~nan])


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_quantizes_and_skips_negative_slots(dtype, src):
    gen = torch.Generator().manual_seed(5)
    blocks, block_size, heads, head_size, tokens = 5, 4, 3, 24, 9
    kv = (torch.randn(tokens, 2, heads, head_size, generator=gen) * 30).to(src)
    kv[0, 0, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, 0.0]).to(src)  # saturation, underflow
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[[1, 4]] = -1
    cache = torch.full((2, blocks, block_size, heads, head_size), 0x7F,
                       dtype=torch.uint8).view(dtype)  # NaN codes: untouched slots stay
    k_scale, v_scale = SCALES[dtype]
    expected = cache.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, heads, head_size)
    flat[0, slots[keep]] = quantize_kv(key[keep], k_scale, dtype)
    flat[1, slots[keep]] = quantize_kv(value[keep], v_scale, dtype)
    reshape_and_cache(key, value, cache, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match="positive scales"):
        reshape_and_cache(key, value, cache, slots, 0.0, 1.0)


def _fp8_batch(batch, dtype, k_scale, v_scale):
    """The batch over an fp8 cache: its stored K/V quantized (NaN slots: NaN codes), the
    reference K/V the dequantized codes of every position."""
    cache = torch.stack([quantize_kv(batch.kv_cache[0], k_scale, dtype),
                         quantize_kv(batch.kv_cache[1], v_scale, dtype)])
    keys = [dequantize_kv(quantize_kv(k, k_scale, dtype), k_scale) for k in batch.keys]
    values = [dequantize_kv(quantize_kv(v, v_scale, dtype), v_scale) for v in batch.values]
    return dataclasses.replace(batch, kv_cache=cache, keys=keys, values=values)


def _check(out, batch, scale, window=None, soft_cap=None):
    expected = reference_attention(batch, scale, window, soft_cap)
    assert not out.isnan().any()
    magnitude = max(float(v.abs().max()) for v in batch.values)
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * magnitude, rtol=0)


MIXED = [(5, 21), (1, 40), (7, 7), (1, 1), (3, 19)]
DECODES = [(1, 50), (1, 17), (1, 3)]


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
@pytest.mark.parametrize(
    "requests,q_dtype,splits,extra",
    [
        pytest.param(MIXED, torch.float32, 1, {}, id="mixed"),
        pytest.param(MIXED, torch.bfloat16, 1, {"sliding_window": 6}, id="mixed-bf16-window"),
        pytest.param(DECODES, torch.float32, 3, {}, id="decodes-split3"),
        pytest.param(MIXED, torch.float32, 1, {"logits_soft_cap": 2.0}, id="softcap"),
    ],
)
def test_unified_attention_over_an_fp8_cache(dtype, requests, q_dtype, splits, extra):
    gen = torch.Generator().manual_seed(11)
    k_scale, v_scale = SCALES[dtype]
    batch = make_batch(requests, 4, 2, 32, 8, torch.float32, gen)
    batch = _fp8_batch(batch, dtype, k_scale, v_scale)
    batch = dataclasses.replace(batch, q=batch.q.to(q_dtype))
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens,
                      batch.block_tables, batch.max_query_len, batch.max_seq_len, 0.3,
                      num_kv_splits=splits, block_m=16, tile_size=16, k_scale=k_scale,
                      v_scale=v_scale, **extra)
    _check(out, batch, 0.3, extra.get("sliding_window"), extra.get("logits_soft_cap"))


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
@pytest.mark.parametrize(
    "requests,splits,extra",
    [
        pytest.param(MIXED, 1, {"sliding_window": 6}, id="window-sinks"),
        pytest.param(DECODES, 3, {"attention_chunk_size": 12}, id="split3-chunk-sinks"),
    ],
)
def test_sinks_and_chunks_over_an_fp8_cache(dtype, requests, splits, extra):
    """A sink is a logit: it meets scores of the dequantized keys (k_scale folded into
    the softmax scale), and is not scaled by v_scale."""
    gen = torch.Generator().manual_seed(13)
    k_scale, v_scale = SCALES[dtype]
    batch = _fp8_batch(make_batch(requests, 4, 2, 32, 8, torch.float32, gen), dtype,
                       k_scale, v_scale)
    sinks = torch.tensor([2.0, -0.5, 0.7, 1.1])
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens,
                      batch.block_tables, batch.max_query_len, batch.max_seq_len, 0.3,
                      num_kv_splits=splits, block_m=16, tile_size=16, k_scale=k_scale,
                      v_scale=v_scale, sinks=sinks, **extra)
    expected = reference_attention(batch, 0.3, extra.get("sliding_window"),
                                   chunk_size=extra.get("attention_chunk_size"), sinks=sinks)
    assert not out.isnan().any()
    magnitude = max(float(v.abs().max()) for v in batch.values)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * magnitude, rtol=0)


def test_cache_format_views_fp8_as_bytes():
    cache = torch.zeros(2, 3, 4, 1, 16, dtype=F8_E5M2)
    fmt, view = cache_format(cache)
    assert fmt == E5M2 and view.dtype == torch.uint8 and view.data_ptr() == cache.data_ptr()
    assert cache_format(cache.float())[0] == 0


@pytest.mark.parametrize("dtype", [F8_E4M3, F8_E5M2])
def test_backend_stores_and_attends_with_the_layer_scales(dtype):
    """The impl's forward: reshape_and_cache then attention, both with impl.k_scale /
    impl.v_scale (set by the attention layer)."""
    gen = torch.Generator().manual_seed(2)
    k_scale, v_scale = SCALES[dtype]
    batch = make_batch(MIXED, 4, 2, 32, 8, torch.float32, gen, store_new_tokens=False)
    fp8 = _fp8_batch(batch, dtype, k_scale, v_scale)
    backend = TritonAttentionBackend(8, torch.device("cpu"), num_kv_splits=1)
    backend.set_kv_cache_dtype(NAMES[dtype])
    spec = AttentionLayerSpec(4, 32, 2, 0.3, kv_cache_dtype=backend.kv_cache_dtype)
    assert backend.validate(spec, 8) is None
    impl = backend.make_impl(spec)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    rows = [int(batch.query_start_loc[r + 1] - batch.query_start_loc[r]) for r in range(5)]
    new_k = torch.cat([k[k.shape[0] - n:] for k, n in zip(batch.keys, rows)])
    new_v = torch.cat([v[v.shape[0] - n:] for v, n in zip(batch.values, rows)])
    metadata = backend.build_metadata(AttentionBatch(
        num_reqs=5, num_tokens=batch.q.shape[0], query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len))
    out = impl.forward(batch.q, new_k, new_v, fp8.kv_cache, metadata)
    _check(out, fp8, 0.3)


def test_mla_layers_refuse_an_fp8_cache():
    backend = TritonAttentionBackend(16, torch.device("cpu"))
    backend.set_kv_cache_dtype("fp8")
    mla = AttentionLayerSpec(4, 24, 1, 0.2, kv_lora_rank=16, kv_cache_dtype="fp8_e4m3")
    assert "multi-head latent attention" in TritonAttentionBackend.validate(mla, 16)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        backend.make_impl(mla)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_engine_on_the_triton_backend_matches_the_cpu_backend_over_fp8(model_dir_factory,
                                                                          kv_cache_dtype):
    """The whole engine over an fp8 cache, Triton (interpreted) vs the CPU backend: the
    two stores quantize bit for bit alike and both read the dequantized values, so the
    greedy tokens agree (prefill chunks after cached keys included: a 16-token budget)."""
    from engine import LLM, SamplingParams
    from engine.kernels import stats
    from tests.helpers.equivalence import assert_outputs_equivalent

    path = str(model_dir_factory("llama-gqa"))
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "block_size": 8,
                  "max_num_batched_tokens": 16, "kv_cache_dtype": kv_cache_dtype}
    prompts = [{"prompt_token_ids": [5 + (7 * i + 3 * n) % 300 for i in range(n)]}
               for n in (3, 11, 37)]
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=2)
    with LLM(path, attention_backend="cpu", **engine) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    before = stats.launches.snapshot()
    with LLM(path, attention_backend="triton", **engine) as llm:
        runtime = llm.llm_engine.client.core.executor.runtime_info()
        assert runtime["attention_backend"] == "triton"
        assert runtime["kv_cache_dtype"] == str(DTYPE_OF[kv_cache_dtype]).removeprefix("torch.")
        got = llm.generate(prompts, params, use_tqdm=False)
    assert stats.launches.snapshot()["reshape_and_cache"] > before["reshape_and_cache"]
    assert_outputs_equivalent(want, got, atol=1e-4)

