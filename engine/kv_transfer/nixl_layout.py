"""What a NIXL transfer is made of: block geometry, descriptors, layout checks.

Pure functions over the KV cache's shapes, strides and addresses (no NIXL calls): one
block of one layer is ``cache.select(block_dim, b)``, for each index of the dims before
``block_dim`` (the K/V half of an MHA cache; none for MLA) a contiguous region at
``data_ptr + (outer . strides + b * stride[block_dim]) * itemsize``; a descriptor list has
one entry per (layer, half, run of blocks consecutive on both sides).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from engine.core.interfaces.kv_connector import KVCacheLayout

# Layout fields both sides of a transfer must agree on (block_size conversion and
# heterogeneous tensor parallelism are not implemented: refused).
_LAYOUT_MUST_MATCH = ("num_layers", "num_kv_heads", "head_size", "dtype", "mla", "tp_size",
                      "block_size", "block_dim", "block_bytes", "backend")
_REMOTE_PARAMS: dict[str, type] = {
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_block_ids": list,
    "remote_request_id": str,
}

class KVLayoutMismatchError(ValueError):
    """A producer's KV cache layout is not this engine's."""


# -- geometry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _LayerGeometry:
    addr: int  # data_ptr of the layer's cache tensor
    outer_offsets: tuple[int, ...]  # byte offset of every index of the dims before block_dim
    block_stride: int  # bytes between blocks
    region_bytes: int  # bytes of one block in one outer index (contiguous)
    num_blocks: int
    block_shape: tuple[int, ...]  # the shape without the block dim

    @property
    def mergeable(self) -> bool:
        """Consecutive blocks are adjacent in memory (one descriptor for a run)."""
        return self.block_stride == self.region_bytes


def layer_geometry(addr: int, shape: list[int] | tuple[int, ...],
                   strides: list[int] | tuple[int, ...], element_size: int,
                   block_dim: int) -> _LayerGeometry:
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    if not 0 <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for a cache of shape {shape}")
    expected = 1
    for size, stride in zip(reversed(shape[block_dim + 1:]), reversed(strides[block_dim + 1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"a KV cache of shape {shape} and strides {strides} does not "
                             f"store a block contiguously after dim {block_dim}: not "
                             "supported by the NIXL connector")
        expected *= size
    region_bytes = expected * element_size
    outer = [0]
    for size, stride in zip(shape[:block_dim], strides[:block_dim]):
        outer = [o + i * stride * element_size for o in outer for i in range(size)]
    return _LayerGeometry(addr=int(addr), outer_offsets=tuple(outer),
                          block_stride=strides[block_dim] * element_size,
                          region_bytes=region_bytes, num_blocks=shape[block_dim],
                          block_shape=shape[:block_dim] + shape[block_dim + 1:])


def _runs(local: list[int], remote: list[int], merge: bool
          ) -> tuple[Any, Any, Any]:
    """(local starts, remote starts, lengths) of runs consecutive on both sides."""
    import numpy as np

    loc = np.asarray(local, dtype=np.int64)
    rem = np.asarray(remote, dtype=np.int64)
    if not merge or len(loc) <= 1:
        return loc, rem, np.ones(len(loc), dtype=np.int64)
    breaks = np.nonzero((np.diff(loc) != 1) | (np.diff(rem) != 1))[0] + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(loc)])))
    return loc[starts], rem[starts], lengths


def build_descriptors(local: list[_LayerGeometry], local_dev: int,
                      remote: list[_LayerGeometry], remote_dev: int,
                      local_blocks: list[int], remote_blocks: list[int]
                      ) -> tuple[Any, Any, int]:
    """Nx3 (addr, len, device) uint64 arrays for both sides and the bytes they cover."""
    import numpy as np

    merge = all(g.mergeable for g in local) and all(g.mergeable for g in remote)
    l0, r0, n = _runs(local_blocks, remote_blocks, merge)
    loc_rows, rem_rows = [], []
    for lg, rg in zip(local, remote):
        lengths = n * lg.region_bytes
        for lo, ro in zip(lg.outer_offsets, rg.outer_offsets):
            la = lg.addr + lo + l0 * lg.block_stride
            ra = rg.addr + ro + r0 * rg.block_stride
            loc_rows.append(np.stack([la, lengths, np.full_like(la, local_dev)], axis=1))
            rem_rows.append(np.stack([ra, lengths, np.full_like(ra, remote_dev)], axis=1))
    loc_arr = np.concatenate(loc_rows).astype(np.uint64)
    rem_arr = np.concatenate(rem_rows).astype(np.uint64)
    return loc_arr, rem_arr, int(loc_arr[:, 1].sum())


def _registration_spans(kv_caches: list[Any]) -> list[tuple[int, int]]:
    """(addr, bytes) of the memory the caches span, overlapping spans merged."""
    spans = []
    for t in kv_caches:
        extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) + 1
        spans.append((t.data_ptr(), extent * t.element_size()))
    spans.sort()
    merged: list[list[int]] = []
    for addr, size in spans:
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], addr + size - merged[-1][0])
        else:
            merged.append([addr, size])
    return [(a, s) for a, s in merged]


def compare_layouts(local: KVCacheLayout, remote: dict[str, Any]) -> list[str]:
    """The fields that differ, as ``"name: local X, remote Y"``."""
    return [f"{name}: local {getattr(local, name)!r}, remote {remote.get(name)!r}"
            for name in _LAYOUT_MUST_MATCH if getattr(local, name) != remote.get(name)]


def _layout_from_dict(value: dict[str, Any]) -> KVCacheLayout | None:
    names = {f.name for f in fields(KVCacheLayout)}
    try:
        return KVCacheLayout(**{k: v for k, v in value.items() if k in names})
    except TypeError:
        return None


def _remote_params_problem(params: dict[str, Any]) -> str | None:
    for key, kind in _REMOTE_PARAMS.items():
        value = params.get(key)
        if value is None:
            return f"kv_transfer_params lacks {key}"
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"kv_transfer_params.{key} is not an integer: {value!r}"
        if not isinstance(value, kind):
            return f"kv_transfer_params.{key} is not a {kind.__name__}: {value!r}"
    blocks = params["remote_block_ids"]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        return "kv_transfer_params.remote_block_ids holds something other than block ids"
    tp = params.get("remote_tp_size")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        return f"kv_transfer_params.remote_tp_size is not a positive integer: {tp!r}"
    return None


def _float_option(extra: dict[str, Any], key: str, default: float, env: str | None = None
                  ) -> float:
    value: Any = extra.get(key, default)
    if env and os.environ.get(env):
        value = os.environ[env]
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"NixlConnector option {key} must be a number of seconds, got "
                         f"{value!r}") from None
    if value <= 0:
        raise ValueError(f"NixlConnector option {key} must be positive, got {value}")
    return value
