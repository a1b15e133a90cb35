"""A model family's front-end processing of images and videos, behind one interface.

Each vision-language family supplies a :class:`MultiModalProcessor`: it turns the user's
items (PIL images; lists of frames for a video) into the encoder's input tensors with the
model's own transformers image processor (the PIL ones: no torchvision), says how many
embedding tokens each item yields, and how the prompt spells an item before and after
expansion. :mod:`engine.multimodal.prompt` does the rest (hashing, placeholder expansion,
offsets) the same way for every family.

Processors are looked up by the HF config's ``model_type`` (lazily imported
``"module:Class"`` paths, like the model registry).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODALITIES = ("image", "video")


@dataclass
class ProcessedItem:
    """One item after the model's processor."""

    tensors: dict[str, Any]  # torch tensors: the encoder's inputs for this item alone
    num_embeds: int  # embedding tokens it yields (placeholder tokens after expansion)


class MultiModalProcessor(ABC):
    """One model family's processing (constructed once per engine, in the front end)."""

    modalities: tuple[str, ...] = ("image",)

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        self.model_dir = Path(model_dir)
        self.hf_config = hf_config
        self.tokenizer = tokenizer

    @abstractmethod
    def placeholder(self, modality: str) -> str:
        """The text that marks one item where a prompt or chat message holds it (e.g.
        ``"<image>"``, ``"<|vision_start|><|image_pad|><|vision_end|>"``)."""

    @abstractmethod
    def target(self, modality: str) -> str:
        """The one special token of the placeholder that expansion replaces (``"<image>"``,
        ``"<|image_pad|>"``, Gemma 3's ``"<start_of_image>"``)."""

    @abstractmethod
    def expansion(self, modality: str, item: ProcessedItem) -> str:
        """The text that replaces one ``target``: ``item.num_embeds`` embedding tokens
        and whatever the model's processor puts around them."""

    @abstractmethod
    def embed_token_id(self, modality: str) -> int:
        """The token whose positions take the item's embeddings."""

    @abstractmethod
    def process(self, modality: str, items: list[Any]) -> list[ProcessedItem]:
        """Run the model's processor on ``items`` (PIL images; for ``"video"`` each item
        is a list of PIL frames). Bad items raise ValueError."""


# HF model_type -> "module:Class" of its processor.
PROCESSORS: dict[str, str] = {
    "llava": "engine.multimodal.processors.llava:LlavaProcessor",
    "llava_next": "engine.multimodal.processors.llava:LlavaNextProcessor",
    "qwen2_vl": "engine.multimodal.processors.qwen2_vl:Qwen2VLProcessor",
    "qwen2_5_vl": "engine.multimodal.processors.qwen2_vl:Qwen2_5_VLProcessor",
    "gemma3": "engine.multimodal.processors.gemma3:Gemma3Processor",
}


def is_multimodal_config(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in PROCESSORS


def processor_for(model_dir: Path, hf_config: Any, tokenizer: Any) -> MultiModalProcessor:
    """The processor of a vision-language model's family (ValueError for others)."""
    model_type = getattr(hf_config, "model_type", None)
    path = PROCESSORS.get(model_type)
    if path is None:
        raise ValueError(f"model type {model_type!r} takes no images or videos; "
                         f"multimodal model types: {', '.join(sorted(PROCESSORS))}")
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(model_dir, hf_config, tokenizer)
