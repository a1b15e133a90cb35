"""A process group shared by a trainer and the engine's ranks, for weight updates.

RL trainers (OpenRLHF, verl, TRL) broadcast new weights from their rank 0 to every
inference rank. That group must not touch torch.distributed's default (world) group,
which the engine's own tensor / pipeline groups may use, nor the trainer's: like vLLM's
``StatelessProcessGroup`` it is built from a TCPStore the trainer hosts
(``master_address:master_port``) and a backend ProcessGroup object used directly, never
registered with torch.distributed. The backend is the platform's (``Platform.dist_backend``:
gloo on the CPU, NCCL on CUDA / ROCm).

The trainer is rank 0 and calls :func:`create_weight_sync_group` with ``rank=0``; engine
rank ``i`` joins as ``rank_offset + i``. Then, per tensor, everyone calls
:meth:`WeightSyncGroup.broadcast` with ``src=0`` in the same order -- or, ``packed``, per
bucket: the tensors laid end to end (64-byte aligned) in flat byte buffers of up to
``PACKED_BUCKET_BYTES`` (:func:`packed_buckets`, computed alike on both sides from the
names, dtypes and shapes), one broadcast each, so a model of hundreds of small tensors
pays the collective's per-call latency a few times instead of once per tensor.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
PACKED_BUCKET_BYTES = 256 << 20  # most bytes one packed broadcast carries (one bigger
# tensor gets a bucket of its own)
PACKED_ALIGN = 64  # each tensor's offset in its bucket: any dtype views it in place

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


def tensor_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * torch.empty((), dtype=dtype).element_size()


def packed_buckets(specs: list[TensorSpec], bucket_bytes: int = PACKED_BUCKET_BYTES
                   ) -> list[tuple[int, list[tuple[int, int]]]]:
    """The buckets of a packed update: ``(total bytes, [(spec index, byte offset)])``
    each, tensors in order, a new bucket when the next would overflow ``bucket_bytes``."""
    buckets: list[tuple[int, list[tuple[int, int]]]] = []
    entries: list[tuple[int, int]] = []
    used = 0
    for index, (_, dtype, shape) in enumerate(specs):
        size = tensor_bytes(dtype, shape)
        if entries and used + size > bucket_bytes:
            buckets.append((used, entries))
            entries, used = [], 0
        entries.append((index, used))
        used += -(-size // PACKED_ALIGN) * PACKED_ALIGN
    if entries:
        buckets.append((used, entries))
    return buckets


class WeightSyncGroup:
    """Broadcasts over one stateless process group (the trainer is rank 0)."""

    def __init__(self, group: Any, rank: int, world_size: int, backend: str,
                 store: Any) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._store = store  # the TCPStore must outlive the group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``src``'s tensor into every rank's ``tensor`` (in place; contiguous)."""
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def barrier(self) -> None:
        """Every rank arrives (a one-element broadcast: works on every backend)."""
        self.broadcast(torch.zeros(1, device=self._device()), src=0)

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.backend == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())

    def destroy(self) -> None:
        self.group = None
        self._store = None


def create_weight_sync_group(master_address: str, master_port: int, rank: int,
                             world_size: int, backend: str = "gloo",
                             timeout_s: float = DEFAULT_TIMEOUT_S) -> WeightSyncGroup:
    """Join the group as ``rank`` of ``world_size``; rank 0 hosts the store. Blocks
    until every rank has joined (or ``timeout_s`` passes)."""
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int of at least 2 (the trainer and one "
                         f"engine rank), not {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside a group of {world_size} ranks")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port must be a TCP port number, not {master_port!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=True)
    prefixed = dist.PrefixStore("engine-weight-sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"weight updates over the {backend!r} backend are not supported "
                         "(gloo and nccl are)")
    return WeightSyncGroup(group, rank, world_size, backend, store)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> torch.bfloat16 (ValueError otherwise)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(  # noqa: TRY004 - a bad request (400), like a bad name
            f"unknown dtype {name!r} (e.g. float32, bfloat16, float16)")
    return dtype


def check_broadcast_specs(names: list[str], dtypes: list[Any], shapes: list[Any]
                          ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) triples of an update, checked before anything is sent."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, "
                         f"{len(dtypes)}, {len(shapes)})")
    if not names:
        raise ValueError("an update needs at least one tensor name")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, not {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"the shape of {name!r} must be a list of sizes, not {shape!r}")
        specs.append((name, parse_dtype(dtype), tuple(shape)))
    return specs


def broadcast_named_tensors(group: WeightSyncGroup, tensors: list[tuple[str, torch.Tensor]],
                            packed: bool = False) -> int:
    """The trainer's side: broadcast the tensors from rank 0 in order (``packed``: in
    :func:`packed_buckets`, as ``update_weights_from_distributed(..., packed=True)``
    receives them); the tensors' bytes sent."""
    tensors = [(name, tensor.detach().contiguous()) for name, tensor in tensors]
    sent = sum(t.numel() * t.element_size() for _, t in tensors)
    if not packed:
        for _, tensor in tensors:
            group.broadcast(tensor, src=0)
        return sent
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    for total, entries in packed_buckets(specs):
        flat = torch.empty(total, dtype=torch.uint8, device=tensors[0][1].device)
        for index, offset in entries:
            data = tensors[index][1].reshape(-1).view(torch.uint8)
            flat[offset : offset + data.numel()].copy_(data)
        group.broadcast(flat, src=0)
    return sent
