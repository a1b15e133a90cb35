"""Tiny random-weight LLaVA-1.5 / LLaVA-NeXT checkpoints and transformers' reference.

The builders save a directory the engine loads: config, safetensors, a BPE tokenizer
with ``<image>``, and the processor (transformers' ``LlavaProcessor`` /
``LlavaNextProcessor`` around the PIL image processor, ``num_additional_image_tokens=1``
for CLIP's class token). Towers are 3 CLIP layers of width 32 on 14-px patches: LLaVA
sees 42-px images (9 patches), LLaVA-NeXT 56-px tiles (16 patches) with pinpoints up to
112 px, so unpadding cuts real rows / columns. The language model is Llama by default
(``text="qwen2"`` / ``"mistral"`` for the others).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.helpers.hf_models import build_tokenizer

IMAGE_TOKEN = "<image>"
LLAVA_IMAGE_SIZE = 42
NEXT_IMAGE_SIZE = 56
NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112]]


# llava-hf's template, with transformers' {% generation %} tag on the assistant's text.
LLAVA_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

def _tokenizer(out: Path) -> Any:
    tok = build_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                          IMAGE_TOKEN]})
    tok.save_pretrained(out)
    return tok


def _text_config(tok: Any, text: str) -> dict[str, Any]:
    config = {"model_type": text, "vocab_size": len(tok), "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id, "initializer_range": 0.25}
    if text == "mistral":
        config["sliding_window"] = 4096
    return config


def build_llava(out: Path, *, next: bool = False, text: str = "llama", seed: int = 0,
                feature_layer: int | list[int] = -2, strategy: str = "default",
                projector_act: str = "gelu") -> Any:
    """Save a tiny LLaVA (``next=False``) or LLaVA-NeXT and return the transformers
    model (float32, eval)."""
    import transformers
    from transformers import CLIPVisionConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out)
    size = NEXT_IMAGE_SIZE if next else LLAVA_IMAGE_SIZE
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, image_size=size, patch_size=14,
                              projection_dim=32, hidden_act="quick_gelu").to_dict()
    common = {"vision_config": vision, "text_config": _text_config(tok, text),
              "image_token_id": tok.convert_tokens_to_ids(IMAGE_TOKEN),
              "vision_feature_layer": feature_layer,
              "vision_feature_select_strategy": strategy, "projector_hidden_act": projector_act}
    if next:
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )

        config = transformers.LlavaNextConfig(image_grid_pinpoints=NEXT_PINPOINTS, **common)
        cls = transformers.LlavaNextForConditionalGeneration
        image_processor = LlavaNextImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size},
            image_grid_pinpoints=NEXT_PINPOINTS)
        processor_cls = transformers.LlavaNextProcessor
    else:
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        config = transformers.LlavaConfig(**common)
        cls = transformers.LlavaForConditionalGeneration
        image_processor = LlavaImageProcessorPil(size={"shortest_edge": size},
                                                 crop_size={"height": size, "width": size})
        processor_cls = transformers.LlavaProcessor
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random biases and norm weights, so a wrong one shows
        for name, param in model.named_parameters():
            vision = "vision_tower" in name or "multi_modal_projector" in name
            if vision and (name.endswith("bias") or "norm" in name or "embedding" in name):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    processor = processor_cls(image_processor=image_processor, tokenizer=tok, patch_size=14,
                              vision_feature_select_strategy=strategy,
                              num_additional_image_tokens=1)
    processor.save_pretrained(out)
    return model


def hf_processor(model_dir: Path) -> Any:
    """transformers' processor as saved (AutoProcessor picks the PIL image processor
    when torchvision is absent)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def random_image(width: int, height: int, seed: int, mode: str = "RGB") -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    image = Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def hf_inputs(model_dir: Path, prompt: str, images: list | None = None
              ) -> dict[str, torch.Tensor]:
    """transformers' model inputs for ``prompt`` with one ``<image>`` per image."""
    processor = hf_processor(model_dir)
    enc = processor(text=[prompt], images=images or None, return_tensors="pt")
    return dict(enc)
