"""Gemma 3's vision-language model against transformers, piece by piece: the image
embeddings (SigLIP tower, pooling, soft-embedding norm, projection; several images in
one tower call), the processor's token ids (the ``full_image_sequence`` expansion) and
pixels, the checkpoint spellings, the scaled text embeddings the image rows join, the
prompt's logits with image tokens attending to each other both ways (transformers'
``token_type_ids`` mask), and the configurations refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.model_executor.models.gemma3_mm import Gemma3ForConditionalGeneration
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.weight_utils import safetensors_weights_iterator
from engine.multimodal.processors.gemma3 import Gemma3Processor
from engine.plugins.cpu.attention import CPUAttentionBackend
from tests.helpers.vlm_gemma3 import (
    BOI,
    MM_TOKENS,
    build_gemma3,
    hf_inputs,
    hf_processor,
    random_image,
    vision_config,
)
from tests.helpers.vlm_reference import engine_prefill_logits

CPU = torch.device("cpu")
# (width, height): landscape, portrait, square; all are resized to the tower's square.
SIZES = [(50, 40), (20, 64), (33, 33)]


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    """float32 on both sides: an absolute margin scaled by the values' magnitude."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)


def make_ctx() -> ModelInitContext:
    return ModelInitContext(dtype=torch.float32, device=CPU,
                            attn_backend=CPUAttentionBackend(1024, CPU))


def weight_names(model: torch.nn.Module) -> set[str]:
    """Parameters a checkpoint must fill (not the optional fp8 KV cache scales)."""
    return {name for name, _ in model.named_parameters()
            if not name.endswith(("k_scale", "v_scale"))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Any]:
    """A saved tiny checkpoint, transformers' model of it, the engine's model (loaded
    lazily, as the engine's loader hands tensors over) and processor."""
    import transformers

    path = tmp_path_factory.mktemp("gemma3_vlm")
    reference = build_gemma3(path)
    config = transformers.AutoConfig.from_pretrained(path)
    model = Gemma3ForConditionalGeneration(config, make_ctx()).eval()
    loaded = model.load_weights(
        safetensors_weights_iterator([path / "model.safetensors"], lazy=True))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return {"path": path, "hf": reference, "model": model, "loaded": loaded,
            "config": config, "tokenizer": tokenizer,
            "processor": Gemma3Processor(path, config, tokenizer)}


def images(n: int = 2, seed: int = 0, mode: str = "RGB") -> list:
    return [random_image(w, h, seed + i, mode) for i, (w, h) in enumerate(SIZES[:n])]


def engine_features(model, processor, imgs: list) -> list[torch.Tensor]:
    items = processor.process("image", imgs)
    with torch.no_grad():
        out = model.embed_multimodal("image", [item.tensors for item in items])
    assert [o.shape[0] for o in out] == [item.num_embeds for item in items]
    return out


