"""Building, caching and calling the CPU plugin's C kernels (cpu.kernel_build, cpu.native)."""

from __future__ import annotations

import pytest
import torch

from engine.core.interfaces import AttentionLayerSpec
from engine.plugins.cpu import kernel_build, native

build = native.load_kernels.__wrapped__  # uncached: each call decides afresh


def test_library_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch, kernels):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    first = build()
    assert first is not None and first.path.parent == tmp_path / "cpu_kernels"
    built_at = first.path.stat().st_mtime_ns
    second = build()
    assert second.path == first.path and second.path.stat().st_mtime_ns == built_at
    assert [p.suffix for p in first.path.parent.iterdir()] == [".so"]  # no temp files left


def test_a_read_only_cache_falls_back_to_a_temporary_directory(tmp_path, monkeypatch, kernels):
    read_only = tmp_path / "ro"
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(read_only))
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    compile_library = kernel_build.compile_library

    def refuse_read_only(compiler, target):
        if target.is_relative_to(read_only):  # as mkdir in a read-only home would
            raise PermissionError(13, "Permission denied", str(target.parent))
        compile_library(compiler, target)

    monkeypatch.setattr(kernel_build, "compile_library", refuse_read_only)
    built = build()
    assert built is not None and built.path.is_relative_to(tmp_path / "tmp")
    assert build().path == built.path  # found there next time, not rebuilt


def test_disabled_or_without_a_compiler_the_torch_path_stays(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ENGINE_CPU_NATIVE_KERNELS", "0")
    assert build() is None
    monkeypatch.delenv("ENGINE_CPU_NATIVE_KERNELS")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert build() is None
    assert "no C compiler" in caplog.text


def test_a_failing_compile_is_reported_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_build, "CFLAGS", (*kernel_build.CFLAGS, "-fno-such-flag"))
    assert build() is None
    assert "unavailable" in caplog.text and "-fno-such-flag" in caplog.text
    assert not list((tmp_path / "cpu_kernels").iterdir())


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


def _keys(cache: torch.Tensor) -> torch.Tensor:
    """The K layout the kernel reads: each block's ``[block_size, D]`` rows with D split
    into groups of ``pack`` (2 for DIM_PAIRS, else 1), groups major: row position of
    (token j, dim d) = (d // pack) * block_size * pack + j * pack + d % pack."""
    num_blocks, kv_heads, block_size, head_size = cache.shape
    pack = native.load_kernels().key_layout(cache.dtype).pack
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
    out = kernels.paged_decode_attention(query, _keys(k_cache), v_cache, tables, seq_lens, 0.3)
    for r in range(3):
        keys = k_cache[tables[r]].permute(1, 0, 2, 3).reshape(2, 32, 32)[:, : seq_lens[r]]
        vals = v_cache[tables[r]].permute(1, 0, 2, 3).reshape(2, 32, 32)[:, : seq_lens[r]]
        q = query[r].double().view(2, 2, 32)  # [kv_head, group, D]
        probs = (q @ keys.double().transpose(1, 2) * 0.3).softmax(-1)
        ref = (probs @ vals.double()).reshape(4, 32)
        torch.testing.assert_close(out[r].double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_splits_merge_to_the_same_softmax(kernels, num_splits, window, dtype):
    """Flash-decoding: each task's keys cut into ranges (some empty: 7 splits of a
    3-key request), partial softmaxes merged."""
    gen = torch.Generator().manual_seed(num_splits)
    k_cache, v_cache = (_cache(20, 1, 8, 16, dtype, gen) for _ in range(2))
    query = torch.randn(3, 4, 16, generator=gen).to(dtype)  # MQA: 4 query heads, 1 KV head
    tables = torch.randperm(20, generator=gen)[:18].view(3, 6)
    seq_lens = torch.tensor([45, 3, 48])
    got = kernels.paged_decode_attention(query, _keys(k_cache), v_cache, tables, seq_lens, 0.25,
                                         window=window, num_splits=num_splits)
    for r in range(3):
        keys = k_cache[tables[r]].reshape(-1, 16)[: seq_lens[r]].double()
        vals = v_cache[tables[r]].reshape(-1, 16)[: seq_lens[r]].double()
        if window is not None:
            keys, vals = keys[-window:], vals[-window:]
        probs = (query[r].double() @ keys.T * 0.25).softmax(-1)
        atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
        torch.testing.assert_close(got[r].double(), probs @ vals, atol=atol, rtol=0)


def test_splits_are_chosen_only_when_tasks_do_not_fill_the_threads(kernels):
    """The kernel picks its key splits per call (num_splits=None), so a replayed graph
    re-picks them as contexts grow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_columns_of_k_and_rows_of_v(kernels, dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, 2, 8 * 16, dtype=dtype)  # [blocks, kv_heads, block * D] rows
    v_cache = torch.zeros(4, 2, 8, 16, dtype=dtype)  # [blocks, kv_heads, block, D]
    pack = kernels.key_layout(dtype).pack
    dims = torch.arange(16)
    # Where dim d of the token at offset j sits in a K row (the documented layouts).
    def key_positions(j: int) -> torch.Tensor:
        return (dims // pack) * 8 * pack + j * pack + dims % pack

    qkv = torch.randn(3, 6 * 16, generator=gen).to(dtype)  # strided K and V views
    key, value = qkv[:, 32:64].view(3, 2, 16), qkv[:, 64:].view(3, 2, 16)
    slots = torch.tensor([9, -1, 31])  # block 1 offset 1; skipped; block 3 offset 7
    kernels.write_kv(key, value, slots, k_cache, v_cache)
    for t, (block, offset) in ((0, (1, 1)), (2, (3, 7))):
        torch.testing.assert_close(
            k_cache[block][:, key_positions(offset)], key[t], atol=0, rtol=0
        )
        torch.testing.assert_close(v_cache[block, :, offset], value[t], atol=0, rtol=0)
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
        kernels.paged_decode_attention(query.bfloat16(), _keys(k_cache), k_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode_attention(query, _keys(k_cache), k_cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_decode_attention(query, _keys(k_cache), k_cache, tables, lens, 1.0,
                                       num_splits=0)
    with pytest.raises(ValueError, match="do not hold"):  # K rows of other blocks than V's
        kernels.paged_decode_attention(query, _keys(k_cache)[:1], k_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head size"):  # V rows of another head size
        kernels.paged_decode_attention(query, _keys(k_cache), k_cache.view(2, 1, 8, 8), tables,
                                       lens, 1.0)
    with pytest.raises(ValueError, match="refused"):  # head size 24: not a multiple of 16
        cache24 = _cache(2, 1, 4, 24, torch.float32, gen)
        query24 = torch.randn(1, 2, 24)
        kernels.paged_decode_attention(query24, _keys(cache24), cache24, tables, lens, 1.0)
