"""Forward graphs on the CPU: a forward's C kernel calls, recorded once, replayed from C.

Capture runs the forward once under two recorders and computes nothing:

- :func:`~.native.recording_calls` appends every C kernel call (entry point and
  arguments) instead of running it;
- :class:`_TorchOpGuard`, a torch dispatch mode, lets through the torch ops that only
  allocate or make views (noting each allocation) and refuses every other one: torch
  arithmetic cannot be replayed from C, and a read of a tensor value (``.item()``) would
  freeze a Python decision at its capture-time value.

The buffers the forward allocated (its intermediates) are then laid out in one arena
shared by all graphs of a capturer: a buffer lives from the first to the last call that
touches it (the output to the end), and buffers whose lives do not overlap share bytes,
so a graph needs about two layers' activations whatever the depth. Addresses into those
buffers become arena offsets; every other address (weights, KV caches, the runner's
input buffers) is kept as it is, so those tensors must outlive the graph. A replay is
one call into ``replay_forward_graph`` (csrc/forward_graph.c) with the table.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.interfaces import ForwardGraph, ForwardGraphCapturer, GraphCaptureError
from engine.plugins.cpu.native import CPUKernels, NativeCall, recording_calls

ALIGN = 64  # bytes: every arena buffer starts on a cache line
_aten = torch.ops.aten
_ALLOCATORS = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default,
})
_NO_COPY = frozenset({_aten.detach.default, _aten.alias.default})
# What a kernel's nonzero status means when it can depend on the step's values.
_REFUSALS = {
    "embedding_shard_rows": "a token id is outside the vocabulary",
    "rotary_neox": "a position is beyond the rotary table",
    "write_kv": "a KV slot is outside the cache",
    "mla_write_entries": "an MLA cache slot is outside the cache",
    "mla_decode_attention": "an MLA decode's length or block id is outside its table or cache",
}


class _TorchOpGuard(TorchDispatchMode):
    """Lets a captured forward allocate and make views, nothing else; keeps every
    allocation alive until the capture is planned (freed memory reused by a later
    allocation would make two buffers share addresses)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep torch.compile out of it unless
        # the mode opts out; the wrapper imports torch._dynamo on first use (~0.5 s on
        # the first decode step). Nothing compiles inside a capture.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALLOCATORS:
            out = func(*args, **kwargs)
            self.allocations.append(out)
            return out
        if func.is_view or func in _NO_COPY:
            out = func(*args, **kwargs)
            if not _aliases(out, args[0]):  # e.g. a reshape that had to copy
                raise GraphCaptureError(f"the torch op {func} copied its input (a graph "
                                        "replays only C kernels)")
            return out
        raise GraphCaptureError(
            f"the forward runs the torch op {func} (a graph replays only C kernels)"
        )


def _aliases(out, source: torch.Tensor) -> bool:
    """Whether every tensor of a view op's result shares ``source``'s memory."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    base = source.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == base for t in outs)


@dataclass
class _Buffer:
    """One allocation of the capture: its addresses then, and its place in the arena."""

    base: int
    nbytes: int
    first_use: int = -1  # index of the first call that touches it
    last_use: int = -1
    offset: int = -1  # in the arena


@dataclass
class GraphPlan:
    """A recorded forward laid out in an arena: the call table (arena-relative where
    ``relative``), the arena bytes it needs and where its output sits."""

    table: np.ndarray  # int64 [calls, words]: kernel id, then the C arguments
    relative: np.ndarray  # bool, same shape: the word is an offset into the arena
    arena_bytes: int
    output_offset: int  # bytes into the arena
    output_bytes: int
    kernel_names: list[str]
    explainers: list[Callable[[int], Exception] | None]  # per call: NativeCall.explain


def _find(buffers: list[_Buffer], bases: list[int], address: int) -> _Buffer | None:
    i = bisect.bisect_right(bases, address) - 1
    if i >= 0 and address < buffers[i].base + buffers[i].nbytes:
        return buffers[i]
    return None


def _float_word(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _assign_offsets(buffers: list[_Buffer]) -> int:
    """First-fit offsets in order of first use, reusing the bytes of buffers whose last
    use came earlier; returns the arena size."""
    live: list[_Buffer] = []
    size = 0
    for buf in sorted(buffers, key=lambda b: (b.first_use, -b.nbytes)):
        live = [b for b in live if b.last_use >= buf.first_use]
        need = -(-buf.nbytes // ALIGN) * ALIGN
        offset = 0
        for other in sorted(live, key=lambda b: b.offset):
            if offset + need <= other.offset:
                break
            offset = max(offset, other.offset + -(-other.nbytes // ALIGN) * ALIGN)
        buf.offset = offset
        live.append(buf)
        size = max(size, offset + need)
    return size


def plan_graph(
    calls: list[NativeCall], allocations: list[torch.Tensor], output: torch.Tensor, words: int
) -> GraphPlan:
    """Lay the capture's buffers out in an arena and turn ``calls`` into a call table."""
    storages = {}
    for tensor in allocations:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    buffers = [_Buffer(base, nbytes) for base, nbytes in sorted(storages.items())]
    bases = [b.base for b in buffers]
    table = np.zeros((len(calls), words), dtype=np.int64)
    relative = np.zeros((len(calls), words), dtype=bool)
    for index, (op, args, _) in enumerate(calls):
        if 1 + len(args) > words:
            raise GraphCaptureError(f"{op.name} takes more arguments than a table row holds")
        table[index, 0] = op.graph_id
        for i, value in enumerate(args):
            if i in op.float_args:
                table[index, 1 + i] = _float_word(value)
            elif i in op.pointer_args and value:
                buf = _find(buffers, bases, value)
                if buf is not None:
                    if buf.first_use < 0:
                        buf.first_use = index
                    buf.last_use = index
                    table[index, 1 + i] = value - buf.base  # made arena-relative below
                    relative[index, 1 + i] = True
                    continue
                table[index, 1 + i] = value
            else:
                table[index, 1 + i] = value or 0
    out = _find(buffers, bases, output.data_ptr())
    if out is None or out.first_use < 0:
        raise GraphCaptureError("the forward's output is not written by its C kernels")
    out.last_use = len(calls)
    used = [b for b in buffers if b.first_use >= 0]
    arena_bytes = _assign_offsets(used)
    # Rebase the relative words from their buffer's start to the arena's.
    for index, (_, args, _) in enumerate(calls):
        for i in np.flatnonzero(relative[index, 1:]):
            table[index, 1 + i] += _find(buffers, bases, args[i]).offset
    into = output.data_ptr() - out.base
    return GraphPlan(table, relative, arena_bytes, out.offset + into, out.nbytes - into,
                     [call.op.name for call in calls], [call.explain for call in calls])


