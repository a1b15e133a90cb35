"""New weights for a running model, from a directory, a trainer's broadcast or shared tensors.

Design (why a fresh model and not a copy into the running one): after loading, a rank's
model no longer holds checkpoint-layout tensors. Dense weights are repacked into the
platform GEMM's layout (``pack_dense_weights``: oneDNN / panel layouts with no way back),
or widened; quantized layers decode their checkpoint tensors and drop them
(``finish_loading``); MLA layers derive absorbed projections; forward graphs hold pointers
to all of it. So an update builds this rank's model anew, through the very steps
``load_model`` takes (the model's ``load_weights`` with its TP / PP slicing by
``ParamLayout``, then the post-load processing), from the new tensors, and the worker
swaps it in and rebuilds its runner (new KV cache, graphs captured again).

Memory: the new model is built beside the old one, so a failed update (a wrong shape, an
unknown or missing tensor) leaves the engine serving the old weights. That holds two
models for a moment; an RL loop that sleeps at level 2 first (the weights already
dropped) holds only the new one. Every update carries the model's full set of checkpoint
tensors (what ``load_weights`` checks); partial updates are refused.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, Any]]


def running_model_files(config: EngineConfig) -> Any:
    """The running model's checked directory (its config and class)."""
    from engine.model_executor.model_loader import load_model_files

    model = config.model
    return load_model_files(model.model, hf_overrides=model.hf_overrides,
                            model_impl=model.model_impl)


def checkpoint_weights(config: EngineConfig, path: str | Path) -> NamedTensors:
    """The tensors of checkpoint directory ``path``, lazily (a TP rank reads its part),
    after checking it holds the running model's architecture."""
    from engine.model_executor.model_loader import load_model_files
    from engine.model_executor.weight_utils import safetensors_weights_iterator

    new = load_model_files(path, model_impl=config.model.model_impl)
    running = running_model_files(config)
    if new.architecture != running.architecture:
        raise ValueError(f"{path} holds a {new.architecture}, the engine runs a "
                         f"{running.architecture}: weight updates keep the architecture")
    return safetensors_weights_iterator(new.weight_files, lazy=True)


def build_model(config: EngineConfig, platform: Platform, parallel: Any,
                weights: NamedTensors) -> tuple[nn.Module, Any]:
    """This rank's model of the running architecture and config, loaded from
    ``weights`` (HF checkpoint names) through the steps of a start-up load; with its
    attention backend. ValueError when a tensor is missing, unexpected or misshapen."""
    from engine.model_executor.worker import load_platform_model

    return load_platform_model(config, platform, parallel, weights=weights)


class BroadcastReceiver:
    """Iterates ``(name, tensor)``, each tensor received by broadcast from the trainer
    (rank 0 of ``group``) as the loader asks for it (``packed``: a bucket at a time, its
    tensors viewed in place, see ``engine.distributed.weight_sync.packed_buckets``).
    ``drain()`` receives whatever is left, so a failed load never leaves the trainer
    blocked in a broadcast."""

    def __init__(self, group: Any, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 device: torch.device, packed: bool = False) -> None:
        from engine.distributed.weight_sync import packed_buckets

        self.group = group
        self.specs = specs
        self.device = device
        self.received = 0
        self.bytes = 0
        self.buckets = packed_buckets(specs) if packed else None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.buckets is not None:
            yield from self._packed()
            return
        while self.received < len(self.specs):
            name, dtype, shape = self.specs[self.received]
            yield name, self._receive(dtype, shape)

    def _packed(self) -> Iterator[tuple[str, torch.Tensor]]:
        from engine.distributed.weight_sync import tensor_bytes

        while self.buckets:
            total, entries = self.buckets.pop(0)
            flat = self._receive(torch.uint8, (total,))
            self.received += len(entries) - 1  # _receive counted the bucket as one
            for index, offset in entries:
                name, dtype, shape = self.specs[index]
                size = tensor_bytes(dtype, shape)
                yield name, flat[offset : offset + size].view(dtype).view(shape)

    def _receive(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.group.broadcast(tensor, src=0)
        self.received += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def drain(self) -> None:
        if self.buckets is not None:
            for _ in self._packed():
                pass
            return
        while self.received < len(self.specs):
            _, dtype, shape = self.specs[self.received]
            self._receive(dtype, shape)


# -- tensors from a trainer in the engine's process ------------------------------------------
def share_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], num_ranks: int
                  ) -> list[list[Any]]:
    """``[name, [handle bytes per rank]]`` per tensor, for :func:`open_shared_tensors` in
    any process: torch.multiprocessing's reductions (shared memory on the CPU, found by
    name; CUDA IPC handles on GPUs). CPU tensors move into shared memory, once. One
    handle per rank: each opening releases the reference its pickling took."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # a named segment, not a one-shot fd
    try:
        handles = []
        for name, tensor in named_tensors:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ValueError(  # noqa: TRY004 - bad input, like a bad name
                    "named_tensors must be (str, torch.Tensor) pairs, got "
                    f"({type(name).__name__}, {type(tensor).__name__})")
            tensor = tensor.detach()
            handles.append([name, [bytes(ForkingPickler.dumps(tensor))
                                   for _ in range(num_ranks)]])
    finally:
        mp.set_sharing_strategy(previous)
    return handles


def open_shared_tensors(handles: list[list[Any]], rank: int
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``rank``'s view of the tensors :func:`share_tensors` described, opened one
    at a time (no copy)."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    for name, blobs in handles:
        yield name, pickle.loads(blobs[rank])
