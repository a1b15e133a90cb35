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


def test_a_cgroup_quota_caps_the_thread_count(monkeypatch, tmp_path):
    """cpu.max ``150000 100000`` (1.5 CPUs) on 4 cores: 2 threads; 0.3 CPUs: 1; no
    quota (``max``): one per core. cgroup v1's -1 quota means none."""
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    _fake_topology(monkeypatch, {0, 1, 2, 3}, None)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", str(cpu_max))
    for text, want in (("150000 100000", 2), ("30000 100000", 1), ("max 100000", 4),
                       ("800000 100000", 4)):
        cpu_max.write_text(text + "\n")
        assert threads.plan_threads().num_threads == want, text
        assert threads.usable_core_count() == want, text
    assert "quota 1.5 CPUs" in (cpu_max.write_text("150000 100000"), threads.plan_threads())[1].reason
    assert threads.plan_threads(3).num_threads == 3  # asked for: the quota does not override
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    v1 = (tmp_path / "quota", tmp_path / "period")
    monkeypatch.setattr(threads, "CGROUP_V1_QUOTA", tuple(map(str, v1)))
    v1[0].write_text("-1\n"), v1[1].write_text("100000\n")
    assert threads.cpu_quota() is None
    v1[0].write_text("100000\n")
    assert threads.cpu_quota() == 1.0 and threads.plan_threads().num_threads == 1


class _Machine:
    """A fake clock and schedstat: ``advance(seconds, threads_running, wait_share)``
    moves time on with each of the governor's threads waiting that share of it."""

    def __init__(self) -> None:
        self.now, self.run_ns, self.wait_ns = 100.0, 0, 0
        self.applied: list[int] = []

    def clock(self) -> float:
        return self.now

    def times(self) -> tuple[int, int]:
        return self.run_ns, self.wait_ns

    def advance(self, seconds: float, threads_now: int, wait_share: float) -> None:
        self.now += seconds
        self.run_ns += int(seconds * threads_now * (1 - wait_share) * 1e9)
        self.wait_ns += int(seconds * threads_now * wait_share * 1e9)


def _governor(machine: _Machine, max_threads: int = 2) -> threads.ThreadGovernor:
    return threads.ThreadGovernor(max_threads, machine.applied.append, read_times=machine.times,
                                  clock=machine.clock)


def test_the_governor_keeps_every_thread_on_a_quiet_machine():
    machine = _Machine()
    governor = _governor(machine, 4)
    for _ in range(200):  # 50 s of 10 ms steps
        machine.advance(0.01, governor.threads, 0.005)
        assert governor.step() == 4
    assert machine.applied == [] and governor.changes == 0


def test_the_governor_yields_threads_under_contention_and_probes_back():
    """Contended windows drop the count to the CPUs' worth the threads got; a failed probe
    is undone and doubles the back-off (2, 4, 8, 8 s); once the neighbour leaves, the
    next probe keeps its thread and the count climbs back to the maximum."""
    machine = _Machine()
    governor = _governor(machine, 4)

    def run(seconds: float, wait_for) -> None:
        for _ in range(round(seconds / 0.01)):
            machine.advance(0.01, governor.threads, wait_for(governor.threads))
            governor.step()

    # two busy neighbours on 4 cores: beyond 2 threads, each thread waits a third
    busy = lambda t: 0.0 if t <= 2 else 0.35  # noqa: E731
    run(1.5, busy)
    assert machine.applied == [3, 2]  # 4 threads got 2.6 CPUs' worth, then 3 got 1.95
    probes = []
    start = machine.now
    for _ in range(4000):  # 40 s
        machine.advance(0.01, governor.threads, busy(governor.threads))
        before = governor.threads
        governor.step()
        if governor.threads > before:
            probes.append(round(machine.now - start, 1))
    assert governor.threads == 2
    gaps = [round(b - a, 1) for a, b in zip(probes, probes[1:])]
    assert all(gap >= 2.0 for gap in gaps) and max(gaps) <= 8.6, probes
    assert sorted(gaps)[-1] >= 7.9, gaps  # the back-off reached its cap
    # the neighbours leave: within one back-off and a few windows every thread is back
    run(8.0 + 3 * 2.5, lambda t: 0.0)
    assert governor.threads == 4 and governor.backoff_s == governor.base_backoff_s


