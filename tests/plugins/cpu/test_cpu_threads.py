"""The CPU worker's thread plan (cpu.threads): how many threads, where they are pinned,
how they wait, applied by the platform's init_worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from engine.plugins.cpu import threads
from engine.plugins.cpu.platform import CPUPlatform


def _fake_topology(monkeypatch, affinity: set[int], cores: dict[int, tuple[int, int]] | None):
    """Pretend the process may run on ``affinity``, CPU -> (package, core) per ``cores``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity))

    def read_int(path: str):
        if cores is None:
            return None
        cpu = int(re.search(r"/cpu(\d+)/topology/", path).group(1))
        package, core = cores[cpu]
        return package if path.endswith("physical_package_id") else core

    monkeypatch.setattr(threads, "_read_int", read_int)


SMT = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}  # two cores, two hardware threads each


def test_smt_siblings_get_no_thread_and_the_threads_are_pinned_one_per_core(monkeypatch):
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    _fake_topology(monkeypatch, {0, 1, 2, 3}, SMT)
    plan = threads.plan_threads()
    assert plan.num_threads == 2 and plan.pin_cpus == (0, 1)


def test_without_smt_the_threads_fill_the_cpus_unpinned(monkeypatch):
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    _fake_topology(monkeypatch, {1, 6}, {1: (0, 1), 6: (1, 1)})  # one thread of two cores
    assert threads.plan_threads() == threads.ThreadPlan(2, None, threads.plan_threads().reason)
    _fake_topology(monkeypatch, {0, 1, 2}, None)  # no topology exposed: every CPU counts
    assert threads.plan_threads().num_threads == 3 and threads.plan_threads().pin_cpus is None


def test_the_environment_and_num_threads_override_the_plan(monkeypatch):
    _fake_topology(monkeypatch, {0, 1, 2, 3}, SMT)
    monkeypatch.setenv(threads.BIND_ENV, "none")
    assert threads.plan_threads().pin_cpus is None
    monkeypatch.setenv(threads.BIND_ENV, "1-3")
    assert threads.plan_threads() .pin_cpus == (1, 2, 3)
    assert threads.plan_threads(2).pin_cpus == (1, 2)
    with pytest.raises(ValueError, match="lists 3 CPUs"):
        threads.plan_threads(4)
    monkeypatch.setenv(threads.BIND_ENV, "0,7")
    with pytest.raises(ValueError, match=r"CPUs \[7\] are outside"):
        threads.plan_threads()
    monkeypatch.setenv(threads.BIND_ENV, "2-x")
    with pytest.raises(ValueError, match="not a CPU or a range"):
        threads.plan_threads()
    monkeypatch.delenv(threads.BIND_ENV)
    assert threads.plan_threads(1) == threads.ThreadPlan(1, (0,), threads.plan_threads(1).reason)
    with pytest.raises(ValueError, match=">= 1"):
        threads.plan_threads(0)


def test_init_worker_applies_the_thread_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    _fake_topology(monkeypatch, {0, 1, 2, 3}, {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (0, 0)})
    monkeypatch.setattr(threads, "plan_threads", lambda n=None: threads.ThreadPlan(
        n or 1, None, "one core"))
    try:
        CPUPlatform().init_worker()
        assert torch.get_num_threads() == 1
        CPUPlatform().init_worker(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_this_machine():
    plan = threads.plan_threads()
    assert 1 <= plan.num_threads <= len(os.sched_getaffinity(0))


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, timeout=120,
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def test_the_wait_policy_is_set_before_openmp_loads_and_never_at_import():
    """``import engine`` leaves the environment alone; an engine-core process's first
    step (prepare_worker_process, before torch loads) sets the short spin; a user's own
    setting wins."""
    assert _run("import os, engine; print(os.environ.get('GOMP_SPINCOUNT'))") == "None"
    prepare = ("import os\n"
               "from engine.core.plugins import get_plugin_registry\n"
               "get_plugin_registry().prepare_worker_process()\n"
               "import torch\n"
               "print(os.environ.get('GOMP_SPINCOUNT'))")
    assert _run(prepare) == str(threads.SPIN_COUNT)
    assert _run(prepare, GOMP_SPINCOUNT="5") == "5"
    assert _run(prepare, OMP_WAIT_POLICY="passive") == "None"
    late = "import torch, os\nfrom engine.plugins.cpu import threads\n" \
           "print(threads.prepare_openmp_environment(), os.environ.get('GOMP_SPINCOUNT'))"
    assert _run(late) == "False None"  # libgomp has read its environment already


def test_pinned_threads_run_where_they_were_pinned(engine_kernels):
    """Pinning goes through one parallel region of torch's own pool; each thread reports
    the CPU it then runs on."""
    cpus = sorted(os.sched_getaffinity(0))
    code = (
        "import os, torch\n"
        "from engine.plugins.cpu.native import load_kernels\n"
        f"torch.set_num_threads({min(2, len(cpus))})\n"
        f"load_kernels().pin_threads({cpus[:2]!r})\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    # The main thread is OpenMP thread 0: it now runs on the first CPU alone.
    assert _run(code) == str([cpus[0]])
