"""How a CPU worker runs its threads: how many, where they are pinned, how they wait.

The CPU platform's ``init_worker`` applies a :class:`ThreadPlan` made by
:func:`plan_threads`; the reasoning behind each choice:

* **How many.** One per physical core the process may run on (its affinity mask, so
  ``taskset`` and cgroup cpusets are honoured). SMT siblings share one core's FMA units
  and its L1/L2: a second thread per core adds no arithmetic to the GEMMs and halves
  each thread's cache, and the OpenMP pool's every parallel region then waits for its
  slowest thread. ``num_threads`` (``--num-threads``) overrides.
* **Where.** Where the mask holds SMT siblings, thread i is pinned to one hardware thread
  of physical core i: left to itself the OS may run two of our threads on one core's
  siblings while another core idles, and every region waits for that core. Where each
  CPU is its own core, the threads stay unpinned: they cannot collide then, and an
  unpinned thread can move off a core that another process (the API server, a
  benchmark client) is busy on. ``$ENGINE_CPU_THREADS_BIND`` = ``auto`` | ``none`` | a
  CPU list (``0-3``, ``0,2,4,6``) overrides.
* **How they wait.** libgomp's threads spin ~300000 rounds between parallel regions
  before they sleep. Within a step that pays (regions follow each other microseconds
  apart; a futex wake-up costs ~5-10 us), but after the step the spinning threads hold
  their cores through the scheduler's and sampler's Python, which starves a front-end
  process on the same cores and stalls the next regions 10-40x when the OS preempts a
  spinner. ``GOMP_SPINCOUNT=20000`` (tens of microseconds) keeps the within-step
  benefit (measured within noise on a quiet machine) and lets the threads sleep soon
  after a step. libgomp reads it once, when it loads, so it is set before torch is
  imported (:func:`prepare_openmp_environment`, run first thing in an engine-core
  process); a user's ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is kept.
* **How many the process really gets.** A cgroup CPU quota (``cpu.max``: a container
  given 1.5 CPUs of a 16-core host) caps the count at the quota, rounded to the nearest
  whole CPU. And the cores are often shared with what the plan cannot see: the API
  server's process, a tokenizer, a noisy neighbour. Every parallel region ends in a
  barrier that waits for its slowest thread, so one thread descheduled in favour of
  another process stalls the whole team for an OS time slice, region after region:
  measured on 2 cores beside one busy process, 2 threads keep 30-34% of their quiet
  throughput (llama-tiny), 1 thread 90-100% of its own, which is ~55% of the quiet
  2-thread figure. So the count is not fixed: :class:`ThreadGovernor` watches, step by
  step, how long the process's threads wait on a run queue for a CPU (the kernel's
  schedstat), drops threads while they wait (two quarter-second windows in a row in which
  each thread waits more than a quarter of the time: what a neighbour holding a whole core costs;
  a front end and a benchmark client sharing the cores cost 12-19%, and there 2 threads
  still beat 1), and probes one more thread again after a back-off
  (2 s, doubling to 8 s while probes fail). Quiet, no thread waits and the count stays
  at the plan's; the probe of a contended machine costs one window. This is also how the
  engine keeps a core for the server's front end when the two share a host: not by
  reserving one up front (on 2 cores that would halve every quiet step), but by yielding
  one while the front end's work really competes for it. ``ENGINE_CPU_THREADS_ADAPT=0``
  keeps the count fixed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BIND_ENV = "ENGINE_CPU_THREADS_BIND"
ADAPT_ENV = "ENGINE_CPU_THREADS_ADAPT"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")
SPIN_COUNT = 20000
_WAIT_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


@dataclass(frozen=True)
class ThreadPlan:
    """What init_worker applies."""

    num_threads: int
    pin_cpus: tuple[int, ...] | None  # thread i -> pin_cpus[i]; None: not pinned
    reason: str  # one line for the log


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def core_of(cpu: int) -> tuple[int, int] | None:
    """(package, core) of a logical CPU, None where the OS does not say."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    package, core = _read_int(topology + "physical_package_id"), _read_int(topology + "core_id")
    return None if package is None or core is None else (package, core)


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return list(range(os.cpu_count() or 1))


