"""LLaVA-1.5 / LLaVA-NeXT against transformers, piece by piece: the image embeddings
(several images, different sizes and aspect ratios, one tower call), LLaVA-NeXT's packing
(tiles stitched, unpadded, ``image_newline`` per row), the processor's tensors and
placeholder counts, both checkpoint spellings, and the prompt's logits with the image
rows merged in (Llama, Qwen2 and Mistral language models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llava import (
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
)
from engine.model_executor.weight_utils import safetensors_weights_iterator
from engine.multimodal.processors.llava import LlavaNextProcessor, LlavaProcessor
from engine.plugins.cpu.attention import CPUAttentionBackend
from tests.helpers.vlm_llava import IMAGE_TOKEN, build_llava, hf_inputs, random_image
from tests.helpers.vlm_reference import engine_prefill_logits

CPU = torch.device("cpu")
KINDS = {"llava": (LlavaForConditionalGeneration, LlavaProcessor),
         "next": (LlavaNextForConditionalGeneration, LlavaNextProcessor)}
# (width, height): square-ish, wide and tall (LLaVA-NeXT: different pinpoints, unpadding
# of rows and of columns).
SIZES = [(50, 40), (64, 20), (20, 64)]


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    """float32 on both sides: an absolute margin scaled by the values' magnitude (holds
    across CPUs' accumulation orders)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)


def make_ctx() -> ModelInitContext:
    # One KV block covers a whole tower segment or test prompt.
    return ModelInitContext(dtype=torch.float32, device=CPU,
                            attn_backend=CPUAttentionBackend(1024, CPU))


def load_engine(path: Path, kind: str) -> tuple[Any, Any, set[str]]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = KINDS[kind][0](config, make_ctx()).eval()
    # Lazily read tensors, as the engine's loader hands them over.
    loaded = model.load_weights(
        safetensors_weights_iterator([path / "model.safetensors"], lazy=True))
    return config, model, loaded


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory) -> dict[str, Any]:
    """A saved tiny checkpoint, transformers' model of it, the engine's model and
    processor."""
    import transformers

    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    reference = build_llava(path, next=kind == "next")
    config, model, loaded = load_engine(path, kind)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return {"kind": kind, "path": path, "hf": reference, "model": model, "loaded": loaded,
            "config": config, "tokenizer": tokenizer,
            "processor": KINDS[kind][1](path, config, tokenizer)}


def images(n: int = 2, seed: int = 0) -> list:
    return [random_image(w, h, seed + i) for i, (w, h) in enumerate(SIZES[:n])]


def weight_names(model: torch.nn.Module) -> set[str]:
    """Parameters a checkpoint must fill (not the optional fp8 KV cache scales)."""
    return {name for name, _ in model.named_parameters()
            if not name.endswith(("k_scale", "v_scale"))}


def hf_features(tiny, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """transformers' per-image embeddings (``get_image_features``' pooler output)."""
    kwargs = {"pixel_values": inputs["pixel_values"]}
    if "image_sizes" in inputs:
        kwargs["image_sizes"] = inputs["image_sizes"]
    with torch.no_grad():
        return list(tiny["hf"].model.get_image_features(**kwargs).pooler_output)


def engine_features(model, processor, imgs: list) -> list[torch.Tensor]:
    items = processor.process("image", imgs)
    with torch.no_grad():
        out = model.embed_multimodal("image", [item.tensors for item in items])
    assert [o.shape[0] for o in out] == [item.num_embeds for item in items]
    return out


# -- weights --------------------------------------------------------------------------
def test_checkpoint_loads_every_parameter(tiny) -> None:
    assert weight_names(tiny["model"]) <= tiny["loaded"]
    tower = tiny["model"].vision_tower
    # vision_feature_layer -2 of 3 layers: the last layer is not built.
    assert len(tower.encoder.layers) == 2
    assert "vision_tower.encoder.layers.1.self_attn.qkv_proj.weight" in tiny["loaded"]
    if tiny["kind"] == "next":
        assert "image_newline" in tiny["loaded"]


def test_checkpoint_loads_transformers_in_memory_names(tiny) -> None:
    """transformers' module names (``model.language_model.*``, ``model.vision_tower.*``,
    ``lm_head.*``, ``model.image_newline``) load too."""
    state = tiny["hf"].state_dict()
    assert any(name.startswith("model.vision_tower.") for name in state)
    model = type(tiny["model"])(tiny["config"], make_ctx())
    assert weight_names(model) <= model.load_weights(state.items())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, dict(tiny["model"].named_parameters())[name])


