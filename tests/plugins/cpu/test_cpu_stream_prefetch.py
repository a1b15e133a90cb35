"""The decode GEMMs' stream prefetch mode: same results in every mode, chosen by timing
once per machine and cached (engine.plugins.cpu.stream_prefetch)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.plugins.cpu import kernel_build, native, stream_prefetch


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
        for mode in stream_prefetch.MODES:
            kernels.set_stream_prefetch(mode)
            try:
                got = kernels.gemm(packed, x)
                plain = kernels.gemm_plain(weight, x)
            finally:
                kernels.set_stream_prefetch(kernels.stream_choice.mode)
            results.setdefault(rows, got)
            assert torch.equal(got, results[rows]), (rows, mode)
            tol = 2e-2 * reference.abs().max().item()  # bf16 output rounding
            assert (got.double() - reference).abs().max().item() <= tol
            assert (plain.double() - reference).abs().max().item() <= tol


def test_unknown_mode_is_refused(engine_kernels):
    with pytest.raises(ValueError, match="unknown stream prefetch mode"):
        engine_kernels.set_stream_prefetch("t2")
    assert engine_kernels.stream_prefetch == engine_kernels.stream_choice.mode


def test_nta_is_kept_unless_another_mode_is_clearly_faster():
    assert stream_prefetch.pick({"nta": 30.0, "t0": 32.0, "none": 31.0}) == "nta"
    assert stream_prefetch.pick({"nta": 12.0, "t0": 24.0, "none": 27.0}) == "none"
    assert stream_prefetch.pick({"nta": 12.0, "t0": 25.0, "none": 13.0}) == "t0"


def test_the_choice_is_timed_once_then_cached(tmp_path, monkeypatch, engine_kernels):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(stream_prefetch.ENV, raising=False)
    level = engine_kernels.level
    first = native._load_level.__wrapped__(level)
    choice = first.stream_choice
    assert choice.reason == "timed" and choice.mode in stream_prefetch.MODES
    assert set(choice.gb_s) == set(stream_prefetch.MODES)
    assert all(rate > 0.5 for rate in choice.gb_s.values())  # streamed, not a no-op
    assert choice.mode == stream_prefetch.pick(choice.gb_s)
    assert first.stream_prefetch == choice.mode
    [cache] = (tmp_path / "cpu_kernels").glob("*.stream_prefetch.json")
    assert json.loads(cache.read_text())["cpu_model"] == kernel_build.cpu_model_name()

    second = native._load_level.__wrapped__(level)
    assert second.stream_choice.reason == "cached" and second.stream_prefetch == choice.mode

    # Another CPU's choice (a home directory shared between machines) is not taken.
    cache.write_text(json.dumps({"mode": "none", "cpu_model": "some other CPU"}))
    monkeypatch.setattr(stream_prefetch, "stream_gb_s",
                        lambda kernels: {"nta": 10.0, "t0": 20.0, "none": 11.0})
    third = native._load_level.__wrapped__(level)
    assert third.stream_choice.reason == "timed" and third.stream_prefetch == "t0"


def test_the_environment_fixes_the_mode(tmp_path, monkeypatch, engine_kernels):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(stream_prefetch.ENV, "none")
    loaded = native._load_level.__wrapped__(engine_kernels.level)
    assert loaded.stream_prefetch == "none" and loaded.stream_choice.reason == stream_prefetch.ENV
    monkeypatch.setenv(stream_prefetch.ENV, "sideways")
    with pytest.raises(ValueError, match=stream_prefetch.ENV):
        native._load_level.__wrapped__(engine_kernels.level)


def test_l3_size_is_read():
    assert stream_prefetch.l3_bytes() >= 1 << 20
