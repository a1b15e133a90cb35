"""The GPU platforms from the command line on a machine without them.

``engine generate --device cuda`` must fail cleanly (non-zero exit, the probe's reason,
no traceback), and ``engine plugins`` must show each GPU platform's own probe reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from engine.cli import main
from engine.core.plugins import ALLOWLIST_ENV, reset_plugin_registry
from engine.plugins.cuda.platform import CUDAPlatform
from engine.plugins.rocm.platform import ROCmPlatform
from engine.plugins.xpu.platform import XPUPlatform

GPU_PLATFORMS = {"cuda": CUDAPlatform, "rocm": ROCmPlatform, "xpu": XPUPlatform}


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    yield
    reset_plugin_registry()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_generate_on_unavailable_cuda_fails_with_the_probe_reason(llama_dir) -> None:
    reason = CUDAPlatform.probe().reason
    assert reason  # unavailable platforms always say why
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "hi", "--device", "cuda",
         "--model", str(llama_dir), "--max-tokens", "2"],
        check=False, capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first == f"Error: device 'cuda' is not available here: {reason}.", proc.stderr
    # The message lists what is installed, so the user sees the alternatives.
    assert "cpu (plugin cpu" in proc.stderr and "Choose one with --device NAME" in proc.stderr


def test_plugins_lists_each_gpu_platform_with_its_probe_reason() -> None:
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    rows = {line.split(None, 1)[0]: line for line in result.output.splitlines() if line.strip()}
    for name, cls in GPU_PLATFORMS.items():
        probe = cls.probe()
        status = "available" if probe.available else "unavailable"
        assert rows[name].split(None, 4)[4] == f"{status}: {probe.reason}"
