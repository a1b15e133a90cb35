"""CPU tensor parallelism over shared memory, with gloo for the rest.

A gloo all-reduce over loopback costs ~0.5 ms and a tensor-parallel decode step runs
dozens of them, which made TP=2 slower than TP=1. When every rank of a group runs on
this host, :class:`ShmCommunicator` moves the hot collectives (all_reduce, all_gather,
reduce_scatter, broadcast, barrier, and expert parallelism's all_to_all with uneven
counts) through a shared-memory segment (csrc/shm_comm.c, :mod:`.shm_segment`);
point-to-point stays on the gloo group it wraps, and process groups are still created by
torch.distributed (gloo).

The segment is set up lazily, on the group's first shared-memory collective (every rank
of a group makes the same calls in the same order, so they all arrive): the ranks
exchange their host identity over gloo; if all match, rank 0 creates a /dev/shm file,
shares its name, every rank maps it, and rank 0 unlinks it once all have. Any rank that
cannot (another host, no C compiler, ``ENGINE_CPU_NATIVE_KERNELS=0``, /dev/shm full)
makes the whole group stay on gloo.

Environment: ``ENGINE_CPU_COMMUNICATOR=auto|shm|gloo`` (read by the CPU platform),
``ENGINE_CPU_SHM_SLOT_BYTES`` (per-rank bytes per step, default 2 MiB: larger tensors
take several steps), ``ENGINE_CPU_SHM_TIMEOUT_S`` (how long a rank waits for its peers,
default the process group's timeout).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any, ClassVar

import torch

from engine.core.interfaces import GraphCaptureError
from engine.distributed import GlooCommunicator
from engine.plugins.cpu import native
from engine.plugins.cpu.shm_segment import REDUCE_DTYPES, ShmSegment

logger = logging.getLogger(__name__)

SLOT_BYTES_ENV = "ENGINE_CPU_SHM_SLOT_BYTES"
TIMEOUT_ENV = "ENGINE_CPU_SHM_TIMEOUT_S"
DEFAULT_SLOT_BYTES = 2 << 20
SHM_DIR = "/dev/shm"
_UNSET = object()


def host_identity() -> tuple[str, str]:
    """What ranks compare to know they share a host (and so /dev/shm): the hostname and
    the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def slot_bytes_setting() -> int:
    """``$ENGINE_CPU_SHM_SLOT_BYTES``, rounded up to a multiple of 64 (ValueError when
    not a positive integer)."""
    raw = os.environ.get(SLOT_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_SLOT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{SLOT_BYTES_ENV}={raw!r}: expected a positive number of bytes")
    return (value + 63) // 64 * 64


class ShmCommunicator(GlooCommunicator):
    """Gloo process groups, shared-memory hot collectives when the group is on one host."""

    # The process group's timeout (set by init_process_group): how long a shared-memory
    # collective waits for a peer that is alive but absent.
    timeout_s: ClassVar[float] = 600.0

    def __init__(self, rank: int, world_size: int, group: Any = None, *,
                 isa_level: str | None = None) -> None:
        super().__init__(rank, world_size, group)
        self.isa_level = isa_level  # whose C kernels move the bytes (None: the engine's)
        self._segment: Any = _UNSET  # ShmSegment, or None: this group stays on gloo

    @classmethod
    def init_process_group(cls, rank: int, world_size: int, init_method: str | None = "env://",
                           timeout_s: float = 600.0, store: Any = None) -> GlooCommunicator:
        ShmCommunicator.timeout_s = timeout_s
        return super().init_process_group(rank, world_size, init_method, timeout_s, store)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the hot collectives go through shared memory (sets the segment up)."""
        return self._shm() is not None

    def _shm(self) -> ShmSegment | None:
        if self._segment is _UNSET:
            if native.is_recording():  # the set-up talks over gloo: never in a capture
                raise GraphCaptureError("the shared-memory segment is set up by the group's "
                                        "first collective, which must run eagerly")
            self._segment = self._connect()
        return self._segment

    def _connect(self) -> ShmSegment | None:
        """Collective over the gloo group: the segment, or None when any rank cannot."""
        import torch.distributed as dist

        from engine.plugins.cpu.native import load_kernels

        try:
            kernels = load_kernels(self.isa_level)
        except ValueError as exc:  # e.g. a bad $ENGINE_CPU_ISA: the group still agrees
            logger.warning("no C kernels for shared-memory collectives: %s", exc)
            kernels = None
        facts: list[Any] = [None] * self.world_size
        dist.all_gather_object(facts, (host_identity(), kernels is not None), group=self.group)
        hosts = {host for host, _ in facts}
        if len(hosts) > 1 or not all(ok for _, ok in facts):
            why = "the ranks run on different hosts" if len(hosts) > 1 else \
                "a rank has no C kernels"
            logger.info("TP group of %d ranks uses gloo: %s", self.world_size, why)
            return None
        slot_bytes = slot_bytes_setting()
        timeout_s = float(os.environ.get(TIMEOUT_ENV) or self.timeout_s)
        segment, path = None, None
        if self.rank == 0:
            path = os.path.join(SHM_DIR, f"engine-shm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                segment = ShmSegment(kernels, path, 0, self.world_size, slot_bytes, True,
                                     timeout_s)
            except OSError as exc:
                logger.warning("cannot create a shared-memory segment (%s): using gloo", exc)
                path = None
        shared = [path]
        dist.broadcast_object_list(shared, src=self._global(0), group=self.group)
        path = shared[0]
        if path is None:
            return None
        if self.rank != 0:
            try:
                segment = ShmSegment(kernels, path, self.rank, self.world_size, slot_bytes,
                                     False, timeout_s)
            except OSError as exc:
                logger.warning("cannot map the shared-memory segment (%s): using gloo", exc)
        mapped: list[Any] = [None] * self.world_size
        dist.all_gather_object(mapped, segment is not None, group=self.group)
        if self.rank == 0:
            os.unlink(path)  # every rank has it mapped (or has given up): nothing leaks
        if not all(mapped):
            if segment is not None:
                segment.close()
            return None
        logger.info("TP group of %d ranks uses shared memory (%d-byte slots)",
                    self.world_size, slot_bytes)
        return segment

    def _routes(self, tensor: torch.Tensor) -> ShmSegment | None:
        """The segment when ``tensor`` can go through it (a CPU tensor)."""
        if tensor.device.type != "cpu":
            return None
        return self._shm()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        shm = self._routes(tensor) if tensor.dtype in REDUCE_DTYPES else None
        if shm is None:
            return super().all_reduce(tensor)
        if tensor.numel() == 0:
            return tensor
        if tensor.is_contiguous():
            return shm.all_reduce_(tensor)
        return tensor.copy_(shm.all_reduce_(tensor.contiguous()))

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if tensor.dim() == 0:
            raise ValueError("all_gather needs a tensor with at least one dimension, "
                             "got a scalar")
        if self.world_size == 1:
            return tensor
        shm = self._routes(tensor)
        if shm is None:
            return super().all_gather(tensor, dim)
        return shm.all_gather(tensor.contiguous(), dim % tensor.dim())

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if tensor.dim() == 0 or self.world_size == 1 or tensor.dtype not in REDUCE_DTYPES:
            return super().reduce_scatter(tensor, dim)
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.world_size or self._routes(tensor) is None:
            return super().reduce_scatter(tensor, dim)
        chunk = tensor.shape[dim] // self.world_size
        reduced = self.all_reduce(tensor.contiguous().clone())
        return reduced.narrow(dim, self.rank * chunk, chunk).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        shm = self._routes(tensor)
        if shm is None:
            return super().broadcast(tensor, src)
        if tensor.is_contiguous():
            return shm.broadcast_(tensor, src)
        return tensor.copy_(shm.broadcast_(tensor.contiguous(), src))

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        shm = self._routes(tensor) if tensor.dim() and self.world_size > 1 else None
        if shm is None:
            return super().all_to_all(tensor, send_counts, recv_counts)
        self.check_all_to_all_counts(tensor, send_counts, recv_counts)
        return shm.all_to_all(tensor.contiguous(), list(send_counts), list(recv_counts))

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        shm = self._shm()
        if shm is None:
            super().barrier()
        else:
            shm.barrier()

    def __repr__(self) -> str:
        how = {True: "shm", False: "gloo"}.get(
            None if self._segment is _UNSET else self._segment is not None, "unset")
        return f"ShmCommunicator(rank={self.rank}, world_size={self.world_size}, via={how})"
