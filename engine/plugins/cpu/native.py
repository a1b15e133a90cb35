"""The CPU plugin's C kernels as typed Python calls (ctypes over the built library).

:func:`load_kernels` builds the library of this CPU's ISA level on first use
(:mod:`.kernel_build`; ``load_kernels(level)`` any other level the CPU runs, which is
how tests cover every level) and wraps it in :class:`CPUKernels`: the paged attention
the CPU attention backend calls, the GEMMs of :mod:`.gemm`, and the platform's
:class:`~engine.core.interfaces.FusedOps` (norm, activation, rotary, embedding,
argmax). Every level's library has the same entry points. Without a compiler (or with
``ENGINE_CPU_NATIVE_KERNELS=0``) it returns None and callers keep their torch-op paths. The wrappers check what the C code
cannot (dtypes, layouts, strides) and raise ValueError rather than let it read out of
bounds; what depends on values (ids, positions, slots) the C code checks itself, so a
replayed forward graph (:mod:`.graphs`) is checked too.

Every entry point is a :class:`NativeOp`: while :func:`recording_calls` is active it
appends its call to the recording instead of running it, which is how a forward graph
is captured.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.core.interfaces import FusedOps, GraphCaptureError
from engine.plugins.cpu import kernel_build
from engine.plugins.cpu.kernel_tuning import AMX_MIN_ROWS, MODES, KernelTuning, tune_kernels

logger = logging.getLogger(__name__)

MAX_HEAD_SIZE = 512  # the C code's bounds
MAX_GROUP = 64
MAX_GROUP_ELEMS = 8192  # query heads per KV head (rounded up to 4) x head size
MAX_SPLITS = 64  # key ranges per (request, KV head)
_FEATURE_BF16_DOT, _FEATURE_AMX = 1, 2  # kernel_features() bits (csrc/runtime.c)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# What the attention kernels' caches may hold besides those: fp8 codes (csrc/cpu_math.h).
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 5, torch.float8_e5m2: 6}
_LOCK = threading.Lock()

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
CATEGORICAL_MAX_COLS = 8192 * 256  # categorical_rows: CAT_MAX_BLOCKS x CAT_BLOCK


class KeyLayout(Enum):
    """How one (block, KV head) row of the K cache orders its block_size x head_size
    values. ``pack`` dims of a key are contiguous; the row is ``[head_size / pack,
    block_size, pack]`` for the kernel layouts, ``[block_size, head_size]`` for PLAIN."""

    PLAIN = 0  # token-major, like V: the torch-op path without C kernels
    DIMS_MAJOR = 1  # [head_size][block_size]: 16 keys of one dim per vector
    DIM_PAIRS = 2  # [head_size / 2][block_size][2]: bf16 pairs for vdpbf16ps

    @property
    def pack(self) -> int:
        return 2 if self is KeyLayout.DIM_PAIRS else 1

    def token_view(self, rows: torch.Tensor, block_size: int, head_size: int) -> torch.Tensor:
        """``rows [..., block_size * head_size]`` as ``[..., block_size, head_size / pack,
        pack]``: index a token, then write ``key.unflatten(-1, (-1, pack))`` into it or
        ``flatten(-2)`` it to read."""
        if self is KeyLayout.PLAIN:
            return rows.unflatten(-1, (block_size, head_size, 1))
        pack = self.pack
        return rows.unflatten(-1, (head_size // pack, block_size, pack)).transpose(-2, -3)


QENC_INT, QENC_FP8, QENC_NVFP4 = 0, 1, 2  # csrc/gemm_quant.h
QACT_CODES = {None: 0, "int8": 1, "fp8": 2, "nvfp4": 3}  # csrc/quant_act.h
QSTRATEGY_CODES = {"token": 0, "tensor": 1, "group": 2}


@dataclass(frozen=True)
class QGemmParams:
    """One quantized layer as csrc/gemm_quant.h packs it (its QP_* words)."""

    n: int
    k: int
    encoding: int  # QENC_*
    bits: int
    group: int  # input features per weight scale
    shard_sizes: tuple[int, ...]
    act: int = 0  # QACT_CODES
    act_strategy: int = 0
    act_dynamic: bool = False
    act_group: int = 0
    has_perm: bool = False
    has_zeros: bool = False
    act_dtype: int = 0  # DTYPE_CODES of the activations the layer will be called with

    def words(self) -> list[int]:
        return [self.n, self.k, self.encoding, self.bits, self.group, self.act,
                self.act_strategy, int(self.act_dynamic), self.act_group, int(self.has_perm),
                int(self.has_zeros), self.act_dtype, len(self.shard_sizes), *self.shard_sizes]


class NativeCall(NamedTuple):
    """One recorded kernel call: the entry point, its ctypes arguments and, for a call
    whose failure means more than refused arguments (a collective: a peer died), the
    error its nonzero status raises at replay."""

    op: "NativeOp"
    args: tuple
    explain: Callable[[int], Exception] | None = None


class _Recording(threading.local):
    """The calls being recorded by this thread (None: kernels run). Per thread, so an
    engine capturing a graph never records another engine's kernels."""

    calls: list[NativeCall] | None = None


_recording = _Recording()


def is_recording() -> bool:
    """Whether this thread is capturing a forward graph (kernel calls are recorded)."""
    return _recording.calls is not None


@contextmanager
def recording_calls() -> Iterator[list[NativeCall]]:
    """Record (not run) every kernel call this thread makes inside the block, in order."""
    if _recording.calls is not None:
        raise GraphCaptureError("a forward graph is already being captured")
    calls: list[NativeCall] = []
    _recording.calls = calls
    try:
        yield calls
    finally:
        _recording.calls = None