def one_cpu_per_core(cpus: list[int]) -> list[int]:
    """The first allowed CPU of each physical core, in CPU order (every CPU when the
    topology is unknown)."""
    seen: set[tuple[int, int]] = set()
    first: list[int] = []
    for cpu in cpus:
        core = core_of(cpu)
        if core is None:
            return list(cpus)
        if core not in seen:
            seen.add(core)
            first.append(cpu)
    return first or list(cpus)


def cpu_quota() -> float | None:
    """The CPUs' worth of time a cgroup quota grants this process (``cpu.max`` 150000
    100000 -> 1.5), None without a quota."""
    try:
        quota, period = Path(CGROUP_CPU_MAX).read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota, period = (int(Path(path).read_text().strip()) for path in CGROUP_V1_QUOTA)
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # v1: -1 is "no quota"


def quota_threads(cores: int, quota: float | None) -> int:
    """Threads for ``cores`` usable cores under ``quota`` CPUs: the quota rounded to the
    nearest whole CPU (at least one), never more than the cores."""
    if quota is None:
        return cores
    return max(1, min(cores, math.floor(quota + 0.5)))


def usable_core_count() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings count once),
    capped by a cgroup CPU quota."""
    return quota_threads(len(one_cpu_per_core(allowed_cpus())), cpu_quota())


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError as exc:
            raise ValueError(f"{BIND_ENV}={text!r}: {part!r} is not a CPU or a range") from exc
        if first < 0 or last < first:
            raise ValueError(f"{BIND_ENV}={text!r}: bad range {part!r}")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{BIND_ENV}={text!r} names no CPU")
    return tuple(cpus)


def plan_threads(num_threads: int | None = None) -> ThreadPlan:
    """The plan for this process (see the module docstring for the reasoning)."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    cpus = allowed_cpus()
    cores = one_cpu_per_core(cpus)
    bind = os.environ.get(BIND_ENV, "auto").strip().lower() or "auto"
    quota = cpu_quota()
    threads = num_threads or quota_threads(len(cores), quota)
    if bind == "none":
        return ThreadPlan(threads, None, f"{threads} threads, unpinned ({BIND_ENV}=none)")
    if bind != "auto":
        listed = parse_cpu_list(bind)
        outside = sorted(set(listed) - set(cpus))
        if outside:
            raise ValueError(f"{BIND_ENV}={bind!r}: CPUs {outside} are outside this process's "
                             f"affinity {cpus}")
        threads = num_threads or len(listed)
        if threads > len(listed):
            raise ValueError(f"{threads} threads but {BIND_ENV} lists {len(listed)} CPUs")
        return ThreadPlan(threads, listed[:threads], f"{threads} threads pinned to {listed}")
    if len(cores) < len(cpus) and threads <= len(cores):
        pins = tuple(cores[:threads])
        return ThreadPlan(threads, pins, f"{threads} threads, one per physical core, "
                                         f"pinned to CPUs {list(pins)} (SMT siblings left idle)")
    quota_note = "" if quota is None else f", cgroup quota {quota:g} CPUs"
    return ThreadPlan(threads, None, f"{threads} threads on {len(cpus)} CPUs, unpinned "
                                     f"(each CPU is its own core{quota_note})")


def thread_cpu_times() -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting on a run queue) summed over this process's threads, from
    the kernel's schedstat; None where it does not report them."""
    run = wait = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
            run += int(fields[0])
            wait += int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return run, wait


