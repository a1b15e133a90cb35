"""A tiny random-weight Gemma 3 vision-language checkpoint and transformers' reference.

The builder saves a directory the engine loads: config, safetensors, a BPE tokenizer
with Gemma 3's image specials (``<start_of_image>``, ``<end_of_image>``,
``<image_soft_token>``, named ``boi_token`` / ``eoi_token`` / ``image_token`` in its
config as in the real checkpoints) and transformers' ``Gemma3Processor`` around the PIL
image processor (``image_seq_length`` 4). The SigLIP tower is 2 layers of width 32 on
28-px images cut into 7-px patches (a 4 x 4 grid, pooled 2 x 2 into 4 image tokens);
the language model is the text tests' tiny Gemma 3 (3 layers: sliding, sliding, full;
window 8, so an image's 4 tokens and the text around them cross windows).

transformers initializes Gemma's norm weights and the projector's matrix to zeros; the
builder randomizes them so a wrong norm or projection shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.helpers.hf_models import build_tokenizer

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE = 28
PATCH_SIZE = 7
MM_TOKENS = 4


def _tokenizer(out: Path) -> Any:
    """The BPE test tokenizer with Gemma 3's image specials, reloaded so that it has
    the ``boi_token`` / ``eoi_token`` / ``image_token`` attributes transformers'
    ``Gemma3Processor`` reads."""
    from transformers import AutoTokenizer

    tok = build_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", BOI,
                                                          EOI, IMAGE_TOKEN]})
    tok.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update({"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN})
    config_path.write_text(json.dumps(config, indent=2))
    return AutoTokenizer.from_pretrained(out)


def text_config(tok: Any, **overrides: Any) -> dict[str, Any]:
    config = {
        "model_type": "gemma3_text", "vocab_size": len(tok), "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "initializer_range": 0.25,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    config.update(overrides)
    return config


def vision_config(**overrides: Any) -> dict[str, Any]:
    from transformers import SiglipVisionConfig

    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=IMAGE_SIZE,
                                patch_size=PATCH_SIZE, vision_use_head=False,
                                layer_norm_eps=1e-6).to_dict()
    config.update(overrides)
    return config


def build_gemma3(out: Path, *, seed: int = 0, tie_word_embeddings: bool = True,
                 **text_overrides: Any) -> Any:
    """Save a tiny Gemma 3 VLM (plus tokenizer and processor) and return transformers'
    model of it (float32, eval). The released models tie the head to the embedding; an
    untied head (``tie_word_embeddings=False``) makes a tiny random model's greedy output
    depend on more than its last input token."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out)
    ids = {name: tok.convert_tokens_to_ids(token)
           for name, token in (("boi", BOI), ("eoi", EOI), ("image", IMAGE_TOKEN))}
    config = transformers.Gemma3Config(
        vision_config=vision_config(),
        text_config=text_config(tok, tie_word_embeddings=tie_word_embeddings,
                                **text_overrides),
        tie_word_embeddings=tie_word_embeddings, mm_tokens_per_image=MM_TOKENS,
        boi_token_index=ids["boi"],
        eoi_token_index=ids["eoi"], image_token_index=ids["image"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # zero-initialized norms / projector and biases made random
        for name, param in model.named_parameters():
            if "mm_input_projection" in name:  # image rows as large as the text rows
                param.copy_(torch.randn_like(param))
            elif "norm" in name:
                param.copy_(torch.randn_like(param) * 0.3)
            elif ("vision_tower" in name and (name.endswith("bias") or "embedding" in name)):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE,
                                                    "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                                             image_seq_length=MM_TOKENS)
    processor.save_pretrained(out)
    return model


def hf_processor(model_dir: Path) -> Any:
    """transformers' Gemma3Processor as saved (with the PIL image processor)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def random_image(width: int, height: int, seed: int, mode: str = "RGB") -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    image = Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def hf_inputs(model_dir: Path, prompt: str, images: list | None = None
              ) -> dict[str, torch.Tensor]:
    """transformers' model inputs for ``prompt`` with one ``<start_of_image>`` per image:
    ``input_ids``, ``attention_mask``, ``pixel_values`` and the ``token_type_ids`` that
    give the image tokens transformers' bidirectional mask."""
    processor = hf_processor(model_dir)
    enc = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
    return dict(enc)
