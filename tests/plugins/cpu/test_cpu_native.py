"""Building, caching and calling the CPU plugin's C kernels (cpu.kernel_build, cpu.native)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.core.interfaces import AttentionLayerSpec
from engine.plugins.cpu import kernel_build, native



def build(level: str | None = None) -> native.CPUKernels | None:
    """Load a level's kernels, uncached: each call decides afresh."""
    name = level or kernel_build.select_level().name
    return native.load_kernels(name) and native._load_level.__wrapped__(name)


def test_library_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch, kernels):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    first = build(kernels.level)
    assert first is not None and first.path.parent == tmp_path / "cpu_kernels"
    assert kernels.level in first.path.name and first.level == kernels.level
    built_at = first.path.stat().st_mtime_ns
    second = build(kernels.level)
    assert second.path == first.path and second.path.stat().st_mtime_ns == built_at
    # the library and its stream prefetch choice (cpu.stream_prefetch); no temp files left
    assert sorted(p.suffix for p in first.path.parent.iterdir()) == [".json", ".so"]


def test_a_read_only_cache_falls_back_to_a_temporary_directory(tmp_path, monkeypatch,
                                                                engine_kernels):
    read_only = tmp_path / "ro"
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(read_only))
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    compile_library = kernel_build.compile_library

    def refuse_read_only(compiler, level, target):
        if target.is_relative_to(read_only):  # as mkdir in a read-only home would
            raise PermissionError(13, "Permission denied", str(target.parent))
        compile_library(compiler, level, target)

    monkeypatch.setattr(kernel_build, "compile_library", refuse_read_only)
    built = build()
    assert built is not None and built.path.is_relative_to(tmp_path / "tmp")
    assert build().path == built.path  # found there next time, not rebuilt


def test_disabled_or_without_a_compiler_the_torch_path_stays(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ENGINE_CPU_NATIVE_KERNELS", "0")
    assert native.load_kernels() is None
    monkeypatch.delenv("ENGINE_CPU_NATIVE_KERNELS")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native._load_level.__wrapped__(kernel_build.select_level().name) is None
    assert "no C compiler" in caplog.text


def test_a_failing_compile_is_reported_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_build, "COMMON_FLAGS", (*kernel_build.COMMON_FLAGS, "-fno-such-flag"))
    assert native._load_level.__wrapped__(kernel_build.select_level().name) is None
    assert "unavailable" in caplog.text and "-fno-such-flag" in caplog.text
    assert not list((tmp_path / "cpu_kernels").iterdir())


# -- ISA levels ---------------------------------------------------------------------------

