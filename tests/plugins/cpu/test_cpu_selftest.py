"""The kernels' self-test driver: every kernel of a build checked against the float64 and
op-chain references, through csrc/selftest_main.c.

Natively, the driver links the level libraries this CPU runs (which proves the driver and
its file format against the same kernels the other tests call directly). For aarch64 the
NEON build is cross-compiled with Debian's gcc-aarch64-linux-gnu and run under qemu-user's
qemu-aarch64 with two OpenMP threads: the kernels of a CPU this machine is not are held to
the same references. .ci/run installs both tools; without them the test fails in CI
(``ENGINE_CI=1``) and is skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil

import pytest

from engine.plugins.cpu import kernel_build
from tests.plugins.cpu.conftest import LEVELS, kernels_of
from tests.plugins.cpu.selftest_cases import standard_suite

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"


@pytest.mark.parametrize("level", LEVELS)
def test_native_builds_pass_the_selftest(level, tmp_path):
    kernels = kernels_of(level)
    driver = tmp_path / f"selftest-{level}"
    kernel_build.link_selftest(os.environ.get("CC") or "cc", kernels.path, driver)
    out = standard_suite(pairs=kernels.has_bf16_dot).run([str(driver)], tmp_path)
    assert out.startswith(f"{level}: ")


def _cross_tools_or_fail() -> None:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if not missing:
        return
    message = (f"{', '.join(missing)} not installed (apt install gcc-aarch64-linux-gnu "
               "qemu-user): the aarch64 kernels are not checked")
    if os.environ.get("ENGINE_CI"):
        pytest.fail(message)
    pytest.skip(message)


def test_the_aarch64_build_passes_the_selftest_under_qemu(tmp_path):
    _cross_tools_or_fail()
    if kernel_build.machine() == "aarch64":
        pytest.skip("this machine is aarch64: the native test runs the NEON build")
    driver = tmp_path / "selftest-neon"
    kernel_build.compile_selftest(CROSS_CC, kernel_build.LEVELS["neon"], driver)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = standard_suite(pairs=False).run([QEMU, str(driver)], tmp_path, env=env)
    assert out.startswith("neon: ")
