"""ModernBERT for pooling: the embedding model and the sequence classifier.

Pre-norm encoder layers with rotary positions and a GeGLU MLP; every
``global_attn_every_n_layers``-th layer (from layer 0) attends globally, the others
locally: keys within ``local_attention // 2`` positions either side, which is exactly
``Attention(sliding_window=local_attention, causal=False)``. Global and local layers
rotate with their own theta (``global_rope_theta`` / ``local_rope_theta``; transformers 5
keeps both in ``rope_parameters`` by layer type).

The fused checkpoint tensors ``attn.Wqkv`` and ``mlp.Wi`` are cut into their q/k/v and
input/gate parts at load time (lazily: a tensor-parallel rank reads only its rows), so
the fused layers split over ranks by heads and by MLP features like any other.

Classification (``ModernBertForSequenceClassification``): ``classifier_pooling`` ``cls``
(the first token) or ``mean`` (over the prompt), then ``head`` (dense, activation,
LayerNorm) and ``classifier``. Checkpoint names: the base model bare (a
sentence-transformers save) or under ``model.``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import (
    MergedLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.model_executor.layers.pooler import PoolingType, make_pooler
from engine.model_executor.layers.rotary import (
    RopeInputs,
    RotaryEmbedding,
    rope_scaling_from_config,
)
from engine.model_executor.lazy_tensor import split_part
from engine.model_executor.models.bert import (
    Activation,
    encoder_kv_spec,
    layer_norm,
    load_encoder_weights,
    refuse_quantization,
)
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.weight_utils import StackedParam

GLOBAL, LOCAL = "full_attention", "sliding_attention"
_DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}
_THETA_KEYS = {GLOBAL: "global_rope_theta", LOCAL: "local_rope_theta"}
# The fused tensors and the parts they are cut into (in their stored order).
_FUSED_PARTS = {".attn.Wqkv.": ("q", "k", "v"), ".mlp.Wi.": (0, 1)}


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's attention: transformers 5's ``layer_types``, or derived from
    ``global_attn_every_n_layers`` as transformers 4 did."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        every = int(getattr(hf_config, "global_attn_every_n_layers", 3))
        types = [LOCAL if i % every else GLOBAL for i in range(hf_config.num_hidden_layers)]
    types = list(types)
    unknown = sorted(set(types) - {GLOBAL, LOCAL})
    if unknown or len(types) != hf_config.num_hidden_layers:
        raise ValueError(f"ModernBERT layer_types {types} must name {GLOBAL!r} or {LOCAL!r} "
                         f"for each of the {hf_config.num_hidden_layers} layers")
    return types


def rotary_for(hf_config: Any, ctx: ModelInitContext, kind: str, head_size: int
               ) -> RotaryEmbedding:
    """The rotary embedding of one layer type, with that type's rope parameters."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    params = dict(params.get(kind) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(hf_config, _THETA_KEYS[kind], None)
                                     or _DEFAULT_THETA[kind])
    params.setdefault("rope_type", "default")
    view = SimpleNamespace(rope_parameters=params,
                           max_position_embeddings=hf_config.max_position_embeddings)
    return RotaryEmbedding(head_size, rope_scaling_from_config(view), dtype=ctx.dtype,
                           device=ctx.device, fused_ops=ctx.fused_ops)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.tok_embeddings = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                             **ctx.matrix_dtypes, device=ctx.device,
                                             fused_ops=ctx.fused_ops, tp=ctx.tp)
        self.norm = layer_norm(hf_config.hidden_size, hf_config.norm_eps, ctx,
                               bias=hf_config.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, layer_idx: int,
                 rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        head_size = hidden // heads
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        bias = bool(hf_config.attention_bias)
        self.Wqkv = QKVLinear(hidden, head_size, heads, heads, bias=bias, **common)
        self.Wo = RowParallelLinear(hidden, hidden, bias=bias, **common)
        self.rotary = rotary
        local_heads = self.Wqkv.num_heads
        self.attn = Attention(local_heads, head_size, head_size**-0.5, local_heads, layer_idx,
                              ctx.attn_backend, sliding_window=window, causal=False)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        qkv = self.Wqkv(hidden)
        q_size, k_size = self.Wqkv.shard_sizes["q"], self.Wqkv.shard_sizes["k"]
        qk = self.rotary.apply(qkv[:, : q_size + k_size], rope)  # q and k heads in one pass
        q, k = qk.split([q_size, k_size], dim=-1)
        return self.Wo(self.attn(q, k, qkv[:, q_size + k_size :]))


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(act(input) * gate)`` with ``Wi`` = [input | gate]."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        inter = int(hf_config.intermediate_size)
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        bias = bool(hf_config.mlp_bias)
        self.Wi = MergedLinear(hf_config.hidden_size, {0: inter, 1: inter}, bias=bias, **common)
        self.act = get_act_and_mul(hf_config.hidden_activation, ctx.fused_ops, ctx.dtype)
        self.Wo = RowParallelLinear(inter, hf_config.hidden_size, bias=bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(x)))


class ModernBertLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, layer_idx: int, kind: str,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        size, eps, bias = hf_config.hidden_size, hf_config.norm_eps, hf_config.norm_bias
        self.kind = kind
        # The first layer's input is the (already normed) embedding: no attn_norm.
        self.attn_norm = nn.Identity() if layer_idx == 0 else layer_norm(size, eps, ctx, bias)
        window = int(hf_config.local_attention) if kind == LOCAL else None
        self.attn = ModernBertAttention(hf_config, ctx, layer_idx, rotary, window)
        self.mlp_norm = layer_norm(size, eps, ctx, bias)
        self.mlp = ModernBertMLP(hf_config, ctx)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), rope)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertClassificationHead(nn.Module):
    """transformers' ``head`` (dense, activation, LayerNorm) then ``classifier``:
    ``[N, hidden] -> [N, num_labels]``."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.dense = ReplicatedLinear(hidden, hidden, bias=bool(hf_config.classifier_bias),
                                      **common)
        self.act = Activation(hf_config.classifier_activation)
        self.norm = layer_norm(hidden, hf_config.norm_eps, ctx, bias=hf_config.norm_bias)
        self.classifier = ReplicatedLinear(hidden, hf_config.num_labels, bias=True, **common)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(self.act(self.dense(pooled))))


class ModernBertModel(nn.Module):
    """The ModernBERT embedding model (CLS pooling unless sentence-transformers' config
    says otherwise)."""

    is_pooling_model = True
    uses_token_type_ids = False
    head_renames: tuple[tuple[str, str], ...] = ()
    skipped = ("head.", "decoder.", "classifier.")  # MLM / classification heads
    stacked = tuple(StackedParam(f"{fused}", f"{fused}{part}.", part)
                    for fused, parts in _FUSED_PARTS.items() for part in parts)

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        refuse_quantization(ctx, type(self).__name__)
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}")
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.head_size = hidden // heads
        types = layer_types(hf_config)
        self.embeddings = ModernBertEmbeddings(hf_config, ctx)
        self.rotary = nn.ModuleDict({kind: rotary_for(hf_config, ctx, kind, self.head_size)
                                     for kind in sorted(set(types))})
        self.layers = nn.ModuleList(
            ModernBertLayer(hf_config, ctx, i, kind, self.rotary[kind])
            for i, kind in enumerate(types)
        )
        self.final_norm = layer_norm(hidden, hf_config.norm_eps, ctx, bias=hf_config.norm_bias)
        head = self.make_head(hf_config, ctx)
        if head is not None:
            self.head = head  # registered before the pooler: its parameters are "head.*"
        self.pooler = make_pooler(ctx, self.default_pooling(hf_config), head=head)

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module | None:
        return None

    def default_pooling(self, hf_config: Any) -> PoolingType:
        return PoolingType.CLS

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        ropes = {kind: rotary.prepare(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden = layer(hidden, ropes[layer.kind])
        return self.final_norm(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        return encoder_kv_spec(self.head_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_encoder_weights(self, _split_fused(weights), base_prefix="model.",
                                    renames=self.head_renames, skipped=self.skipped,
                                    stacked=self.stacked)


def _split_fused(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``...attn.Wqkv.weight`` -> ``...attn.Wqkv.q.weight`` / ``.k.`` / ``.v.`` (and
    ``mlp.Wi`` -> ``.0.`` / ``.1.``): equal parts along the output rows, not read yet."""
    for name, tensor in weights:
        fused = next((f for f in _FUSED_PARTS if f in name), None)
        if fused is None:
            yield name, tensor
            continue
        parts = _FUSED_PARTS[fused]
        for i, part in enumerate(parts):
            yield name.replace(fused, f"{fused}{part}."), split_part(tensor, 0, i, len(parts))


class ModernBertForSequenceClassification(ModernBertModel):
    """ModernBERT classifier: ``classifier_pooling`` (cls | mean), ``head``, ``classifier``."""

    # "head." kept as it is (not skipped), the classifier moved under it.
    head_renames = (("head.", "head."), ("classifier.", "head.classifier."))

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module:
        return ModernBertClassificationHead(hf_config, ctx)

    def default_pooling(self, hf_config: Any) -> PoolingType:
        pooling = getattr(hf_config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {pooling!r} is not supported ('cls', 'mean')")
        return PoolingType.CLS if pooling == "cls" else PoolingType.MEAN