def test_a_burst_of_contention_does_not_cost_a_thread():
    """One contended window (a front end tokenizing a burst of arrivals), then quiet steps,
    or then one long step (the prefill of that burst): the count stays."""
    machine = _Machine()
    governor = _governor(machine)
    for after in ("quiet", "long step"):
        for _ in range(30):
            machine.advance(0.01, governor.threads, 0.45)
            governor.step()
        if after == "quiet":
            for _ in range(30):
                machine.advance(0.01, governor.threads, 0.0)
                governor.step()
        else:
            machine.advance(6.0, governor.threads, 0.0)
            governor.step()
        assert governor.threads == 2 and machine.applied == [], after
    for _ in range(60):  # sustained: two windows in a row
        machine.advance(0.01, governor.threads, 0.45)
        governor.step()
    assert machine.applied == [1]


def test_the_governor_ignores_idle_gaps_and_stays_off_without_schedstat():
    machine = _Machine()
    governor = _governor(machine)
    machine.advance(5.0, 0, 0.0)  # the engine sat idle
    machine.wait_ns += int(5e9)  # whatever happened meanwhile
    assert governor.step() == 2
    off = threads.ThreadGovernor(2, machine.applied.append, read_times=lambda: None,
                                 clock=machine.clock)
    assert not off.active and off.step() == 2
    assert not threads.ThreadGovernor(1, machine.applied.append, read_times=machine.times).active
    assert machine.applied == []


def test_this_process_reports_its_threads_cpu_times():
    first = threads.thread_cpu_times()
    assert first is not None, "Linux reports per-thread schedstat"
    sum(i * i for i in range(200000))
    second = threads.thread_cpu_times()
    assert second[0] > first[0] and second[1] >= first[1]


def test_init_worker_installs_a_governor_that_before_step_drives(monkeypatch):
    """The worker calls ``before_step`` before each model step; the CPU platform's governor
    then owns the count (ENGINE_CPU_THREADS_ADAPT=0 leaves none)."""
    before = torch.get_num_threads()
    platform = CPUPlatform()
    try:
        platform.init_worker(2)
        assert platform._governor is not None and platform._governor.max_threads == 2
        platform.before_step()
        monkeypatch.setenv(threads.ADAPT_ENV, "0")
        fixed = CPUPlatform()
        fixed.init_worker(2)
        assert fixed._governor is None
        fixed.before_step()
    finally:
        torch.set_num_threads(before)


def test_decode_key_splits_follow_the_plan_not_the_governors_count(kernels):
    """(Every ISA level this CPU runs.) The worker fixes the count decode attention plans its key splits for: with it set,
    the splits (and so the softmax's summation order) stay what they were when the pool
    shrinks; 0 follows the pool again."""
    seq_lens = torch.tensor([4096], dtype=torch.int64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        kernels.set_split_threads(0)
        at_two = kernels.decode_key_splits(seq_lens, 1)
        kernels.set_split_threads(2)
        torch.set_num_threads(1)
        assert kernels.decode_key_splits(seq_lens, 1) == at_two > 1
        kernels.set_split_threads(0)
        assert kernels.decode_key_splits(seq_lens, 1) < at_two
    finally:
        kernels.set_split_threads(0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads, warned", [(None, True), (4, True), (3, False)])
def test_async_scheduling_warns_only_when_every_core_computes(monkeypatch, caplog, num_threads,
                                                              warned):
    """Async scheduling's host thread needs a core of its own to pay on the CPU
    (README, async scheduling): the platform warns when the threads take every core."""
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    _fake_topology(monkeypatch, {0, 1, 2, 3}, None)
    from engine.core.engine_args import EngineArgs

    config = EngineArgs(model=None, device="cpu", async_scheduling=True,
                        num_threads=num_threads).create_engine_config()
    with caplog.at_level("WARNING", "engine.plugins.cpu.platform"):
        CPUPlatform().check_and_update_config(config)
    assert ("async scheduling on the CPU" in caplog.text) is warned
