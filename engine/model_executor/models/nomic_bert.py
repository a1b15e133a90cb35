"""NomicBERT (nomic-embed-text) for pooling: the embedding model and the classifier.

A post-norm BERT without position embeddings: word + token-type embeddings and a
LayerNorm, then layers of bidirectional attention with rotary positions (no biases)
and a SwiGLU MLP, each followed by ``LayerNorm(x + sublayer(x))``.

Two spellings exist, both read here. transformers 5's own ``nomic_bert``
(``hidden_size``, ``rope_parameters``; ``layers.N.self_attn.q_proj``, ``mlp.gate_proj``,
``post_attention_layernorm`` ...) and the original remote-code checkpoints on the Hub
(``n_embd``, ``rotary_emb_base``; ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` / ``fc12``
/ ``fc2``, ``norm1`` / ``norm2``, ``emb_ln``), whose tensors are renamed the way
transformers' conversion mapping does (``fc11`` is the up projection, ``fc12`` the gate;
``Wqkv`` is cut into q, k and v). Remote-code switches this model does not implement
(pre-norm, partial or interleaved rotary, biases, rotary scaling, MoE layers) are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from engine.model_executor.layers.pooler import PoolingType, make_pooler
from engine.model_executor.layers.rotary import (
    RopeInputs,
    RotaryEmbedding,
    rope_scaling_from_config,
)
from engine.model_executor.lazy_tensor import split_part
from engine.model_executor.models.bert import (
    TanhClassificationHead,
    encoder_kv_spec,
    layer_norm,
    load_encoder_weights,
    refuse_quantization,
)
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.weight_utils import StackedParam

# Remote-code tensor names -> transformers 5's (its conversion mapping, in order).
_LEGACY_RENAMES = (
    ("encoder.layers.", "layers."), ("emb_ln.", "embeddings.LayerNorm."),
    (".attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."), (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."), (".norm2.", ".post_mlp_layernorm."),
)
# Remote-code config switches and the only values implemented here.
_LEGACY_REQUIRED = {
    "prenorm": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
    "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
    "rotary_scaling_factor": None, "use_rms_norm": False, "parallel_block": False,
    "moe_every_n_layers": 0,
}
_LEGACY_ACTIVATIONS = {"swiglu": "silu"}


@dataclass(frozen=True)
class NomicShape:
    """The config values the model needs, from either spelling."""

    hidden_size: int
    num_heads: int
    head_size: int
    num_layers: int
    intermediate_size: int
    eps: float
    hidden_act: str
    rope_parameters: dict[str, Any]  # transformers' (rope_type, rope_theta, scaling ...)
    max_positions: int
    type_vocab_size: int

    @classmethod
    def of(cls, hf_config: Any) -> NomicShape:
        if getattr(hf_config, "n_embd", None) is None:
            params = dict(getattr(hf_config, "rope_parameters", None) or {})
            params.setdefault("rope_theta", 1000.0)
            hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
            return cls(hidden, heads, getattr(hf_config, "head_dim", None) or hidden // heads,
                       hf_config.num_hidden_layers, hf_config.intermediate_size,
                       hf_config.layer_norm_eps, hf_config.hidden_act, params,
                       hf_config.max_position_embeddings, hf_config.type_vocab_size)
        for key, wanted in _LEGACY_REQUIRED.items():
            value = getattr(hf_config, key, None)  # absent or null: the default
            if value is not None and value != wanted:
                raise ValueError(f"NomicBERT with {key}={value!r} is not supported "
                                 f"(only {wanted!r})")
        activation = getattr(hf_config, "activation_function", "swiglu")
        if activation not in _LEGACY_ACTIVATIONS:
            raise ValueError(f"NomicBERT activation_function {activation!r} is not supported "
                             f"({', '.join(_LEGACY_ACTIVATIONS)})")
        hidden, heads = hf_config.n_embd, hf_config.n_head
        return cls(hidden, heads, hidden // heads, hf_config.n_layer,
                   getattr(hf_config, "n_inner", None) or 4 * hidden,
                   getattr(hf_config, "layer_norm_epsilon", 1e-12),
                   _LEGACY_ACTIVATIONS[activation],
                   {"rope_type": "default",
                    "rope_theta": float(getattr(hf_config, "rotary_emb_base", 1000.0))},
                   getattr(hf_config, "n_positions", 2048),
                   getattr(hf_config, "type_vocab_size", 2))


class NomicBertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any, shape: NomicShape, ctx: ModelInitContext) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.word_embeddings = VocabEmbedding(hf_config.vocab_size, hidden, **ctx.matrix_dtypes,
                                              device=ctx.device, fused_ops=ctx.fused_ops,
                                              tp=ctx.tp)
        self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, hidden,
                                                  dtype=ctx.dtype, device=ctx.device)
        self.LayerNorm = layer_norm(hidden, shape.eps, ctx)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
                ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return self.LayerNorm(self.word_embeddings(input_ids)
                              + self.token_type_embeddings(token_type_ids))


class NomicBertAttention(nn.Module):
    def __init__(self, shape: NomicShape, ctx: ModelInitContext, layer_idx: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        heads, head_size = shape.num_heads, shape.head_size
        self.qkv_proj = QKVLinear(shape.hidden_size, head_size, heads, heads, bias=False,
                                  **common)
        self.o_proj = RowParallelLinear(heads * head_size, shape.hidden_size, bias=False,
                                        **common)
        self.rotary = rotary
        local_heads = self.qkv_proj.num_heads
        self.attn = Attention(local_heads, head_size, head_size**-0.5, local_heads, layer_idx,
                              ctx.attn_backend, causal=False)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, k_size = self.qkv_proj.shard_sizes["q"], self.qkv_proj.shard_sizes["k"]
        qk = self.rotary.apply(qkv[:, : q_size + k_size], rope)  # q and k heads in one pass
        q, k = qk.split([q_size, k_size], dim=-1)
        return self.o_proj(self.attn(q, k, qkv[:, q_size + k_size :]))


class NomicBertMLP(nn.Module):
    """``down(act(gate) * up)``."""

    def __init__(self, shape: NomicShape, ctx: ModelInitContext) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        inter = shape.intermediate_size
        self.gate_up_proj = MergedLinear(shape.hidden_size, {0: inter, 1: inter}, bias=False,
                                         **common)
        self.act = get_act_and_mul(shape.hidden_act, ctx.fused_ops, ctx.dtype)
        self.down_proj = RowParallelLinear(inter, shape.hidden_size, bias=False, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class NomicBertLayer(nn.Module):
    def __init__(self, shape: NomicShape, ctx: ModelInitContext, layer_idx: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = NomicBertAttention(shape, ctx, layer_idx, rotary)
        self.post_attention_layernorm = layer_norm(shape.hidden_size, shape.eps, ctx)
        self.mlp = NomicBertMLP(shape, ctx)
        self.post_mlp_layernorm = layer_norm(shape.hidden_size, shape.eps, ctx)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        hidden = self.post_attention_layernorm(hidden + self.self_attn(hidden, rope))
        return self.post_mlp_layernorm(hidden + self.mlp(hidden))


class NomicBertModel(nn.Module):
    """The NomicBERT embedding model (CLS pooling unless sentence-transformers' config
    says otherwise: nomic-embed-text pools the mean)."""

    is_pooling_model = True
    uses_token_type_ids = True
    head_renames: tuple[tuple[str, str], ...] = ()
    skipped = ("pooler.", "lm_head.", "cls.", "classifier.")  # heads of other tasks
    stacked = (
        StackedParam(".self_attn.qkv_proj.", ".self_attn.q_proj.", "q"),
        StackedParam(".self_attn.qkv_proj.", ".self_attn.k_proj.", "k"),
        StackedParam(".self_attn.qkv_proj.", ".self_attn.v_proj.", "v"),
        StackedParam(".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
        StackedParam(".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
    )

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        refuse_quantization(ctx, type(self).__name__)
        shape = NomicShape.of(hf_config)
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.head_size = shape.head_size
        self.embeddings = NomicBertEmbeddings(hf_config, shape, ctx)
        rope = SimpleNamespace(rope_parameters=shape.rope_parameters,
                               max_position_embeddings=shape.max_positions)
        self.rotary_emb = RotaryEmbedding(shape.head_size, rope_scaling_from_config(rope),
                                          dtype=ctx.dtype, device=ctx.device,
                                          fused_ops=ctx.fused_ops)
        self.layers = nn.ModuleList(NomicBertLayer(shape, ctx, i, self.rotary_emb)
                                    for i in range(shape.num_layers))
        head = self.make_head(hf_config, ctx)
        if head is not None:
            self.head = head  # registered before the pooler: its parameters are "head.*"
        self.pooler = make_pooler(ctx, PoolingType.CLS, head=head)

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, token_type_ids)
        rope = self.rotary_emb.prepare(positions)
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return hidden

    def kv_cache_spec(self) -> ModelKVSpec:
        return encoder_kv_spec(self.head_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_encoder_weights(self, _from_legacy_names(weights),
                                    base_prefix="nomic_bert.", renames=self.head_renames,
                                    skipped=self.skipped, stacked=self.stacked)


def _from_legacy_names(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Remote-code names as transformers 5 spells them (``Wqkv`` cut into q, k, v)."""
    for name, tensor in weights:
        for old, new in _LEGACY_RENAMES:
            name = name.replace(old, new)
        if ".attn.Wqkv." in name:
            for i, part in enumerate("qkv"):
                yield (name.replace(".attn.Wqkv.", f".self_attn.{part}_proj."),
                       split_part(tensor, 0, i, 3))
            continue
        yield name, tensor


class NomicBertForSequenceClassification(NomicBertModel):
    """NomicBERT classifier: the CLS row through ``pooler.dense`` + tanh, then
    ``classifier`` (as BERT's)."""

    head_renames = (("pooler.dense.", "head.dense."), ("classifier.", "head.out_proj."))

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module:
        shape = NomicShape.of(hf_config)
        view = SimpleNamespace(hidden_size=shape.hidden_size, num_labels=hf_config.num_labels)
        return TanhClassificationHead(view, ctx)
