"""Gemma 3's front end: transformers' PIL image processor and the prompt expansion of
transformers' ``Gemma3Processor``.

A prompt marks an image with ``<start_of_image>`` (the tokenizer's ``boi_token``), which
expansion replaces by transformers' ``full_image_sequence``:
``"\\n\\n" + boi + image_token * mm_tokens_per_image + eoi + "\\n\\n"``; the embeddings go
at the ``<image_soft_token>`` (``image_token_id``) rows. Every image is resized to the
tower's square size, so each yields ``mm_tokens_per_image`` embeddings.

Pan-and-scan (extra crops of wide or tall images, each its own image sequence inside
extra text) is not supported: an image processor saved with ``do_pan_and_scan`` on is
refused, so it is never silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.multimodal.processing import MultiModalProcessor, ProcessedItem

_DEFAULTS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}


def _saved_processor_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "processor_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


class Gemma3Processor(MultiModalProcessor):
    """One tensor ``pixel_values [C, S, S]`` per image."""

    modalities = ("image",)

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        tokens = {name: getattr(tokenizer, name, None) or default
                  for name, default in _DEFAULTS.items()}
        self.boi_token, self.eoi_token = tokens["boi_token"], tokens["eoi_token"]
        self.image_token = tokens["image_token"]
        self.boi_token_id = self._token_id(self.boi_token, hf_config, "boi_token_id")
        self._token_id(self.eoi_token, hf_config, "eoi_token_id")
        self.image_token_id = self._token_id(self.image_token, hf_config, "image_token_id")
        self.num_tokens = int(hf_config.mm_tokens_per_image)
        saved = _saved_processor_config(self.model_dir).get("image_seq_length")
        if saved is not None and int(saved) != self.num_tokens:
            raise ValueError(f"the saved processor's image_seq_length {saved} differs from "
                             f"the model's mm_tokens_per_image {self.num_tokens}")
        self.image_processor = self.load_image_processor()
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ValueError("Gemma 3 with do_pan_and_scan is not supported (the saved image "
                             "processor turns it on): save it with do_pan_and_scan false")
        self.full_image_sequence = (f"\n\n{self.boi_token}"
                                    f"{self.image_token * self.num_tokens}"
                                    f"{self.eoi_token}\n\n")

    def _token_id(self, token: str, hf_config: Any, config_key: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no {token!r} token")
        config_id = getattr(hf_config, config_key, None)
        if config_id is not None and int(config_id) != int(token_id):
            raise ValueError(f"{token!r} is id {token_id} in the tokenizer but {config_key} "
                             f"{config_id} in the config")
        return int(token_id)

    def load_image_processor(self) -> Any:
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        return Gemma3ImageProcessorPil.from_pretrained(self.model_dir)

    # -- the interface ------------------------------------------------------------------
    def placeholder(self, modality: str) -> str:
        return self.boi_token

    def target(self, modality: str) -> str:
        return self.boi_token

    def expansion(self, modality: str, item: ProcessedItem) -> str:
        if item.num_embeds != self.num_tokens:
            raise ValueError(f"a Gemma 3 image has {self.num_tokens} embeddings, "
                             f"not {item.num_embeds}")
        return self.full_image_sequence

    def embed_token_id(self, modality: str) -> int:
        return self.image_token_id

    def process(self, modality: str, items: list[Any]) -> list[ProcessedItem]:
        from PIL import Image

        if modality != "image":
            raise ValueError(f"Gemma 3 takes images, not {modality!r}")
        out = []
        for image in items:
            if not isinstance(image, Image.Image):
                raise ValueError(  # noqa: TRY004 - the contract's error for a bad item
                    f"an image must be a PIL.Image.Image, got {type(image).__name__}")
            enc = self.image_processor([image], do_pan_and_scan=False, return_tensors="pt")
            out.append(ProcessedItem({"pixel_values": enc["pixel_values"][0]},
                                     self.num_tokens))
        return out
