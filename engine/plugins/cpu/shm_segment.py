"""One mapped shared-memory segment of csrc/shm_comm.c, as typed Python calls.

The C code moves the bytes and waits on the peers; this wrapper checks what it cannot
(dtypes, contiguity) and turns its status codes into exceptions that say which rank
failed and how, so a dead or diverged peer is an error rather than a hang or garbage.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os

import numpy as np
import torch

from engine.plugins.cpu.native import DTYPE_CODES, CPUKernels

_i64, _i32, _ptr, _dbl = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double
_TIMEOUT, _PEER_DEAD, _MISMATCH, _INVALID, _BROKEN = -1, -2, -3, -4, -5
REDUCE_DTYPES = frozenset(DTYPE_CODES)  # float32, bfloat16, float16


class CollectiveError(RuntimeError):
    """A shared-memory collective failed: a peer died, timed out or diverged."""


class _Api:
    """The library's shm_comm_* entry points with their C signatures. The collectives are
    :class:`NativeOp` s: a forward graph capture records the all-reduce (forward_graph.c
    replays it) and refuses the others, so no collective ever runs during a capture."""

    def __init__(self, kernels: CPUKernels) -> None:
        lib = kernels.library

        def bind(name: str, restype, argtypes: list):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            return fn

        self.open = bind("shm_comm_open", _i32, [ctypes.c_char_p, _i32, _i32, _i64, _i32,
                                                 _dbl, ctypes.POINTER(_ptr)])
        self.close = bind("shm_comm_close", None, [_ptr])
        self.failed_rank = bind("shm_comm_failed_rank", _i32, [_ptr])
        self.barrier = kernels.bind_op("shm_comm_barrier", [_ptr])
        self.all_reduce = kernels.bind_op("shm_comm_all_reduce", [_ptr, _ptr, _i64, _i32])
        self.all_gather = kernels.bind_op("shm_comm_all_gather", [_ptr, _ptr, _i64, _i64, _ptr])
        self.broadcast = kernels.bind_op("shm_comm_broadcast", [_ptr, _ptr, _i64, _i32])
        self.all_to_all = kernels.bind_op("shm_comm_all_to_all", [_ptr, _ptr, _ptr, _ptr, _ptr])
        self.segment_bytes = bind("shm_comm_segment_bytes", _i64, [_i32, _i64])
        self.max_ranks = bind("shm_comm_max_ranks", _i32, [])()
        self.lib = lib  # the bound functions live as long as the library


class ShmSegment:
    """This rank's mapping of one group's segment (``rank`` of ``world``)."""

    def __init__(self, kernels: CPUKernels, path: str, rank: int, world: int,
                 slot_bytes: int, create: bool, timeout_s: float) -> None:
        api = _Api(kernels)
        if not 1 <= world <= api.max_ranks:
            raise ValueError(f"a shared-memory group holds 1 to {api.max_ranks} ranks, "
                             f"not {world}")
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, not {slot_bytes}")
        handle = _ptr()
        status = api.open(path.encode(), world, rank, slot_bytes, int(create), timeout_s,
                          ctypes.byref(handle))
        if status == _INVALID:
            raise OSError(errno.EINVAL, f"{path} is not a {world}-rank segment with "
                          f"{slot_bytes}-byte slots")
        if status != 0:
            raise OSError(-status, f"cannot map the shared-memory segment {path}: "
                          f"{os.strerror(-status)}")
        self._api, self._handle = api, handle
        self.path, self.rank, self.world = path, rank, world
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s

    def close(self) -> None:
        if self._handle:
            self._api.close(self._handle)
            self._handle = _ptr()

    def __del__(self) -> None:
        self.close()

    def _check(self, status: int, op: str) -> None:
        if status != 0:
            raise self._error(status, op)

    def _replay_error(self, status: int) -> Exception:
        """What a forward graph's replay raises when its all-reduce of this segment fails."""
        return self._error(status, "all_reduce")

    def _error(self, status: int, op: str) -> Exception:
        peer = self._api.failed_rank(self._handle)
        where = f"shared-memory {op} on rank {self.rank} of {self.world}"
        if status == _PEER_DEAD:
            return CollectiveError(f"{where}: rank {peer} died (its process is gone)")
        if status == _TIMEOUT:
            return CollectiveError(f"{where}: rank {peer} did not arrive within "
                                   f"{self.timeout_s:g} s")
        if status == _MISMATCH:
            return CollectiveError(f"{where}: rank {peer} runs a different collective or "
                                   "size (the ranks diverged)")
        if status == _BROKEN:
            return CollectiveError(f"{where}: the group is broken by an earlier failure")
        return ValueError(f"{where} refused its arguments")

    def _handle_or_raise(self) -> ctypes.c_void_p:
        if not self._handle:
            raise CollectiveError(f"the shared-memory segment {self.path} is closed")
        return self._handle

    def barrier(self) -> None:
        self._check(self._api.barrier(self._handle_or_raise()), "barrier")

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, float32 / bfloat16 / float16) over the ranks, in
        place; every rank gets the same bits."""
        if tensor.dtype not in REDUCE_DTYPES:
            raise ValueError(f"shared-memory all_reduce sums {sorted(map(str, REDUCE_DTYPES))}"
                             f", not {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError("shared-memory all_reduce needs a contiguous tensor")
        # The handle as a plain address: a forward graph keeps it in its table (the graph
        # must not outlive this segment; the worker's runner does not).
        status = self._api.all_reduce(self._handle_or_raise().value, tensor.data_ptr(),
                                      tensor.numel(), DTYPE_CODES[tensor.dtype],
                                      explain=self._replay_error)
        self._check(status, "all_reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (gathered
        straight into that layout: no copy after)."""
        if not tensor.is_contiguous():
            raise ValueError("shared-memory all_gather needs a contiguous tensor")
        shape = list(tensor.shape)
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim:]) * tensor.element_size()
        shape[dim] *= self.world
        out = tensor.new_empty(shape)
        status = self._api.all_gather(self._handle_or_raise(), tensor.data_ptr(), outer,
                                      inner, out.data_ptr())
        self._check(status, "all_gather")
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s contiguous ``tensor`` copied into every other rank's, in place."""
        if not tensor.is_contiguous():
            raise ValueError("shared-memory broadcast needs a contiguous tensor")
        if not 0 <= src < self.world:
            raise ValueError(f"rank {src} is outside a group of {self.world} ranks")
        nbytes = tensor.numel() * tensor.element_size()
        status = self._api.broadcast(self._handle_or_raise(), tensor.data_ptr(), nbytes, src)
        self._check(status, "broadcast")
        return tensor

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Rows ``send_counts[j]`` of ``tensor`` (in rank order) to rank ``j``; the rows
        every rank sent here, in rank order (``recv_counts[j]`` from rank ``j``). Any
        dtype: rows move as bytes."""
        if not tensor.is_contiguous():
            raise ValueError("shared-memory all_to_all needs a contiguous tensor")
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        send = np.asarray(send_counts, dtype=np.int64) * row_bytes
        recv = np.asarray(recv_counts, dtype=np.int64) * row_bytes
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        status = self._api.all_to_all(self._handle_or_raise(), tensor.data_ptr(),
                                      send.ctypes.data, out.data_ptr(), recv.ctypes.data)
        self._check(status, "all_to_all")
        return out