ZEN2 = frozenset({"sse4_1", "sse4_2", "ssse3", "cx16", "lahf_lm", "popcnt", "avx", "avx2",
                  "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
ZEN4 = ZEN2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16",
               "avx512_vnni"}


def _names(levels) -> list[str]:
    return [level.name for level in levels]


def test_the_levels_a_cpu_runs_follow_its_flags(monkeypatch):
    monkeypatch.delenv(kernel_build.ISA_ENV, raising=False)
    assert _names(kernel_build.runnable_levels(ZEN2, "x86_64")) == ["sse2", "avx2"]
    assert _names(kernel_build.runnable_levels(ZEN4, "x86_64")) == [
        "sse2", "avx2", "avx512", "avx512_bf16"]
    no_bf16 = ZEN4 - {"avx512_bf16"}  # Skylake-SP / Ice Lake
    assert kernel_build.select_level(no_bf16, "x86_64").name == "avx512"
    spr = ZEN4 | {"amx_tile", "amx_bf16"}
    assert kernel_build.select_level(spr, "x86_64").name == "amx"
    assert kernel_build.select_level(ZEN2 - {"fma"}, "x86_64").name == "sse2"
    assert _names(kernel_build.runnable_levels(frozenset(), "aarch64")) == ["neon"]
    assert _names(kernel_build.runnable_levels(frozenset(), "riscv64")) == ["generic"]


def test_the_environment_picks_a_lower_level_and_refuses_one_the_cpu_lacks(monkeypatch):
    monkeypatch.setenv(kernel_build.ISA_ENV, "avx2")
    assert kernel_build.select_level(ZEN4, "x86_64").name == "avx2"
    monkeypatch.setenv(kernel_build.ISA_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match="lacks avx512_bf16.*runs sse2, avx2, avx512$"):
        kernel_build.select_level(ZEN4 - {"avx512_bf16"}, "x86_64")
    monkeypatch.setenv(kernel_build.ISA_ENV, "neon")
    with pytest.raises(ValueError, match="built for aarch64"):
        kernel_build.select_level(ZEN4, "x86_64")
    monkeypatch.setenv(kernel_build.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="expected auto or one of"):
        kernel_build.select_level(ZEN4, "x86_64")


def test_each_library_is_its_level(kernels):
    """The library says which level it was built for, with that level's vector width
    and native paths (vdpbf16ps only where the level has AVX512-BF16)."""
    assert kernels.level in kernel_build.LEVELS
    lanes = {"sse2": 4, "avx2": 8, "avx512": 16, "avx512_bf16": 16, "amx": 16, "neon": 4,
             "generic": 4}
    assert kernels.vector_lanes == lanes[kernels.level]
    assert kernels.has_bf16_dot == kernel_build.LEVELS[kernels.level].bf16_dot
    # the amx level's tiles passed their load-time self-check (else it would say no AMX)
    assert kernels.has_amx == (kernels.level == "amx")
    assert kernels.key_layout(torch.bfloat16).pack == (2 if kernels.has_bf16_dot else 1)
    assert kernels.key_layout(torch.float32).pack == 1


def test_the_engine_loads_the_best_level_this_cpu_runs(monkeypatch, engine_kernels):
    monkeypatch.delenv(kernel_build.ISA_ENV, raising=False)
    assert engine_kernels.level == kernel_build.runnable_levels()[-1].name
    with pytest.raises(ValueError, match="cannot run"):
        native.load_kernels("neon" if kernel_build.machine() != "aarch64" else "avx2")


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,ok",
    [(32, 8, 128, True), (8, 2, 24, False), (128, 1, 64, False), (64, 2, 512, False),
     (16, 2, 512, True)],
)
def test_supports_matches_the_c_bounds(num_heads, num_kv_heads, head_size, ok):
    spec = AttentionLayerSpec(num_heads, head_size, num_kv_heads, 1.0)
    assert native.CPUKernels.supports_attention(spec) is ok


def _cache(num_blocks, kv_heads, block_size, head_size, dtype, gen):
    """``[blocks, kv_heads, block_size, head_size]`` values (V's layout; K is its transpose)."""
    return torch.randn(num_blocks, kv_heads, block_size, head_size, generator=gen).to(dtype)


def _keys(cache: torch.Tensor, kernels: native.CPUKernels) -> torch.Tensor:
    """The K layout ``kernels`` read: each block's ``[block_size, D]`` rows with D split
    into groups of ``pack`` (2 for DIM_PAIRS, else 1), groups major: row position of
    (token j, dim d) = (d // pack) * block_size * pack + j * pack + d % pack."""
    num_blocks, kv_heads, block_size, head_size = cache.shape
    pack = kernels.key_layout(cache.dtype).pack
    rows = cache.view(num_blocks, kv_heads, block_size, head_size // pack, pack)
    return rows.transpose(2, 3).reshape(num_blocks, kv_heads, block_size * head_size)


def test_strided_query_rows_match_a_float64_reference(kernels):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (_cache(6, 2, 16, 32, torch.float32, gen) for _ in range(2))
    # Query heads as a column slice of a fused qkv row: row stride 7 * 32, not 4 * 32.
    qkv = torch.randn(3, 7 * 32, generator=gen)
    query = qkv[:, : 4 * 32].view(3, 4, 32)
    tables = torch.tensor([[5, 0], [2, 3], [1, 4]])
    seq_lens = torch.tensor([20, 32, 1])
    out = kernels.paged_decode_attention(query, _keys(k_cache, kernels), v_cache, tables, seq_lens, 0.3)
    for r in range(3):
        keys = k_cache[tables[r]].permute(1, 0, 2, 3).reshape(2, 32, 32)[:, : seq_lens[r]]
        vals = v_cache[tables[r]].permute(1, 0, 2, 3).reshape(2, 32, 32)[:, : seq_lens[r]]
        q = query[r].double().view(2, 2, 32)  # [kv_head, group, D]
        probs = (q @ keys.double().transpose(1, 2) * 0.3).softmax(-1)
        ref = (probs @ vals.double()).reshape(4, 32)
        torch.testing.assert_close(out[r].double(), ref, atol=1e-5, rtol=0)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (query / output, cache): one dtype, or float32 activations over a narrower cache
QUERY_CACHE = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (F32, F16)]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("q_dtype", "dtype"), QUERY_CACHE,
                         ids=[f"{str(q)[6:]}-q-{str(c)[6:]}-cache" for q, c in QUERY_CACHE])
