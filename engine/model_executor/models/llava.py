"""LLaVA-1.5 and LLaVA-NeXT: a CLIP vision tower, a two-layer projector into the
language model's embedding space, and a Llama / Mistral / Qwen2 language model.

An image's embeddings are the projected hidden states of the tower's
``vision_feature_layer`` (several layers concatenated when it is a list), without the
class token under the ``"default"`` select strategy (``"full"`` keeps it). They replace
the image's ``<image>`` placeholder tokens in the prompt (the model runner merges them
into :meth:`embed_input_ids`' rows); the language model is the engine's own text class
composed on ``text_config``, run with those ``inputs_embeds``.

LLaVA-NeXT ("anyres") also splits an image into tiles: the processor sends the resized
whole image (the base) plus a grid of crops of the image resized to the best of the
``image_grid_pinpoints``; every tile goes through the tower and projector, then the
tiles' feature maps are stitched into one grid, the padding the resize introduced is cut
off (``unpad_image``) and ``image_newline`` is appended after every row -- exactly
transformers' ``pack_image_features``.

Checkpoint names: both the original layout (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``,
``image_newline``; transformers 5's ``save_pretrained`` writes the same but
``vision_tower.*`` without ``vision_model.``) and transformers 4.5x's in-memory names
(``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*``, ...).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.bert import Activation
from engine.model_executor.models.clip import CLIPVisionTower
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.vlm import VisionLanguageModel
from engine.model_executor.weight_utils import load_named_weights

# Language models by text_config.model_type (configs rarely name their architectures).
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def build_language_model(text_config: Any, ctx: ModelInitContext,
                         tie_word_embeddings: bool) -> nn.Module:
    """The engine's text class for ``text_config``; it must take ``inputs_embeds``."""
    from engine.model_executor.models.registry import MODEL_REGISTRY

    model_type = getattr(text_config, "model_type", None)
    names = list(getattr(text_config, "architectures", None) or [])
    if model_type in _TEXT_ARCHITECTURES:
        names.insert(0, _TEXT_ARCHITECTURES[model_type])
    if not names:
        raise ValueError(f"LLaVA language model of model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(_TEXT_ARCHITECTURES))}")
    cls = MODEL_REGISTRY.resolve(names)
    if not hasattr(cls, "embed_input_ids") or "inputs_embeds" not in inspect.signature(
            cls.forward).parameters:
        raise ValueError(f"{cls.__name__} cannot take image embeddings (no inputs_embeds); "
                         f"LLaVA language models: {', '.join(sorted(_TEXT_ARCHITECTURES))}")
    if tie_word_embeddings and not getattr(text_config, "tie_word_embeddings", False):
        # transformers ties the head when the top-level config says so.
        text_config = copy.copy(text_config)
        text_config.tie_word_embeddings = True
    return cls(text_config, ctx)


