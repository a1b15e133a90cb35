"""The BERT encoder family for pooling: BERT, RoBERTa and XLM-RoBERTa, as embedding
models (the bare ``*Model`` classes) and sequence classifiers.

An encoder runs each request's whole prompt in one step with bidirectional attention
(``Attention(..., causal=False)``: the backend attends within each request of the flat
batch and keeps no KV cache). ``forward`` returns the final hidden states
(transformers' ``last_hidden_state``); the model's ``pooler``
(:mod:`engine.model_executor.layers.pooler`) turns them into embeddings or, through the
classification ``head``, into logits.

Post-norm layers as in transformers: ``LayerNorm(x + attention(x))`` then
``LayerNorm(x + mlp(x))``. q/k/v are fused into ``qkv_proj`` (column parallel), the
attention output and MLP output projections are row parallel; norms, position and
token-type embeddings are replicated.

Checkpoint names: a sentence-transformers save holds the bare model's names
(``embeddings.*``, ``encoder.layer.*``), a ``*ForSequenceClassification`` checkpoint the
same under ``bert.`` / ``roberta.`` plus its head. Tensors no pooling model uses (BERT's
pooler on an embedding model, MLM / NSP heads, saved position-id buffers) are skipped;
every parameter the model has must be in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.model_executor.layers.pooler import PoolingType, make_pooler
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.weight_utils import StackedParam, load_named_weights

# transformers' ACT2FN names an encoder config may carry in ``hidden_act``.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_python": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}
# Buffers older transformers versions saved with the weights.
_SAVED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


class Activation(nn.Module):
    """The activation a config names (``hidden_act``), by transformers' semantics."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in _ACTIVATIONS:
            raise ValueError(f"activation {name!r} is not supported; supported: "
                             + ", ".join(sorted(_ACTIVATIONS)))
        self.name = name
        self.fn = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


def layer_norm(size: int, eps: float, ctx: ModelInitContext, bias: bool = True) -> nn.LayerNorm:
    """A LayerNorm in the activation dtype (norms follow the activations)."""
    return nn.LayerNorm(size, eps=eps, bias=bias, dtype=ctx.dtype, device=ctx.device)


def refuse_quantization(ctx: ModelInitContext, architecture: str) -> None:
    if ctx.quantization is not None:
        raise ValueError(f"{architecture}: quantized encoder checkpoints are not supported")


def encoder_kv_spec(head_size: int) -> ModelKVSpec:
    """Encoders keep no KV cache: no cache layers."""
    return ModelKVSpec(num_layers=0, num_kv_heads=1, head_size=head_size, sliding_windows=())


def load_encoder_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    base_prefix: str,
    renames: tuple[tuple[str, str], ...],
    skipped: tuple[str, ...],
    stacked: Iterable[StackedParam],
) -> set[str]:
    """Load checkpoint tensors into an encoder model with its layers at the top level.

    Names lose ``base_prefix`` (``bert.``: a classification checkpoint's base model),
    then the first matching ``(old, new)`` prefix of ``renames`` applies (the head), else
    names under ``skipped`` are dropped. The pooler's sentence-transformers Dense modules
    (loaded from their own folders) may stay unloaded."""

    def renamed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix(base_prefix)
            if name in _SAVED_BUFFERS:
                continue
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            else:
                if name.startswith(skipped):
                    continue
            yield name, tensor

    own_dense = {name for name, _ in model.named_parameters() if name.startswith("pooler.")}
    return load_named_weights(model, renamed(), stacked=stacked, optional=own_dense)