class NativeOp:
    """A typed C entry point. ``graph_id`` is its id in forward_graph.c's replay table
    (-1: not replayable); ``pointer_args`` / ``float_args`` say which arguments are
    addresses and float32 values, for the graph's table."""

    def __init__(self, fn: ctypes._CFuncPtr, argtypes: list, graph_id: int) -> None:
        fn.restype = _i32
        fn.argtypes = argtypes
        self._fn = fn
        self.name: str = fn.__name__
        self.graph_id = graph_id
        self.pointer_args = tuple(i for i, t in enumerate(argtypes) if t is _ptr)
        self.float_args = tuple(i for i, t in enumerate(argtypes) if t is _f32)

    def __call__(self, *args, explain: Callable[[int], Exception] | None = None) -> int:
        calls = _recording.calls
        if calls is None:
            return self._fn(*args)
        if self.graph_id < 0:
            raise GraphCaptureError(f"the C kernel {self.name} cannot be replayed in a graph")
        calls.append(NativeCall(self, args, explain))
        return 0  # not run: a replay runs it


class CPUKernels(FusedOps):
    """Typed entry points of one compiled library (also the platform's FusedOps)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._lib = lib  # kept: the bound functions live as long as the library
        graph_id = _bind(lib.graph_kernel_id, [ctypes.c_char_p])

        def _bind_op(fn: ctypes._CFuncPtr, argtypes: list) -> NativeOp:
            return NativeOp(fn, argtypes, graph_id(fn.__name__.encode()))

        self._bind_op = _bind_op

        isa_level = lib.isa_level
        isa_level.restype, isa_level.argtypes = ctypes.c_char_p, []
        self.level: str = isa_level().decode()
        self.vector_lanes: int = _bind(lib.vector_lanes, [])()
        features = _bind(lib.kernel_features, [])()
        self.has_bf16_dot = bool(features & _FEATURE_BF16_DOT)
        self.has_amx = bool(features & _FEATURE_AMX)
        self.graph_op_words = _bind(lib.graph_op_words, [])()
        self.replay_graph = _bind(lib.replay_forward_graph, [_ptr, _i64, ctypes.POINTER(_i64)])
        self._key_splits = _bind(lib.decode_key_splits, [_i32, _ptr, _i32, _i32])
        self._pin_threads = _bind(lib.pin_threads, [ctypes.POINTER(_i32), _i32])
        self._set_split_threads = lib.set_split_threads
        self._set_split_threads.restype, self._set_split_threads.argtypes = None, [_i32]
        self._set_stream_prefetch = _bind(lib.set_stream_prefetch, [_i32])
        self.stream_prefetch: str = "nta"  # the library's default (csrc/cpu_math.h)
        self._set_amx_min_rows = _bind(lib.gemm_set_amx_min_rows, [_i32])
        self._set_batch_invariant = _bind(lib.set_batch_invariant, [_i32])
        self.batch_invariant = False  # the library's default (csrc/runtime.c)
        self.amx_min_rows: int | None = AMX_MIN_ROWS if self.has_amx else None
        self._fma_peak = lib.fma_peak_gflops
        self._fma_peak.restype, self._fma_peak.argtypes = ctypes.c_double, [_i64]
        self._decode = _bind_op(lib.paged_decode_attention, [
            _ptr, _i64, _i64,  # q, q_req_stride, q_head_stride
            _ptr, _ptr,  # k_cache, v_cache
            _ptr, _i64, _ptr,  # block_tables, bt_stride, seq_lens
            _ptr, _i32, _i32, _i32, _i32,  # out, num_reqs, num_heads, num_kv_heads, head_size
            _i32, _i32, _f32, _i32, _f32,  # block_size, cache dtype, scale, window, soft_cap
            _i32, _i32, _f32, _f32,  # num_splits, query dtype, fp8 k_scale, v_scale
        ])
        # With chunked local attention or sinks; not in forward_graph.c's replay table
        # (graph_id -1), so a layer using them runs eagerly (capture falls back).
        self._decode_ext = _bind_op(lib.paged_decode_attention_ext, [
            _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
            _ptr, _i32, _i32, _i32, _i32,
            _i32, _i32, _f32, _i32, _f32,
            _i32, _i32, _f32, _f32,
            _i32, _ptr,  # chunk (0: none), sinks (float32 [num_heads] or NULL)
        ])
        self._write_kv = _bind_op(lib.write_kv, [
            _ptr, _i64, _i64, _ptr, _i64, _i64,  # key + strides, value + strides
            _ptr, _i64, _ptr, _ptr, _i64,  # slots, num_tokens, k_cache, v_cache, num_blocks
            _i32, _i32, _i32, _i32, _i32,  # num_kv_heads, head_size, block_size, dtypes
            _f32, _f32,  # fp8 k_scale, v_scale
        ])
        self._mla_decode = _bind_op(lib.mla_decode_attention, [
            _ptr, _i64, _i64, _ptr,  # q, q_req_stride, q_head_stride, kv_cache
            _ptr, _i64, _ptr, _ptr,  # block_tables, bt_stride, seq_lens, out
            _i32, _i32, _i32, _i32, _i32, _i64,  # R, H, D, L, block_size, num_blocks
            _i32, _f32, _i32, _i32,  # cache dtype, scale, num_splits, query dtype
        ])
        self._mla_write = _bind_op(lib.mla_write_entries, [
            _ptr, _i64, _ptr, _i64, _ptr, _i64,  # entries, row stride, slots, T, cache, slots
            _i32, _i32, _i32,  # D, cache dtype, entries' dtype
        ])
        self._rms_norm = _bind_op(lib.rms_norm, [
            _ptr, _i64, _i64, _ptr, _i64,  # x, token stride, heads, residual, its stride
            _ptr, _ptr, _i64, _i64, _f32, _i32,  # weight, out, rows, hidden, eps, dtype
        ])
        self._silu_and_mul = _bind_op(lib.silu_and_mul, [_ptr, _i64, _ptr, _i64, _i64, _i32])
        self._residual_add = _bind_op(lib.residual_add, [_ptr, _i64, _ptr, _i64, _i64, _i64,
                                                         _i32])
        self._argmax = _bind_op(lib.argmax_rows, [_ptr, _i64, _i64, _i64, _ptr])
        self._categorical = _bind_op(lib.categorical_rows, [_ptr, _i64, _i64, _i64, _ptr, _ptr])
        self._rotary_neox = _bind_op(lib.rotary_neox, [
            _ptr, _i64, _ptr, _ptr,  # x, x row stride, positions, cos|sin table
            _i64, _i64, _i64, _i64, _i32,  # rows, heads, head size, table rows, dtype
        ])
        self._embedding = _bind_op(lib.embedding_shard_rows, [
            _ptr, _i64, _ptr,  # ids, n, table
            _i64, _i64, _i64, _i64,  # first row, rows held, vocabulary, hidden
            _i32, _ptr, _i32,  # table dtype, out, out dtype
        ])
        self._gemm_pack = _bind_op(lib.gemm_pack, [_ptr, _i64, _i64, _i32, _i32, _ptr])
        self._gemm_packed = _bind_op(lib.gemm_packed, [
            _ptr, _i64, _ptr, _ptr,  # x, x row stride, packed weight, bias (or NULL)
            _ptr, _i64, _i64, _i64, _i64, _i32, _i32,  # out, its row stride, M, N, K, dtypes
        ])
        self._gemm_plain = _bind_op(lib.gemm_plain, [
            _ptr, _i64, _ptr, _i64, _ptr,  # x, x row stride, weight, weight row stride, bias
            _ptr, _i64, _i64, _i64, _i64, _i32, _i32,  # out, its row stride, M, N, K, dtypes
        ])

        self._qgemm_pack_bytes = lib.qgemm_pack_bytes
        self._qgemm_pack_bytes.restype, self._qgemm_pack_bytes.argtypes = _i64, [_ptr]
        self._qgemm_pack = _bind(lib.qgemm_pack, [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr])
        self._qgemm = _bind_op(lib.qgemm, [
            _ptr, _i64, _ptr, _ptr,  # x, x row stride, packed weights, bias (or NULL)
            _ptr, _i64, _i64, _i32,  # out, its row stride, M, activation dtype
        ])
        self._qgemm_path = _bind(lib.qgemm_path, [_ptr])
        self._lora_shrink = _bind_op(lib.lora_shrink, [
            _ptr, _i64, _ptr, _ptr,  # x, x row stride, A [S, K, in], slots (int32)
            _ptr, _i64, _i64, _i64, _i64, _i64, _i32,  # out, its row stride, T, K, in, S, dt
        ])
        self._lora_expand = _bind_op(lib.lora_expand, [
            _ptr, _i64, _ptr, _ptr,  # s (float32), its row stride, B [S, R, N], slots (int32)
            _ptr, _i64, _ptr, _i64,  # shard bounds (int64), shards, y, its row stride
            _i64, _i64, _i64, _i64, _i32,  # T, N, R, S, dtype
        ])
        self._quantize_activations = _bind(lib.quantize_activations, [
            _ptr, _i64, _i64, _i64, _i32,  # x, row stride, M, K, dtype
            _i32, _i32, _i32, _i64, _f32, _ptr,  # scheme, strategy, dynamic, group, scale, out
        ])

    tuning: KernelTuning | None = None  # what load_kernels timed or read for this machine

    def __repr__(self) -> str:
        return f"CPUKernels(level={self.level!r}, path={str(self.path)!r})"

    @property
    def library(self) -> ctypes.CDLL:
        """The loaded library, for modules that bind entry points of their own
        (:mod:`.shm_segment`)."""
        return self._lib

    def bind_op(self, name: str, argtypes: list) -> NativeOp:
        """The library's entry point ``name`` as a :class:`NativeOp`: recorded by a graph
        capture when forward_graph.c's table has it, else refused there (a capture must
        never run it)."""
        return self._bind_op(getattr(self._lib, name), argtypes)

    def key_layout(self, dtype: torch.dtype) -> KeyLayout:
        """The K cache layout :meth:`write_kv` writes and the decode kernel reads (fp8
        caches: dims major)."""
        if dtype == torch.bfloat16 and self.has_bf16_dot:
            return KeyLayout.DIM_PAIRS
        return KeyLayout.DIMS_MAJOR

    def fma_peak_gflops(self, rounds: int = 100_000_000) -> float:
        """This level's float32 multiply-add peak over torch's threads, measured (GFLOP/s)."""
        return self._fma_peak(rounds)

    def pin_threads(self, cpus: list[int]) -> None:
        """Pin OpenMP thread i of torch's pool to ``cpus[i]`` (OSError when refused)."""
        array = (_i32 * len(cpus))(*cpus)
        if self._pin_threads(array, len(cpus)) != 0:
            raise OSError(f"sched_setaffinity refused to pin the OpenMP threads to CPUs {cpus}")

    def set_stream_prefetch(self, mode: str) -> None:
        """How the decode GEMMs prefetch the weights they stream: ``nta``, ``t0`` or
        ``none`` (:mod:`.kernel_tuning` times them when the library loads)."""
        if mode not in MODES or self._set_stream_prefetch(MODES.index(mode)) < 0:
            raise ValueError(f"unknown stream prefetch mode {mode!r}; modes: {', '.join(MODES)}")
        self.stream_prefetch = mode

    def set_amx_min_rows(self, rows: int) -> None:
        """From how many rows of activations the bf16 GEMM takes the AMX tiles
        (:mod:`.kernel_tuning` measures the crossover when the library loads)."""
        if not self.has_amx or self._set_amx_min_rows(rows) < 0:
            raise ValueError(f"cannot take AMX tiles from {rows} rows: "
                             + ("a count must be >= 1" if self.has_amx
                                else f"the {self.level} kernels have no usable tiles"))
        self.amx_min_rows = rows

    def set_split_threads(self, threads: int) -> None:
        """Plan decode attention's key splits for ``threads`` threads whatever the pool's
        count is meanwhile (0: follow the pool), so the order its softmax sums in, and so
        a request's tokens, do not depend on the thread governor's moves."""
        self._set_split_threads(threads)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Batch-invariant mode (engine.core.batch_invariance) for this library: GEMMs
        keep one accumulator chain and the vdpbf16ps path at any row count (no AMX),
        attention never splits a row's keys, gemm_plain never switches to panels."""
        self._set_batch_invariant(int(enabled))
        self.batch_invariant = bool(enabled)

    # -- fused elementwise ops (rows may be strided; the last dimension is contiguous) --
    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, hidden], or [T, heads, hidden] with contiguous heads
        weight: torch.Tensor,  # [hidden], x's dtype
        eps: float,
        residual: torch.Tensor | None = None,  # [T, hidden], updated in place to x + residual
    ) -> torch.Tensor:
        """``weight * norm(x)`` or, with ``residual``, ``weight * norm(x + residual)``
        (the sum written back into ``residual``), rounded as HF's op chain rounds; the
        result is contiguous ``[rows, hidden]`` (``T * heads`` rows for a 3-D x: per-head
        norms of a fused projection's slice, without copying it first)."""
        if x.dim() == 3:
            tokens, heads, hidden = x.shape
            if residual is not None or (heads > 1 and x.stride(1) != hidden):
                raise ValueError("3-D rms_norm takes contiguous heads and no residual")
        else:
            (tokens, hidden), heads = x.shape, 1
        if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            raise ValueError(f"rms_norm takes x, weight and residual of one dtype, not "
                             f"{x.dtype} / {weight.dtype}")
        out = torch.empty((tokens * heads, hidden), dtype=x.dtype)
        res_ptr, res_stride = (0, 0) if residual is None else (
            residual.data_ptr(), residual.stride(0))
        _check(self._rms_norm(x.data_ptr(), x.stride(0), heads, res_ptr, res_stride,
                              weight.data_ptr(), out.data_ptr(), tokens * heads, hidden, eps,
                              DTYPE_CODES[x.dtype]), "rms_norm")
        return out

    def residual_add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` (both ``[rows, hidden]``, unit last stride), rounded as
        torch's add; returns ``residual``."""
        if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
            raise ValueError(f"residual_add_ needs two equal [rows, hidden] tensors, got "
                             f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} "
                             f"{residual.dtype}")
        if x.stride(-1) != 1 or residual.stride(-1) != 1:
            raise ValueError("residual_add_ needs a contiguous last dimension")
        rows, hidden = x.shape
        _check(self._residual_add(x.data_ptr(), x.stride(0), residual.data_ptr(),
                                  residual.stride(0), rows, hidden, DTYPE_CODES[x.dtype]),
               "residual_add")
        return residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``."""
        rows, width = x.shape
        out = torch.empty((rows, width // 2), dtype=x.dtype)
        _check(self._silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2,
                                  DTYPE_CODES[x.dtype]), "silu_and_mul")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of float32 ``x [rows, cols]`` (torch's ties and NaNs)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
            return x.argmax(dim=-1)
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            _check(self._argmax(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr()), "argmax")
        return out

    def categorical(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
        """Inverse-CDF draws (``FusedOps.categorical``): one pass over each row."""
        if (probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(-1) != 1
                or probs.shape[1] > CATEGORICAL_MAX_COLS):
            return None
        rows, cols = probs.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            u = u.to(torch.float64).contiguous()
            _check(self._categorical(probs.data_ptr(), probs.stride(0), rows, cols,
                                     u.data_ptr(), out.data_ptr()), "categorical")
        return out

    def rotary_neox_(
        self,
        x: torch.Tensor,  # [T, heads * head_size], rotated in place
        positions: torch.Tensor,  # int64 [T], contiguous
        cos_sin_cache: torch.Tensor,  # [max_positions, head_size]: cos half, sin half
        head_size: int,
    ) -> None:
        """Rotate-half rotary embedding of every head of ``x``, in place (a position
        outside the table: ValueError, nothing rotated)."""
        if cos_sin_cache.dtype != x.dtype:
            raise ValueError(f"the rotary table is {cos_sin_cache.dtype}, x {x.dtype}")
        rows, width = x.shape
        status = self._rotary_neox(x.data_ptr(), x.stride(0), positions.data_ptr(),
                                   cos_sin_cache.data_ptr(), rows, width // head_size, head_size,
                                   cos_sin_cache.shape[0], DTYPE_CODES[x.dtype])
        if status == -2:
            raise ValueError(f"a position is beyond the rotary table "
                             f"({cos_sin_cache.shape[0]} positions)")
        _check(status, "rotary_neox")

    def embedding(
        self, ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``weight[ids]`` for int64 ``ids [T]``, in ``dtype`` (default: the table's; a
        bf16 table is widened for float32 activations). An id outside the table:
        ValueError."""
        return self.embedding_shard(ids, weight, 0, weight.shape[0], weight.shape[0], dtype)

    def embedding_shard(
        self, ids: torch.Tensor, weight: torch.Tensor, start: int, num_real: int, vocab: int,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One C call a forward graph records (see FusedOps.embedding_shard)."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise ValueError("embedding ids must be a contiguous int64 vector")
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("the embedding table must be a contiguous matrix")
        if not 0 <= num_real <= weight.shape[0] or start < 0:
            raise ValueError(f"a shard of {num_real} rows from row {start} does not fit a "
                             f"table of {weight.shape[0]} rows")
        dtype = weight.dtype if dtype is None else dtype
        hidden = weight.shape[1]
        out = torch.empty((ids.shape[0], hidden), dtype=dtype)
        status = self._embedding(ids.data_ptr(), ids.shape[0], weight.data_ptr(), start,
                                 num_real, vocab, hidden, DTYPE_CODES[weight.dtype],
                                 out.data_ptr(), DTYPE_CODES[dtype])
        if status == -2:
            raise ValueError(f"a token id is outside the vocabulary of {vocab}")
        _check(status, "embedding_shard_rows")
        return out

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D], last dim contiguous
        value: torch.Tensor,
        slots: torch.Tensor,  # int64 [T], contiguous; -1: not written
        key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size * D] in key_layout(dtype)
        value_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Store the step's new K/V rows at their slots (K in :meth:`key_layout`, the
        layout the decode kernel reads), rounded to the caches' dtype, in one call
        instead of two indexed stores. An fp8 cache stores ``quantize_kv(key, k_scale)``
        (engine.core.interfaces.attention) and the same of the values, bit for bit."""
        num_tokens, num_kv_heads, head_size = key.shape
        block_size = value_cache.shape[2]
        dtype = key_cache.dtype
        if value_cache.dtype != dtype or value.dtype != key.dtype or key.dtype not in DTYPE_CODES:
            raise ValueError("keys / values must share a dtype, and so must the two caches")
        if dtype not in CACHE_DTYPE_CODES:
            raise ValueError(f"write_kv has no {dtype} cache")
        _check_kv_scales(dtype, k_scale, v_scale)
        if key.stride(2) != 1 or value.stride(2) != 1 or slots.dtype != torch.int64:
            raise ValueError("K/V rows must be contiguous in the head dim and slots int64")
        if tuple(value.shape) != tuple(key.shape) or not slots.is_contiguous():
            raise ValueError("keys, values and slots must describe the same tokens")
        _check_caches(key_cache, value_cache)
        status = self._write_kv(key.data_ptr(), key.stride(0), key.stride(1),
                                value.data_ptr(), value.stride(0), value.stride(1),
                                slots.data_ptr(), num_tokens, key_cache.data_ptr(),
                                value_cache.data_ptr(), value_cache.shape[0], num_kv_heads,
                                head_size, block_size, CACHE_DTYPE_CODES[dtype],
                                DTYPE_CODES[key.dtype], k_scale, v_scale)
        if status != 0:
            raise ValueError(f"a slot is outside the cache of {value_cache.shape[0]} blocks of "
                             f"{block_size} (or below -1)")

    # -- GEMMs (csrc/gemm.c) ---------------------------------------------------------------
    @staticmethod
    def gemm_refusal(out_features: int, in_features: int) -> str | None:
        """None if :meth:`pack` / :meth:`gemm` take a weight of this shape."""
        if out_features % 16 or out_features <= 0 or in_features <= 0:
            return (f"a [{out_features}, {in_features}] weight: the packed GEMM needs out "
                    "features in multiples of 16")
        return None

    def pack(self, weight: torch.Tensor, activation_dtype: torch.dtype) -> torch.Tensor:
        """``weight [N, K]`` in the GEMM's panel layout for activations of
        ``activation_dtype``: a flat tensor of N x K values in the weight's own dtype (see
        csrc/gemm.c), not a matrix."""
        if weight.dim() != 2 or weight.dtype not in DTYPE_CODES:
            raise ValueError(f"pack takes a 2-D float weight, not {weight.dtype} {weight.dim()}-D")
        weight = weight.contiguous()
        packed = torch.empty(weight.numel(), dtype=weight.dtype)
        n, k = weight.shape
        _check(self._gemm_pack(weight.data_ptr(), n, k, DTYPE_CODES[weight.dtype],
                               DTYPE_CODES[activation_dtype], packed.data_ptr()), "gemm_pack")
        return packed

    def gemm(
        self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias)`` in x's dtype, ``packed`` from :meth:`pack` for
        that dtype."""
        k = x.shape[-1]
        if x.dtype not in DTYPE_CODES or packed.dtype not in DTYPE_CODES or not k:
            raise ValueError(f"gemm takes float inputs, not {x.dtype} / {packed.dtype}")
        n, leftover = divmod(packed.numel(), k)
        if leftover:
            raise ValueError(f"a packed weight of {packed.numel()} values has no rows of {k}")
        bias_ptr = _bias_pointer(bias, n, x.dtype)
        rows, ldx = _matrix_rows(x)
        m = rows.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        if m:
            _check(self._gemm_packed(rows.data_ptr(), ldx, packed.data_ptr(), bias_ptr,
                                     out.data_ptr(), n, m, n, k, DTYPE_CODES[x.dtype],
                                     DTYPE_CODES[packed.dtype]), "gemm_packed")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def gemm_plain(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [..., K] @ weight.T (+ bias)`` in x's dtype for a plain row-major ``[N, K]``
        weight used as it is (one shared with the embedding)."""
        k = x.shape[-1]
        if x.dtype not in DTYPE_CODES or weight.dtype not in DTYPE_CODES or not k:
            raise ValueError(f"gemm_plain takes float inputs, not {x.dtype} / {weight.dtype}")
        if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
            raise ValueError(f"weight {tuple(weight.shape)} is not a row-major [N, {k}]")
        n = weight.shape[0]
        bias_ptr = _bias_pointer(bias, n, x.dtype)
        rows, ldx = _matrix_rows(x)
        m = rows.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        ldw = weight.stride(0) if n > 1 else k
        if m:
            _check(self._gemm_plain(rows.data_ptr(), ldx, weight.data_ptr(), ldw, bias_ptr,
                                    out.data_ptr(), n, m, n, k, DTYPE_CODES[x.dtype],
                                    DTYPE_CODES[weight.dtype]), "gemm_plain")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    # -- quantized GEMM (csrc/gemm_quant.h) -----------------------------------------------
    def qgemm_pack(
        self,
        params: QGemmParams,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
        act_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Canonical quantized weights (engine/core/interfaces/quant.py; codes already in
        act-order when ``perm`` is given) in this level's packed layout: a uint8 tensor
        :meth:`qgemm` multiplies."""
        words = torch.tensor(params.words(), dtype=torch.int64)
        size = self._qgemm_pack_bytes(words.data_ptr())
        if size < 0:
            raise ValueError(f"qgemm_pack refused {params}")
        n, k = params.n, params.k
        want_codes = (n, k // 2) if params.encoding == QENC_NVFP4 else (n, k)
        groups = k // params.group
        checks = [("codes", codes, torch.uint8, want_codes),
                  ("scales", scales, torch.float32, (n, groups)),
                  ("zeros", zeros, torch.float32, (n, groups)),
                  ("perm", perm, torch.int64, (k,)),
                  ("act_scales", act_scales, torch.float32, (len(params.shard_sizes),))]
        args = []
        for name, tensor, dtype, shape in checks:
            if tensor is None:
                args.append(None)
                continue
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"qgemm_pack: {name} must be {dtype} {list(shape)}, not "
                                 f"{tensor.dtype} {list(tensor.shape)}")
            tensor = tensor.contiguous()
            args.append(tensor)
        if (perm is None) == params.has_perm or (zeros is None) == params.has_zeros:
            raise ValueError("qgemm_pack: perm / zeros must be given exactly when params say")
        packed = torch.empty(size, dtype=torch.uint8)
        pointers = [None if t is None else t.data_ptr() for t in args]
        _check(self._qgemm_pack(words.data_ptr(), *pointers, packed.data_ptr()), "qgemm_pack")
        return packed

    def qgemm(
        self, packed: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``QDQ(x [..., K]) @ dequant(W).T (+ bias)`` in x's dtype, ``packed`` from
        :meth:`qgemm_pack` (``n`` its output features)."""
        if x.dtype not in DTYPE_CODES or packed.dtype != torch.uint8:
            raise ValueError(f"qgemm takes float activations and packed uint8 weights, not "
                             f"{x.dtype} / {packed.dtype}")
        bias_ptr = _bias_pointer(bias, n, x.dtype)
        rows, ldx = _matrix_rows(x)
        m = rows.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        if m:
            _check(self._qgemm(rows.data_ptr(), ldx, packed.data_ptr(), bias_ptr,
                               out.data_ptr(), n, m, DTYPE_CODES[x.dtype]), "qgemm")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def qgemm_path(self, packed: torch.Tensor) -> str:
        """How a packed layer multiplies: "float32" (dequantized weights, float32
        multiply-adds), "int8 vnni" (W8A8: int8 x int8) or "int4 x bf16" (vdpbf16ps)."""
        path = self._qgemm_path(packed.data_ptr())
        if path < 0:
            raise ValueError("not a layer packed by this library's qgemm_pack")
        return {0: "float32", 1: "int8 vnni", 2: "int4 x bf16"}[path]

    def quantize_activations(self, x: torch.Tensor, scheme: int, strategy: int, dynamic: bool,
                             group: int = 0, scale: float = 0.0) -> torch.Tensor:
        """float32 ``QDQ(x [M, K])`` as the C kernels quantize activations (codes
        :data:`QACT_CODES` / :data:`QSTRATEGY_CODES`; ``scale``: the static scale, or
        nvfp4's global input scale)."""
        if x.dtype not in DTYPE_CODES or x.dim() != 2:
            raise ValueError("quantize_activations takes float [M, K] rows")
        rows, ldx = _matrix_rows(x)
        out = torch.empty(rows.shape, dtype=torch.float32)
        _check(self._quantize_activations(rows.data_ptr(), ldx, rows.shape[0], rows.shape[1],
                                          DTYPE_CODES[x.dtype], scheme, strategy, int(dynamic),
                                          group, scale, out.data_ptr()),
               "quantize_activations")
        return out

    # -- batched multi-LoRA (csrc/lora.c; engine/core/interfaces/lora.py) ---------------
    def lora_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                    out: torch.Tensor) -> None:
        """``out[t] = lora_a[token_slots[t]] @ x[t]`` (float32 ``out``, 0 for slot -1);
        the slots are read by the C code at run time (a replayed graph follows them)."""
        t, k = out.shape
        s_count, _, n_in = lora_a.shape
        _check_lora(x, lora_a, token_slots, t)
        if (out.dtype != torch.float32 or out.stride(1) != 1 or x.shape != (t, n_in)
                or lora_a.shape[1] != k):
            raise ValueError(f"lora_shrink: x {tuple(x.shape)}, A {tuple(lora_a.shape)}, out "
                             f"{out.dtype} {tuple(out.shape)} do not fit")
        if t:
            _check(self._lora_shrink(x.data_ptr(), _row_stride(x), lora_a.data_ptr(),
                                     token_slots.data_ptr(), out.data_ptr(), _row_stride(out),
                                     t, k, n_in, s_count, DTYPE_CODES[x.dtype]),
                   "lora_shrink (a slot outside the adapters?)")

    def lora_expand(self, s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                    bounds: np.ndarray, y: torch.Tensor) -> None:
        """``y[t, lo_j:hi_j] += s[t, j*R:(j+1)*R] @ lora_b[slot, :, lo_j:hi_j]`` (``lora_b``
        R-major, ``[S, R, N]``); ``bounds``: int64 numpy ``[num_shards + 1]`` that must
        outlive any graph recording the call."""
        t, n = y.shape
        s_count, rank, _ = lora_b.shape
        _check_lora(y, lora_b, token_slots, t)
        shards = len(bounds) - 1
        if (s.dtype != torch.float32 or s.stride(1) != 1 or s.shape != (t, shards * rank)
                or lora_b.shape[2] != n or bounds.dtype != np.int64
                or not bounds.flags.c_contiguous):
            raise ValueError(f"lora_expand: s {s.dtype} {tuple(s.shape)}, B "
                             f"{tuple(lora_b.shape)}, y {tuple(y.shape)}, {shards} shards "
                             "do not fit")
        if t:
            _check(self._lora_expand(s.data_ptr(), _row_stride(s), lora_b.data_ptr(),
                                     token_slots.data_ptr(), bounds.ctypes.data, shards,
                                     y.data_ptr(), _row_stride(y), t, n, rank, s_count,
                                     DTYPE_CODES[y.dtype]),
                   "lora_expand (a slot outside the adapters, or bad shard bounds?)")

    def decode_key_splits(
        self, seq_lens: torch.Tensor, num_kv_heads: int, window: int | None = None
    ) -> int:
        """The key ranges per (request, KV head) the decode kernel picks for int64
        ``seq_lens`` at the current thread count (or the one :meth:`set_split_threads`
        fixed): none while the tasks alone fill the
        threads; otherwise about two work items per thread of at least 256 keys each."""
        seq_lens = seq_lens.contiguous()
        num_reqs = seq_lens.shape[0]
        return self._key_splits(num_reqs * num_kv_heads, seq_lens.data_ptr(), num_reqs,
                                window or 0)

    @staticmethod
    def supports_attention(spec) -> bool:
        """Whether :meth:`paged_decode_attention` runs a layer of ``spec``
        (an AttentionLayerSpec); the C code checks the same bounds."""
        group = spec.num_heads // spec.num_kv_heads
        padded_group = -(-group // 4) * 4
        return (
            0 < spec.head_size <= MAX_HEAD_SIZE
            and spec.head_size % 16 == 0
            and group <= MAX_GROUP
            and padded_group * spec.head_size <= MAX_GROUP_ELEMS
        )

    def paged_decode_attention(
        self,
        query: torch.Tensor,  # [R, H, D], last dim contiguous
        key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size * D] in key_layout(dtype)
        value_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D], contiguous
        block_tables: torch.Tensor,  # int64 [R, M], last dim contiguous
        seq_lens: torch.Tensor,  # int64 [R], contiguous
        scale: float,
        window: int | None = None,
        soft_cap: float | None = None,
        num_splits: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        chunk: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention straight from the paged cache; ``[R, H, D]`` in the query's dtype
        (which may be wider than the cache's: float32 activations over a bf16 cache).

        ``chunk``: chunked local attention, row ``r`` (at position ``seq_lens[r] - 1``)
        attends only to keys from ``chunk * ((seq_lens[r] - 1) // chunk)``; ``sinks``:
        float32 ``[H]`` sink logits joining each head's softmax denominator. Either one
        runs the entry point forward graphs cannot replay (capture then fails cleanly).

        ``num_splits``: key ranges per (request, KV head), merged afterwards; None lets
        the kernel pick (:meth:`decode_key_splits`), so a replayed graph picks per step.
        An fp8 cache's keys read as ``k_scale * code``, its values as ``v_scale * code``
        (the scales ignored for other caches)."""
        num_reqs, num_heads, head_size = query.shape
        num_blocks, num_kv_heads, block_size, _ = value_cache.shape
        dtype = key_cache.dtype
        if (value_cache.dtype != dtype or dtype not in CACHE_DTYPE_CODES
                or query.dtype not in DTYPE_CODES):
            raise ValueError(f"query {query.dtype} / cache {dtype}: supported dtypes needed")
        _check_kv_scales(dtype, k_scale, v_scale)
        if value_cache.shape[3] != head_size:
            raise ValueError(f"the value cache holds head size {value_cache.shape[3]}, "
                             f"the query {head_size}")
        if query.stride(2) != 1:
            raise ValueError("query rows must be contiguous in the head dimension")
        _check_caches(key_cache, value_cache)
        if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("block tables and sequence lengths must be int64")
        if block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
            raise ValueError("block table rows and sequence lengths must be contiguous")
        if num_splits is None:
            num_splits = 0  # the kernel's choice
        elif not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        if chunk is not None and chunk <= 0:
            raise ValueError(f"the attention chunk size must be positive, not {chunk}")
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,)
                                  or not sinks.is_contiguous()):
            raise ValueError(f"sinks must be a contiguous float32 [{num_heads}] tensor, not "
                             f"{sinks.dtype} {tuple(sinks.shape)}")
        out = torch.empty((num_reqs, num_heads, head_size), dtype=query.dtype)
        args = (
            query.data_ptr(), query.stride(0), query.stride(1),
            key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_size,
            block_size, CACHE_DTYPE_CODES[dtype], scale, window or 0, soft_cap or 0.0,
            num_splits, DTYPE_CODES[query.dtype], k_scale, v_scale,
        )
        if chunk is None and sinks is None:
            status = self._decode(*args)
        else:
            status = self._decode_ext(*args, chunk or 0,
                                      None if sinks is None else sinks.data_ptr())
        if status != 0:
            raise ValueError(
                f"paged_decode_attention refused heads {num_heads}/{num_kv_heads} of size "
                f"{head_size} (block size {block_size})"
            )
        return out


    # -- MLA (csrc/mla_decode.c) -------------------------------------------------------------
    def mla_write_entries(self, entries: torch.Tensor, slots: torch.Tensor,
                          kv_cache: torch.Tensor) -> None:
        """Store latent entries ``[T, D]`` (rows strided, dims contiguous) at int64
        ``slots`` of ``kv_cache [num_blocks, block_size, D]`` (-1: skipped), rounded to the
        cache's dtype; the C code checks every slot before writing any."""
        num_tokens, entry = entries.shape
        if entries.dtype not in DTYPE_CODES or kv_cache.dtype not in DTYPE_CODES:
            raise ValueError(f"mla_write_entries: entries {entries.dtype} / cache "
                             f"{kv_cache.dtype}: float32, bf16 or fp16 needed")
        if (kv_cache.dim() != 3 or kv_cache.shape[2] != entry or not kv_cache.is_contiguous()
                or entries.stride(1) != 1):
            raise ValueError(f"mla_write_entries: entries {tuple(entries.shape)} do not fit a "
                             f"contiguous cache {tuple(kv_cache.shape)}")
        if slots.dtype != torch.int64 or slots.shape != (num_tokens,) or not slots.is_contiguous():
            raise ValueError(f"slots must be a contiguous int64 [{num_tokens}]")
        status = self._mla_write(entries.data_ptr(), _row_stride(entries) if num_tokens else entry,
                                 slots.data_ptr(), num_tokens, kv_cache.data_ptr(),
                                 kv_cache.shape[0] * kv_cache.shape[1], entry,
                                 DTYPE_CODES[kv_cache.dtype], DTYPE_CODES[entries.dtype])
        if status != 0:
            raise ValueError(f"a slot is outside the MLA cache {tuple(kv_cache.shape)} (or "
                             "below -1)")

    def mla_decode_attention(
        self,
        query: torch.Tensor,  # [R, H, D], last dim contiguous, float32 / bf16 / fp16
        kv_cache: torch.Tensor,  # [num_blocks, block_size, D], contiguous
        block_tables: torch.Tensor,  # int64 [R, M], last dim contiguous
        seq_lens: torch.Tensor,  # int64 [R], contiguous, each >= 1
        lora_rank: int,
        scale: float,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """MLA decode attention straight from the paged latent cache: ``[R, H, L]`` in the
        query's dtype, ``L = lora_rank`` (the entries' first dims are the values). Every
        head shares the request's entries (multi-query); ``num_splits`` key ranges per
        request (None: the kernel's choice, as :meth:`decode_key_splits` for one KV head)."""
        num_reqs, num_heads, entry = query.shape
        dtype = kv_cache.dtype
        if query.dtype not in DTYPE_CODES or dtype not in DTYPE_CODES:
            raise ValueError(f"MLA decode: query {query.dtype} / cache {dtype}: float32, bf16 "
                             "or fp16 needed")
        if kv_cache.dim() != 3 or kv_cache.shape[2] != entry or not kv_cache.is_contiguous():
            raise ValueError(f"MLA decode: the cache must be a contiguous [blocks, block_size, "
                             f"{entry}], not {tuple(kv_cache.shape)}")
        if not 0 < lora_rank <= entry or query.stride(2) != 1:
            raise ValueError(f"MLA decode: lora rank {lora_rank} of entries of {entry}, and "
                             "query rows contiguous in the entry dim")
        if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("block tables and sequence lengths must be int64")
        if (block_tables.dim() != 2 or block_tables.shape[0] != num_reqs
                or block_tables.stride(1) != 1 or seq_lens.shape != (num_reqs,)
                or not seq_lens.is_contiguous()):
            raise ValueError("block table rows and sequence lengths must be contiguous, one "
                             "per request")
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        out = torch.empty((num_reqs, num_heads, lora_rank), dtype=query.dtype)
        status = self._mla_decode(
            query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            out.data_ptr(), num_reqs, num_heads, entry, lora_rank, kv_cache.shape[1],
            kv_cache.shape[0], DTYPE_CODES[dtype], scale, num_splits or 0,
            DTYPE_CODES[query.dtype])
        if status == -2:
            raise ValueError("MLA decode: a sequence length or block id is outside its block "
                             f"table or the cache of {kv_cache.shape[0]} blocks")
        _check(status, f"mla_decode_attention ({num_heads} heads, entries of {entry})")
        return out


def _matrix_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [..., K]`` as 2-D rows with a unit last stride, and their row stride for C (a
    single row's stride is irrelevant: K)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


def _row_stride(m: torch.Tensor) -> int:
    """A 2-D tensor's row stride for C (one row: its length, whatever torch says)."""
    return m.stride(0) if m.shape[0] > 1 else m.shape[1]


def _check_lora(act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, t: int) -> None:
    """What the LoRA kernels cannot check: dtypes, layouts (values: the C code)."""
    if act.dtype not in DTYPE_CODES or weights.dtype != act.dtype:
        raise ValueError(f"LoRA kernels take float activations and adapters of the same "
                         f"dtype, not {act.dtype} / {weights.dtype}")
    if act.dim() != 2 or act.stride(1) != 1 or weights.dim() != 3 or not weights.is_contiguous():
        raise ValueError("LoRA kernels need rows with a unit last stride and contiguous "
                         "[S, rows, cols] adapters")
    if slots.dtype != torch.int32 or slots.shape != (t,) or not slots.is_contiguous():
        raise ValueError(f"token_slots must be a contiguous int32 [{t}], not {slots.dtype} "
                         f"{tuple(slots.shape)}")


def _bias_pointer(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> int | None:
    """The bias' address for C (None: no bias), once it is known to hold ``n`` values of
    the activations' ``dtype``."""
    if bias is None:
        return None
    if bias.dtype != dtype or bias.shape != (n,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous {dtype} [{n}]")
    return bias.data_ptr()


def _check_kv_scales(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    if dtype not in DTYPE_CODES and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"an fp8 cache needs positive scales, not {k_scale} / {v_scale}")


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """K rows (any layout) must match V's ``[blocks, kv_heads, block, D]`` in size."""
    if value_cache.dim() != 4 or tuple(key_cache.shape[:2]) != tuple(value_cache.shape[:2]) or (
        key_cache.numel() != value_cache.numel()
    ):
        raise ValueError(
            f"caches K {tuple(key_cache.shape)} / V {tuple(value_cache.shape)} do not hold "
            "the same [blocks, kv_heads] rows"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")


def _bind(fn, argtypes: list) -> ctypes._CFuncPtr:
    fn.restype = _i32
    fn.argtypes = argtypes
    return fn


def _check(status: int, name: str) -> None:
    if status != 0:
        raise ValueError(f"{name} refused its arguments")


def native_kernels_enabled() -> bool:
    return os.environ.get("ENGINE_CPU_NATIVE_KERNELS", "1").strip().lower() not in (
        "0", "false", "no", "off",
    )


def load_kernels(level: str | None = None) -> CPUKernels | None:
    """The compiled kernels of ``level`` (default: :func:`kernel_build.select_level`, this
    CPU's best or ``$ENGINE_CPU_ISA``), building them on first use; None when they cannot
    be had. A level this CPU cannot run is a ValueError."""
    if not native_kernels_enabled():
        return None
    name = kernel_build.select_level().name if level is None else level
    if name not in kernel_build.LEVELS:
        raise ValueError(f"unknown ISA level {name!r}; levels: {', '.join(kernel_build.LEVELS)}")
    if kernel_build.LEVELS[name] not in kernel_build.runnable_levels():
        raise ValueError(f"this CPU cannot run the {name} kernels")
    return _load_level(name)


_LOADED: dict[str, CPUKernels] = {}  # what _load_level returned, by level


def loaded_kernels(level: str) -> CPUKernels | None:
    """The kernels of ``level`` if this process has loaded them (never builds)."""
    return _LOADED.get(level)


@cache
def _load_level(name: str) -> CPUKernels | None:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s): the CPU plugin uses its torch-op kernels", compiler)
        return None
    try:
        with _LOCK:
            path = kernel_build.built_library(compiler, kernel_build.LEVELS[name])
            kernels = CPUKernels(ctypes.CDLL(str(path)), path)
            kernels.tuning = tune_kernels(kernels)
            _LOADED.setdefault(name, kernels)  # the first: what load_kernels returns
            return kernels
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU C kernels unavailable, using torch ops instead: %s", exc)
        return None

