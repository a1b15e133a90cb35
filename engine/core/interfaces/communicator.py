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
