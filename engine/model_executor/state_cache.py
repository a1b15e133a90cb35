"""The executor side of state layers (Mamba mixers): their per-slot state tensors and the
per-step metadata that tells each request which slot is its own.

A model with state layers reports a :class:`StateCacheSpec` (``model.state_cache_spec()``:
one :class:`StateLayerSpec` per state layer, in the order its mixers index them). The
runner allocates, per state layer, one tensor ``[num_slots + 1, *shape]`` per entry (row
0 is the null slot), alongside the KV cache and through the same allocate / free path
(sleep mode frees both). The scheduler gives every request a slot
(:mod:`engine.core.kv_cache.state_slots`); each step the runner builds a
:class:`StateMetadata` and puts it in the forward context, where the mixers read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StateLayerSpec:
    """One state layer's state tensors per slot: their shapes (no slot dim) and dtypes
    (Mamba-2: the conv window ``(conv_dim, d_conv - 1)`` and the SSM state
    ``(nheads, head_dim, d_state)``)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def bytes_per_slot(self) -> int:
        return sum(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class StateCacheSpec:
    """Every state layer of the model (this rank's)."""

    layers: tuple[StateLayerSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_slot(self) -> int:
        """What one request's state costs across all state layers."""
        return sum(layer.bytes_per_slot() for layer in self.layers)


def model_state_spec(model: torch.nn.Module) -> StateCacheSpec | None:
    """The model's state layers (None: it has none)."""
    get = getattr(model, "state_cache_spec", None)
    spec = None if get is None else get()
    return spec if spec is not None and spec.num_layers else None


def allocate_state_caches(spec: StateCacheSpec, num_slots: int, device: torch.device
                          ) -> list[tuple[torch.Tensor, ...]]:
    """Zeroed ``[num_slots + 1, *shape]`` tensors per state layer (slot 0: the null slot)."""
    return [tuple(torch.zeros((num_slots + 1, *shape), dtype=dtype, device=device)
                  for shape, dtype in zip(layer.shapes, layer.dtypes))
            for layer in spec.layers]


@dataclass
class StateMetadata:
    """One step's requests (batch order) as the state kernels see them.

    A step that mixes decodes with prefills is split into ``parts`` (the decodes, then
    the rest), each a StateMetadata of its own with ``token_index``: its tokens' rows in
    the step. The layer runs each part's kernels on those rows, so a decode never pays
    for a padded prefill chunk."""

    state_indices: torch.Tensor  # int32 [R]: each request's slot
    has_initial_state: torch.Tensor  # bool [R]: it continues from its slot (computed > 0)
    query_start_loc: torch.Tensor  # int32 [R + 1]
    # Every request has one token and continues from its slot: the decode kernels run.
    is_decode: bool
    max_query_len: int = 1  # the most tokens any request has this step
    parts: tuple[StateMetadata, ...] = ()
    token_index: torch.Tensor | None = None  # int64 [T_part]: a part's rows of the step


def build_state_metadata(slots: np.ndarray, num_computed: np.ndarray,
                         query_start_loc: np.ndarray, max_query_len: int,
                         upload: Callable[[np.ndarray], torch.Tensor]) -> StateMetadata:
    """``slots`` / ``num_computed``: per request of the step, before the step runs."""
    has_initial = num_computed > 0
    whole = _metadata(slots, has_initial, query_start_loc, max_query_len, upload)
    lens = np.diff(query_start_loc)
    decodes = (lens == 1) & has_initial
    if whole.is_decode or not decodes.any():
        return whole
    parts = []
    for rows in (np.flatnonzero(decodes), np.flatnonzero(~decodes)):
        counts = lens[rows].astype(np.int64)
        starts = query_start_loc[rows].astype(np.int64)
        tokens = np.repeat(starts, counts) + (np.arange(int(counts.sum()))
                                              - np.repeat(np.cumsum(counts) - counts, counts))
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(counts)
        part = _metadata(slots[rows], has_initial[rows], qsl, int(counts.max()), upload)
        part.token_index = upload(tokens)
        parts.append(part)
    whole.parts = tuple(parts)
    return whole


def _metadata(slots: np.ndarray, has_initial: np.ndarray, query_start_loc: np.ndarray,
              max_query_len: int, upload: Callable[[np.ndarray], torch.Tensor]
              ) -> StateMetadata:
    return StateMetadata(
        state_indices=upload(np.ascontiguousarray(slots, dtype=np.int32)),
        has_initial_state=upload(np.ascontiguousarray(has_initial)),
        query_start_loc=upload(np.ascontiguousarray(query_start_loc, dtype=np.int32)),
        is_decode=max_query_len == 1 and bool(has_initial.all()),
        max_query_len=max_query_len,
    )
