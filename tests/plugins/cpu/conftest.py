"""Fixtures shared by the CPU plugin's tests.

``kernels`` runs a test once per ISA level this CPU executes (an AVX-512 machine also
runs the avx2 and sse2 builds), so every level's code is checked on every machine that
can run it. A level whose kernels cannot be built fails the test: the kernel tests never
skip wholesale (CI has a compiler; a machine without one must install it).
"""

from __future__ import annotations

import pytest

from engine.plugins.cpu import kernel_build, native

LEVELS = [level.name for level in kernel_build.runnable_levels()]


def kernels_of(level: str | None) -> native.CPUKernels:
    """The compiled kernels of ``level`` (None: the engine's choice), or a test failure
    saying why there are none."""
    loaded = native.load_kernels(level)
    if loaded is None:
        pytest.fail(f"the CPU plugin's C kernels ({level or 'default level'}) could not be "
                    "built or are disabled (ENGINE_CPU_NATIVE_KERNELS); the logs say why")
    return loaded


@pytest.fixture(params=LEVELS)
def kernels(request) -> native.CPUKernels:
    """The C kernels of every ISA level this CPU runs, one test run each."""
    return kernels_of(request.param)


@pytest.fixture
def engine_kernels() -> native.CPUKernels:
    """The kernels the engine itself loads here (this CPU's best level)."""
    return kernels_of(None)
