"""Fixtures of the quantization tests: synthetic quantized checkpoints, written once per
session into a temp directory (see :mod:`tests.quantization.refs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.quantization import refs


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """``synthetic(shape, label, quantize, qconfig) -> (dir, reference model)``: the base
    model of ``shape`` saved with every decoder linear quantized by ``quantize(prefix,
    weight)`` and ``qconfig`` as its quantization_config; the reference model holds the
    dequantized weights. ``label`` names the variant (one checkpoint per shape + label)."""
    cache: dict[tuple[str, str], tuple[Path, Any]] = {}

    def make(shape: str, label: str, quantize: Callable, qconfig: dict | None):
        key = (shape, label)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{shape}-{label}")
            cache[key] = refs.write_quantized_checkpoint(out, refs.base_model(shape), quantize,
                                                         qconfig)
        return cache[key]

    return make
