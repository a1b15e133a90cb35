"""Decoder models run for pooling: embedders, sequence classifiers, rerankers, rewards.

:func:`as_pooling_model` turns a generating decoder class (the Llama family: Llama,
Mistral, Qwen2, Qwen3 ...) into a pooling one that returns the final hidden states and
pools them (last token by default: a causal model's summary of the whole prompt). What
the head is follows the pooler config's task:

- ``embed``: no head; the LM head is not built (its tensor is skipped when present).
- ``classify`` / ``reward``: ``score`` (``[num_labels, hidden]``, no bias), as
  transformers' ``*ForSequenceClassification`` saves it; or, with ``classifier_from_token``
  (vLLM's hf_overrides for Qwen3-Reranker-style checkpoints that are causal LMs), the
  LM-head rows of those tokens: two tokens make one logit, ``row[1] - row[0]`` (so its
  sigmoid is the 2-way softmax probability of the second token), more make one label
  each. The LM head is dropped once the rows are taken.

Checkpoint names: a bare ``*Model`` save (sentence-transformers) has no ``model.`` prefix;
``*ForCausalLM`` / ``*ForSequenceClassification`` ones have it. Both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.embedding import LMHead
from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.pooler import PoolingType, make_pooler
from engine.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    PPMissingLayer,
    Qwen2ForCausalLM,
)
from engine.model_executor.models.qwen3 import Qwen3ForCausalLM

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


def pooling_model_class(model_cls: type[nn.Module], architecture: str, pooler_config: Any
                        ) -> type[nn.Module]:
    """The class that runs ``architecture`` for pooling: the class itself when it only
    pools, a decoder through :func:`as_pooling_model`, else a clear error."""
    if getattr(model_cls, "is_pooling_model", False):
        return model_cls
    if isinstance(model_cls, type) and issubclass(model_cls, LlamaForCausalLM):
        return as_pooling_model(model_cls)
    raise ValueError(f"{architecture} cannot run as a pooling model (--runner pooling); "
                     "pooling runs encoder models and Llama-family decoders")


def as_pooling_model(base: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """``base`` (a Llama-family decoder) as a pooling model (see the module docstring)."""
    return type(f"{base.__name__}ForPooling", (_DecoderPooling, base), {})


class _DecoderPooling(LlamaForCausalLM):
    """Mixin placed before a decoder class; see :func:`as_pooling_model`."""

    is_pooling_model = True
    uses_token_type_ids = False

    def __init__(self, hf_config: Any, ctx: Any) -> None:
        super().__init__(hf_config, ctx)
        config = ctx.pooler_config
        task = "embed" if config is None else config.task
        self._from_tokens = list(config.classifier_from_token) if config is not None else []
        self._model_dir = ctx.model_dir
        head = None
        if task in ("classify", "reward"):
            num_labels = (1 if len(self._from_tokens) == 2 else len(self._from_tokens)
                          ) or int(getattr(hf_config, "num_labels", 1))
            self.score = ReplicatedLinear(hf_config.hidden_size, num_labels, bias=False,
                                          **ctx.matrix_dtypes, device=ctx.device)
            head = self.score
        if not self._from_tokens or task == "embed":
            self.lm_head = PPMissingLayer()
        self.pooler = make_pooler(ctx, PoolingType.LAST, head=head,
                                  reward_pooling=PoolingType.ALL)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("a pooling model computes no token logits")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        score = getattr(self, "score", None)
        keeps_head = isinstance(self.lm_head, LMHead)
        from_tokens = score is not None and bool(self._from_tokens)
        if from_tokens:
            score.weight.optional_weight = True  # made from the LM head's rows below

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(_OWN_PREFIXES):
                    name = "model." + name  # a bare *Model checkpoint
                if name.startswith("lm_head.") and not keeps_head:
                    continue
                if name.startswith("score.") and (score is None or from_tokens):
                    continue  # an embedder of a classifier checkpoint: no head
                yield name, tensor

        try:
            loaded = super().load_weights(renamed())
        except ValueError as exc:
            if score is not None and "score.weight" in str(exc):
                raise ValueError(f"{exc} (the classification head; a causal LM scores "
                                 "through hf_overrides classifier_from_token)") from exc
            raise
        if from_tokens:
            self._score_from_lm_head(score)
            loaded.add("score.weight")
        return loaded

    def _score_from_lm_head(self, score: ReplicatedLinear) -> None:
        from engine.core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(self._model_dir))
        ids = []
        for token in self._from_tokens:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"classifier_from_token {token!r} is not one token of the "
                                 "model's vocabulary")
            ids.append(int(token_id))
        rows = self.lm_head.weight[torch.tensor(ids)].float()
        weight = (rows[1] - rows[0]).unsqueeze(0) if len(ids) == 2 else rows
        score.weight.copy_(weight.to(score.weight.dtype))
        self.lm_head = PPMissingLayer()  # only its rows were needed


# Bare decoders (sentence-transformers saves; e5-mistral-style embedders) and
# transformers' sequence classifiers.
LlamaModel = type("LlamaModel", (_DecoderPooling, LlamaForCausalLM), {})
MistralModel = type("MistralModel", (_DecoderPooling, MistralForCausalLM), {})
MistralForSequenceClassification = type(
    "MistralForSequenceClassification", (_DecoderPooling, MistralForCausalLM), {})
Qwen3Model = type("Qwen3Model", (_DecoderPooling, Qwen3ForCausalLM), {})
LlamaForSequenceClassification = type(
    "LlamaForSequenceClassification", (_DecoderPooling, LlamaForCausalLM), {})
Qwen3ForSequenceClassification = type(
    "Qwen3ForSequenceClassification", (_DecoderPooling, Qwen3ForCausalLM), {})

Qwen2Model = type("Qwen2Model", (_DecoderPooling, Qwen2ForCausalLM), {})
Qwen2ForSequenceClassification = type(
    "Qwen2ForSequenceClassification", (_DecoderPooling, Qwen2ForCausalLM), {})
