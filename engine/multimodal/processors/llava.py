"""LLaVA-1.5 and LLaVA-NeXT front ends: transformers' PIL image processors and the
placeholder counts of transformers' ``LlavaProcessor`` / ``LlavaNextProcessor``.

A prompt marks an image with one ``<image>`` token (the saved processor's
``image_token``); expansion repeats it once per embedding row. LLaVA-1.5 counts
``(H // patch) * (W // patch) + num_additional_image_tokens`` rows for its resized and
cropped image, one fewer under the ``"default"`` strategy (the class token is dropped).
LLaVA-NeXT adds the tiles of the best ``image_grid_pinpoints`` resolution: the unpadded
feature grid plus one ``image_newline`` per grid row. The image processors convert
non-RGB images to RGB (``do_convert_rgb``) as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.multimodal.processing import MultiModalProcessor, ProcessedItem

_PROCESSOR_CONFIG = "processor_config.json"


def _saved_processor_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / _PROCESSOR_CONFIG
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


class LlavaProcessor(MultiModalProcessor):
    """LLaVA-1.5: one tensor ``pixel_values [C, S, S]`` per image."""

    modalities = ("image",)

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        saved = _saved_processor_config(self.model_dir)
        vision = hf_config.vision_config
        self.image_token = getattr(tokenizer, "image_token", None) or saved.get(
            "image_token") or "<image>"
        self.patch_size = int(saved.get("patch_size") or vision.patch_size)
        self.strategy = saved.get("vision_feature_select_strategy") or getattr(
            hf_config, "vision_feature_select_strategy", "default")
        # CLIP prepends a class token; transformers' default of 0 is for towers without
        # one (older saved processors leave the key out).
        self.num_additional = int(saved.get("num_additional_image_tokens", 1))
        self.image_token_id = self._image_token_id(hf_config, tokenizer)
        self.image_processor = self.load_image_processor()

    def _image_token_id(self, hf_config: Any, tokenizer: Any) -> int:
        token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no image token {self.image_token!r}")
        config_id = getattr(hf_config, "image_token_id", None)
        if config_id is not None and int(config_id) != int(token_id):
            raise ValueError(f"image token {self.image_token!r} is id {token_id} in the "
                             f"tokenizer but image_token_id {config_id} in the config")
        return int(token_id)

    def load_image_processor(self) -> Any:
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        return LlavaImageProcessorPil.from_pretrained(self.model_dir)

    # -- the interface ------------------------------------------------------------------
    def placeholder(self, modality: str) -> str:
        return self.image_token

    def target(self, modality: str) -> str:
        return self.image_token

    def expansion(self, modality: str, item: ProcessedItem) -> str:
        return self.image_token * item.num_embeds

    def embed_token_id(self, modality: str) -> int:
        return self.image_token_id

    def _check(self, modality: str, items: list[Any]) -> None:
        from PIL import Image

        if modality != "image":
            raise ValueError(f"LLaVA takes images, not {modality!r}")
        for item in items:
            if not isinstance(item, Image.Image):
                raise ValueError(  # noqa: TRY004 - the contract's error for a bad item
                    f"an image must be a PIL.Image.Image, got {type(item).__name__}")

    def _strategy_offset(self) -> int:
        return 1 if self.strategy == "default" else 0

    def process(self, modality: str, items: list[Any]) -> list[ProcessedItem]:
        self._check(modality, items)
        out = []
        for image in items:
            pixels = self.image_processor([image], return_tensors="pt")["pixel_values"][0]
            height, width = pixels.shape[-2:]
            count = ((height // self.patch_size) * (width // self.patch_size)
                     + self.num_additional - self._strategy_offset())
            out.append(ProcessedItem({"pixel_values": pixels}, int(count)))
        return out


class LlavaNextProcessor(LlavaProcessor):
    """LLaVA-NeXT: ``pixel_values [tiles, C, S, S]`` (the base image first) and
    ``image_sizes [2]`` (original height, width) per image."""

    def load_image_processor(self) -> Any:
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )

        return LlavaNextImageProcessorPil.from_pretrained(self.model_dir)

    def num_features(self, orig_height: int, orig_width: int, height: int, width: int) -> int:
        """transformers' ``LlavaNextProcessor._get_number_of_features`` (before the
        strategy's class-token adjustment)."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution(
            [orig_height, orig_width], self.image_processor.image_grid_pinpoints)
        scale_height, scale_width = best_height // height, best_width // width
        patches_height, patches_width = height // self.patch_size, width // self.patch_size
        current_height = patches_height * scale_height
        current_width = patches_width * scale_width
        if orig_width / orig_height > current_width / current_height:
            new_height = int(round(orig_height * (current_width / orig_width), 7))
            current_height -= ((current_height - new_height) // 2) * 2
        else:
            new_width = int(round(orig_width * (current_height / orig_height), 7))
            current_width -= ((current_width - new_width) // 2) * 2
        unpadded = current_height * current_width + current_height  # + one newline per row
        return unpadded + patches_height * patches_width + self.num_additional

    def process(self, modality: str, items: list[Any]) -> list[ProcessedItem]:
        self._check(modality, items)
        out = []
        for image in items:
            enc = self.image_processor([image], return_tensors="pt")
            tiles, size = enc["pixel_values"][0], enc["image_sizes"][0]
            height, width = tiles.shape[-2:]
            count = self.num_features(int(size[0]), int(size[1]), height, width)
            out.append(ProcessedItem({"pixel_values": tiles, "image_sizes": size},
                                     count - self._strategy_offset()))
        return out
