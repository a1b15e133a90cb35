"""The Platform contract: everything the engine asks of a kind of hardware.

A plugin contributes Platform subclasses. The engine never names a device outside
``engine/plugins``; it asks the current Platform for its torch device, dtypes, memory,
attention backend, communicator and quantized-GEMM kernels.

``probe()`` must be cheap and must not raise: a missing vendor stack makes the platform
unavailable with a human-readable reason, it never breaks the package. Heavy imports
belong inside methods, not at module import time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces.attention import AttentionBackend
    from engine.core.interfaces.communicator import Communicator
    from engine.core.interfaces.fused_ops import FusedOps
    from engine.core.interfaces.gemm import DenseGemmKernel
    from engine.core.interfaces.graphs import ForwardGraphCapturer
    from engine.core.interfaces.lora import LoRAKernel
    from engine.core.interfaces.moe import FusedMoEKernel
    from engine.core.interfaces.quant import QuantizedGemmKernel


@dataclass(frozen=True)
class DeviceCapability:
    """A device's identity and arithmetic, as kernels need to choose a path.

    ``arch``: e.g. "sm_90", "gfx942", "xe-hpc"; ``major`` / ``minor``: CUDA compute
    capability (or the vendor's closest analogue); ``fp8_dtype``: the FP8 e4m3 flavour
    the hardware computes in ("e4m3fn"; "e4m3fnuz" on MI300-class ROCm; None: none);
    ``fp8_mma`` / ``fp4_mma`` / ``int8_mma``: tensor-core (matrix) instructions for those
    types."""

    vendor: str
    arch: str
    major: int = 0
    minor: int = 0
    fp8_dtype: str | None = None
    fp8_mma: bool = False
    fp4_mma: bool = False
    int8_mma: bool = False


@dataclass(frozen=True)
class ProbeResult:
    """Whether a platform can run here, and why not when it cannot."""

    available: bool
    reason: str = ""  # why unavailable; for available platforms, a short description

    @classmethod
    def ok(cls, description: str = "") -> "ProbeResult":
        return cls(True, description)

    @classmethod
    def unavailable(cls, reason: str) -> "ProbeResult":
        return cls(False, reason)


class Platform(ABC):
    """One kind of hardware, as seen by the engine.

    Class attributes identify it; instances are created only once ``probe()`` said yes.
    """

    name: ClassVar[str]  # what ``--device NAME`` selects, e.g. "cpu", "cuda"
    device_type: ClassVar[str]  # torch device type, e.g. "cpu", "cuda", "xpu"
    priority: ClassVar[int] = 0  # ``--device auto`` picks the highest available
    description: ClassVar[str] = ""
    # Name of the torch.distributed backend its Communicator uses ("gloo", "nccl", ...).
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Cheap availability check; never raises."""

    # -- device ---------------------------------------------------------------------------
    def device(self, index: int = 0) -> "torch.device":
        import torch

        return torch.device(self.device_type, index)

    @abstractmethod
    def supported_dtypes(self) -> list["torch.dtype"]:
        """Activation/weight dtypes this platform computes in."""

    def check_dtype(self, dtype: "torch.dtype") -> str | None:
        """Why ``dtype`` cannot be used here (None when it can)."""
        if dtype not in self.supported_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
            return (
                f"platform {self.name!r} does not support dtype "
                f"{str(dtype).removeprefix('torch.')}; supported: {names}"
            )
        return None

    def activation_dtype(self, weight_dtype: "torch.dtype") -> "torch.dtype":
        """The dtype to compute in when ``--dtype auto`` loads weights of ``weight_dtype``
        (they stay stored as they are). The same by default; a platform without fast
        arithmetic in a narrow dtype may widen the activations (a CPU without bf16 dot
        products computes a bf16 checkpoint in float32)."""
        return weight_dtype

    @abstractmethod
    def total_memory_bytes(self) -> int:
        """Total memory of one device."""

    @abstractmethod
    def available_memory_bytes(self) -> int:
        """Memory free right now on one device."""

    @abstractmethod
    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        """Bytes the KV cache may take, given the cache config and loaded weights."""

    # -- memory profiling (engine.model_executor.worker: the profile run) ------------------
    def profile_peak_bytes(self, fn: Any) -> int | None:
        """Run ``fn()`` and return the peak memory it used above what was in use before
        (activations, workspaces, the sampler's buffers), or None when this platform
        cannot measure it: the KV cache is then sized analytically (``kv_cache_bytes``).
        Devices read their allocator's peak statistics; the CPU its resident set."""
        fn()
        return None

    def kv_cache_needs_profile(self, cache_config: Any) -> bool:
        """Whether ``kv_cache_budget`` under ``cache_config`` depends on the measured
        activations, so a profile run is worth its start-up time. Default: no."""
        return False

    def kv_cache_budget(self, cache_config: Any, weights_bytes: int,
                        activation_bytes: int | None) -> int:
        """Bytes the KV cache may take once a profile run measured ``activation_bytes``
        of peak activations (None: not measured). Default: ``kv_cache_bytes``, the
        analytic rule (what a platform written before profiling existed keeps)."""
        return self.kv_cache_bytes(cache_config, weights_bytes)

    def seed_everything(self, seed: int) -> None:
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def release_cached_memory(self) -> None:
        """Hand memory the process freed (tensors dropped by sleep mode) back to the
        device or the OS: a caching allocator empties its cache here. Default: nothing
        to do."""

    def make_generator(self, seed: int) -> "torch.Generator":
        import torch

        gen = torch.Generator(device=self.device())
        gen.manual_seed(seed)
        return gen

    # -- components -----------------------------------------------------------------------
    @abstractmethod
    def attention_backends(self) -> list[type["AttentionBackend"]]:
        """Attention backends in preference order (first usable one is taken)."""

    def get_attention_backend(self, name: str | None = None) -> type["AttentionBackend"]:
        """The backend called ``name``, or the preferred one."""
        backends = self.attention_backends()
        if name is None:
            return backends[0]
        for backend in backends:
            if backend.name == name:
                return backend
        known = ", ".join(b.name for b in backends)
        raise ValueError(
            f"attention backend {name!r} is not offered by platform {self.name!r}; "
            f"offered: {known}"
        )

    @abstractmethod
    def communicator_cls(self) -> type["Communicator"]:
        """Collective layer for tensor / pipeline / expert parallelism."""

    def quantized_gemm_kernels(self) -> list[type["QuantizedGemmKernel"]]:
        """Quantized-GEMM kernels in preference order (empty: no quantization)."""
        return []

    def dense_gemm_kernels(self) -> list[type["DenseGemmKernel"]]:
        """Kernels for unquantized linears in preference order (empty: ``F.linear``)."""
        return []

    def fused_moe_kernels(self) -> list[type["FusedMoEKernel"]]:
        """Fused mixture-of-experts kernels in preference order (empty: the portable
        torch implementation of the MoE layer)."""
        return []

    def lora_kernels(self) -> list[type["LoRAKernel"]]:
        """Batched multi-LoRA kernels in preference order (empty: the portable torch
        implementation, :class:`engine.kernels.lora_torch.TorchLoRAKernel`)."""
        return []

    def fused_ops(self) -> "FusedOps | None":
        """Fused norm / activation / rotary kernels, or None (the layers' torch ops)."""
        return None

    def forward_graph_capturer(self) -> "ForwardGraphCapturer | None":
        """A new capturer of forward graphs (see ``interfaces.graphs``), or None when the
        platform has none: every forward then runs eagerly."""
        return None

    def kernel_info(self) -> dict[str, Any]:
        """What the platform computes with, for ``engine plugins`` and benchmark reports
        (e.g. the CPU's ISA level and kernel order); cheap, plain JSON values."""
        return {}

    def check_and_update_config(self, config: Any) -> None:
        """Adjust or reject an engine config for this platform (raise ValueError)."""

    @classmethod
    def prepare_worker_process(cls) -> None:
        """Settings that must be in place before device runtimes load (environment
        variables a library reads once, when it loads: OpenMP's wait policy). Called for
        every installed platform, first thing in an engine-core process, before any
        probe has imported torch; must be cheap and never raise."""

    # The Ray resource one rank of this platform reserves (None: one CPU).
    ray_device_key: str | None = None

    def device_capability(self) -> "DeviceCapability | None":
        """What the device's arithmetic can do, for kernels' ``can_implement`` (None:
        not a GPU-class device; kernels that need one refuse)."""
        return None

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Give a worker process its share of the node: ``local_rank`` of
        ``local_world_size`` ranks on this machine (a GPU platform selects device
        ``local_rank``; the CPU platform restricts the process to its share of the
        cores). Called before :meth:`init_worker` in multi-rank engines only."""

    def init_worker(self, num_threads: int | None = None) -> None:
        """Process-wide setup of a process about to run models (threads and their
        pinning, allocator settings, device selection); called once before the model
        loads. ``num_threads``: host threads asked for (None: the platform's choice)."""
        self.set_num_threads(num_threads)

    def set_num_threads(self, num_threads: int | None) -> None:
        """Intra-op parallelism for host-side compute (meaningful on CPU)."""

    def before_step(self) -> None:
        """Called by the worker before every model step, on the step loop's hot path
        (keep it to a clock read in the common case): a platform adapts its runtime to
        conditions that change while the engine runs (the CPU platform sizes its thread
        count to the CPUs the process really gets)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
