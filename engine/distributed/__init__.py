"""Collective communication shared by the platform plugins (torch.distributed)."""

from engine.distributed.communicator import (
    CclCommunicator,
    GlooCommunicator,
    NcclCommunicator,
    TorchDistributedCommunicator,
    XcclCommunicator,
)

__all__ = [
    "CclCommunicator",
    "GlooCommunicator",
    "NcclCommunicator",
    "TorchDistributedCommunicator",
    "XcclCommunicator",
]