def canonical_name(name: str) -> str:
    """A checkpoint name in the original LLaVA layout (see the module docstring)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("model."):
        return name[len("model."):]
    return name


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``."""

    def __init__(self, in_features: int, out_features: int, act: str, bias: bool,
                 ctx: ModelInitContext) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.linear_1 = ColumnParallelLinear(in_features, out_features, bias=bias, **common)
        self.act = Activation(act)
        self.linear_2 = RowParallelLinear(out_features, out_features, bias=bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA-1.5: one tower pass per image, ``patches (+1 with "full")`` embeddings."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.init_vlm(hf_config, ctx, tower=("clip_vision_model", "CLIP"))
        vision_config, text_config = hf_config.vision_config, hf_config.text_config
        self.strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not "
                             "supported ('default' or 'full')")
        self.vision_tower = CLIPVisionTower(vision_config, ctx, hf_config.vision_feature_layer)
        num_layers = len(self.vision_tower.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size * num_layers, text_config.hidden_size,
            getattr(hf_config, "projector_hidden_act", "gelu"),
            bool(getattr(hf_config, "multimodal_projector_bias", True)), ctx)
        self.language_model = build_language_model(
            text_config, ctx, bool(getattr(hf_config, "tie_word_embeddings", False)))

    # -- images -------------------------------------------------------------------------
    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` tiles -> ``[N, tokens, text_hidden]`` projected features."""
        features = self.vision_tower(pixels)
        if self.strategy == "default":
            features = features[:, 1:]
        n, length, dim = features.shape
        return self.multi_modal_projector(features.reshape(n * length, dim)).reshape(
            n, length, -1)

    def embed_multimodal(self, modality: str, items: list[dict[str, torch.Tensor]]
                         ) -> list[torch.Tensor]:
        """Per image, its ``[tokens, text_hidden]`` embeddings (one tower call)."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r}")
        if not items:
            return []
        pixels = torch.stack([item["pixel_values"] for item in items])
        return list(self.image_features(pixels).to(self.ctx.dtype).unbind(0))

    # -- weights ------------------------------------------------------------------------
    def load_own_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """The projector's tensors (subclasses add theirs)."""
        return {"multi_modal_projector." + name for name in load_named_weights(
            self.multi_modal_projector,
            [(name.removeprefix("multi_modal_projector."), t) for name, t in weights])}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each tensor to the language model, the tower or the projector."""
        parts = self.split_weights(weights, ("language_model.", "vision_tower.", ""),
                                   canonical_name)
        loaded = {"language_model." + n
                  for n in self.language_model.load_weights(parts["language_model."])}
        loaded |= {"vision_tower." + n
                   for n in self.vision_tower.load_weights(parts["vision_tower."])}
        return loaded | self.load_own_weights(parts[""])


# -- LLaVA-NeXT -------------------------------------------------------------------------
def select_best_resolution(size: tuple[int, int], pinpoints: list[list[int]]
                           ) -> tuple[int, int]:
    """transformers' ``select_best_resolution``: the ``(height, width)`` pinpoint that
    keeps most of the ``(height, width)`` image's resolution, then wastes least."""
    from transformers.image_processing_utils import select_best_resolution as select

    height, width = select(list(size), pinpoints)
    return int(height), int(width)


def unpad_features(tensor: torch.Tensor, original: tuple[int, int]) -> torch.Tensor:
    """transformers' ``unpad_image``: cut the rows (or columns) of ``[D, H, W]`` that
    the resize-then-pad of an ``original = (height, width)`` image made padding."""
    original_height, original_width = original
    current_height, current_width = tensor.shape[1:]
    if original_width / original_height > current_width / current_height:
        new_height = int(round(original_height * (current_width / original_width), 7))
        padding = (current_height - new_height) // 2
        return tensor[:, padding:current_height - padding, :]
    new_width = int(round(original_width * (current_height / original_height), 7))
    padding = (current_width - new_width) // 2
    return tensor[:, :, padding:current_width - padding]


def num_anyres_tiles(size: tuple[int, int], pinpoints: list[list[int]], tile: int) -> int:
    """Tiles the processor makes of an image: the base plus the best pinpoint's grid
    (transformers' ``image_size_to_num_patches``)."""
    height, width = select_best_resolution(size, pinpoints)
    return -(-height // tile) * -(-width // tile) + 1


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: per image ``pixel_values [tiles, C, S, S]`` (base first) and its
    original ``image_sizes [2]`` (height, width)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__(hf_config, ctx)
        if self.strategy == "full":
            # Each tile would carry its class token into the grid: transformers cannot
            # lay those out either ("Image feature shape does not line up").
            raise ValueError("LLaVA-NeXT with a CLIP tower needs vision_feature_select_strategy "
                             "'default' (the class token does not fit the tile grid)")
        self.pinpoints = [list(map(int, p)) for p in hf_config.image_grid_pinpoints]
        self.tile = self.vision_tower.image_size
        self.grid = self.tile // self.vision_tower.patch_size  # features per tile side
        self.image_newline = nn.Parameter(
            torch.empty(hf_config.text_config.hidden_size, dtype=ctx.dtype, device=ctx.device),
            requires_grad=False)

    def pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's ``[tiles, grid*grid, D]`` features -> its embedding rows."""
        newline = self.image_newline.to(features.dtype)
        if features.shape[0] == 1:
            return torch.cat([features[0], newline[None]], dim=0)
        base, tiles = features[0], features[1:]
        best_height, best_width = select_best_resolution(image_size, self.pinpoints)
        rows, cols = best_height // self.tile, best_width // self.tile
        if rows * cols != tiles.shape[0]:
            raise ValueError(f"an image of size {list(image_size)} needs {rows * cols + 1} "
                             f"tiles, got {tiles.shape[0] + 1}")
        g = self.grid
        grid = tiles.reshape(rows, cols, g, g, -1).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(grid.shape[0], rows * g, cols * g)  # [D, H, W]
        grid = unpad_features(grid, image_size)
        grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
        return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)], dim=0)

    def embed_multimodal(self, modality: str, items: list[dict[str, torch.Tensor]]
                         ) -> list[torch.Tensor]:
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r}")
        if not items:
            return []
        sizes = [tuple(int(v) for v in item["image_sizes"].reshape(-1).tolist())
                 for item in items]
        counts = [num_anyres_tiles(size, self.pinpoints, self.tile) for size in sizes]
        pixels = []
        for item, count in zip(items, counts):
            tiles = item["pixel_values"]
            if tiles.dim() != 4 or tiles.shape[0] < count:
                raise ValueError(f"LLaVA-NeXT image needs pixel_values [{count}, C, H, W], got "
                                 f"{list(tiles.shape)}")
            pixels.append(tiles[:count])  # beyond: the processor's batch padding
        features = self.image_features(torch.cat(pixels)).split(counts)
        return [self.pack(f, size).to(self.ctx.dtype) for f, size in zip(features, sizes)]

    def load_own_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        rest = []
        loaded = set()
        for name, tensor in weights:
            if name == "image_newline":
                if tuple(tensor.shape) != tuple(self.image_newline.shape):
                    raise ValueError(f"image_newline has shape {list(tensor.shape)}, expected "
                                     f"{list(self.image_newline.shape)}")
                with torch.no_grad():
                    self.image_newline.copy_(materialize(tensor))
                loaded.add(name)
            else:
                rest.append((name, tensor))
        if not loaded:
            raise ValueError("checkpoint lacks image_newline")
        return loaded | super().load_own_weights(rest)