class BertEmbeddings(nn.Module):
    """word + token type + position embeddings, then LayerNorm. ``position_offset``:
    what transformers adds to 0-based positions (RoBERTa: ``padding_idx + 1``)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, position_offset: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        common = {"dtype": ctx.dtype, "device": ctx.device}
        self.word_embeddings = VocabEmbedding(hf_config.vocab_size, hidden, **ctx.matrix_dtypes,
                                              device=ctx.device, fused_ops=ctx.fused_ops,
                                              tp=ctx.tp)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings, hidden,
                                                **common)
        self.token_type_embeddings = nn.Embedding(hf_config.type_vocab_size, hidden, **common)
        self.LayerNorm = layer_norm(hidden, hf_config.layer_norm_eps, ctx)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class BertOutput(nn.Module):
    """``LayerNorm(residual + dense(x))``: the attention output and the MLP output."""

    def __init__(self, in_features: int, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hf_config.hidden_size, bias=True,
                                       **ctx.matrix_dtypes, device=ctx.device, tp=ctx.tp)
        self.LayerNorm = layer_norm(hf_config.hidden_size, hf_config.layer_norm_eps, ctx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        head_size = hidden // heads
        self.qkv_proj = QKVLinear(hidden, head_size, heads, heads, bias=True,
                                  **ctx.matrix_dtypes, device=ctx.device, tp=ctx.tp)
        local_heads = self.qkv_proj.num_heads
        self.attn = Attention(local_heads, head_size, head_size**-0.5, local_heads, layer_idx,
                              ctx.attn_backend, causal=False)
        self.output = BertOutput(hidden, hf_config, ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.output(self.attn(q, k, v), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size,
                                          bias=True, **ctx.matrix_dtypes, device=ctx.device,
                                          tp=ctx.tp)
        self.act = Activation(hf_config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        self.attention = BertAttention(hf_config, ctx, layer_idx)
        self.intermediate = BertIntermediate(hf_config, ctx)
        self.output = BertOutput(hf_config.intermediate_size, hf_config, ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hf_config, ctx, i)
                                   for i in range(hf_config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class TanhClassificationHead(nn.Module):
    """``out_proj(tanh(dense(pooled)))``: BERT's pooler + classifier, RoBERTa's
    classification head (``[N, hidden] -> [N, num_labels]``)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.dense = ReplicatedLinear(hidden, hidden, bias=True, **common)
        self.out_proj = ReplicatedLinear(hidden, hf_config.num_labels, bias=True, **common)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(pooled)))


def check_bert_config(hf_config: Any) -> None:
    """Refuse the variants these classes do not implement (rather than compute wrong)."""
    kind = getattr(hf_config, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported (only 'absolute')")
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ValueError("BERT decoders (is_decoder / add_cross_attention) are not supported; "
                         "only encoders run for pooling")
    if hf_config.hidden_size % hf_config.num_attention_heads:
        raise ValueError(f"hidden_size {hf_config.hidden_size} is not a multiple of "
                         f"num_attention_heads {hf_config.num_attention_heads}")


class BertModel(nn.Module):
    """A BERT embedding model: CLS pooling unless the sentence-transformers config says
    otherwise. Subclasses add a classification ``head`` (:meth:`make_head`)."""

    is_pooling_model = True
    uses_token_type_ids = True
    base_prefix = "bert."  # the base model inside a *ForSequenceClassification checkpoint
    # Checkpoint prefixes of the head, renamed into ``head.`` (classification classes).
    head_renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint tensors no pooling model uses: HF's pooler, MLM / NSP heads, a classifier
    # seen by an embedding model.
    skipped = ("pooler.", "cls.", "lm_head.", "classifier.")
    stacked = (
        StackedParam(".attention.qkv_proj.", ".attention.self.query.", "q"),
        StackedParam(".attention.qkv_proj.", ".attention.self.key.", "k"),
        StackedParam(".attention.qkv_proj.", ".attention.self.value.", "v"),
    )

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        check_bert_config(hf_config)
        refuse_quantization(ctx, type(self).__name__)
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.head_size = hf_config.hidden_size // hf_config.num_attention_heads
        self.embeddings = BertEmbeddings(hf_config, ctx, self.position_offset(hf_config))
        self.encoder = BertEncoder(hf_config, ctx)
        head = self.make_head(hf_config, ctx)
        if head is not None:
            self.head = head  # registered before the pooler: its parameters are "head.*"
        self.pooler = make_pooler(ctx, PoolingType.CLS, head=head)

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        return 0

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def kv_cache_spec(self) -> ModelKVSpec:
        return encoder_kv_spec(self.head_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_encoder_weights(self, weights, base_prefix=self.base_prefix,
                                    renames=self.head_renames, skipped=self.skipped,
                                    stacked=self.stacked)


class BertForSequenceClassification(BertModel):
    """BERT classifier: the CLS row through ``pooler.dense`` + tanh, then ``classifier``."""

    head_renames = (("pooler.dense.", "head.dense."), ("classifier.", "head.out_proj."))

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module:
        return TanhClassificationHead(hf_config, ctx)


class RobertaModel(BertModel):
    """RoBERTa: BERT whose positions start after the padding index."""

    base_prefix = "roberta."

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        pad = getattr(hf_config, "pad_token_id", None)
        if pad is None:
            raise ValueError("RoBERTa configs need pad_token_id (positions start after it)")
        return pad + 1


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa: the RoBERTa architecture (transformers names its base ``roberta``)."""


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa classifier: the CLS row through ``classifier.dense``, tanh,
    ``classifier.out_proj``."""

    head_renames = (("classifier.", "head."),)

    def make_head(self, hf_config: Any, ctx: ModelInitContext) -> nn.Module:
        return TanhClassificationHead(hf_config, ctx)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """XLM-RoBERTa classifier (rerankers such as bge-reranker)."""