def test_key_splits_merge_to_the_same_softmax(kernels, num_splits, window, q_dtype, dtype):
    """Flash-decoding: each task's keys cut into ranges (some empty: 7 splits of a
    3-key request), partial softmaxes merged; for every query / cache dtype pair."""
    gen = torch.Generator().manual_seed(num_splits)
    k_cache, v_cache = (_cache(20, 1, 8, 16, dtype, gen) for _ in range(2))
    query = torch.randn(3, 4, 16, generator=gen).to(q_dtype)  # MQA: 4 query heads, 1 KV head
    tables = torch.randperm(20, generator=gen)[:18].view(3, 6)
    seq_lens = torch.tensor([45, 3, 48])
    got = kernels.paged_decode_attention(query, _keys(k_cache, kernels), v_cache, tables, seq_lens, 0.25,
                                         window=window, num_splits=num_splits)
    for r in range(3):
        keys = k_cache[tables[r]].reshape(-1, 16)[: seq_lens[r]].double()
        vals = v_cache[tables[r]].reshape(-1, 16)[: seq_lens[r]].double()
        if window is not None:
            keys, vals = keys[-window:], vals[-window:]
        probs = (query[r].double() @ keys.T * 0.25).softmax(-1)
        # the output's rounding; a float32 query scored by vdpbf16ps is rounded to bf16
        atol = {F32: 1e-5, BF16: 2e-2, F16: 3e-3}[q_dtype]
        if q_dtype != dtype and kernels.key_layout(dtype).pack == 2:
            atol = 3e-2
        assert got.dtype == q_dtype
        torch.testing.assert_close(got[r].double(), probs @ vals, atol=atol, rtol=0)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 7])
@pytest.mark.parametrize(("window", "chunk"), [(None, 20), (None, 7), (37, None), (13, 20)])
@pytest.mark.parametrize(("q_dtype", "dtype"), [(F32, F32), (BF16, BF16), (F32, BF16)],
                         ids=["f32", "bf16", "f32-q-bf16-cache"])
