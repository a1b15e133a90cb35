"""Collectives over torch.distributed, shared by every platform plugin.

torch.distributed already hides NCCL, RCCL (exposed as "nccl"), oneCCL ("xccl", or "ccl"
through the oneccl bindings) and gloo behind one API, so one Communicator serves all
platforms; a platform only names its backend with :meth:`for_backend`. Collectives are
the rank-order concatenations and sums the tensor / pipeline / expert-parallel layers
expect, and a world of one rank returns its input without touching torch.distributed.
"""

from __future__ import annotations

import datetime
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from engine.core.interfaces import Communicator

if TYPE_CHECKING:
    import torch

# Backends that exist only after importing a bindings module.
_BACKEND_MODULES = {"ccl": "oneccl_bindings_for_pytorch"}

_subclasses: dict[str, type[TorchDistributedCommunicator]] = {}


def _all_gather_single(dist: Any) -> Any:
    """Newer torch renamed all_gather_into_tensor (the old name warns)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single(dist: Any) -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _require_dims(tensor: torch.Tensor, op: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{op} needs a tensor with at least one dimension, got a scalar")


class TorchDistributedCommunicator(Communicator):
    """A Communicator over one torch.distributed process group.

    ``group=None`` means the default (world) group; ``rank`` is this process's rank
    inside ``group`` and ``src``/``dst`` arguments are group ranks too.
    """

    backend: ClassVar[str] = "gloo"
    # Single-tensor all-gather / reduce-scatter; False emulates them with list all_gather
    # and all_reduce (older gloo builds lack the native ops).
    native_tensor_collectives: ClassVar[bool] = True

    @classmethod
    def for_backend(cls, backend: str) -> type[TorchDistributedCommunicator]:
        """The communicator class bound to torch.distributed backend ``backend``."""
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend must be a torch.distributed backend name, got {backend!r}")
        if backend not in _subclasses:  # a backend registered by some other package
            name = f"{backend.capitalize()}Communicator"
            _subclasses[backend] = type(name, (cls,), {"backend": backend, "__module__": __name__})
        return _subclasses[backend]

    @classmethod
    def init_process_group(
        cls,
        rank: int,
        world_size: int,
        init_method: str | None = "env://",
        timeout_s: float = 600.0,
        store: Any = None,
    ) -> TorchDistributedCommunicator:
        """Join (or reuse) the default process group with this class's backend, meeting
        the other ranks through ``init_method`` or, when given, a torch.distributed
        ``store`` (the data-parallel ranks' shared rendezvous)."""
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
        module = _BACKEND_MODULES.get(cls.backend)
        if module is not None:
            importlib.import_module(module)  # registers the backend with torch.distributed
        if not dist.is_initialized():
            where = {"store": store} if store is not None else {"init_method": init_method}
            dist.init_process_group(
                backend=cls.backend,
                **where,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        elif dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        return cls(rank, world_size)

    def _global(self, group_rank: int) -> int:
        """torch.distributed's point-to-point and broadcast calls take global ranks."""
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"rank {group_rank} is outside a group of {self.world_size} ranks")
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        _require_dims(tensor, "all_gather")
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        dim = dim % tensor.dim()
        tensor = tensor.contiguous()
        if not self.native_tensor_collectives:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor, group=self.group)
            return torch.cat(parts, dim=dim)
        # Gather along dim 0 (rank-major), view as [W, *shape], then merge W into ``dim``.
        out = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather_single(dist)(out, tensor, group=self.group)
        if dim == 0:
            return out
        shape = list(tensor.shape)
        shape[dim] *= self.world_size
        return out.view(self.world_size, *tensor.shape).movedim(0, dim).reshape(shape)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        _require_dims(tensor, "reduce_scatter")
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible "
                f"by the world size {self.world_size}"
            )
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        chunk = tensor.shape[dim] // self.world_size
        if not self.native_tensor_collectives:
            reduced = self.all_reduce(tensor.clone())
            return reduced.narrow(dim, self.rank * chunk, chunk).contiguous()
        # Put ``dim`` first so torch's dim-0 chunking is the rank split along ``dim``.
        src = tensor.movedim(dim, 0).contiguous()
        out = src.new_empty((chunk, *src.shape[1:]))
        _reduce_scatter_single(dist)(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        self.check_all_to_all_counts(tensor, send_counts, recv_counts)
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=self.group)
        return out

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(tensor.contiguous(), dst=self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        dist.recv(tensor, src=self._global(src), group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


class GlooCommunicator(TorchDistributedCommunicator):
    backend = "gloo"
    native_tensor_collectives = False  # portable across the torch versions we support


class NcclCommunicator(TorchDistributedCommunicator):
    """NCCL on CUDA, RCCL on ROCm (torch exposes RCCL under the name "nccl")."""

    backend = "nccl"


class XcclCommunicator(TorchDistributedCommunicator):
    """oneCCL built into torch's XPU wheels."""

    backend = "xccl"


class CclCommunicator(TorchDistributedCommunicator):
    """oneCCL through the separate oneccl_bindings_for_pytorch package."""

    backend = "ccl"


_subclasses.update(
    {c.backend: c for c in (GlooCommunicator, NcclCommunicator, XcclCommunicator, CclCommunicator)}
)
