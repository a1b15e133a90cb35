"""The plugin conformance kit (engine.testing) passes on the CPU platform and catches a
broken attention backend, naming the clause."""

from __future__ import annotations

import subprocess
import sys
import warnings
from importlib.metadata import entry_points

import pytest
import torch

from engine.core.plugins import resolve_platform

with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    # the kit's ``conformance`` marker is registered by its pytest plugin, not loaded here
    from engine.testing.conformance.test_attention import check_attention_backend


def _plugin_args() -> list[str]:
    """``-p engine.testing.pytest_plugin`` unless the pytest11 entry point already loads it
    (registering the module twice is an error)."""
    installed = any(ep.value == "engine.testing.pytest_plugin"
                    for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "engine.testing.pytest_plugin"]


def _run_kit(platform: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(),
         "--pyargs", "engine.testing.conformance", "--engine-platform", platform],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def _need_example_plugin() -> None:
    import os

    names = {ep.name for ep in entry_points(group="engine.plugins")}
    if "example" not in names:
        message = ("the example plugin is not installed (pip install -e "
                   "examples/engine-plugin-example)")
        if os.environ.get("ENGINE_CI") == "1":
            pytest.fail(message)
        pytest.skip(message)


def test_kit_passes_on_cpu() -> None:
    proc = _run_kit("cpu")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_kit_passes_on_the_out_of_tree_example_and_catches_its_planted_bug() -> None:
    """The example package's platform passes; with its test-only attention bug switched
    on, the kit fails and names the attention clauses."""
    _need_example_plugin()
    proc = _run_kit("example-torch")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    broken = _run_kit("example-torch", EXAMPLE_PLUGIN_ATTENTION_BUG="1")
    assert broken.returncode != 0
    assert "[attention.varlen]" in broken.stdout or "[attention.gqa]" in broken.stdout, (
        broken.stdout[-4000:])


def test_perturbed_attention_backend_is_caught_with_its_clause() -> None:
    platform = resolve_platform("cpu")
    base = platform.attention_backends()[0]

    class _Perturbed:
        def __init__(self, impl):
            self._impl = impl

        def forward(self, query, key, value, kv_cache, metadata):
            out = self._impl.forward(query, key, value, kv_cache, metadata)
            return out + 1e-2 * torch.ones_like(out)

    class BrokenBackend(base):
        name = "broken"

        def make_impl(self, spec):
            return _Perturbed(super().make_impl(spec))

    check_attention_backend(platform, base, num_kv_heads=2)  # the real one passes
    with pytest.raises(AssertionError, match=r"\[attention\.gqa\]\[attention\.paged\]"):
        check_attention_backend(platform, BrokenBackend, num_kv_heads=2)
    with pytest.raises(AssertionError, match=r"\[attention\.varlen\]"):
        check_attention_backend(platform, BrokenBackend, num_kv_heads=4)


def test_backends_that_ignore_sinks_or_chunks_are_caught_with_their_clause() -> None:
    """A backend that opts in to sinks / chunked local attention but drops them from the
    layer it builds fails the kit's new cases, naming the clause."""
    import dataclasses

    platform = resolve_platform("cpu")
    base = platform.attention_backends()[0]

    class IgnoresSinks(base):
        name = "ignores-sinks"

        def make_impl(self, spec):
            return super().make_impl(dataclasses.replace(spec, use_sinks=False))

    class IgnoresChunks(base):
        name = "ignores-chunks"

        def make_impl(self, spec):
            return super().make_impl(dataclasses.replace(spec, attention_chunk_size=None))

    check_attention_backend(platform, base, num_kv_heads=2, sinks=True, sliding_window=7)
    check_attention_backend(platform, base, num_kv_heads=2, attention_chunk_size=12)
    with pytest.raises(AssertionError, match=r"\[attention\.sinks\]"):
        check_attention_backend(platform, IgnoresSinks, num_kv_heads=2, sinks=True)
    with pytest.raises(AssertionError, match=r"\[attention\.chunked_local\]"):
        check_attention_backend(platform, IgnoresChunks, num_kv_heads=2,
                                attention_chunk_size=12)