class _Arena:
    """The bytes a capturer's graphs share; grows (moving) when a graph needs more."""

    def __init__(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self.base = 0
        self.version = 0

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.bytes.numel() - (self.base - self.bytes.data_ptr()):
            self.bytes = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
            self.base = -(-self.bytes.data_ptr() // ALIGN) * ALIGN
            self.version += 1

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        start = self.base - self.bytes.data_ptr() + offset
        return self.bytes[start : start + nbytes]


class CPUForwardGraph(ForwardGraph):
    """A planned call table bound to its capturer's arena."""

    def __init__(
        self,
        kernels: CPUKernels,
        arena: _Arena,
        plan: GraphPlan,
        output: torch.Tensor,
        keep_alive: object,
    ) -> None:
        self._kernels = kernels
        self._arena = arena
        self._plan = plan
        self._output_meta = (output.dtype, tuple(output.shape), output.stride())
        self._keep_alive = keep_alive  # the forward's inputs: the table points into them
        self._version = -1
        self._table = plan.table
        self._output: torch.Tensor | None = None  # a view of the arena, once bound
        self._failed = ctypes.c_int64(-1)

    @property
    def num_calls(self) -> int:
        return len(self._plan.kernel_names)

    def _bind_to_arena(self) -> None:
        arena, plan = self._arena, self._plan
        self._table = np.where(plan.relative, plan.table + arena.base, plan.table)
        dtype, shape, stride = self._output_meta
        flat = arena.view(plan.output_offset, plan.output_bytes).view(dtype)
        self._output = flat.as_strided(shape, stride)
        self._version = arena.version

    def replay(self) -> torch.Tensor:
        if self._version != self._arena.version:
            self._bind_to_arena()
        table = self._table
        status = self._kernels.replay_graph(table.ctypes.data, table.shape[0],
                                            ctypes.byref(self._failed))
        if status != 0:
            explain = self._plan.explainers[self._failed.value]
            if explain is not None:
                raise explain(status)
            name = self._plan.kernel_names[self._failed.value]
            reason = _REFUSALS.get(name, "it refused its arguments")
            raise ValueError(f"forward graph replay stopped at {name}: {reason} "
                             f"(status {status})")
        return self._output


class CPUGraphCapturer(ForwardGraphCapturer):
    """Captures forwards whose every computation is one of the plugin's C kernels
    (tensor parallelism's shared-memory all-reduce included; a gloo collective is a
    torch op, which the capture refuses)."""

    records_collectives = True

    def __init__(self, kernels: CPUKernels) -> None:
        self._kernels = kernels
        self._arena = _Arena()

    def capture(self, forward: Callable[[], torch.Tensor]) -> CPUForwardGraph:
        guard = _TorchOpGuard()
        with recording_calls() as calls, guard:
            output = forward()
        if not isinstance(output, torch.Tensor):
            raise GraphCaptureError("the forward must return one tensor")
        plan = plan_graph(calls, guard.allocations, output, self._kernels.graph_op_words)
        self._arena.reserve(plan.arena_bytes)
        return CPUForwardGraph(self._kernels, self._arena, plan, output, forward)
