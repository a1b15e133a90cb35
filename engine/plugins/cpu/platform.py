"""The CPU platform: always available, lowest priority, KV cache sized in GiB by config.

Memory figures come from the OS (sysconf, /proc/meminfo and the cgroup limit when the
process runs in a container), so probing needs neither psutil nor torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

from engine.core.interfaces import Platform, ProbeResult

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces import (
        AttentionBackend,
        Communicator,
        DenseGemmKernel,
        ForwardGraphCapturer,
        FusedOps,
    )

logger = logging.getLogger(__name__)

GIB = 1 << 30
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_CGROUP_USAGE_FILES = (
    "/sys/fs/cgroup/memory.current",
    "/sys/fs/cgroup/memory/memory.usage_in_bytes",
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # missing file, or "max" (no limit)
        return None


def _first_int(paths: tuple[str, ...]) -> int | None:
    for path in paths:
        value = _read_int(path)
        if value is not None:
            return value
    return None


def _meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (reported in kB) in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_limit() -> int | None:
    """The container's memory limit, when it is below the machine's RAM."""
    limit = _first_int(_CGROUP_LIMIT_FILES)  # cgroup v1 says "no limit" with a huge number
    return limit if limit and limit < _sysconf_total() else None


def physical_memory_bytes() -> int:
    """Total RAM, capped by the cgroup limit when one is set."""
    limit = _cgroup_limit()
    return limit if limit is not None else _sysconf_total()


def free_memory_bytes() -> int:
    """RAM the process could still take: MemAvailable, capped by the cgroup's headroom."""
    available = _meminfo_bytes("MemAvailable")
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    limit = _cgroup_limit()
    usage = _first_int(_CGROUP_USAGE_FILES)
    if limit is not None and usage is not None:
        available = min(available, max(0, limit - usage))
    return available


def usable_core_count() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings count once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        package = _read_int(topology + "physical_package_id")
        core = _read_int(topology + "core_id")
        if package is None or core is None:  # no topology exposed: count CPUs
            return len(cpus)
        cores.add((package, core))
    return len(cores) or 1


class CPUPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0  # the fallback: any accelerator that is available wins over it
    description = "host CPU (torch eager, gloo collectives)"
    dist_backend = "gloo"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            gib = physical_memory_bytes() / GIB
            return ProbeResult.ok(f"{os.cpu_count()} CPUs, {gib:.1f} GiB RAM")
        except Exception as exc:  # noqa: BLE001 - an odd /proc never hides the CPU
            return ProbeResult.ok(f"memory size unknown ({exc})")

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.float32, torch.bfloat16, torch.float16]

    def total_memory_bytes(self) -> int:
        return physical_memory_bytes()

    def available_memory_bytes(self) -> int:
        return free_memory_bytes()

    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        """``cache_config.resolved_cpu_kvcache_gib()`` GiB (ENGINE_CPU_KVCACHE_SPACE).

        Refused when cache plus weights exceed the machine's RAM; a cache larger than
        what is free right now only warns (the OS may reclaim page cache).
        """
        kv_bytes = int(cache_config.resolved_cpu_kvcache_gib() * GIB)
        total = self.total_memory_bytes()
        if kv_bytes + weights_bytes > total:
            raise ValueError(
                f"CPU KV cache of {kv_bytes / GIB:.2f} GiB plus {weights_bytes / GIB:.2f} GiB "
                f"of weights exceeds this machine's {total / GIB:.2f} GiB of RAM; lower "
                "ENGINE_CPU_KVCACHE_SPACE (or cpu_kvcache_space_gib)"
            )
        free = self.available_memory_bytes()
        if kv_bytes > free:
            logger.warning(
                "CPU KV cache of %.2f GiB exceeds the %.2f GiB of RAM free now",
                kv_bytes / GIB,
                free / GIB,
            )
        return kv_bytes

    def init_worker(self) -> None:
        """Keep a forward's large freed activations in the heap (see host_memory)."""
        from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap

        keep_freed_blocks_in_heap()

    def set_num_threads(self, num_threads: int | None) -> None:
        """``num_threads`` intra-op threads; None: one per physical core this process may
        run on.

        torch's own default counts every core of the machine, which oversubscribes a
        process pinned to fewer CPUs (taskset, cgroup cpusets): each op's parallel region
        then waits for a thread the OS cannot run. SMT siblings share one core's GEMM
        units, so they get no thread of their own.
        """
        if num_threads is None:
            num_threads = usable_core_count()
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        import torch

        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    def attention_backends(self) -> list[type[AttentionBackend]]:
        """The CPU backend first; the portable Triton backend too when triton imports."""
        from engine.plugins.cpu.attention import CPUAttentionBackend

        backends: list[type[AttentionBackend]] = [CPUAttentionBackend]
        if importlib.util.find_spec("triton") is not None:
            try:
                from engine.kernels.triton_backend import TritonAttentionBackend
            except Exception as exc:  # noqa: BLE001 - optional extra, never fatal
                logger.debug("Triton attention backend unavailable on CPU: %s", exc)
            else:
                backends.append(TritonAttentionBackend)
        return backends

    def dense_gemm_kernels(self) -> list[type[DenseGemmKernel]]:
        from engine.plugins.cpu.gemm import gemm_preference

        return gemm_preference()

    def fused_ops(self) -> FusedOps | None:
        """The C kernels of :mod:`engine.plugins.cpu.native` (None without a compiler)."""
        from engine.plugins.cpu.native import load_kernels

        return load_kernels()

    def forward_graph_capturer(self) -> ForwardGraphCapturer | None:
        """Graphs of C kernel calls (:mod:`engine.plugins.cpu.graphs`); None without the
        C kernels."""
        from engine.plugins.cpu.native import load_kernels

        kernels = load_kernels()
        if kernels is None:
            return None
        from engine.plugins.cpu.graphs import CPUGraphCapturer

        return CPUGraphCapturer(kernels)

    def communicator_cls(self) -> type[Communicator]:
        from engine.distributed import GlooCommunicator

        return GlooCommunicator