def test_checkpoint_loads_original_llava_hf_names(tiny) -> None:
    """The llava-hf layout nests the tower under ``vision_tower.vision_model.`` and
    saves ``position_ids``; the model computes the same embeddings from it."""
    def original():
        for name, tensor in safetensors_weights_iterator([tiny["path"] / "model.safetensors"]):
            if name.startswith("vision_tower."):
                name = "vision_tower.vision_model." + name[len("vision_tower."):]
            yield name, tensor
        yield "vision_tower.vision_model.embeddings.position_ids", torch.arange(5)[None]

    model = type(tiny["model"])(tiny["config"], make_ctx())
    assert weight_names(model) <= model.load_weights(original())
    imgs = images(1)
    for got, want in zip(engine_features(model, tiny["processor"], imgs),
                         engine_features(tiny["model"], tiny["processor"], imgs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_missing_tensor_is_named(tiny) -> None:
    weights = [(n, t) for n, t in safetensors_weights_iterator(
        [tiny["path"] / "model.safetensors"]) if "multi_modal_projector.linear_2.bias" not in n]
    model = type(tiny["model"])(tiny["config"], make_ctx())
    with pytest.raises(ValueError, match="linear_2.bias"):
        model.load_weights(weights)


# -- embeddings -----------------------------------------------------------------------
def test_image_embeddings_equal_get_image_features(tiny) -> None:
    """Three images of different aspect ratios in one tower call; for LLaVA-NeXT the
    packed rows (base, unpadded tile grid, a newline per row)."""
    imgs = images(3)
    prompt = " ".join([IMAGE_TOKEN] * len(imgs))
    want = hf_features(tiny, hf_inputs(tiny["path"], prompt, imgs))
    got = engine_features(tiny["model"], tiny["processor"], imgs)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        close(g, w)
    if tiny["kind"] == "next":
        # The three images pick different pinpoints and unpad differently.
        assert len({g.shape[0] for g in got}) == 3
        newline = tiny["model"].image_newline
        assert any(torch.equal(row, newline) for row in got[0])


def test_embeddings_do_not_depend_on_the_batch(tiny) -> None:
    imgs = images(3)
    together = engine_features(tiny["model"], tiny["processor"], imgs)
    for i, image in enumerate(imgs):
        alone = engine_features(tiny["model"], tiny["processor"], [image])[0]
        close(alone, together[i], tol=1e-5)


@pytest.mark.parametrize("feature_layer,strategy", [([-3, -1], "full"), (1, "default")],
                         ids=["layers-list-full", "first-layer"])
def test_feature_layer_variants(tmp_path: Path, feature_layer, strategy) -> None:
    """A list of feature layers (concatenated; all layers built) with the class token
    kept, and a non-negative index (layer 1: one layer built). (transformers cannot
    select layer 0, the embedding: it reads ``output_hidden_states=0`` as off.)"""
    import transformers

    hf = build_llava(tmp_path, feature_layer=feature_layer, strategy=strategy, seed=1)
    config, model, loaded = load_engine(tmp_path, "llava")
    assert weight_names(model) <= loaded
    assert len(model.vision_tower.encoder.layers) == (3 if strategy == "full" else 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    processor = LlavaProcessor(tmp_path, config, tokenizer)
    imgs = images(2)
    inputs = hf_inputs(tmp_path, f"{IMAGE_TOKEN} a {IMAGE_TOKEN}", imgs)
    with torch.no_grad():
        want = list(hf.model.get_image_features(pixel_values=inputs["pixel_values"]
                                                ).pooler_output)
    got = engine_features(model, processor, imgs)
    for g, w in zip(got, want):
        close(g, w)
    ids = inputs["input_ids"][0]
    assert int((ids == config.image_token_id).sum()) == sum(g.shape[0] for g in got)


# -- processor ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_processor_equals_transformers(tiny, mode: str) -> None:
    """Per image: the placeholder count of transformers' processor and its tensors
    (non-RGB images converted the same way)."""
    imgs = [random_image(w, h, 7 + i, mode=mode) for i, (w, h) in enumerate(SIZES)]
    items = tiny["processor"].process("image", imgs)
    image_id = tiny["config"].image_token_id
    for i, (image, item) in enumerate(zip(imgs, items)):
        inputs = hf_inputs(tiny["path"], f"x {IMAGE_TOKEN} y", [image])
        assert int((inputs["input_ids"] == image_id).sum()) == item.num_embeds
        pixels = inputs["pixel_values"][0]
        torch.testing.assert_close(item.tensors["pixel_values"], pixels, atol=0, rtol=0)
        if tiny["kind"] == "next":
            assert item.tensors["image_sizes"].tolist() == inputs["image_sizes"][0].tolist()
            assert item.tensors["image_sizes"].tolist() == [image.height, image.width]


def test_processor_strings_and_ids(tiny) -> None:
    from engine.multimodal.processing import processor_for

    assert type(processor_for(tiny["path"], tiny["config"], tiny["tokenizer"])) is type(
        tiny["processor"])
    processor = tiny["processor"]
    assert processor.placeholder("image") == processor.target("image") == IMAGE_TOKEN
    assert processor.embed_token_id("image") == tiny["config"].image_token_id
    item = processor.process("image", images(1))[0]
    ids = tiny["tokenizer"].encode(processor.expansion("image", item), add_special_tokens=False)
    assert ids == [tiny["config"].image_token_id] * item.num_embeds
    with pytest.raises(ValueError, match="PIL"):
        processor.process("image", ["not an image"])


# -- the language model ---------------------------------------------------------------


def merged_logits(model, processor, inputs: dict, imgs: list, image_id: int) -> torch.Tensor:
    """The engine's prompt logits with each image's rows at its run of image tokens."""
    ids = inputs["input_ids"][0]
    embeds = model.embed_input_ids(ids).clone()
    rows = torch.cat(engine_features(model, processor, imgs))
    embeds[ids == image_id] = rows
    return engine_prefill_logits(model, embeds, ids, torch.arange(len(ids)))


def test_prompt_logits_equal_transformers(tiny) -> None:
    imgs = images(2)
    inputs = hf_inputs(tiny["path"], f"The quick {IMAGE_TOKEN} brown {IMAGE_TOKEN} fox", imgs)
    with torch.no_grad():
        want = tiny["hf"](**inputs).logits[0]
    got = merged_logits(tiny["model"], tiny["processor"], inputs, imgs,
                        tiny["config"].image_token_id)
    close(got, want)


@pytest.mark.parametrize("text,kind", [("qwen2", "llava"), ("mistral", "next")])
def test_other_language_models(tmp_path: Path, text: str, kind: str) -> None:
    import transformers

    hf = build_llava(tmp_path, next=kind == "next", text=text, seed=2)
    config, model, loaded = load_engine(tmp_path, kind)
    assert weight_names(model) <= loaded
    assert type(model.language_model).__name__.lower().startswith(text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    processor = KINDS[kind][1](tmp_path, config, tokenizer)
    imgs = images(1, seed=3)
    inputs = hf_inputs(tmp_path, f"Once upon {IMAGE_TOKEN} a time", imgs)
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    close(merged_logits(model, processor, inputs, imgs, config.image_token_id), want)


# -- refusals -------------------------------------------------------------------------
TINY_TEXT = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def tower(model_type: str) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28,
            "patch_size": 14}


def test_siglip_tower_is_refused() -> None:
    import transformers

    config = transformers.LlavaConfig(vision_config=tower("siglip_vision_model"),
                                      text_config=TINY_TEXT)
    with pytest.raises(ValueError, match="siglip_vision_model"):
        LlavaForConditionalGeneration(config, make_ctx())


def test_next_with_full_strategy_is_refused() -> None:
    """Each tile's class token would not fit LLaVA-NeXT's grid (transformers cannot
    lay it out either)."""
    import transformers

    config = transformers.LlavaNextConfig(
        vision_config=tower("clip_vision_model"), text_config=TINY_TEXT,
        vision_feature_select_strategy="full", image_grid_pinpoints=[[28, 56]])
    with pytest.raises(ValueError, match="default"):
        LlavaNextForConditionalGeneration(config, make_ctx())
