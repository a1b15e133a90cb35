"""Per-step state that attention layers read without threading it through every call.

The model runner builds the attention metadata once per step and wraps the model's
forward in :func:`set_forward_context`; each :class:`~engine.model_executor.layers.
attention.Attention` layer picks its own cache by layer index. Keeping this out of the
model signature lets every model keep the plain ``forward(input_ids, positions)`` shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    """What the attention layers need during one model forward."""

    attn_metadata: Any  # whatever the backend's build_metadata returned this step
    kv_caches: list[torch.Tensor]  # one tensor per attention layer, by layer index
    # A KV connector whose per-layer hooks run around each attention (None: none).
    kv_connector: Any = None
    # A hybrid model's metadata per layer (its KV cache group's block tables and cache
    # slots), by layer index; None: every layer reads ``attn_metadata``.
    layer_attn_metadata: list[Any] | None = None
    # A model with state layers (Mamba mixers): the step's StateMetadata
    # (engine.model_executor.state_cache) and each state layer's state tensors, by state
    # layer index; None: no state layers.
    state_metadata: Any = None
    state_caches: list[tuple[torch.Tensor, ...]] | None = None
    # LoRA: each token's adapter slot (engine.lora.layers.LoRABatch); None: no adapters.
    lora: Any = None

    def metadata_for(self, layer_index: int) -> Any:
        """The attention metadata of the layer whose cache is ``kv_caches[layer_index]``."""
        per_layer = self.layer_attn_metadata
        return self.attn_metadata if per_layer is None else per_layer[layer_index]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` current for the duration of one model forward (nesting restores)."""
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


def current_forward_context() -> ForwardContext | None:
    """The context of the forward in progress, or None outside one."""
    return _current


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; a clear error outside one."""
    if _current is None:
        raise RuntimeError(
            "no forward context is set: run the model inside "
            "`with set_forward_context(ForwardContext(attn_metadata, kv_caches)):`"
        )
    return _current
