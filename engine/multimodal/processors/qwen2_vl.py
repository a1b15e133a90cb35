"""Qwen2-VL / Qwen2.5-VL front-end processing of images and videos.

Images go through transformers' PIL image processor (``Qwen2VLImageProcessorPil``, from
the model dir's processor config): smart resize to multiples of ``patch * merge``,
normalise, and patchify into ``pixel_values [patches, C*T*P*P]`` plus
``image_grid_thw [1, 3]``.

Videos (lists of PIL frames): transformers' ``Qwen2VLVideoProcessor`` needs torchvision,
so its pipeline is reproduced here with torch alone, step for step: frames as uint8
``[T, C, H, W]``; the smart resize of the frame size (bicubic with antialiasing on the
uint8 tensor, torchvision's CPU kernel for it); rescale and normalise fused as
``(x - mean * 255) / (std * 255)`` in float32; the frame count padded to a multiple of
``temporal_patch_size`` by repeating the last frame; the same patch layout. Tensors:
``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``
(``temporal_patch_size / fps``; frames are taken to be sampled at ``fps`` = 2, the rate
Qwen2.5-VL's videos are sampled at, unless the video processor config names another).

One item's placeholder ``<|vision_start|><|image_pad|><|vision_end|>`` keeps its start
and end tokens; the pad token is expanded to ``t*h*w // merge**2`` copies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.multimodal.processing import MultiModalProcessor, ProcessedItem

_PADS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
# Qwen2VLVideoProcessor's class defaults (used where the model dir's config is silent).
_VIDEO_DEFAULTS = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
    "cap_pixels_per_frame": False, "max_video_tokens": 128000, "fps": 2.0,
}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' Qwen2-VL ``smart_resize``: both sides multiples of ``factor``, the
    area within ``[min_pixels, max_pixels]``, the aspect ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _video_settings(model_dir: Path) -> dict[str, Any]:
    """The video processor's settings as transformers finds them: the nested
    ``processor_config.json``, else ``video_preprocessor_config.json``, else the image
    processor's ``preprocessor_config.json``; class defaults for what none names."""
    found: dict[str, Any] = {}
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        found = json.loads(nested.read_text()).get("video_processor") or {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if not found and (model_dir / name).is_file():
            found = json.loads((model_dir / name).read_text())
    settings = {**_VIDEO_DEFAULTS, **{k: v for k, v in found.items() if v is not None}}
    size = dict(settings["size"])
    if found.get("min_pixels") is not None:
        size["shortest_edge"] = found["min_pixels"]
    if found.get("max_pixels") is not None:
        size["longest_edge"] = found["max_pixels"]
    settings["size"] = size
    return settings


def _frames_tensor(frames: Any) -> torch.Tensor:
    """uint8 ``[T, C, H, W]`` RGB frames from PIL images or a ``[T, H, W, C]`` array."""
    if isinstance(frames, (np.ndarray, torch.Tensor)):
        array = torch.as_tensor(np.asarray(frames))
        if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != torch.uint8:
            raise ValueError("a video array must be uint8 [frames, height, width, 3]")
        return array.permute(0, 3, 1, 2).contiguous()
    frames = list(frames)
    if not frames:
        raise ValueError("a video needs at least one frame")
    arrays = []
    for frame in frames:
        if not hasattr(frame, "convert"):
            raise ValueError(f"video frames must be PIL images, not {type(frame).__name__}")
        arrays.append(np.asarray(frame.convert("RGB"), dtype=np.uint8))
    if len({a.shape for a in arrays}) != 1:
        raise ValueError("all frames of a video must have the same size")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def process_video(frames: Any, s: dict[str, Any]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(pixel_values_videos [patches, C*T*P*P], (t, h, w))`` of one video, as
    transformers' ``Qwen2VLVideoProcessor`` computes them (see the module docstring)."""
    video = _frames_tensor(frames)
    patch, merge, temporal = s["patch_size"], s["merge_size"], s["temporal_patch_size"]
    if s["do_resize"]:
        size, factor = s["size"], patch * merge
        max_pixels = size["longest_edge"]
        if s.get("cap_pixels_per_frame"):
            total = int(s["max_video_tokens"] * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * temporal // video.shape[0]),
                             int(size["shortest_edge"] * 1.05))
        height, width = smart_resize(video.shape[-2], video.shape[-1], factor,
                                     size["shortest_edge"], max_pixels)
        if (height, width) != tuple(video.shape[-2:]):
            video = torch.nn.functional.interpolate(
                video, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    pixels = video.to(torch.float32)
    if s["do_normalize"]:
        scale = 1.0 / s["rescale_factor"] if s["do_rescale"] else 1.0
        mean = torch.tensor(s["image_mean"]) * scale
        std = torch.tensor(s["image_std"]) * scale
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    elif s["do_rescale"]:
        pixels = pixels * s["rescale_factor"]
    if pad := -pixels.shape[0] % temporal:
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
    frames_n, channels, height, width = pixels.shape
    t, h, w = frames_n // temporal, height // patch, width // patch
    patches = pixels.view(t, temporal, channels, h // merge, merge, patch,
                          w // merge, merge, patch)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * temporal * patch * patch), (t, h, w)


class Qwen2VLProcessor(MultiModalProcessor):
    modalities = ("image", "video")
    video_timing = False  # Qwen2.5-VL adds second_per_grid_ts

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(self.model_dir)
        self.video = _video_settings(self.model_dir)
        self.merge = hf_config.vision_config.spatial_merge_size

    def placeholder(self, modality: str) -> str:
        return f"<|vision_start|>{self.target(modality)}<|vision_end|>"

    def target(self, modality: str) -> str:
        if modality not in _PADS:
            raise ValueError(f"Qwen2-VL takes images and videos, not {modality!r}")
        return _PADS[modality]

    def expansion(self, modality: str, item: ProcessedItem) -> str:
        return self.target(modality) * item.num_embeds

    def embed_token_id(self, modality: str) -> int:
        self.target(modality)
        return int(self.hf_config.image_token_id if modality == "image"
                   else self.hf_config.video_token_id)

    def process(self, modality: str, items: list[Any]) -> list[ProcessedItem]:
        self.target(modality)
        if modality == "video":
            return [self._video(frames) for frames in items]
        out = []
        for image in items:
            if not hasattr(image, "convert"):
                raise ValueError(f"images must be PIL images, not {type(image).__name__}")
            enc = self.image_processor([image], return_tensors="pt")
            grid = enc["image_grid_thw"].reshape(1, 3).to(torch.int64)
            out.append(ProcessedItem(
                {"pixel_values": enc["pixel_values"].to(torch.float32).contiguous(),
                 "image_grid_thw": grid},
                int(grid.prod()) // self.merge**2))
        return out

    def _video(self, frames: Any) -> ProcessedItem:
        pixels, grid = process_video(frames, self.video)
        tensors = {"pixel_values_videos": pixels.contiguous(),
                   "video_grid_thw": torch.tensor([grid], dtype=torch.int64)}
        if self.video_timing:
            seconds = self.video["temporal_patch_size"] / float(self.video["fps"])
            tensors["second_per_grid_ts"] = torch.tensor([seconds], dtype=torch.float32)
        return ProcessedItem(tensors, math.prod(grid) // self.merge**2)


class Qwen2_5_VLProcessor(Qwen2VLProcessor):
    video_timing = True
