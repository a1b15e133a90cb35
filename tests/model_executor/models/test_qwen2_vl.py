"""Qwen2-VL / Qwen2.5-VL against transformers, piece by piece: the vision towers'
embeddings (images of different sizes in one call, and videos), the M-RoPE positions of
mixed prompts, the M-RoPE rotary itself, the processor's tensors, and the prompt's
logits with the image rows merged in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.model_executor.layers.rotary import MRotaryEmbedding, RopeScaling, RotaryEmbedding
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)
from engine.model_executor.weight_utils import safetensors_weights_iterator
from engine.multimodal.inputs import MultiModalFeature, PackedTensor
from engine.multimodal.processors.qwen2_vl import (
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    process_video,
)
from engine.plugins.cpu.attention import CPUAttentionBackend
from tests.helpers.vlm_qwen2vl import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    build_qwen2_vl,
    hf_inputs,
    image_processor,
    random_image,
)
from tests.helpers.vlm_reference import engine_prefill_logits

CPU = torch.device("cpu")
# float32 on both sides; the margin covers other CPUs' accumulation orders.
ATOL = 2e-5
VERSIONS = {"2": (Qwen2VLForConditionalGeneration, Qwen2VLProcessor),
            "2.5": (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor)}


@pytest.fixture(scope="module", params=list(VERSIONS))
def tiny(request, tmp_path_factory) -> dict[str, Any]:
    """A saved tiny checkpoint, transformers' model of it, the engine's model and
    processor."""
    import transformers

    version = request.param
    path = tmp_path_factory.mktemp(f"qwen{version}vl")
    reference = build_qwen2_vl(path, version=version)
    config = transformers.AutoConfig.from_pretrained(path)
    model_cls, processor_cls = VERSIONS[version]
    # One block per segment: the vision segments here are at most 64 patches.
    ctx = ModelInitContext(dtype=torch.float32, device=CPU,
                           attn_backend=CPUAttentionBackend(1024, CPU))
    model = model_cls(config, ctx).eval()
    loaded = model.load_weights(safetensors_weights_iterator([path / "model.safetensors"]))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return {"version": version, "path": path, "hf": reference, "model": model,
            "loaded": loaded, "config": config,
            "processor": processor_cls(path, config, tokenizer), "tokenizer": tokenizer}


def frames(n: int, width: int, height: int, seed: int) -> list:
    return [random_image(width, height, seed + i) for i in range(n)]


def split_items(pixels: torch.Tensor, grids: torch.Tensor, key: str, grid_key: str
                ) -> list[dict[str, torch.Tensor]]:
    items, offset = [], 0
    for grid in grids:
        n = int(grid.prod())
        items.append({key: pixels[offset:offset + n], grid_key: grid[None]})
        offset += n
    return items


def features_for(inputs: dict[str, torch.Tensor], items: dict[str, list[dict]]
                 ) -> list[MultiModalFeature]:
    """The features the front end would record for ``inputs``' pad-token runs."""
    ids = inputs["input_ids"][0].tolist()
    types = inputs["mm_token_type_ids"][0].tolist()
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or types[i] != types[start]:
            if types[start]:
                runs.append(("image" if types[start] == 1 else "video", start, i - start))
            start = i
    cursors = {"image": iter(items.get("image", [])), "video": iter(items.get("video", []))}
    return [MultiModalFeature(modality, f"{modality}{offset}", offset, length,
                              {k: PackedTensor.of(v) for k, v in next(cursors[modality]).items()})
            for modality, offset, length in runs]


def weight_names(model: torch.nn.Module) -> set[str]:
    """Parameters a checkpoint must fill (not the optional fp8 KV cache scales)."""
    return {name for name, _ in model.named_parameters()
            if not name.endswith(("k_scale", "v_scale"))}


def test_checkpoint_loads_every_parameter(tiny) -> None:
    assert weight_names(tiny["model"]) <= tiny["loaded"]
    assert "visual.blocks.0.attn.qkv_proj.weight" in tiny["loaded"]


def test_checkpoint_loads_transformers_in_memory_names(tiny) -> None:
    """The v5 module names (``model.language_model.*``, ``model.visual.*``) load too."""
    state = tiny["hf"].state_dict()
    assert any(name.startswith("model.visual.") for name in state)
    model = type(tiny["model"])(tiny["config"], tiny["model"].ctx)
    loaded = model.load_weights(state.items())
    assert weight_names(model) <= loaded


