"""What the CPU kernels time on the machine (engine.plugins.cpu.kernel_tuning): the
decode GEMMs' stream prefetch mode (same results in every mode) and the AMX crossover,
chosen once per machine and cached."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from engine.plugins.cpu import kernel_build, kernel_tuning, native
from tests.plugins.cpu.test_cpu_amx import EMULATED, _emulated_kernels


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_every_mode_computes_the_same_gemm(kernels, act):
    """The mode only moves prefetches: decode rows (streamed) and prefill rows give the
    same bits in every mode, and match a float64 product."""
    torch.manual_seed(0)
    weight = torch.randn(96, 256, dtype=torch.bfloat16)
    packed = kernels.pack(weight, act)
    results = {}
    for rows in (1, 2, 5, 40):
        x = torch.randn(rows, 256).to(act)
        reference = x.double() @ weight.double().T
        for mode in kernel_tuning.MODES:
            kernels.set_stream_prefetch(mode)
            try:
                got = kernels.gemm(packed, x)
                plain = kernels.gemm_plain(weight, x)
            finally:
                kernels.set_stream_prefetch(kernels.tuning.stream_prefetch)
            results.setdefault(rows, got)
            assert torch.equal(got, results[rows]), (rows, mode)
            tol = 2e-2 * reference.abs().max().item()  # bf16 output rounding
            assert (got.double() - reference).abs().max().item() <= tol
            assert (plain.double() - reference).abs().max().item() <= tol


def test_unknown_mode_is_refused(engine_kernels):
    with pytest.raises(ValueError, match="unknown stream prefetch mode"):
        engine_kernels.set_stream_prefetch("t2")
    assert engine_kernels.stream_prefetch == engine_kernels.tuning.stream_prefetch


def test_nta_is_kept_unless_another_mode_is_clearly_faster():
    assert kernel_tuning.pick_stream_prefetch({"nta": 30.0, "t0": 32.0, "none": 31.0}) == "nta"
    assert kernel_tuning.pick_stream_prefetch({"nta": 12.0, "t0": 24.0, "none": 27.0}) == "none"
    assert kernel_tuning.pick_stream_prefetch({"nta": 12.0, "t0": 25.0, "none": 13.0}) == "t0"


def _fresh_cache(tmp_path, monkeypatch, kernels: native.CPUKernels) -> None:
    """An empty cache directory holding only a copy of the built library: loading it
    there tunes afresh without compiling again."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu_kernels").mkdir()
    shutil.copy(kernels.path, tmp_path / "cpu_kernels" / kernels.path.name)


def test_the_choice_is_timed_once_then_cached(tmp_path, monkeypatch, engine_kernels):
    _fresh_cache(tmp_path, monkeypatch, engine_kernels)
    monkeypatch.delenv(kernel_tuning.STREAM_ENV, raising=False)
    level = engine_kernels.level
    first = native._load_level.__wrapped__(level)
    choice = first.tuning
    assert choice.reason == "timed" and choice.stream_prefetch in kernel_tuning.MODES
    assert set(choice.stream_gb_s) == set(kernel_tuning.MODES)
    assert all(rate > 0.5 for rate in choice.stream_gb_s.values())  # streamed, not a no-op
    assert choice.stream_prefetch == kernel_tuning.pick_stream_prefetch(choice.stream_gb_s)
    assert first.stream_prefetch == choice.stream_prefetch
    assert (choice.amx_min_rows is None) == (not first.has_amx)
    [cache] = (tmp_path / "cpu_kernels").glob("*.tuning.json")
    assert json.loads(cache.read_text())["cpu_model"] == kernel_build.cpu_model_name()

    second = native._load_level.__wrapped__(level)
    assert second.tuning.reason == "cached" and second.stream_prefetch == choice.stream_prefetch
    assert second.tuning.amx_min_rows == choice.amx_min_rows

    # Another CPU's choice (a home directory shared between machines) is not taken.
    cache.write_text(json.dumps({**choice.to_json(), "version": 2, "stream_prefetch": "none",
                                 "cpu_model": "some other CPU"}))
    monkeypatch.setattr(kernel_tuning, "stream_gb_s",
                        lambda kernels: {"nta": 10.0, "t0": 20.0, "none": 11.0})
    third = native._load_level.__wrapped__(level)
    assert third.tuning.reason == "timed" and third.stream_prefetch == "t0"


def test_the_environment_fixes_the_mode(tmp_path, monkeypatch, engine_kernels):
    _fresh_cache(tmp_path, monkeypatch, engine_kernels)
    monkeypatch.setenv(kernel_tuning.STREAM_ENV, "none")
    loaded = native._load_level.__wrapped__(engine_kernels.level)
    assert loaded.stream_prefetch == "none"
    assert loaded.tuning.reason == ("timed" if loaded.has_amx else "environment")
    monkeypatch.setenv(kernel_tuning.STREAM_ENV, "sideways")
    with pytest.raises(ValueError, match=kernel_tuning.STREAM_ENV):
        native._load_level.__wrapped__(engine_kernels.level)


