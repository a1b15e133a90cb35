"""Fixtures shared by the CPU plugin's tests."""

from __future__ import annotations

import pytest

from engine.plugins.cpu import native


@pytest.fixture
def kernels() -> native.CPUKernels:
    """The plugin's compiled C kernels (the test is skipped where they cannot be built)."""
    loaded = native.load_kernels()
    if loaded is None:
        pytest.skip("no C compiler here")
    return loaded