def test_image_embeddings_equal_transformers(tiny) -> None:
    """Three images of different sizes (and windows that do not tile them) in one call."""
    images = [random_image(60, 40, 0), random_image(30, 80, 1), random_image(120, 100, 2)]
    enc = image_processor(tiny["path"])(images, return_tensors="pt")
    with torch.no_grad():
        reference = tiny["hf"].get_image_features(enc["pixel_values"],
                                                  enc["image_grid_thw"]).pooler_output
    items = split_items(enc["pixel_values"], enc["image_grid_thw"], "pixel_values",
                        "image_grid_thw")
    got = tiny["model"].embed_multimodal("image", items)
    assert [g.shape for g in got] == [r.shape for r in reference]
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=1e-4)


def test_video_embeddings_equal_transformers(tiny) -> None:
    """Videos of several temporal patches (an odd frame count, padded) next to another."""
    videos = [tiny["processor"].process("video", [frames(5, 56, 84, 10)])[0].tensors,
              tiny["processor"].process("video", [frames(2, 70, 50, 20)])[0].tensors]
    assert videos[0]["video_grid_thw"].tolist() == [[3, 6, 4]]
    with torch.no_grad():
        reference = tiny["hf"].get_video_features(
            torch.cat([v["pixel_values_videos"] for v in videos]),
            torch.cat([v["video_grid_thw"] for v in videos])).pooler_output
    got = tiny["model"].embed_multimodal("video", videos)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=1e-4)


def mixed_prompt(tiny, with_video: bool) -> tuple[dict, dict[str, list[dict]]]:
    images = [random_image(60, 40, 3), random_image(90, 60, 4)]
    prompt = f"a cat {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and"
    video = None
    if with_video:
        prompt += f" a dog {VIDEO_PLACEHOLDER} end"
        video = tiny["processor"].process("video", [frames(6, 84, 56, 30)])[0].tensors
    inputs = hf_inputs(tiny["path"], prompt, images, video)
    items = {"image": split_items(inputs["pixel_values"], inputs["image_grid_thw"],
                                  "pixel_values", "image_grid_thw")}
    if video is not None:
        items["video"] = [video]
    return inputs, items


@pytest.mark.parametrize("with_video", [False, True])
def test_mrope_positions_equal_get_rope_index(tiny, with_video: bool) -> None:
    inputs, items = mixed_prompt(tiny, with_video)
    kwargs = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
              if k in inputs}
    reference, delta = tiny["hf"].model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], **kwargs)
    ids = inputs["input_ids"][0].tolist()
    positions, got_delta = tiny["model"].mrope_positions(ids, features_for(inputs, items))
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, reference[:, 0].numpy())
    assert got_delta == int(delta)


def test_text_only_mrope_positions_are_plain() -> None:
    positions, delta = Qwen2VLForConditionalGeneration.mrope_positions(
        type("M", (), {"merge": 2})(), [5, 6, 7], [])
    np.testing.assert_array_equal(positions, np.tile(np.arange(3), (3, 1)))
    assert delta == 0


