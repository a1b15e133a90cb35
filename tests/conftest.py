"""Shared fixtures: tiny random-weight model directories, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Speculative tests count drafts: every step drafts, whatever a timing-based governor
# would decide on a loaded machine (tests/core/test_spec_governor.py covers the governor).
os.environ.setdefault("ENGINE_SPEC_ADAPTIVE", "0")


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory):
    """``factory(variant, **overrides) -> Path``; each distinct model is built once."""
    from tests.helpers.hf_models import build_model_dir

    cache: dict[tuple, Path] = {}

    def factory(variant: str = "llama-gqa", **overrides) -> Path:
        key = (variant, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            name = variant + "-" + str(len(cache))
            cache[key] = build_model_dir(tmp_path_factory.mktemp(name), variant, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama-gqa")


@pytest.fixture(autouse=True)
def _batch_invariance_off_after_each_test():
    """An in-process ``LLM(batch_invariant=True)`` turns the mode on in this process (the
    worker's switch, and the CPU kernels' C global): back to the environment's default
    after the test, so later kernel tests see the kernels' normal schedules."""
    yield
    from engine.core import batch_invariance

    if batch_invariance._enabled is None:
        return
    batch_invariance._enabled = None
    from engine.plugins.cpu import native

    for kernels in native._LOADED.values():
        kernels.set_batch_invariant(False)
