"""fp8 KV caches on the CPU plugin (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``).

Writes quantize (``quantize_kv``: key / k_scale, nearest even, saturated), reads
dequantize: the C kernels of every ISA level this CPU runs and the torch-op paths are held
to a float64 reference computed on the dequantized cache values, so what separates them
is only the order of the float32 sums (and a bf16 query's output rounding). Unused cache
bytes are poisoned with large finite codes first: a key read outside its context would
move the result by far more than the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.interfaces import AttentionBatch, AttentionLayerSpec
from engine.core.interfaces.attention import dequantize_kv, quantize_kv
from engine.plugins.cpu import attention as cpu_attention
from engine.plugins.cpu.attention import CPUAttentionBackend
from engine.plugins.cpu.graphs import CPUGraphCapturer
from engine.plugins.cpu.native import CPUKernels
from tests.plugins.cpu.conftest import LEVELS, kernels_of
from tests.plugins.cpu.test_cpu_attention import Case, cache_views, key_layout, reference

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
SCALES = {E4M3: (0.043, 1.7), E5M2: (2.5, 0.31)}  # (k_scale, v_scale): neither 1
NAMES = {E4M3: "fp8_e4m3", E5M2: "fp8_e5m2"}  # their --kv-cache-dtype


def value_sweep(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every finite code's value, the midpoints between neighbours (ties) and the floats
    just beside them, random magnitudes from 1e-12 to 1e6, infinities and overflows."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    gen = torch.Generator().manual_seed(seed)
    rnd = torch.randn(8000, generator=gen) * torch.logspace(-12, 6, 8000)
    edges = torch.tensor([math.inf, -math.inf, 1e30, -1e30, 448.0, 464.0, 465.0, 57344.0,
                          61440.0, 1e-45, -1e-45, 0.0, -0.0])
    values = torch.cat([finite, mids, mids.nextafter(up), mids.nextafter(down), rnd, edges])
    return values[: values.numel() // 16 * 16]


def finite_codes(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random finite fp8 codes over the whole range (large magnitudes included)."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    mag = codes & 0x7F
    top = 0x7E if dtype == E4M3 else 0x7B  # the largest finite magnitude
    codes = torch.where(mag > top, (codes & 0x80) | top, codes)
    return codes.to(torch.uint8).view(dtype)


# -- the C kernels: bit-exact stores, exact reads -------------------------------------
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_write_kv_stores_quantize_kv_bit_for_bit(kernels, dtype, scale):
    values = value_sweep(dtype)
    head_size, block_size = 16, 4
    rows = values.view(-1, 1, head_size)
    tokens = rows.shape[0]
    blocks = -(-tokens // block_size)
    key_cache = torch.zeros(blocks, 1, block_size * head_size, dtype=dtype)
    value_cache = torch.zeros(blocks, 1, block_size, head_size, dtype=dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    kernels.write_kv(rows, -rows, slots, key_cache, value_cache, scale, 2 * scale)
    keys = key_cache.view(blocks, block_size * head_size).view(blocks, head_size, block_size)
    stored_k = keys.transpose(1, 2).reshape(-1, head_size)[slots]  # dims-major K rows
    stored_v = value_cache.view(-1, head_size)[slots]
    want_k = quantize_kv(rows, scale, dtype).view(-1, head_size)
    want_v = quantize_kv(-rows, 2 * scale, dtype).view(-1, head_size)
    assert kernels.key_layout(dtype).pack == 1
    assert torch.equal(stored_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(stored_v.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_write_kv_of_nan_stores_nan_and_refuses_bad_scales(kernels, dtype, src):
    rows = torch.tensor([math.nan, 1.0] * 8).view(1, 1, 16).to(src)
    key_cache = torch.zeros(1, 1, 16, dtype=dtype)
    value_cache = torch.zeros(1, 1, 1, 16, dtype=dtype)
    kernels.write_kv(rows, rows, torch.tensor([0]), key_cache, value_cache, 0.5, 0.5)
    assert value_cache.float().view(-1)[0::2].isnan().all()
    assert torch.equal(value_cache.float().view(-1)[1::2], torch.full((8,), 2.0))
    with pytest.raises(ValueError, match="positive scales"):
        kernels.write_kv(rows, rows, torch.tensor([0]), key_cache, value_cache, 0.0, 1.0)


@pytest.mark.parametrize("dtype", FP8)
def test_decode_reads_every_code_exactly(kernels, dtype):
    """One key per request: the output is its value row, so every code's widening (the
    vector loads of each level) shows up bit for bit, NaN and infinity codes included."""
    head_size = 32
    reqs = 256 // head_size
    codes = torch.arange(256, dtype=torch.uint8)
    value_cache = codes.view(reqs, 1, 1, head_size).clone().view(dtype)
    key_cache = torch.zeros(reqs, 1, head_size, dtype=dtype)
    query = torch.randn(reqs, 1, head_size)
    tables = torch.arange(reqs, dtype=torch.int64).view(reqs, 1)
    lens = torch.ones(reqs, dtype=torch.int64)
    out = kernels.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.1,
                                         k_scale=2.0, v_scale=0.5)
    want = codes.view(dtype).float().view(reqs, 1, head_size) * 0.5
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0))


# -- the attention backend, C kernels and torch ops -----------------------------------
@pytest.fixture(params=[f"c_kernel-{level}" for level in LEVELS] + ["torch_ops"])
def path(request, monkeypatch) -> str:
    if request.param == "torch_ops":
        monkeypatch.setattr(cpu_attention, "load_kernels", lambda: None)
    else:
        kernels = kernels_of(request.param.removeprefix("c_kernel-"))
        monkeypatch.setattr(cpu_attention, "load_kernels", lambda: kernels)
    return request.param


def make_fp8_case(requests, num_heads, num_kv_heads, head_size, block_size, dtype,
                  cache_dtype, k_scale, v_scale, seed=0) -> Case:
    """Like test_cpu_attention.make_case, over an fp8 cache: the history is stored as
    ``quantize_kv``, the new rows come in ``dtype``, and the reference history (hist_k /
    hist_v) is every position's dequantized code."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(s / block_size) for _, s in requests]
    total_blocks = sum(nblocks) + 3
    perm = torch.randperm(total_blocks, generator=gen)
    shape = CPUAttentionBackend.get_kv_cache_shape(total_blocks, block_size, num_kv_heads,
                                                   head_size)
    kv_cache = finite_codes(shape, cache_dtype, gen)  # poison: unused slots never read
    layout = key_layout(num_heads, num_kv_heads, head_size, cache_dtype)
    key_cache, value_cache = cache_views(kv_cache, block_size, head_size, layout)
    block_tables = torch.zeros(len(requests), max(nblocks), dtype=torch.int32)
    queries, keys, values, slot_mapping, hist_k, hist_v, slots_all, qsl = ([] for _ in range(8))
    qsl.append(0)
    used = 0
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = perm[used : used + nblocks[r]]
        used += nblocks[r]
        block_tables[r, : nblocks[r]] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        # magnitudes over four decades: subnormal codes too, scores of order one
        spread = torch.logspace(-3, 0.7, seq_len)[torch.randperm(seq_len, generator=gen)]
        k = (torch.randn(seq_len, num_kv_heads, head_size, generator=gen) * k_scale
             * spread[:, None, None]).to(dtype)
        v = (torch.randn(seq_len, num_kv_heads, head_size, generator=gen) * v_scale
             * 3).to(dtype)
        qk, qv = quantize_kv(k, k_scale, cache_dtype), quantize_kv(v, v_scale, cache_dtype)
        ctx = seq_len - q_len
        blk, off = slots[:ctx] // block_size, slots[:ctx] % block_size
        key_cache[blk, :, off] = qk[:ctx].unflatten(-1, (-1, layout.pack))
        value_cache[blk, :, off] = qv[:ctx]
        queries.append(torch.randn(q_len, num_heads, head_size, generator=gen).to(dtype))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slot_mapping.append(slots[ctx:])
        hist_k.append(dequantize_kv(qk, k_scale).double())
        hist_v.append(dequantize_kv(qv, v_scale).double())
        slots_all.append(slots)
        qsl.append(qsl[-1] + q_len)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    batch = AttentionBatch(
        num_reqs=len(requests), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=seq_lens,
        block_tables=block_tables, slot_mapping=torch.cat(slot_mapping).to(torch.int64),
        max_query_len=max(q for q, _ in requests), max_seq_len=int(seq_lens.max()),
    )
    return Case(batch, kv_cache, torch.cat(queries), torch.cat(keys), torch.cat(values),
                hist_k, hist_v, slots_all)