def hf_mrope(q: torch.Tensor, positions: torch.Tensor, section: list[int], theta: float
             ) -> torch.Tensor:
    """transformers' Qwen2-VL rotary (its rotary module's cos / sin, then
    apply_multimodal_rotary_pos_emb as the attention applies it)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    dim = q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = positions[:, None, :, None].float() * inv_freq  # [3, 1, T, dim/2]
    parts = freqs.split(section, dim=-1)
    freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    rotated, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None],
                                      emb.cos(), emb.sin())
    return rotated[0].transpose(0, 1)  # [T, heads, dim]


def test_mrotary_equals_transformers_and_plain_rope_on_1d_positions() -> None:
    head, heads, tokens, section = 16, 3, 11, [2, 3, 3]
    scaling = RopeScaling("default", 10000.0, 256)
    mrope = MRotaryEmbedding(head, scaling, tuple(section), dtype=torch.float32, device=CPU)
    plain = RotaryEmbedding(head, scaling, dtype=torch.float32, device=CPU)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads * head, generator=gen)
    positions = torch.stack([torch.arange(tokens) // 4 + 2, torch.arange(tokens) % 5,
                             torch.arange(tokens) * 3]).long()
    got = mrope.apply(q.clone(), mrope.prepare(positions)).view(tokens, heads, head)
    torch.testing.assert_close(got, hf_mrope(q.view(tokens, heads, head), positions, section,
                                             10000.0), atol=1e-6, rtol=1e-6)
    flat = torch.arange(tokens) + 7
    torch.testing.assert_close(mrope.apply(q.clone(), mrope.prepare(flat)),
                               plain.apply(q.clone(), plain.prepare(flat)), atol=0, rtol=0)
    # Equal rows on all three axes: the 1-D result.
    torch.testing.assert_close(mrope.apply(q.clone(), mrope.prepare(flat.expand(3, -1))),
                               plain.apply(q.clone(), plain.prepare(flat)), atol=0, rtol=0)


def test_processor_images_equal_the_pil_image_processor(tiny) -> None:
    images = [random_image(60, 40, 5), random_image(200, 30, 6)]
    items = tiny["processor"].process("image", images)
    for image, item in zip(images, items):
        enc = image_processor(tiny["path"])([image], return_tensors="pt")
        torch.testing.assert_close(item.tensors["pixel_values"], enc["pixel_values"],
                                   atol=0, rtol=0)
        assert item.tensors["image_grid_thw"].tolist() == enc["image_grid_thw"].tolist()
        assert item.num_embeds == int(enc["image_grid_thw"].prod()) // 4
    proc = tiny["processor"]
    assert proc.expansion("image", items[0]) == "<|image_pad|>" * items[0].num_embeds
    assert proc.placeholder("video") == VIDEO_PLACEHOLDER
    assert proc.embed_token_id("image") == tiny["config"].image_token_id
    with pytest.raises(ValueError):
        proc.process("image", ["not an image"])


def test_processor_video_matches_the_image_pipeline(tiny) -> None:
    """A frame the size smart_resize keeps, repeated over one temporal patch, is what
    the image processor makes of it (it repeats an image's one frame itself); an odd
    frame count repeats the last frame."""
    frame = random_image(84, 56, 7)
    item = tiny["processor"].process("video", [[frame, frame]])[0]
    enc = image_processor(tiny["path"])([frame], return_tensors="pt")
    torch.testing.assert_close(item.tensors["pixel_values_videos"], enc["pixel_values"],
                               atol=1e-5, rtol=1e-5)
    assert item.tensors["video_grid_thw"].tolist() == [[1, 4, 6]]
    odd = tiny["processor"].process("video", [[frame, random_image(84, 56, 8), frame]])[0]
    even = tiny["processor"].process("video", [[frame, random_image(84, 56, 8), frame,
                                                frame]])[0]
    torch.testing.assert_close(odd.tensors["pixel_values_videos"],
                               even.tensors["pixel_values_videos"], atol=0, rtol=0)
    if tiny["version"] == "2.5":
        assert odd.tensors["second_per_grid_ts"].tolist() == [1.0]  # 2 frames / 2 fps
    else:
        assert "second_per_grid_ts" not in odd.tensors


def test_processor_video_resize_is_close_to_pil(tiny) -> None:
    """Resized frames (torch's antialiased bicubic on uint8, torchvision's kernel) stay
    within a grey level of PIL's bicubic resize of the same frame on average (random
    noise is the worst case for the two kernels' differences)."""
    frame = random_image(100, 70, 9)
    video, grid = process_video([frame, frame], tiny["processor"].video)
    enc = image_processor(tiny["path"])([frame], return_tensors="pt")
    assert list(grid) == enc["image_grid_thw"][0].tolist()
    diff = (video - enc["pixel_values"]).abs() * 0.27 * 255  # in grey levels
    assert diff.mean() < 1.0 and diff.max() < 24




@pytest.mark.parametrize("with_video", [False, True])
def test_prompt_logits_equal_transformers(tiny, with_video: bool) -> None:
    """The image / video rows merged into the text embedding at their pad tokens, the
    decoder at the M-RoPE positions: transformers' logits at every prompt position."""
    inputs, items = mixed_prompt(tiny, with_video)
    kwargs = {k: v for k, v in inputs.items() if k != "pixel_values_videos"}
    if with_video:
        kwargs["pixel_values_videos"] = inputs["pixel_values_videos"]
    with torch.no_grad():
        reference = tiny["hf"](**kwargs).logits[0]
    model = tiny["model"]
    ids = inputs["input_ids"][0]
    features = features_for(inputs, items)
    embeds = model.embed_input_ids(ids).clone()
    for feature in features:
        rows = model.embed_multimodal(feature.modality, [feature.tensors()])[0]
        embeds[feature.offset:feature.end] = rows
    positions, _ = model.mrope_positions(ids.tolist(), features)
    got = engine_prefill_logits(model, embeds, ids, torch.from_numpy(positions))
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def test_weights_survive_a_tied_head(tmp_path: Path) -> None:
    import transformers

    build_qwen2_vl(tmp_path, version="2", tie=True)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    ctx = ModelInitContext(dtype=torch.float32, device=CPU,
                           attn_backend=CPUAttentionBackend(1024, CPU))
    model = Qwen2VLForConditionalGeneration(config, ctx)
    model.load_weights(safetensors_weights_iterator([tmp_path / "model.safetensors"]))
    lm = model.language_model
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
