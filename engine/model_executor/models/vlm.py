"""What every vision-language model class shares.

A VLM is a vision tower plus a projector whose rows replace the prompt's image tokens,
and one of the engine's text models (``self.language_model``) that runs everything else:
text embedding, the decoder over ``inputs_embeds``, logits and the KV cache spec all
belong to it. Subclasses build the tower and the language model and implement
``embed_multimodal`` (the model runner's contract: engine.model_executor.multimodal_runner).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.models.interface import (
    IntermediateTensors,
    ModelInitContext,
    ModelKVSpec,
)


class VisionLanguageModel(nn.Module):
    supports_multimodal = True
    # The model runner refuses pipeline stages for VLMs (the tower and the merge run on
    # the first stage only); saying it here refuses them before anything is built.
    supports_pipeline_parallel = False
    language_model: nn.Module

    def init_vlm(self, hf_config: Any, ctx: ModelInitContext,
                 tower: tuple[str, str] | None = None) -> None:
        """The checks and attributes every VLM starts with (call before building).
        ``tower``: the vision config's model_type the class builds and its name (another
        tower is refused by name)."""
        architecture = type(self).__name__
        vision_type = getattr(hf_config.vision_config, "model_type", None)
        if tower is not None and vision_type != tower[0]:
            raise ValueError(f"{architecture}: vision tower model_type {vision_type!r} is "
                             f"not supported (only {tower[1]}, {tower[0]!r})")
        if ctx.quantization is not None:
            raise ValueError(f"{architecture}: quantized checkpoints are not supported")
        if not (ctx.is_first_stage and ctx.is_last_stage):
            raise ValueError(f"{architecture} does not support pipeline parallelism")
        self.config = hf_config
        self.ctx = ctx
        self.vocab_size = hf_config.text_config.vocab_size
        self.activation_dtype = ctx.dtype

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text rows the image rows are written over."""
        return self.language_model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.language_model(input_ids, positions, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        return self.language_model.kv_cache_spec()

    @staticmethod
    def split_weights(weights: Iterable[tuple[str, Any]], prefixes: tuple[str, ...],
                      rename: Any = None) -> dict[str, list[tuple[str, Any]]]:
        """Checkpoint tensors by component: ``{prefix: [(name without it, tensor)]}``
        (``rename``: a name's canonical spelling first); a name under none of the
        prefixes is a ValueError naming it."""
        parts: dict[str, list[tuple[str, Any]]] = {prefix: [] for prefix in prefixes}
        unexpected = []
        for name, tensor in weights:
            name = rename(name) if rename is not None else name
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is None:
                unexpected.append(name)
            else:
                parts[prefix].append((name[len(prefix):], tensor))
        if unexpected:
            raise ValueError(f"unexpected checkpoint tensors: {', '.join(unexpected[:8])}")
        return parts
