"""Checkpoint tensors read only when (and as far as) a parameter needs them.

A tensor-parallel rank needs ``1/tp`` of most matrices: :class:`LazyTensor` wraps a
safetensors slice handle, :func:`split_part` narrows it without reading, and
:func:`materialize` reads just the selected part from the (memory-mapped) file. Plain
torch tensors pass through both functions, so loaders handle either.
"""

from __future__ import annotations

from typing import Any

import torch


class LazyTensor:
    """A not-yet-read checkpoint tensor, possibly narrowed along some dims."""

    def __init__(self, handle: Any, shape: tuple[int, ...], index: tuple[slice, ...] | None = None
                 ) -> None:
        self._handle = handle  # safetensors' PySafeSlice: supports [slice, ...]
        self._full_shape = shape
        self._index = index or tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index)

    def dim(self) -> int:
        return len(self._full_shape)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= self.dim()
        current = self._index[dim]
        if start < 0 or length < 0 or current.start + start + length > current.stop:
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside shape "
                             f"{tuple(self.shape)}")
        index = list(self._index)
        index[dim] = slice(current.start + start, current.start + start + length)
        return LazyTensor(self._handle, self._full_shape, tuple(index))

    def read(self) -> torch.Tensor:
        if not self._full_shape:
            return self._handle[()]  # a scalar
        return self._handle[self._index]

    def __getitem__(self, item: Any) -> torch.Tensor:
        return self.read()[item]

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)})"


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, LazyTensor) else tensor


def split_part(tensor: torch.Tensor | LazyTensor, dim: int, part: int, parts: int
               ) -> torch.Tensor | LazyTensor:
    """Part ``part`` of ``parts`` equal parts along ``dim`` (stored elements)."""
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f"a checkpoint tensor of shape {tuple(tensor.shape)} cannot be cut "
                         f"into {parts} equal parts along dim {dim}")
    chunk = size // parts
    return tensor.narrow(dim, part * chunk, chunk)