def test_chunks_and_sinks_merge_to_the_same_softmax(kernels, num_splits, window, chunk,
                                                    q_dtype, dtype):
    """Chunked local attention (chunks of 20 and 7 keys over blocks of 8) and sinks (added
    once, at the merge, whatever the split count). The table entries before a request's
    first needed block name a block of NaN: reading one would poison the output."""
    gen = torch.Generator().manual_seed(17)
    k_cache, v_cache = (_cache(21, 2, 8, 16, dtype, gen) for _ in range(2))
    k_cache[20], v_cache[20] = float("nan"), float("nan")
    query = torch.randn(4, 8, 16, generator=gen).to(q_dtype)  # GQA: 8 heads over 2 KV heads
    tables = torch.randperm(20, generator=gen)[:20].view(4, 5)
    seq_lens = torch.tensor([40, 3, 21, 33])
    sinks = torch.tensor([4.0, -1.0, 0.5, float("-inf"), 2.0, -3.0, 1.0, 0.0])
    firsts = []
    for r in range(4):
        n = int(seq_lens[r])
        first = max(0, n - window) if window else 0
        first = max(first, (n - 1) // chunk * chunk) if chunk else first
        tables[r, : first // 8] = 20
        firsts.append(first)
    got = kernels.paged_decode_attention(query, _keys(k_cache, kernels), v_cache, tables,
                                         seq_lens, 0.25, window=window, num_splits=num_splits,
                                         chunk=chunk, sinks=sinks)
    for r in range(4):
        n, first = int(seq_lens[r]), firsts[r]
        keys = k_cache[tables[r]].transpose(0, 1).reshape(2, -1, 16)[:, first:n].double()
        vals = v_cache[tables[r]].transpose(0, 1).reshape(2, -1, 16)[:, first:n].double()
        q = query[r].double().view(2, 4, 16)
        scores = q @ keys.transpose(1, 2) * 0.25  # [kv_head, group, keys]
        sink_col = sinks.double().view(2, 4, 1)
        probs = torch.cat((scores, sink_col), -1).softmax(-1)[..., :-1]
        ref = (probs @ vals).reshape(8, 16)
        atol = {F32: 1e-5, BF16: 2e-2}[q_dtype]
        if q_dtype != dtype and kernels.key_layout(dtype).pack == 2:
            atol = 3e-2
        torch.testing.assert_close(got[r].double(), ref, atol=atol, rtol=0)


def test_chunk_and_sink_arguments_are_checked(kernels):
    gen = torch.Generator().manual_seed(1)
    cache = _cache(2, 1, 8, 16, F32, gen)
    query, tables, lens = torch.randn(1, 2, 16), torch.tensor([[0, 1]]), torch.tensor([9])
    with pytest.raises(ValueError, match="chunk"):
        kernels.paged_decode_attention(query, _keys(cache, kernels), cache, tables, lens, 1.0,
                                       chunk=0)
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_decode_attention(query, _keys(cache, kernels), cache, tables, lens, 1.0,
                                       sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_decode_attention(query, _keys(cache, kernels), cache, tables, lens, 1.0,
                                       sinks=torch.zeros(2, dtype=torch.float64))


def test_chunks_and_sinks_run_eagerly_not_in_a_forward_graph(kernels):
    """The entry point with chunks / sinks is not in forward_graph.c's replay table: a
    capture that meets it fails cleanly (the runner then runs that batch size eagerly),
    while the plain call is recorded as before."""
    from engine.core.interfaces import GraphCaptureError

    gen = torch.Generator().manual_seed(2)
    cache = _cache(2, 1, 8, 16, F32, gen)
    query, tables, lens = torch.randn(1, 2, 16), torch.tensor([[0, 1]]), torch.tensor([9])
    with native.recording_calls() as calls:
        kernels.paged_decode_attention(query, _keys(cache, kernels), cache, tables, lens, 1.0)
        assert len(calls) == 1
        with pytest.raises(GraphCaptureError, match="paged_decode_attention_ext"):
            kernels.paged_decode_attention(query, _keys(cache, kernels), cache, tables, lens,
                                           1.0, sinks=torch.zeros(2))


def test_splits_are_chosen_only_when_tasks_do_not_fill_the_threads(kernels):
    """The kernel picks its key splits per call (num_splits=None), so a replayed graph
    re-picks them as contexts grow (planned for the pool's count here: a worker fixes the
    count with set_split_threads, which an engine built earlier in this process did)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    kernels.set_split_threads(0)
    try:
        def splits(lens: list[int], kv_heads: int = 1, window: int | None = None) -> int:
            return kernels.decode_key_splits(torch.tensor(lens), kv_heads, window)

        assert splits([4096] * 4, kv_heads=2) == 1  # 8 tasks fill 8 threads
        assert splits([4096]) == 16  # 2 work items per thread
        assert splits([600, 20]) == 2  # >= 256 keys per split
        assert splits([4096], window=600) == 2  # only the window's keys count
        assert splits([100, 100]) == 1
        assert splits([]) == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("src_dtype", "dtype"), QUERY_CACHE,
                         ids=[f"{str(q)[6:]}-kv-{str(c)[6:]}-cache" for q, c in QUERY_CACHE])
def test_write_kv_stores_columns_of_k_and_rows_of_v(kernels, src_dtype, dtype):
    """New K/V rows in the activations' dtype, rounded (nearest even) into the cache's."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, 2, 8 * 16, dtype=dtype)  # [blocks, kv_heads, block * D] rows
    v_cache = torch.zeros(4, 2, 8, 16, dtype=dtype)  # [blocks, kv_heads, block, D]
    pack = kernels.key_layout(dtype).pack
    dims = torch.arange(16)
    # Where dim d of the token at offset j sits in a K row (the documented layouts).
    def key_positions(j: int) -> torch.Tensor:
        return (dims // pack) * 8 * pack + j * pack + dims % pack

    qkv = torch.randn(3, 6 * 16, generator=gen).to(src_dtype)  # strided K and V views
    key, value = qkv[:, 32:64].view(3, 2, 16), qkv[:, 64:].view(3, 2, 16)
    slots = torch.tensor([9, -1, 31])  # block 1 offset 1; skipped; block 3 offset 7
    kernels.write_kv(key, value, slots, k_cache, v_cache)
    for t, (block, offset) in ((0, (1, 1)), (2, (3, 7))):
        torch.testing.assert_close(
            k_cache[block][:, key_positions(offset)], key[t].to(dtype), atol=0, rtol=0
        )
        torch.testing.assert_close(v_cache[block, :, offset], value[t].to(dtype), atol=0, rtol=0)
    assert int((k_cache != 0).sum()) == int((v_cache != 0).sum()) == 2 * 2 * 16
    with pytest.raises(ValueError, match="outside the cache"):
        kernels.write_kv(key, value, torch.tensor([0, 1, 32]), k_cache, v_cache)
    assert int((k_cache != 0).sum()) == 2 * 2 * 16  # a refused batch writes nothing


def test_bad_arguments_are_refused(kernels):
    gen = torch.Generator().manual_seed(0)
    k_cache = _cache(2, 1, 4, 16, torch.float32, gen)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    query = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(query.int(), _keys(k_cache, kernels), k_cache, tables,
                                       lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode_attention(query, _keys(k_cache, kernels), k_cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_decode_attention(query, _keys(k_cache, kernels), k_cache, tables, lens, 1.0,
                                       num_splits=0)
    with pytest.raises(ValueError, match="do not hold"):  # K rows of other blocks than V's
        kernels.paged_decode_attention(query, _keys(k_cache, kernels)[:1], k_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head size"):  # V rows of another head size
        kernels.paged_decode_attention(query, _keys(k_cache, kernels), k_cache.view(2, 1, 8, 8), tables,
                                       lens, 1.0)
    with pytest.raises(ValueError, match="refused"):  # head size 24: not a multiple of 16
        cache24 = _cache(2, 1, 4, 24, torch.float32, gen)
        query24 = torch.randn(1, 2, 24)
        kernels.paged_decode_attention(query24, _keys(cache24, kernels), cache24, tables, lens, 1.0)


def test_the_engine_runs_the_native_kernels_of_its_level(llama_dir):
    """Fails when no C kernel ran: an engine that fell back to torch ops (a failed build,
    a missing compiler) would still pass every numerical test. Every linear gets the C
    GEMM of this CPU's level, attention and the fused ops are the C kernels, and decode
    steps replay forward graphs, which hold nothing but C kernel calls."""
    from tests.helpers.hf_reference import cpu_llm

    llm = cpu_llm(llama_dir)
    executor = llm.llm_engine.client.core.executor
    info = executor.runtime_info()
    level = kernel_build.select_level().name
    assert info["isa_level"] == level
    assert info["stream_prefetch"] == native.load_kernels(level).tuning.stream_prefetch
    assert set(info["gemm_kernels"]) == {f"cpu_packed ({level})"}, info["gemm_kernels"]
    model = executor.runner.model.model
    assert model.layers[0].self_attn.attn.impl.kernels is not None
    assert model.norm.fused_ops is not None
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert executor.runner.decode_graphs.captured_sizes == [2]  # both decode together
