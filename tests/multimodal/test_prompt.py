"""The generic multimodal prompt step: per-prompt limits, placeholder expansion in text
(as transformers' processors do it) and in token ids, the items' offsets, content hashes
(equal content -> equal hash), and clear errors for mismatched placeholders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine.multimodal.processing import MultiModalProcessor, ProcessedItem
from engine.multimodal.prompt import MultiModalInputProcessor
from tests.helpers.hf_models import build_tokenizer


class SquareProcessor(MultiModalProcessor):
    """A made-up family: an image of side s yields s // 8 embedding tokens, wrapped in
    begin / end markers; pixel_values are the image's bytes."""

    modalities = ("image", "video")

    def placeholder(self, modality: str) -> str:
        return "<image>" if modality == "image" else "<video>"

    def target(self, modality: str) -> str:
        return self.placeholder(modality)

    def expansion(self, modality: str, item: ProcessedItem) -> str:
        if modality == "video":
            return "<video>" * item.num_embeds
        return "<|im_start|>" + "<image>" * item.num_embeds + "<|im_end|>"

    def embed_token_id(self, modality: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.placeholder(modality))

    def process(self, modality: str, items: list) -> list[ProcessedItem]:
        if modality == "video":
            return [ProcessedItem({"frames": torch.tensor(np.stack([np.asarray(f) for f in v]))},
                                  len(v)) for v in items]
        return [ProcessedItem({"pixel_values": torch.tensor(np.asarray(img))},
                              img.size[0] // 8) for img in items]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_special_tokens({"additional_special_tokens":
                            ["<|im_start|>", "<|im_end|>", "<image>", "<video>"]})
    return tok


def square(side: int, value: int = 0) -> Image.Image:
    return Image.fromarray(np.full((side, side, 3), value, dtype=np.uint8))


def make(tokenizer, **limits) -> MultiModalInputProcessor:
    return MultiModalInputProcessor(SquareProcessor("/nowhere", None, tokenizer), tokenizer,
                                    limits or None)


def test_text_prompt_expands_each_placeholder_and_finds_the_items(tokenizer):
    mm = make(tokenizer)
    out = mm.process("a <image> b <image> c", {"image": [square(16), square(32, 7)]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ids = np.asarray(out.token_ids)
    assert [(f.offset, f.length) for f in out.features] == [
        (int(np.flatnonzero(ids == image_id)[0]), 2), (int(np.flatnonzero(ids == image_id)[2]), 4)]
    assert all((ids[f.offset:f.end] == image_id).all() for f in out.features)
    # The same text as transformers would tokenize after replacing the placeholders.
    expected = tokenizer.encode("a <|im_start|><image><image><|im_end|> b <|im_start|>"
                                "<image><image><image><image><|im_end|> c")
    assert out.token_ids == expected
    torch.testing.assert_close(out.features[1].tensors()["pixel_values"],
                               torch.tensor(np.asarray(square(32, 7))))


def test_token_prompt_expands_single_targets_and_accepts_expanded_prompts(tokenizer):
    mm = make(tokenizer)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ids = tokenizer.encode("x <image> y")
    out = mm.process(ids, {"image": square(24)})
    assert out.features[0].length == 3
    again = mm.process(out.token_ids, {"image": square(24)})  # already expanded: kept
    assert again.token_ids == out.token_ids
    assert again.features[0].offset == out.features[0].offset
    assert sum(1 for t in out.token_ids if t == image_id) == 3


def test_hash_follows_content_not_object(tokenizer):
    mm = make(tokenizer)
    a = mm.process("<image>", {"image": square(16, 1)}).features[0].identifier
    b = mm.process("<image>", {"image": square(16, 1)}).features[0].identifier
    c = mm.process("<image>", {"image": square(16, 2)}).features[0].identifier
    assert a == b != c


def test_videos_and_images_keep_prompt_order(tokenizer):
    mm = make(tokenizer)
    frames = [square(8, i) for i in range(3)]
    out = mm.process("<video> then <image>", {"image": square(16), "video": frames})
    assert [f.modality for f in out.features] == ["video", "image"]
    assert [f.length for f in out.features] == [3, 2]


@pytest.mark.parametrize(("prompt", "data", "message"), [
    ("no placeholder", {"image": square(16)}, "0 '<image>' placeholder"),
    ("<image> <image>", {"image": square(16)}, "2 '<image>' placeholder"),
    ("<image>", {"audio": square(16)}, "not 'audio'"),
    ("<image>", {"image": "not an image"}, "PIL.Image"),
    ("<image>", ["image"], "must be a dict"),
    ("<video>", {"video": []}, "at least one frame"),
])
def test_bad_inputs_are_clear_errors(tokenizer, prompt, data, message):
    with pytest.raises(ValueError, match=message):
        make(tokenizer).process(prompt, data)


def test_limit_per_prompt(tokenizer):
    mm = make(tokenizer, image=1)
    with pytest.raises(ValueError, match="at most 1 image"):
        mm.process("<image><image>", {"image": [square(16), square(16)]})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        make(tokenizer, audio=2)
