"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): a SigLIP tower,
transformers' ``Gemma3MultiModalProjector`` and the Gemma 3 text decoder.

An image's embeddings: the tower's last hidden state (one row per patch) laid out as the
patch grid, average-pooled to ``mm_tokens_per_image`` cells (``AvgPool2d``), normalized
by ``mm_soft_emb_norm`` (Gemma's RMSNorm, ``1 + weight``) and multiplied by
``mm_input_projection_weight`` (``[vision_hidden, text_hidden]``; here a linear layer
holding its transpose, so the platform's GEMM runs). They replace the image's
``<image_soft_token>`` rows among the *scaled* text embeddings -- transformers' Gemma 3
puts them into ``embed_tokens(ids) * sqrt(hidden)`` -- so :meth:`embed_input_ids`
returns scaled rows and the decoder takes ``inputs_embeds`` as they are.

Image tokens of one image attend to each other in both directions in transformers (its
``token_type_ids`` mask); ``bidirectional_mm_attention`` asks the engine for the same
(the attention backends and the scheduler honour it, keeping an image in one prefill
chunk).

Checkpoint names: the original layout (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``), transformers 5's
``save_pretrained`` output (the same but ``vision_tower.*`` without ``vision_model.``)
and transformers' in-memory names (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``lm_head.*``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.norm import GemmaRMSNorm
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.gemma import Gemma3ForCausalLM
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llava import canonical_name
from engine.model_executor.models.siglip import SiglipVisionTower
from engine.model_executor.models.vlm import VisionLanguageModel
from engine.model_executor.weight_utils import load_named_weights

_PROJECTION = "mm_input_projection_weight"


class Gemma3MultiModalProjector(nn.Module):
    """``[N, patches, vision_hidden]`` -> ``[N, mm_tokens_per_image, text_hidden]``."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        tokens = int(hf_config.mm_tokens_per_image)
        self.tokens_per_side = math.isqrt(tokens)
        if (self.tokens_per_side**2 != tokens
                or self.patches_per_side % self.tokens_per_side):
            raise ValueError(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                f"{self.patches_per_side} patches per image side")
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps,
                                             dtype=ctx.dtype, device=ctx.device)
        # Holds mm_input_projection_weight transposed: x @ W == linear(x, W.T).
        self.mm_input_projection = ReplicatedLinear(
            vision.hidden_size, text.hidden_size, bias=False, **ctx.matrix_dtypes,
            device=ctx.device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, dim = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, dim, side, side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)  # [N, tokens, dim], row-major cells
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, dim))
        return self.mm_input_projection(normed).reshape(n, pooled.shape[1], -1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == _PROJECTION:
                    yield "mm_input_projection.weight", materialize(tensor).t().contiguous()
                else:
                    yield name, tensor

        return load_named_weights(self, renamed())


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """One tower pass per image (all of a step's images in one call);
    ``mm_tokens_per_image`` embeddings each."""

    bidirectional_mm_attention = True

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.init_vlm(hf_config, ctx, tower=("siglip_vision_model", "SigLIP"))
        vision_config, text_config = hf_config.vision_config, hf_config.text_config
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_tower = SiglipVisionTower(vision_config, ctx)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config, ctx)
        if getattr(hf_config, "tie_word_embeddings", True) and not getattr(
                text_config, "tie_word_embeddings", True):
            # transformers ties the head when the top-level config says so.
            text_config = copy.copy(text_config)
            text_config.tie_word_embeddings = True
        self.language_model = Gemma3ForCausalLM(text_config, ctx)

    # -- images -------------------------------------------------------------------------
    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, mm_tokens_per_image, text_hidden]``."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def embed_multimodal(self, modality: str, items: list[dict[str, torch.Tensor]]
                         ) -> list[torch.Tensor]:
        """Per image, its ``[mm_tokens_per_image, text_hidden]`` rows (one tower call)."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r}")
        if not items:
            return []
        pixels = []
        for item in items:
            tensor = item["pixel_values"]
            if tensor.dim() == 4 and tensor.shape[0] == 1:
                tensor = tensor[0]
            if tensor.dim() != 3:
                raise ValueError("Gemma 3 takes one [C, H, W] pixel_values per image "
                                 f"(no pan-and-scan crops), got {list(tensor.shape)}")
            pixels.append(tensor)
        return list(self.image_features(torch.stack(pixels)).to(self.ctx.dtype).unbind(0))

    # -- text ---------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled text embeddings (image rows go over them). An image token id past
        the text vocabulary embeds as id 0, as in transformers (its row is replaced)."""
        if self.image_token_id >= self.vocab_size:
            input_ids = torch.where(input_ids == self.image_token_id, 0, input_ids)
        return self.language_model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' Gemma3ForConditionalGeneration applies no final_logit_softcapping
        # (its text-only Gemma3ForCausalLM does; the released checkpoints set none).
        return self.language_model.lm_head(hidden)

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each tensor to the language model, the tower or the projector."""
        parts = self.split_weights(
            weights, ("language_model.", "vision_tower.", "multi_modal_projector."),
            canonical_name)
        loaded = {"language_model." + n
                  for n in self.language_model.load_weights(parts["language_model."])}
        loaded |= {"vision_tower." + n
                   for n in self.vision_tower.load_weights(parts["vision_tower."])}
        return loaded | {"multi_modal_projector." + n for n in
                         self.multi_modal_projector.load_weights(
                             parts["multi_modal_projector."])}
