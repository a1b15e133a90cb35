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
        FusedMoEKernel,
        FusedOps,
        LoRAKernel,
        QuantizedGemmKernel,
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


def _status_kib(*fields: str) -> list[int] | None:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM); None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            values = dict(line.split(":", 1) for line in f if ":" in line)
        return [int(values[name].split()[0]) for name in fields]
    except (OSError, KeyError, ValueError):
        return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc), so memory ``fn`` reuses from
    earlier frees shows as growth of the resident set."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def profile_peak_rss_bytes(fn: Any) -> int | None:
    """Run ``fn()``; the growth of the resident set at its peak (None: not measurable
    here). The allocator may hand memory back between steps; the high-water mark keeps
    the peak."""
    _trim_heap()
    before = _status_kib("VmRSS")
    if before is None or not _reset_peak_rss():
        fn()
        return None
    fn()
    after = _status_kib("VmHWM")
    if after is None:
        return None
    return max(0, after[0] - before[0]) * 1024


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
        return self.kv_cache_budget(cache_config, weights_bytes, None)

    def profile_peak_bytes(self, fn: Any) -> int | None:
        return profile_peak_rss_bytes(fn)

    def kv_cache_needs_profile(self, cache_config: Any) -> bool:
        """Only a share of RAM (an explicit ``gpu_memory_utilization`` without a KV cache
        space) depends on the activations; a given size does not, and start-up skips the
        profile run (a step at max_num_batched_tokens, seconds on a small host)."""
        return (cache_config.gpu_memory_utilization is not None
                and not cache_config.cpu_kvcache_space_given())

    def kv_cache_budget(self, cache_config: Any, weights_bytes: int,
                        activation_bytes: int | None) -> int:
        """The KV cache space when given (``cpu_kvcache_space_gib`` /
        ENGINE_CPU_KVCACHE_SPACE; 4 GiB by default); with an explicit
        ``gpu_memory_utilization`` and no space given, that share of the host's RAM less
        the weights and the profiled activations, and never more than is free now."""
        activations = activation_bytes or 0
        total = self.total_memory_bytes()
        if (cache_config.gpu_memory_utilization is not None
                and not cache_config.cpu_kvcache_space_given()):
            share = int(total * cache_config.gpu_memory_utilization)
            kv_bytes = min(share - weights_bytes - activations,
                           self.available_memory_bytes() - activations)
            if kv_bytes <= 0:
                raise ValueError(
                    f"no RAM left for the KV cache: gpu_memory_utilization="
                    f"{cache_config.gpu_memory_utilization} allows {share / GIB:.2f} GiB of "
                    f"{total / GIB:.2f} GiB, but weights take {weights_bytes / GIB:.2f} GiB "
                    f"and activations {activations / GIB:.2f} GiB (and "
                    f"{self.available_memory_bytes() / GIB:.2f} GiB are free); raise it, or "
                    "give the size (--kv-cache-memory, ENGINE_CPU_KVCACHE_SPACE)")
            return kv_bytes
        kv_bytes = int(cache_config.resolved_cpu_kvcache_gib() * GIB)
        if kv_bytes + weights_bytes + activations > total:
            raise ValueError(
                f"CPU KV cache of {kv_bytes / GIB:.2f} GiB plus {weights_bytes / GIB:.2f} GiB "
                f"of weights (and {activations / GIB:.2f} GiB of activations) exceeds this "
                f"machine's {total / GIB:.2f} GiB of RAM; lower ENGINE_CPU_KVCACHE_SPACE "
                "(or cpu_kvcache_space_gib, --kv-cache-memory)"
            )
        free = self.available_memory_bytes()
        if kv_bytes > free:
            logger.warning(
                "CPU KV cache of %.2f GiB exceeds the %.2f GiB of RAM free now",
                kv_bytes / GIB,
                free / GIB,
            )
        return kv_bytes

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """float32 for bf16 / fp16 weights unless the kernels multiply that dtype natively
        (bf16 on AVX512-BF16 and AMX levels; fp16 on none): the weights stay as stored,
        half the bytes a decode step streams, and the kernels widen them as they read.
        Emulated bf16 arithmetic would be several times slower than float32 FMAs."""
        import torch

        from engine.plugins.cpu.native import load_kernels

        if weight_dtype == torch.float32:
            return weight_dtype
        kernels = load_kernels()
        if weight_dtype == torch.bfloat16 and kernels is not None and kernels.has_bf16_dot:
            return weight_dtype
        name = str(weight_dtype).removeprefix("torch.")
        where = f"{kernels.level} kernels" if kernels is not None else "no C kernels"
        storage = ("they stay " + name + ", widened inside the kernels" if kernels is not None
                   else "widened to float32 at load")
        logger.info(
            "%s checkpoint on a CPU without %s dot products (%s): weights %s, activations "
            "float32 (--dtype %s for %s activations, --dtype float32 for float32 weights)",
            name, name, where, storage, name, name,
        )
        return torch.float32

    @classmethod
    def prepare_worker_process(cls) -> None:
        """OpenMP's wait policy, which libgomp reads once when torch loads it (see
        :mod:`engine.plugins.cpu.threads`)."""
        from engine.plugins.cpu.threads import prepare_openmp_environment

        prepare_openmp_environment()

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Restrict this process to its share of the allowed CPUs (consecutive ranges, so
        ranks do not fight over cores; with more ranks than CPUs they share round-robin);
        the thread plan then sizes itself to the share."""
        from engine.plugins.cpu.threads import allowed_cpus

        cpus = allowed_cpus()
        if len(cpus) >= local_world_size:
            per = len(cpus) // local_world_size
            share = cpus[local_rank * per : (local_rank + 1) * per]
        else:
            share = [cpus[local_rank % len(cpus)]]
        try:
            os.sched_setaffinity(0, share)
        except (AttributeError, OSError) as exc:
            logger.warning("rank %d: cannot restrict to CPUs %s (%s)", local_rank, share, exc)

    def init_worker(self, num_threads: int | None = None) -> None:
        """Threads, their pinning and their wait policy (the reasoning is in
        :mod:`engine.plugins.cpu.threads`), and the heap settings that keep a forward's
        large freed activations (:mod:`engine.plugins.cpu.host_memory`).

        The plan's count (one per physical core the affinity mask allows, capped by a
        cgroup CPU quota; ``num_threads`` when given) is the most the worker runs with:
        a :class:`~engine.plugins.cpu.threads.ThreadGovernor` lowers it step by step
        while the threads wait for CPUs that something else holds (a front-end process
        on the same cores, a noisy neighbour) and raises it again when they free up,
        instead of reserving a core for a front end that may not be there."""
        from engine.core.batch_invariance import batch_invariant_enabled
        from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap
        from engine.plugins.cpu.native import load_kernels
        from engine.plugins.cpu.threads import (
            ThreadGovernor,
            adaptive_threads_enabled,
            plan_threads,
            prepare_openmp_environment,
        )

        keep_freed_blocks_in_heap()
        if not prepare_openmp_environment() and "GOMP_SPINCOUNT" not in os.environ:
            logger.debug("OpenMP was loaded before the worker was prepared: its wait policy "
                         "stays libgomp's default")
        plan = plan_threads(num_threads)
        self.set_num_threads(plan.num_threads)
        kernels = load_kernels()
        if kernels is not None:
            kernels.set_split_threads(plan.num_threads)
            kernels.set_batch_invariant(batch_invariant_enabled())
        if plan.pin_cpus is not None and kernels is not None:
            try:
                kernels.pin_threads(list(plan.pin_cpus))
            except OSError as exc:
                logger.warning("%s; threads stay unpinned", exc)
        self._governor = (ThreadGovernor(plan.num_threads, self.set_num_threads)
                          if adaptive_threads_enabled() else None)
        adapt = ("adapted to contention" if self._governor is not None and self._governor.active
                 else "fixed")
        logger.info("CPU worker: %s, count %s; %s", plan.reason, adapt,
                    f"{kernels.level} kernels" if kernels is not None else "no C kernels")

    _governor = None

    def release_cached_memory(self) -> None:
        """The KV cache lives on its own memory maps (unmapped when its tensors go); the
        heap keeps freed blocks (:mod:`engine.plugins.cpu.host_memory`): trim them."""
        from engine.plugins.cpu.host_memory import trim_heap

        trim_heap()

    def before_step(self) -> None:
        """The thread governor's turn (see :meth:`init_worker`)."""
        if self._governor is not None:
            self._governor.step()

    def set_num_threads(self, num_threads: int | None) -> None:
        """``num_threads`` intra-op threads; None: one per physical core this process may
        run on (torch's own default counts every core of the machine, which
        oversubscribes a process pinned to fewer CPUs)."""
        from engine.plugins.cpu.threads import plan_threads

        threads = plan_threads(num_threads).num_threads
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def attention_backends(self) -> list[type[AttentionBackend]]:
        """The CPU backend first; the portable Triton backend too when triton imports and
        runs interpreted (TRITON_INTERPRET=1: compiled, its kernels need a GPU)."""
        from engine.plugins.cpu.attention import CPUAttentionBackend

        backends: list[type[AttentionBackend]] = [CPUAttentionBackend]
        if (os.environ.get("TRITON_INTERPRET") == "1"
                and importlib.util.find_spec("triton") is not None):
            try:
                from engine.kernels.triton_backend import TritonAttentionBackend
            except Exception as exc:  # noqa: BLE001 - optional extra, never fatal
                logger.debug("Triton attention backend unavailable on CPU: %s", exc)
            else:
                backends.append(TritonAttentionBackend)
        return backends

    def check_and_update_config(self, config) -> None:
        """Batch-invariant mode needs the C kernels: the torch-op fallbacks (SDPA, oneDNN)
        choose their reduction order by shape."""
        from engine.plugins.cpu.native import load_kernels

        if config.model.batch_invariant and load_kernels() is None:
            raise ValueError("batch-invariant mode on the CPU needs the plugin's C kernels, "
                             "which could not be built or are disabled here (the log says why)")
        if config.scheduler.async_scheduling and self._every_core_computes(config):
            logger.warning("async scheduling on the CPU pays only where the compute "
                           "threads leave the host thread a core (--num-threads below the "
                           "core count); where every core computes, the host's Python "
                           "stalls a compute thread mid-step (measured at best even with the "
                           "serial loop on 2 cores, slower when served: README, async "
                           "scheduling)")

    @staticmethod
    def _every_core_computes(config) -> bool:
        """Whether the worker's threads take every core this process may use (none left
        for the host thread of async scheduling)."""
        from engine.plugins.cpu.threads import plan_threads

        cores = plan_threads(None).num_threads
        return (config.device.num_threads or cores) >= cores

    def dense_gemm_kernels(self) -> list[type[DenseGemmKernel]]:
        from engine.plugins.cpu.gemm import gemm_preference

        return gemm_preference()

    def quantized_gemm_kernels(self) -> list[type[QuantizedGemmKernel]]:
        """The plugin's C kernel (every encoding, every ISA level), then the torch
        reference for what it refuses (:mod:`engine.plugins.cpu.quant_gemm`)."""
        from engine.plugins.cpu.quant_gemm import quant_gemm_preference

        return quant_gemm_preference()

    def lora_kernels(self) -> list[type[LoRAKernel]]:
        """The plugin's C kernel (csrc/lora.c, replayable in forward graphs) when the C
        kernels load; else [] (the portable torch kernel)."""
        from engine.plugins.cpu.lora import lora_preference

        return lora_preference()

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

    def kernel_info(self) -> dict[str, Any]:
        """The ISA level the C kernels load (and every level this CPU runs), the GEMM
        order; builds nothing, so ``engine plugins`` stays fast."""
        from engine.plugins.cpu import kernel_build
        from engine.plugins.cpu.gemm import gemm_preference
        from engine.plugins.cpu.native import loaded_kernels, native_kernels_enabled
        from engine.plugins.cpu.quant_gemm import quant_gemm_preference

        info: dict[str, Any] = {"isa_level": None}
        try:
            info["isa_level"] = kernel_build.select_level().name
            info["isa_levels_runnable"] = [lv.name for lv in kernel_build.runnable_levels()]
            info["gemm_order"] = [k.name for k in gemm_preference()]
            info["quantized_gemm_order"] = [k.name for k in quant_gemm_preference()]
        except ValueError as exc:  # a bad ENGINE_CPU_ISA / ENGINE_CPU_GEMM
            info["error"] = str(exc)
        if not native_kernels_enabled():
            info["isa_level"] = None
            info["error"] = "C kernels disabled (ENGINE_CPU_NATIVE_KERNELS=0)"
        info["cpu_model"] = kernel_build.cpu_model_name()
        loaded = info["isa_level"] and loaded_kernels(info["isa_level"])
        if loaded:  # what cpu.kernel_tuning chose for this machine
            info["stream_prefetch"] = loaded.stream_prefetch
            if loaded.amx_min_rows is not None:
                info["amx_min_rows"] = loaded.amx_min_rows
        return info

    def fused_moe_kernels(self) -> list[type[FusedMoEKernel]]:
        from engine.plugins.cpu.fused_moe import CPUFusedMoE

        return [CPUFusedMoE]

    def communicator_cls(self) -> type[Communicator]:
        """Shared memory between the ranks of one host (each group falls back to gloo
        when its ranks are not all here); ``ENGINE_CPU_COMMUNICATOR=gloo`` forces gloo,
        as does running without the C kernels."""
        from engine.distributed import GlooCommunicator
        from engine.plugins.cpu.native import native_kernels_enabled

        choice = os.environ.get("ENGINE_CPU_COMMUNICATOR", "auto").strip().lower() or "auto"
        if choice not in ("auto", "shm", "gloo"):
            raise ValueError(f"ENGINE_CPU_COMMUNICATOR={choice!r}: expected auto, shm or gloo")
        if choice == "gloo" or not native_kernels_enabled():
            return GlooCommunicator
        from engine.plugins.cpu.shm_communicator import ShmCommunicator

        return ShmCommunicator
