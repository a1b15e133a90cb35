"""EAGLE-1 draft head for Llama-family targets (as vLLM's ``llama_eagle.py``).

The head drafts the token after next from the target's last hidden state: at
position ``i`` it reads ``(embed(t_{i+1}), h_i)`` with ``h_i`` the target's
``forward`` output (after the target's final norm) and returns a hidden state that
the *target's* ``lm_head`` turns into logits for ``t_{i+2}``. Architecture, as in
the EAGLE authors' checkpoints (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B):

- ``fc``: ``Linear(2 * hidden -> hidden)``, bias only if the config says ``bias``;
- ``num_hidden_layers`` (normally 1) Llama decoder layers; layer 0 has no input norm
  (its input is ``fc``'s output, not a residual stream);
- no final norm and no LM head of its own; the embedding may be absent from the
  checkpoint, in which case it is shared from the target (:meth:`share_target`).

The head's attention layers own a separate KV cache list indexed ``0 .. num_layers-1``
(the proposer runs the head under its own forward context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.rotary import RotaryEmbedding, rope_scaling_from_config
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.llama import (
    SKIPPED_TENSORS,
    STACKED_PARAMS,
    DecoderOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    config_head_size,
)
from engine.model_executor.weight_utils import load_named_weights

FC_KEYS = ("fc.weight", "model.fc.weight")
EMBED_WEIGHT = "embed_tokens.weight"
# EAGLE-1 shares the target's LM head; layer 0 has no input norm (a checkpoint that
# carries one anyway gets it ignored, as vLLM does).
IGNORED_TENSORS = frozenset({"lm_head.weight", "layers.0.input_layernorm.weight"})


def is_eagle_checkpoint(weight_files: Iterable[str | Path]) -> bool:
    """Whether safetensors files hold an EAGLE head (an ``fc.weight`` tensor).

    The EAGLE authors' configs name the architecture ``LlamaForCausalLM``; only the
    tensor names tell a head from a one-layer Llama. Reads the headers only."""
    from safetensors import safe_open

    for path in weight_files:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if any(key in FC_KEYS for key in f.keys()):  # noqa: SIM118
                return True
    return False


class NoNorm(nn.Module):
    """Stands in for layer 0's input norm: the head's input is ``fc``'s output as is."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x
        summed = x + residual
        return summed, summed


def checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The authors' names (``fc.weight``, ``layers.0.*``) from either layout: vLLM-style
    exports prefix them with ``model.``; the ignored tensors are dropped. ``fc`` is
    loaded as its two input halves (see :class:`EagleLlamaForCausalLM`)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name in IGNORED_TENSORS:
            continue
        if name == "fc.weight":
            if tensor.dim() != 2 or tensor.shape[1] % 2:
                raise ValueError(f"fc.weight must be [hidden, 2 * hidden], got {list(tensor.shape)}")
            half = tensor.shape[1] // 2
            yield "fc_embed.weight", tensor[:, :half]
            yield "fc_hidden.weight", tensor[:, half:]
        elif name == "fc.bias":
            yield "fc_embed.bias", tensor
        else:
            yield name, tensor


class EagleLlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], target_hidden [T, H]) -> hidden [T, H]``;
    ``compute_logits`` goes through the target's LM head."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        ctx = dataclasses.replace(ctx, quantization=None)  # EAGLE heads are unquantized
        self.config = hf_config
        hidden = hf_config.hidden_size
        self.opts = DecoderOptions(head_size=config_head_size(hf_config))
        self.vocab_size = hf_config.vocab_size
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or (
            hf_config.num_attention_heads
        )
        self.head_size = self.opts.head_size
        common = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        self.embed_tokens = VocabEmbedding(
            hf_config.vocab_size, hidden, **ctx.matrix_dtypes, device=ctx.device,
            fused_ops=ctx.fused_ops,
        )
        # fc(cat(embed, target_hidden)) as its two halves summed: no concatenation, so
        # the head's decode passes are made of kernels a forward graph can record.
        self.fc_embed = ReplicatedLinear(
            hidden, hidden, bias=bool(getattr(hf_config, "bias", False)),
            **ctx.matrix_dtypes, device=ctx.device,
        )
        self.fc_hidden = ReplicatedLinear(
            hidden, hidden, bias=False, **ctx.matrix_dtypes, device=ctx.device
        )
        self.fused_ops = ctx.fused_ops
        self.rotary_emb = RotaryEmbedding(
            self.head_size, rope_scaling_from_config(hf_config), **common
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, ctx, self.opts, i, self.rotary_emb)
            for i in range(self.num_layers)
        )
        self.layers[0].input_layernorm = NoNorm()
        self.lm_head: LMHead | None = None  # the target's, set by share_target
        self.embed_loaded = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Pre-LM-head hidden states; ``target_hidden[j]`` is the target's output at the
        position before ``input_ids[j]``'s (EAGLE's one-token shift)."""
        embeds = self.embed_tokens(input_ids)
        hidden = self._add(self.fc_embed(embeds), self.fc_hidden(target_hidden.to(embeds.dtype)))
        rope = self.rotary_emb.prepare(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        return self._add(hidden, residual)  # no final norm: the target's lm_head reads it

    def _add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``x + residual`` (into ``residual``) through the platform's fused op."""
        if self.fused_ops is None or not self.fused_ops.supports(x.dtype):
            return x + residual
        return self.fused_ops.residual_add_(x, residual)

    def share_target(self, target: LlamaForCausalLM) -> None:
        """Use the target's LM head, and its embedding when the checkpoint had none."""
        self.lm_head = target.lm_head
        if not self.embed_loaded:
            self.embed_tokens = target.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError(
                "an EAGLE head has no LM head of its own: call share_target(target_model) "
                "after loading it"
            )
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        return ModelKVSpec(
            self.num_layers, self.num_kv_heads, self.head_size, (None,) * self.num_layers
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load an EAGLE checkpoint in the authors' or the ``model.``-prefixed layout;
        a missing ``embed_tokens.weight`` is shared from the target later."""
        seen: set[str] = set()

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in checkpoint_names(weights):
                seen.add(name)
                yield name, tensor

        try:
            loaded = load_named_weights(
                self,
                tracked(),
                stacked=STACKED_PARAMS,
                skip_substrings=SKIPPED_TENSORS,
                optional={EMBED_WEIGHT},
            )
        except ValueError as exc:
            if "fc_embed.weight" not in seen:
                raise ValueError(f"not an EAGLE checkpoint: it lacks fc.weight ({exc})") from None
            raise
        self.embed_loaded = EMBED_WEIGHT in loaded
        # Report the checkpoint's own names for the two fc halves.
        halves = {"fc_embed.weight": "fc.weight", "fc_hidden.weight": "fc.weight",
                  "fc_embed.bias": "fc.bias"}
        return {halves.get(name, name) for name in loaded}

