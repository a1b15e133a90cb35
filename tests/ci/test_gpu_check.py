"""ci/gpu_check.py, the prepared GPU check, stays runnable where the engine is partial.

The GPU machine's image lacks the engine's config/IPC dependencies unless wheels are
carried, so the kernel sections must import without them, and the end-to-end section's
wiring (model choice, ``engine generate`` call, JSON parsing, tokens/s) is checked here on
the CPU through ``--e2e-only --e2e-device cpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "gpu_check.py"


def test_kernel_sections_import_without_the_engine_service_dependencies() -> None:
    code = (
        "import sys, importlib.util\n"
        "for name in ('pydantic', 'pydantic_core', 'msgspec', 'zmq', 'fastapi', 'uvicorn'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('gpu_check', {str(SCRIPT)!r})\n"
        "module = sys.modules['gpu_check'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "ua, rc, tb, stats = module.import_kernels()\n"
        "print(tb.TritonAttentionBackend.name, sorted(stats.launches.snapshot()))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        "triton ['reshape_and_cache', 'split_kv_attention', 'split_kv_reduce', "
        "'unified_attention']"
    )


@pytest.mark.slow
def test_e2e_section_runs_engine_generate_and_reports_tokens_per_second(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--e2e-only", "--e2e-device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (section,) = json.loads((tmp_path / "gpu_check.json").read_text())
    assert section["name"] == "end-to-end" and not section["errors"]
    first, split, *quantized = section["rows"]  # then the GPTQ fixture's run, if present
    for row in (first, split, *quantized):
        assert row["ok"] and row["rc"] == 0 and row["tokens"] == 16
        assert row["tok_s_incl_startup"] == pytest.approx(16 / row["engine_s"])
    assert split["same_tokens_as_auto"] is True
    assert "RESULT: PASS" in proc.stdout


@pytest.mark.slow
def test_batch_invariant_section_wiring_on_tiny_cpu_shapes() -> None:
    """Section 2d's invariance checks run (tiny shapes, interpreted kernels, no timing)
    without the engine's service dependencies."""
    code = (
        "import sys, importlib.util\n"
        "for name in ('pydantic', 'pydantic_core', 'msgspec', 'zmq', 'fastapi', 'uvicorn'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('gpu_check', {str(SCRIPT)!r})\n"
        "module = sys.modules['gpu_check'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.import_kernels()\n"
        "import torch\n"
        "s = module.check_batch_invariant(torch, torch.device('cpu'), 4.8, 989, small=True)\n"
        "print(s.errors, [row['ok'] for row in s.rows])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[] [True, True, True, True]"


def test_the_gpu_kernel_shim_keeps_the_kernel_tests_meaning_on_another_device() -> None:
    """ci/gpu_kernel_shim.py moves each Triton launcher's tensors to the GPU and back; in
    its ``cpu`` mode (each argument cloned, kernels interpreted) the kernel tests must still
    pass: written outputs reach the caller's tensors, returned ``out=`` keeps its identity,
    and every launcher named in it exists."""
    repo = SCRIPT.parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "ENGINE_GPU_SHIM_DEVICE": "cpu",
           "PYTHONPATH": str(repo / "ci")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "gpu_kernel_shim", "tests/kernels/test_mla_attention.py",
         "tests/kernels/test_lora_kernels.py", "-k", "not can_implement"],
        capture_output=True, text=True, timeout=300, env=env, cwd=repo, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Triton launchers run on cpu" in proc.stdout
    assert " passed" in proc.stdout and "failed" not in proc.stdout