def adaptive_threads_enabled() -> bool:
    return os.environ.get(ADAPT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ThreadGovernor:
    """The intra-op thread count, step by step, sized to the CPUs the process gets (the
    module docstring says why). :meth:`step` runs before every model step; it reads the
    clock and, once a window has passed, the threads' schedstat.

    A window of ``window_s`` is judged by the share of it each thread spent waiting for
    a CPU: above ``wait_share`` the CPUs are contended, and after ``patience`` contended
    windows in a row the count drops to the CPUs' worth of time the threads did get (at
    least one fewer). One window is not enough: a server's front end tokenizing a burst
    of arrivals holds a core for a fraction of a second, and a drop then would run the
    long prefill step that follows on fewer threads. At or below, a count under
    the maximum probes one more thread once ``backoff_s`` has passed since the last
    change. A probe that meets contention is undone and doubles the back-off (up to
    ``max_backoff_s``); one that does not resets it. A window much longer than
    ``window_s`` (the engine sat idle, or one long step filled it) is not judged, and
    breaks a run of contended windows.
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 read_times: Callable[[], tuple[int, int] | None] = thread_cpu_times,
                 clock: Callable[[], float] = time.monotonic, window_s: float = 0.25,
                 wait_share: float = 0.25, patience: int = 2, backoff_s: float = 2.0,
                 max_backoff_s: float = 8.0) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self._set_threads = set_threads
        self._read_times = read_times
        self._clock = clock
        self.window_s = window_s
        self.wait_share = wait_share
        self.patience = patience
        self._contended_windows = 0
        self.base_backoff_s = backoff_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._probing_from: int | None = None  # the count a probe raised from
        self._last_change = clock()
        self._window_start = self._last_change
        self._window_times = read_times()
        self.changes = 0  # how often the count moved (for tests and the log)

    @property
    def active(self) -> bool:
        return self._window_times is not None and self.max_threads > 1

    def step(self) -> int:
        """Before a model step: the thread count it runs with."""
        if not self.active:
            return self.threads
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.window_s:
            return self.threads
        times = self._read_times()
        if times is None:
            self._window_times = None
            return self.threads
        (run0, wait0), (run1, wait1) = self._window_times, times
        self._window_start, self._window_times = now, times
        if elapsed > 4 * self.window_s:
            self._contended_windows = 0
            return self.threads  # an idle gap or one long step, not a window of steps
        wait = (wait1 - wait0) / 1e9 / elapsed / self.threads
        ran = (run1 - run0) / 1e9 / elapsed
        if wait > self.wait_share:
            self._contended_windows += 1
            if self._probing_from is not None or self._contended_windows >= self.patience:
                self._contended(now, ran, wait)
        else:
            self._contended_windows = 0
            self._quiet(now)
        return self.threads

    def _contended(self, now: float, cpus_got: float, wait: float) -> None:
        if self._probing_from is not None:
            target = self._probing_from
            self.backoff_s = min(self.max_backoff_s, self.backoff_s * 2)
        else:
            target = max(1, min(self.threads - 1, math.floor(cpus_got + 0.5)))
        self._probing_from = None
        self._contended_windows = 0
        self._apply(target, now, f"each thread waits {wait:.0%} of the time for a CPU "
                                 f"({cpus_got:.2f} CPUs' worth used)")

    def _quiet(self, now: float) -> None:
        if self._probing_from is not None:
            self._probing_from = None
            self.backoff_s = self.base_backoff_s
            return
        if self.threads < self.max_threads and now - self._last_change >= self.backoff_s:
            self._probing_from = self.threads
            self._apply(self.threads + 1, now, "probing one more thread")

    def _apply(self, threads: int, now: float, why: str) -> None:
        self._last_change = now
        if threads == self.threads:
            return
        logger.debug("CPU threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)


def openmp_loaded() -> bool:
    """Whether this process has already loaded an OpenMP runtime (torch brings libgomp)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line or "libiomp" in line for line in f)
    except OSError:
        import sys

        return "torch" in sys.modules


def prepare_openmp_environment() -> bool:
    """Set the wait policy of the module docstring for an OpenMP runtime that has not
    loaded yet. Returns whether it will apply (False: the user set one, or libgomp
    already read its environment)."""
    if any(name in os.environ for name in _WAIT_SETTINGS):
        return False
    if openmp_loaded():
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
