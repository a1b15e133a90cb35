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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BIND_ENV = "ENGINE_CPU_THREADS_BIND"
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


def usable_core_count() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings count once)."""
    return len(one_cpu_per_core(allowed_cpus()))


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
    threads = num_threads or len(cores)
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
    return ThreadPlan(threads, None, f"{threads} threads on {len(cpus)} CPUs, unpinned "
                                     "(each CPU is its own core)")


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
