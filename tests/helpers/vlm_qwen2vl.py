"""Tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoints and transformers' reference.

The builders save a checkpoint directory the engine loads (config, safetensors, a BPE
tokenizer with the vision special tokens, ``preprocessor_config.json`` with a small pixel
budget so images stay a few dozen patches). transformers' ``Qwen2VLProcessor`` needs
torchvision (its video processor), so the reference inputs are assembled here the way
that processor does: the PIL image processor's tensors, the placeholder expanded to
``grid_thw.prod() // merge**2`` pad tokens, and ``mm_token_type_ids`` (1 image, 2 video).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.helpers.hf_models import build_tokenizer

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28


def _tokenizer(out: Path) -> Any:
    tok = build_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                          *VISION_SPECIALS]})
    tok.save_pretrained(out)
    return tok


def _save_preprocessor(out: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)


def build_qwen2_vl(out: Path, *, version: str = "2", seed: int = 0, tie: bool = False) -> Any:
    """Save a tiny Qwen2-VL (``version="2"``) or Qwen2.5-VL (``"2.5"``) and return the
    transformers model (float32, eval)."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]}}
    if version == "2":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                  "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2}
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=tie, **ids)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64,
                  "intermediate_size": 48, "num_heads": 2, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [1], "tokens_per_second": 2}
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                               tie_word_embeddings=tie, **ids)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random biases and norm weights, so a wrong one shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    _save_preprocessor(out)
    return model


def image_processor(model_dir: Path) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


def random_image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def hf_inputs(model_dir: Path, prompt: str, images: list | None = None,
              video: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """transformers' model inputs for ``prompt`` (its image / video placeholders expanded
    as Qwen2VLProcessor does). ``video``: the engine processor's tensors of one video
    (``pixel_values_videos``, ``video_grid_thw``, optionally ``second_per_grid_ts``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    merge = 4  # spatial_merge_size ** 2
    inputs: dict[str, torch.Tensor] = {}
    if images:
        enc = image_processor(model_dir)(images, return_tensors="pt")
        inputs["pixel_values"], inputs["image_grid_thw"] = enc["pixel_values"], enc["image_grid_thw"]
        parts = prompt.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        prompt = parts[0] + "".join(
            "<|image_pad|>" * int(g.prod() // merge) + p
            for g, p in zip(enc["image_grid_thw"], parts[1:]))
    if video is not None:
        grid = video["video_grid_thw"].reshape(1, 3)
        inputs["pixel_values_videos"], inputs["video_grid_thw"] = video["pixel_values_videos"], grid
        if "second_per_grid_ts" in video:
            inputs["second_per_grid_ts"] = video["second_per_grid_ts"].reshape(1)
        prompt = prompt.replace("<|video_pad|>", "<|video_pad|>" * int(grid.prod() // merge))
    input_ids = tok(prompt, return_tensors="pt")["input_ids"]
    image_id, video_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    types = torch.zeros_like(input_ids)
    types[input_ids == image_id] = 1
    types[input_ids == video_id] = 2
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": types, **inputs}
