"""What every model class receives at construction and reports back.

A model class is ``cls(hf_config, ctx)`` with ``ctx`` a :class:`ModelInitContext`;
it exposes ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` over a flat
token batch, ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``,
``load_weights(weights) -> set[str]`` and ``kv_cache_spec() -> ModelKVSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.core.interfaces import AttentionBackend, FusedOps


@dataclass
class ModelInitContext:
    """Everything a model needs besides its HF config to build its layers.

    ``dtype`` is what activations are computed in; ``weight_dtype`` what unquantized
    linear, embedding and LM-head matrices are stored in (None: ``dtype``). They differ
    where a platform computes a narrow checkpoint in float32 (bf16 weights on a CPU
    without bf16 arithmetic); norms and rotary tables follow the activations."""

    dtype: torch.dtype
    device: torch.device
    attn_backend: AttentionBackend
    quantization: Any = None  # engine.quantization.QuantizationPlan of a quantized checkpoint
    fused_ops: FusedOps | None = None  # the platform's norm/act/rotary kernels
    parallel_config: Any = None  # tensor / pipeline parallel rank and sizes, later
    weight_dtype: torch.dtype | None = None

    def linear_method(self, *prefixes: str) -> Any:
        """The quant_method of the linear layer built from the checkpoint modules
        ``prefixes`` (several for a fused layer); None: unquantized."""
        if self.quantization is None:
            return None
        return self.quantization.method.linear_method(tuple(prefixes))

    @property
    def matrix_dtypes(self) -> dict[str, torch.dtype]:
        """Keyword arguments of the layers that hold a weight matrix: the activation
        dtype and the matrix's storage dtype."""
        return {"dtype": self.dtype, "weight_dtype": self.weight_dtype or self.dtype}


@dataclass(frozen=True)
class ModelKVSpec:
    """What the KV cache must hold for this model (one cache tensor per layer)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer uses the same one, else None (keep all blocks)."""
        windows = set(self.sliding_windows)
        if len(windows) == 1:
            return next(iter(windows))
        return None