def hf_features(tiny, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(tiny["hf"].model.get_image_features(pixel_values=pixel_values)
                    .pooler_output)


# -- weights --------------------------------------------------------------------------
def test_checkpoint_loads_every_parameter(tiny) -> None:
    """transformers 5's save_pretrained layout (``vision_tower.*`` directly); the tied
    head is the embedding."""
    assert weight_names(tiny["model"]) <= tiny["loaded"]
    lm = tiny["model"].language_model
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()


def test_checkpoint_loads_original_names(tiny) -> None:
    """The released checkpoints nest the tower under ``vision_tower.vision_model.`` (and
    may carry ``position_ids`` and the unused pooling head); the same embeddings."""
    def original():
        for name, tensor in safetensors_weights_iterator([tiny["path"] / "model.safetensors"]):
            if name.startswith("vision_tower."):
                name = "vision_tower.vision_model." + name[len("vision_tower."):]
            yield name, tensor
        yield "vision_tower.vision_model.embeddings.position_ids", torch.arange(16)[None]
        yield "vision_tower.vision_model.head.probe", torch.zeros(1, 1, 32)

    model = Gemma3ForConditionalGeneration(tiny["config"], make_ctx())
    assert weight_names(model) <= model.load_weights(original())
    imgs = images(1)
    for got, want in zip(engine_features(model, tiny["processor"], imgs),
                         engine_features(tiny["model"], tiny["processor"], imgs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_checkpoint_loads_transformers_in_memory_names(tiny) -> None:
    """``model.language_model.*``, ``model.vision_tower.*``,
    ``model.multi_modal_projector.*`` and a saved (tied) ``lm_head.weight``."""
    state = tiny["hf"].state_dict()
    assert "lm_head.weight" in state and "model.multi_modal_projector.mm_input_projection_weight" in state
    model = Gemma3ForConditionalGeneration(tiny["config"], make_ctx())
    assert weight_names(model) <= model.load_weights(state.items())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, dict(tiny["model"].named_parameters())[name])


def test_missing_tensor_is_named(tiny) -> None:
    weights = [(n, t) for n, t in safetensors_weights_iterator(
        [tiny["path"] / "model.safetensors"]) if "mm_soft_emb_norm" not in n]
    model = Gemma3ForConditionalGeneration(tiny["config"], make_ctx())
    with pytest.raises(ValueError, match="mm_soft_emb_norm"):
        model.load_weights(weights)


# -- embeddings -----------------------------------------------------------------------
def test_image_embeddings_equal_get_image_features(tiny) -> None:
    """Three images in one tower call, each ``mm_tokens_per_image`` rows."""
    imgs = images(3)
    inputs = hf_inputs(tiny["path"], " ".join([BOI] * len(imgs)), imgs)
    want = hf_features(tiny, inputs["pixel_values"])
    got = engine_features(tiny["model"], tiny["processor"], imgs)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.shape == (MM_TOKENS, tiny["config"].text_config.hidden_size)
        close(g, w)
    assert not torch.allclose(got[0], got[1])


def test_embeddings_do_not_depend_on_the_batch(tiny) -> None:
    imgs = images(3)
    together = engine_features(tiny["model"], tiny["processor"], imgs)
    for i, image in enumerate(imgs):
        alone = engine_features(tiny["model"], tiny["processor"], [image])[0]
        close(alone, together[i], tol=1e-5)


def test_text_embeddings_are_scaled_like_transformers(tiny) -> None:
    """``embed_input_ids`` is transformers' scaled embedding (``sqrt(hidden)``), the rows
    its Gemma 3 VLM merges image features into."""
    ids = torch.arange(tiny["config"].text_config.vocab_size)
    with torch.no_grad():
        want = tiny["hf"].model.get_input_embeddings()(ids)
        got = tiny["model"].embed_input_ids(ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- processor ------------------------------------------------------------------------
def engine_prompt(tiny, prompt, imgs: list):
    from engine.multimodal.prompt import MultiModalInputProcessor

    return MultiModalInputProcessor(tiny["processor"], tiny["tokenizer"]).process(
        prompt, {"image": imgs})


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_processor_equals_transformers(tiny, mode: str) -> None:
    """Two images: the expanded prompt's token ids (``\\n\\n`` boi, image tokens, eoi
    ``\\n\\n`` per image), each image's pixels (non-RGB converted the same way) and the
    features' offsets at transformers' image-token runs."""
    imgs = images(2, seed=7, mode=mode)
    prompt = f"The quick {BOI} brown {BOI} fox"
    inputs = hf_inputs(tiny["path"], prompt, imgs)
    mm = engine_prompt(tiny, prompt, imgs)
    assert mm.token_ids == inputs["input_ids"][0].tolist()
    image_rows = np.flatnonzero(inputs["token_type_ids"][0].numpy() == 1)
    assert [(f.offset, f.length) for f in mm.features] == [
        (int(image_rows[0]), MM_TOKENS), (int(image_rows[MM_TOKENS]), MM_TOKENS)]
    for i, item in enumerate(tiny["processor"].process("image", imgs)):
        assert item.num_embeds == MM_TOKENS
        torch.testing.assert_close(item.tensors["pixel_values"], inputs["pixel_values"][i],
                                   atol=0, rtol=0)


def test_token_id_prompts_expand_like_text(tiny) -> None:
    """A prompt given as token ids with one boi token per image expands to the same
    ids as the text prompt."""
    imgs = images(2)
    prompt = f"look {BOI} and {BOI} here"
    ids = tiny["tokenizer"].encode(prompt)
    assert engine_prompt(tiny, ids, imgs).token_ids == engine_prompt(tiny, prompt,
                                                                     imgs).token_ids


def test_processor_strings_and_ids(tiny) -> None:
    from engine.multimodal.processing import processor_for

    assert type(processor_for(tiny["path"], tiny["config"], tiny["tokenizer"])) is (
        Gemma3Processor)
    processor = tiny["processor"]
    assert processor.placeholder("image") == processor.target("image") == BOI
    assert processor.embed_token_id("image") == tiny["config"].image_token_id
    item = processor.process("image", images(1))[0]
    assert processor.expansion("image", item) == hf_processor(tiny["path"]).full_image_sequence
    with pytest.raises(ValueError, match="PIL"):
        processor.process("image", ["not an image"])


# -- the language model ---------------------------------------------------------------
def image_key_ends(token_type_ids: torch.Tensor) -> np.ndarray:
    """What the model runner hands the attention backend: each image token's keys end
    at the end of its image's run, every other token's at itself."""
    types = token_type_ids.numpy()
    ends = np.arange(1, len(types) + 1, dtype=np.int64)
    i = 0
    while i < len(types):
        j = i
        while j < len(types) and types[j] == 1:
            j += 1
        ends[i:j] = j
        i = max(j, i + 1)
    return ends


def test_prompt_logits_equal_transformers(tiny) -> None:
    """Two images merged into the scaled text rows; image tokens attend to their whole
    image (the sliding layers' window of 8 still counts back from each token)."""
    imgs = images(2)
    inputs = hf_inputs(tiny["path"], f"The quick {BOI} brown {BOI} fox jumps", imgs)
    with torch.no_grad():
        want = tiny["hf"](**inputs).logits[0]
    ids = inputs["input_ids"][0]
    model = tiny["model"]
    embeds = model.embed_input_ids(ids).clone()
    embeds[ids == tiny["config"].image_token_id] = torch.cat(
        engine_features(model, tiny["processor"], imgs))
    positions = torch.arange(len(ids))
    got = engine_prefill_logits(model, embeds, ids, positions,
                                image_key_ends(inputs["token_type_ids"][0]))
    close(got, want)
    # The bidirectional image mask matters to these logits: causal attention differs.
    causal = engine_prefill_logits(model, embeds, ids, positions)
    assert (causal - want).abs().max() > 1e-2


# -- refusals -------------------------------------------------------------------------
def test_pan_and_scan_is_refused(tiny, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "processor_config.json"):
        shutil.copy(tiny["path"] / name, tmp_path / name)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    saved["image_processor"]["do_pan_and_scan"] = True
    (tmp_path / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        Gemma3Processor(tmp_path, tiny["config"], tiny["tokenizer"])


def test_other_vision_towers_are_refused(tiny) -> None:
    import transformers

    config = transformers.Gemma3Config(
        vision_config={**vision_config(), "model_type": "clip_vision_model"},
        text_config=tiny["config"].text_config.to_dict(), mm_tokens_per_image=MM_TOKENS)
    with pytest.raises(ValueError, match="clip_vision_model"):
        Gemma3ForConditionalGeneration(config, make_ctx())


def test_image_tokens_that_do_not_tile_the_patch_grid_are_refused(tiny) -> None:
    import transformers

    config = transformers.Gemma3Config(
        vision_config=vision_config(), text_config=tiny["config"].text_config.to_dict(),
        mm_tokens_per_image=9)  # 3 x 3 cells of a 4 x 4 patch grid
    with pytest.raises(ValueError, match="mm_tokens_per_image 9"):
        Gemma3ForConditionalGeneration(config, make_ctx())
