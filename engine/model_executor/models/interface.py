"""What every model class receives at construction and reports back.

A model class is ``cls(hf_config, ctx)`` with ``ctx`` a :class:`ModelInitContext`;
it exposes ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` over a flat
token batch, ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``,
``load_weights(weights) -> set[str]`` and ``kv_cache_spec() -> ModelKVSpec``.

Under pipeline parallelism (``ctx.parallel.pp_size > 1``) a model builds only its stage's
layers and ``forward(input_ids, positions, intermediate)`` takes the previous stage's
:class:`IntermediateTensors` (None on the first stage) and returns them for the next stage
(hidden states only from the last). A model that supports it sets
``supports_pipeline_parallel = True``; tensor parallelism needs no declaration beyond
building its layers with ``ctx.tp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.interfaces import AttentionBackend, Communicator, FusedOps


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the residual stream, not yet added."""

    hidden: torch.Tensor
    residual: torch.Tensor

    def stacked(self) -> torch.Tensor:
        """``[2, T, hidden]``: one message for the point-to-point send."""
        return torch.stack((self.hidden, self.residual))

    @classmethod
    def unstack(cls, buffer: torch.Tensor) -> IntermediateTensors:
        return cls(buffer[0], buffer[1])


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
    parallel: Any = None  # engine.distributed.ParallelState; None: one rank
    weight_dtype: torch.dtype | None = None
    moe_kernels: list = field(default_factory=list)  # the platform's FusedMoEKernel classes
    # engine.core.pooling_config.PoolerConfig when the model is run for pooling (its
    # class builds ``self.pooler`` from it); None: a generating model.
    pooler_config: Any = None
    model_dir: Any = None  # the checkpoint directory (sentence-transformers modules)

    @property
    def expert_parallel(self) -> bool:
        """Experts placed whole on the TP ranks instead of sharded (--enable-expert-parallel)."""
        return self.parallel is not None and self.parallel.layout.enable_expert_parallel

    @property
    def tp(self) -> Communicator | None:
        """The tensor-parallel group the sharded layers reduce over (None: one rank)."""
        if self.parallel is None or self.parallel.tp_size == 1:
            return None
        return self.parallel.tp

    @property
    def ep(self) -> Communicator | None:
        """The expert-parallel group when it spans data-parallel replicas (EP = DP x TP);
        None: expert parallelism, if on, runs over ``tp``."""
        return None if self.parallel is None else self.parallel.ep

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank builds (all of them without pipeline stages)."""
        if self.parallel is None:
            return range(num_layers)
        return self.parallel.layout.stage_layers(num_layers)

    @property
    def is_first_stage(self) -> bool:
        return self.parallel is None or self.parallel.layout.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.parallel is None or self.parallel.layout.is_last_stage

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
    # MLA: one latent entry of head_size per token (num_kv_heads 1), no separate values.
    mla: bool = False
    # Per layer: chunked local attention's chunk size (None: none); empty: no layer chunked.
    attention_chunk_sizes: tuple[int | None, ...] = ()

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer uses the same one, else None (keep all blocks)."""
        windows = set(self.sliding_windows)
        if len(windows) == 1:
            return next(iter(windows))
        return None