def run_fp8(case: Case, spec: AttentionLayerSpec, block_size: int, k_scale: float,
            v_scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    backend = CPUAttentionBackend(block_size=block_size, device=CPU)
    backend.set_kv_cache_dtype(NAMES[case.kv_cache.dtype])
    assert backend.validate(spec, block_size) is None
    impl = backend.make_impl(spec)
    impl.k_scale, impl.v_scale = k_scale, v_scale  # what the attention layer hands over
    impl.sinks = sinks
    uses_c = cpu_attention.load_kernels() is not None and CPUKernels.supports_attention(spec)
    assert (impl.kernels is not None) == uses_c
    return impl.forward(case.query, case.key, case.value, case.kv_cache,
                        backend.build_metadata(case.batch))


def check(out, case, requests, num_heads, scale, window=None, soft_cap=None, chunk=None,
          sinks=None):
    ref = reference(case, requests, num_heads, scale, window, soft_cap, chunk=chunk,
                    sinks=sinks)
    magnitude = max(float(v.abs().max()) for v in case.hist_v)
    tol = 2e-6 if out.dtype == torch.float32 else 2e-2  # float32 sums; bf16 rounding
    torch.testing.assert_close(out.double(), ref, atol=tol * magnitude, rtol=0)


# (query_len, seq_len): decodes, a first prefill chunk, chunks after cached context
MIXED = [(1, 1), (7, 7), (1, 33), (5, 21), (1, 16), (16, 40), (1, 70)]
DECODES = [(1, 9), (1, 1), (1, 64), (1, 31), (1, 17)]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize(
    "requests,num_heads,num_kv_heads,head_size,block_size",
    [
        (MIXED, 8, 2, 32, 16),  # GQA, decodes and prefill chunks in one step
        (DECODES, 10, 2, 64, 8),  # pure decode, a group of 5 (one padded register block)
        (MIXED, 4, 4, 16, 5),  # MHA, blocks that cut the kernel's key slices
        (MIXED, 6, 1, 24, 8),  # head size 24: the torch ops serve it on every path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_cache_matches_the_dequantized_reference(
        path, requests, num_heads, num_kv_heads, head_size, block_size, dtype, cache_dtype):
    k_scale, v_scale = SCALES[cache_dtype]
    case = make_fp8_case(requests, num_heads, num_kv_heads, head_size, block_size, dtype,
                         cache_dtype, k_scale, v_scale, seed=head_size)
    scale = head_size**-0.5
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, scale,
                              kv_cache_dtype=NAMES[cache_dtype])
    out = run_fp8(case, spec, block_size, k_scale, v_scale)
    assert out.dtype == dtype and out.shape == case.query.shape
    check(out, case, requests, num_heads, scale)
    # the step's new rows were stored quantized, bit for bit
    layout = key_layout(num_heads, num_kv_heads, head_size, cache_dtype)
    key_cache, value_cache = cache_views(case.kv_cache, block_size, head_size, layout)
    start = 0
    for (q_len, seq_len), slots in zip(requests, case.slots):
        new = slots[seq_len - q_len:]
        blk, off = new // block_size, new % block_size
        want = quantize_kv(case.key[start:start + q_len], k_scale, cache_dtype)
        got = key_cache[blk, :, off].flatten(-2)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        want = quantize_kv(case.value[start:start + q_len], v_scale, cache_dtype)
        assert torch.equal(value_cache[blk, :, off].view(torch.uint8), want.view(torch.uint8))
        start += q_len


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_windows_soft_caps_and_long_chunks_over_an_fp8_cache(path, cache_dtype,
                                                             kernel_max_context, monkeypatch):
    """kernel_max_context 20: the C path hands the longer chunks to SDPA, which reads
    the kernel's K layout dequantized."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    k_scale, v_scale = SCALES[cache_dtype]
    requests = MIXED + [(12, 58)]
    case = make_fp8_case(requests, 4, 2, 16, 4, torch.float32, cache_dtype, k_scale,
                         v_scale, seed=9)
    spec = AttentionLayerSpec(4, 16, 2, 0.25, sliding_window=13, logits_soft_cap=3.0,
                              kv_cache_dtype=NAMES[cache_dtype])
    out = run_fp8(case, spec, 4, k_scale, v_scale)
    check(out, case, requests, 4, 0.25, window=13, soft_cap=3.0)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("kernel_max_context", [1024, 20])
def test_sinks_windows_and_chunks_over_an_fp8_cache(path, cache_dtype, kernel_max_context,
                                                    monkeypatch):
    """GPT-OSS (window + sinks) and Llama 4 (chunks of 6 over blocks of 4) layers: the
    sink is a logit, compared with scores of dequantized keys (k_scale folded in)."""
    monkeypatch.setattr(cpu_attention, "KERNEL_PREFILL_MAX_CONTEXT", kernel_max_context)
    k_scale, v_scale = SCALES[cache_dtype]
    requests = MIXED + [(12, 58)]
    case = make_fp8_case(requests, 4, 2, 16, 4, torch.float32, cache_dtype, k_scale,
                         v_scale, seed=19)
    sinks = torch.tensor([2.5, -1.0, 0.3, 1.2])
    name = NAMES[cache_dtype]
    spec = AttentionLayerSpec(4, 16, 2, 0.25, sliding_window=13, use_sinks=True,
                              kv_cache_dtype=name)
    check(run_fp8(case, spec, 4, k_scale, v_scale, sinks), case, requests, 4, 0.25,
          window=13, sinks=sinks)
    spec = AttentionLayerSpec(4, 16, 2, 0.25, attention_chunk_size=6, use_sinks=True,
                              kv_cache_dtype=name)
    check(run_fp8(case, spec, 4, k_scale, v_scale, sinks), case, requests, 4, 0.25,
          chunk=6, sinks=sinks)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_split_key_ranges_over_an_fp8_cache(kernels, cache_dtype):
    """Flash-decoding's merged key ranges scale the output by v_scale once."""
    k_scale, v_scale = SCALES[cache_dtype]
    requests = [(1, 300), (1, 45)]
    case = make_fp8_case(requests, 4, 1, 16, 16, torch.float32, cache_dtype, k_scale,
                         v_scale, seed=3)
    assert kernels.key_layout(cache_dtype).pack == 1  # dims major, as make_fp8_case stored
    num_blocks = case.kv_cache.shape[1]
    key_cache, value_cache = case.kv_cache[0], case.kv_cache[1].view(num_blocks, 1, 16, 16)
    kernels.write_kv(case.key, case.value, case.batch.slot_mapping, key_cache, value_cache,
                     k_scale, v_scale)
    out = kernels.paged_decode_attention(
        case.query, key_cache, value_cache, case.batch.block_tables.long(),
        case.batch.seq_lens.long(), 0.25, num_splits=3, k_scale=k_scale, v_scale=v_scale)
    check(out, case, requests, 4, 0.25)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_a_captured_decode_over_an_fp8_cache_replays_the_eager_result(kernels, cache_dtype,
                                                                     monkeypatch):
    """Forward graphs record write_kv and the decode kernel with their scales: a replay
    over the runner's persistent buffers equals the eager call bit for bit."""
    monkeypatch.setattr(cpu_attention, "load_kernels", lambda: kernels)
    k_scale, v_scale = SCALES[cache_dtype]
    requests = [(1, 9), (1, 33), (1, 20)]
    case = make_fp8_case(requests, 8, 2, 32, 8, torch.float32, cache_dtype, k_scale,
                         v_scale, seed=5)
    backend = CPUAttentionBackend(block_size=8, device=CPU)
    backend.set_kv_cache_dtype(NAMES[cache_dtype])
    spec = AttentionLayerSpec(8, 32, 2, 32**-0.5, kv_cache_dtype=backend.kv_cache_dtype)
    impl = backend.make_impl(spec)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    batch = case.batch
    graph_batch = AttentionBatch(
        num_reqs=batch.num_reqs, num_tokens=batch.num_tokens,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens.long(),
        block_tables=batch.block_tables.long(), slot_mapping=batch.slot_mapping.clone(),
        max_query_len=1, max_seq_len=batch.max_seq_len)
    metadata = backend.build_graph_metadata(graph_batch)
    q, k, v = case.query.clone(), case.key.clone(), case.value.clone()
    eager_cache = case.kv_cache.clone()
    graph = CPUGraphCapturer(kernels).capture(
        lambda: impl.forward(q, k, v, case.kv_cache, metadata))
    before = case.kv_cache.clone()
    got = graph.replay().clone()
    eager = impl.forward(q, k, v, eager_cache, backend.build_metadata(batch))
    assert torch.equal(got, eager)
    assert torch.equal(case.kv_cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert not torch.equal(before.view(torch.uint8), case.kv_cache.view(torch.uint8))
    check(got, case, requests, 8, 32**-0.5)


# -- the contract ---------------------------------------------------------------------
def test_the_backend_takes_fp8_caches_and_refuses_them_for_mla():
    backend = CPUAttentionBackend(block_size=16, device=CPU)
    assert backend.kv_cache_dtype == "auto"
    backend.set_kv_cache_dtype("fp8")
    assert backend.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="not supported"):
        backend.set_kv_cache_dtype("int8")
    mla = AttentionLayerSpec(4, 24, 1, 0.2, kv_lora_rank=16, kv_cache_dtype="fp8_e4m3")
    why = backend.validate(mla, 16)
    assert "multi-head latent attention" in why and "--kv-cache-dtype auto" in why
    mha = AttentionLayerSpec(4, 32, 2, 0.2, kv_cache_dtype="fp8_e5m2")
    assert backend.validate(mha, 16) is None