def test_l3_size_is_read():
    assert kernel_tuning.l3_bytes() >= 1 << 20


def test_the_amx_crossover_is_where_the_tiles_win_from_then_on():
    times = {4: (9.0, 5.0), 8: (9.0, 8.0), 16: (10.0, 11.0), 32: (12.0, 20.0), 64: (20.0, 40.0)}
    assert kernel_tuning.amx_crossover(times) == 16
    times[8] = (7.0, 8.0)  # a win below a loss does not count: 16 on is where they pay
    times[16] = (12.0, 11.0)
    assert kernel_tuning.amx_crossover(times) == 32
    assert kernel_tuning.amx_crossover({32: (5.0, 4.0), 64: (9.0, 8.0)}) == kernel_tuning.NEVER


def test_only_a_library_with_tiles_takes_a_crossover(kernels):
    if kernels.has_amx:  # the amx level on an AMX CPU: the setter moves the crossover
        previous = kernels.amx_min_rows
        try:
            kernels.set_amx_min_rows(16)
            assert kernels.amx_min_rows == 16
        finally:
            kernels.set_amx_min_rows(previous)
        return
    assert kernels.amx_min_rows is None
    with pytest.raises(ValueError, match="no usable tiles"):
        kernels.set_amx_min_rows(16)


if EMULATED.runs_on(kernel_build.machine(), kernel_build.cpu_flags()):

    def test_the_crossover_is_timed_and_routes_the_rows(monkeypatch, tmp_path):
        """On the emulated tiles (plain C, far slower than vdpbf16ps) the timing finds
        no row count where they win, so the tuned library never takes them; a crossover
        set by hand routes rows from it to the tiles, and both paths match float64."""
        monkeypatch.setattr(kernel_tuning, "AMX_SHAPE", (64, 64))
        monkeypatch.setattr(kernel_tuning, "AMX_ROWS", (16, 32, 64))
        monkeypatch.setattr(kernel_tuning, "AMX_REPEATS", 2)
        monkeypatch.setattr(kernel_tuning, "stream_bytes", lambda: 64 * 64 * 2 * 3)  # 3 copies
        monkeypatch.setattr(kernel_tuning, "stream_gb_s", lambda kernels: {"nta": 1.0, "t0": 1.0,
                                                                          "none": 1.0})
        monkeypatch.delenv(kernel_tuning.AMX_ENV, raising=False)
        tiles = _emulated_kernels()  # the library test_cpu_amx builds, tuned afresh here
        kernel_tuning._cache_file(tiles).unlink(missing_ok=True)
        assert tiles.has_amx and tiles.amx_min_rows == kernel_tuning.AMX_MIN_ROWS
        tuning = kernel_tuning.tune_kernels(tiles)
        assert set(tuning.amx_us) == {16, 32, 64}
        assert all(t > v for t, v in tuning.amx_us.values()), tuning.amx_us
        assert tuning.amx_min_rows == tiles.amx_min_rows == kernel_tuning.NEVER

        torch.manual_seed(1)
        weight = torch.randn(64, 96, dtype=torch.bfloat16)
        packed = tiles.pack(weight, torch.bfloat16)
        x = torch.randn(40, 96).bfloat16()
        reference = x.double() @ weight.double().T
        timings = {}
        for crossover in (kernel_tuning.NEVER, 32):
            tiles.set_amx_min_rows(crossover)
            got = tiles.gemm(packed, x)
            assert (got.double() - reference).abs().max() <= 2e-2 * reference.abs().max()
            start = time.perf_counter()
            for _ in range(3):
                tiles.gemm(packed, x)
            timings[crossover] = time.perf_counter() - start
        # 40 rows >= 32: the emulated tiles ran, many times slower than vdpbf16ps
        assert timings[32] > 3 * timings[kernel_tuning.NEVER], timings
        with pytest.raises(ValueError, match=">= 1"):
            tiles.set_amx_min_rows(0)

        monkeypatch.setenv(kernel_tuning.AMX_ENV, "48")
        assert kernel_tuning.tune_kernels(tiles).amx_min_rows == tiles.amx_min_rows == 48
        monkeypatch.setenv(kernel_tuning.AMX_ENV, "-3")
        with pytest.raises(ValueError, match=kernel_tuning.AMX_ENV):
            kernel_tuning.tune_kernels(tiles)


def test_a_failed_timing_leaves_the_defaults(tmp_path, monkeypatch, engine_kernels, caplog):
    _fresh_cache(tmp_path, monkeypatch, engine_kernels)
    monkeypatch.delenv(kernel_tuning.STREAM_ENV, raising=False)

    def out_of_memory(kernels):
        raise MemoryError("no room for the timed weights")

    monkeypatch.setattr(kernel_tuning, "stream_gb_s", out_of_memory)
    loaded = native._load_level.__wrapped__(engine_kernels.level)
    assert loaded is not None and loaded.stream_prefetch == kernel_tuning.DEFAULT_MODE
    assert loaded.tuning.reason.startswith("not timed") and "not tuned" in caplog.text
    assert not list((tmp_path / "cpu_kernels").glob("*.tuning.json"))  # timed next time
