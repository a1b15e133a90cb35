"""The collective-communication contract used by tensor / pipeline / expert parallelism.

A Communicator wraps one process group of ``world_size`` ranks on one platform. Model
layers call it (e.g. a row-parallel linear all-reduces its partial sums) without knowing
whether NCCL, RCCL, oneCCL or gloo moves the bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Communicator(ABC):
    """Collectives over one process group; all calls are made by every rank."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group

    @abstractmethod
    def all_reduce(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """Elementwise sum across ranks; returns the reduced tensor."""

    @abstractmethod
    def all_gather(self, tensor: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
        """Concatenate every rank's tensor along ``dim`` (rank order)."""

    @abstractmethod
    def reduce_scatter(self, tensor: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
        """Sum across ranks, then keep this rank's 1/world_size slice along ``dim``."""

    @abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> "torch.Tensor":
        """Copy ``src``'s tensor to every rank (in place on receivers)."""

    @abstractmethod
    def send(self, tensor: "torch.Tensor", dst: int) -> None:
        """Point-to-point send (pipeline parallelism)."""

    @abstractmethod
    def recv(self, tensor: "torch.Tensor", src: int) -> "torch.Tensor":
        """Point-to-point receive into ``tensor``."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank arrives."""

    def check_all_to_all_counts(
        self, tensor: "torch.Tensor", send_counts: list[int], recv_counts: list[int]
    ) -> None:
        """ValueError unless there is one send and one receive count per rank and the
        send counts cover ``tensor``'s rows (what every all_to_all checks first)."""
        if len(send_counts) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} send and receive counts")
        if sum(send_counts) != tensor.shape[0]:
            raise ValueError(f"all_to_all: send counts {send_counts} do not add up to the "
                             f"{tensor.shape[0]} rows sent")

    def all_to_all(
        self, tensor: "torch.Tensor", send_counts: list[int], recv_counts: list[int]
    ) -> "torch.Tensor":
        """Rows ``tensor[sum(send_counts[:j]) : ... + send_counts[j]]`` go to rank ``j``;
        returns the rows every rank sent here, in rank order (``recv_counts[j]`` from
        rank ``j``). Expert parallelism's dispatch and combine.

        This portable version all-gathers every rank's rows (padded to the longest) and
        keeps its own; communicators with a native all-to-all override it."""
        import torch

        self.check_all_to_all_counts(tensor, send_counts, recv_counts)
        if self.world_size == 1:
            return tensor
        counts = torch.tensor(send_counts, dtype=torch.int64, device=tensor.device)
        all_counts = self.all_gather(counts.unsqueeze(0), dim=0)  # [W, W]
        longest = int(all_counts.sum(dim=1).max())
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        rows = self.all_gather(padded.unsqueeze(0), dim=0)  # [W, longest, ...]
        starts = torch.cumsum(all_counts, dim=1) - all_counts  # [W, W]
        parts = [rows[j, int(starts[j, self.rank]) : int(starts[j, self.rank])
                      + int(all_counts[j, self.rank])] for j in range(self.world_size)]
        return torch.cat(parts, dim=0)
