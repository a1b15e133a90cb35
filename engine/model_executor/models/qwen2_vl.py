"""Qwen2-VL and Qwen2.5-VL: a vision tower (qwen2_vl_vision.py) whose merged tokens
replace the prompt's ``<|image_pad|>`` / ``<|video_pad|>`` rows, and a Qwen2 decoder
with multimodal RoPE.

M-RoPE: every prompt token has three positions (temporal, height, width). Text tokens
have the same value on all three, counting on from the previous item; an item's tokens
take ``(t * interval, row, col)`` offset by the position where it starts, and the text
after it continues at ``start + max(h, w) // merge`` (transformers'
``get_rope_index``: :meth:`Qwen2VLForConditionalGeneration.mrope_positions`). Generated
tokens sit at ``p + delta`` on all three axes, so decode steps pass 1-D positions and
run as plain RoPE (fused kernel, forward graphs).

Checkpoint names: ``model.*`` / ``lm_head.*`` / ``visual.*`` (what the original
checkpoints hold and what transformers 5's ``save_pretrained`` writes back) and the
in-memory v5 spelling ``model.language_model.*`` / ``model.visual.*``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from engine.model_executor.layers.rotary import (
    MRotaryEmbedding,
    mrope_section_from_config,
    rope_scaling_from_config,
)
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, Qwen2ForCausalLM
from engine.model_executor.models.qwen2_vl_vision import Qwen2VisionTransformer
from engine.model_executor.models.vlm import VisionLanguageModel


def _mrope_config(text_config: Any) -> Any:
    """The text config as :func:`rope_scaling_from_config` reads it: older configs name
    the M-RoPE rope type ``"mrope"`` (ordinary RoPE frequencies)."""
    params = dict(getattr(text_config, "rope_parameters", None)
                  or getattr(text_config, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type")) not in ("mrope", None):
        return text_config
    params.pop("type", None)
    params["rope_type"] = "default"
    params.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    config = copy.copy(text_config)
    config.rope_parameters = params
    return config


class Qwen2VLTextModel(Qwen2ForCausalLM):
    """Qwen2 with multimodal RoPE (positions ``[3, T]`` or ``[T]``)."""

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions
                    ) -> MRotaryEmbedding:
        section = mrope_section_from_config(hf_config)
        if section is None:
            raise ValueError("Qwen2-VL text config has no mrope_section")
        return MRotaryEmbedding(opts.head_size, rope_scaling_from_config(_mrope_config(hf_config)),
                                section, dtype=ctx.dtype, device=ctx.device,
                                fused_ops=ctx.fused_ops)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True
    qwen25 = False

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.init_vlm(hf_config, ctx)
        text_config = copy.copy(hf_config.text_config)
        # The head is tied by the composite config (the text config does not say).
        text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.vision = hf_config.vision_config
        self.visual = Qwen2VisionTransformer(self.vision, ctx, self.qwen25)
        self.language_model = Qwen2VLTextModel(text_config, ctx)
        self.merge = self.vision.spatial_merge_size
        self.head_size = self.language_model.head_size

    # -- vision ---------------------------------------------------------------------------
    def embed_multimodal(self, modality: str, items: list[dict[str, torch.Tensor]]
                         ) -> list[torch.Tensor]:
        """Every item through one tower call; per item its ``t*h*w // merge**2`` rows."""
        if modality not in ("image", "video"):
            raise ValueError(f"{type(self).__name__} takes images and videos, not {modality!r}")
        if not items:
            return []
        pixel_key, grid_key = (("pixel_values", "image_grid_thw") if modality == "image"
                               else ("pixel_values_videos", "video_grid_thw"))
        grids = [tuple(int(v) for v in item[grid_key].reshape(3).tolist()) for item in items]
        pixels = torch.cat([item[pixel_key] for item in items])
        with torch.no_grad():
            merged = self.visual(pixels, grids)
        sizes = [t * h * w // self.merge**2 for t, h, w in grids]
        return list(merged.to(self.ctx.dtype).split(sizes))

    def mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                        ) -> tuple[np.ndarray, int]:
        """``([3, P] int64, delta)`` as transformers' ``get_rope_index``: text counts on
        from ``current``; an item of grid ``(t, h, w)`` at ``current`` takes temporal
        ``current + floor(i * interval)``, rows / columns ``current + r`` / ``current + c``
        (merged grid), then ``current += max(h, w) // merge``. ``delta = max + 1 - P``."""
        total = len(prompt_token_ids)
        out = np.empty((3, total), dtype=np.int64)
        current, cursor = 0, 0
        for feature in sorted(features, key=lambda f: f.offset):
            if feature.offset < cursor or feature.end > total:
                raise ValueError("multimodal items overlap or run past the prompt")
            text = feature.offset - cursor
            out[:, cursor:feature.offset] = np.arange(current, current + text)
            current += text
            t, h, w, interval = self._grid(feature)
            gh, gw = h // self.merge, w // self.merge
            if t * gh * gw != feature.length:
                raise ValueError(f"{feature.modality} item has {feature.length} tokens, its grid "
                                 f"({t}, {h}, {w}) yields {t * gh * gw}")
            temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
            tt, hh, ww = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
            out[:, feature.offset:feature.end] = np.stack(
                [tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + current
            current += max(h, w) // self.merge
            cursor = feature.end
        out[:, cursor:] = np.arange(current, current + total - cursor)
        delta = int(out.max()) + 1 - total if total else 0
        return out, delta

    def _grid(self, feature: Any) -> tuple[int, int, int, float]:
        """An item's ``(t, h, w)`` patch grid and temporal position step (only the small
        tensors are decoded, not the pixels)."""
        small = {name: packed.tensor() for name, packed in feature.data.items()
                 if name.endswith(("grid_thw", "second_per_grid_ts"))}
        key = "image_grid_thw" if feature.modality == "image" else "video_grid_thw"
        if key not in small:
            raise ValueError(f"{feature.modality} item lacks its {key}")
        t, h, w = (int(v) for v in small[key].reshape(3).tolist())
        return t, h, w, self._time_interval(feature.modality, small)

    def _time_interval(self, modality: str, tensors: dict[str, torch.Tensor]) -> float:
        return 1.0  # Qwen2-VL: one temporal position per temporal patch

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("visual.", "model.visual.")):
                    vision.append((name.split("visual.", 1)[1], tensor))
                    continue
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model."):]
                elif name.startswith("language_model."):  # other tools' composite spelling
                    name = name[len("language_model."):]
                yield name, tensor

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(text())}
        loaded |= {f"visual.{n}" for n in self.visual.load_weights(vision)}
        return loaded


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: RMSNorm / gated-MLP tower with windowed attention; a video's temporal
    positions step by ``tokens_per_second * second_per_grid_t``."""

    qwen25 = True

    def _time_interval(self, modality: str, tensors: dict[str, torch.Tensor]) -> float:
        if modality != "video":
            return 1.0
        seconds = tensors.get("second_per_grid_ts")
        seconds = np.float32(1.0 if seconds is None else float(seconds.reshape(-1)[0]))
        return float(np.float32(self.vision.tokens_per_second) * seconds)
