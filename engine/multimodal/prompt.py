"""A prompt plus its images / videos -> expanded token ids and one feature per item.

The same steps for every family (the family's :class:`MultiModalProcessor` supplies the
specifics): check the items and the per-prompt limits, run the model's processor, hash
each item's processed tensors, replace the k-th placeholder of a modality by the k-th
item's expansion (in the text before tokenizing, as transformers' processors do, so the
token ids are theirs; in token space for token-id prompts), and find where each item's
embedding tokens landed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.multimodal.hashing import hash_item
from engine.multimodal.inputs import MultiModalFeature, PackedTensor
from engine.multimodal.processing import MODALITIES, MultiModalProcessor, ProcessedItem


@dataclass
class MultiModalPrompt:
    """A processed multimodal prompt."""

    text: str | None
    token_ids: list[int]
    features: list[MultiModalFeature]  # by offset


class MultiModalInputProcessor:
    """The front end's multimodal step (one per engine)."""

    def __init__(self, mm_processor: MultiModalProcessor, tokenizer: Any,
                 limits: Mapping[str, int] | None = None,
                 max_item_tokens: int | None = None) -> None:
        """``max_item_tokens``: the most embedding tokens one item may have (a model
        that runs an item's tokens in one step: that step's token budget)."""
        self.mm_processor = mm_processor
        self.tokenizer = tokenizer
        self.max_item_tokens = max_item_tokens
        self.limits = dict(limits or {})
        for modality, limit in self.limits.items():
            if modality not in MODALITIES:
                raise ValueError(f"limit_mm_per_prompt names {modality!r}; modalities: "
                                 f"{', '.join(MODALITIES)}")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer "
                                 f">= 0, not {limit!r}")

    @property
    def modalities(self) -> tuple[str, ...]:
        return self.mm_processor.modalities

    # -- public ---------------------------------------------------------------------------
    def process(self, prompt: str | Sequence[int], mm_data: Any,
                add_special_tokens: bool = True) -> MultiModalPrompt:
        items = self.parse_items(mm_data)
        processed = {m: self.mm_processor.process(m, v) for m, v in items.items()}
        for modality, outs in processed.items():
            if len(outs) != len(items[modality]):
                raise RuntimeError(f"the {modality} processor returned {len(outs)} items "
                                   f"for {len(items[modality])}")
            longest = max(item.num_embeds for item in outs)
            if self.max_item_tokens is not None and longest > self.max_item_tokens:
                raise ValueError(
                    f"a {modality} of {longest} tokens does not fit one step of "
                    f"{self.max_item_tokens} tokens (max_num_batched_tokens), and this "
                    f"model runs a {modality}'s tokens in one step")
        if isinstance(prompt, str):
            text = self._expand_text(prompt, processed)
            token_ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        else:
            text, token_ids = None, self._expand_tokens(list(prompt), processed)
        return MultiModalPrompt(text, token_ids, self._features(token_ids, processed))

    def parse_items(self, mm_data: Any) -> dict[str, list[Any]]:
        """``{"image": item or [items], "video": video or [videos]}`` -> lists, checked."""
        if not isinstance(mm_data, Mapping):
            raise ValueError("multi_modal_data must be a dict like {'image': [images]}, "
                             f"got {type(mm_data).__name__}")
        items: dict[str, list[Any]] = {}
        for modality, value in mm_data.items():
            if modality not in self.modalities:
                raise ValueError(f"this model takes {' and '.join(self.modalities)} input, "
                                 f"not {modality!r}")
            values = _as_video_list(value) if modality == "video" else _as_image_list(value)
            limit = self.limits.get(modality)
            if limit is not None and len(values) > limit:
                raise ValueError(f"at most {limit} {modality}(s) per prompt are allowed "
                                 f"(--limit-mm-per-prompt), got {len(values)}")
            if values:
                items[modality] = values
        return items

    # -- expansion ------------------------------------------------------------------------
    def _expand_text(self, text: str, processed: dict[str, list[ProcessedItem]]) -> str:
        mm = self.mm_processor
        targets = {mm.target(m): m for m in processed}
        counts = {m: 0 for m in processed}
        for found in re.findall("|".join(map(re.escape, targets)), text) if targets else ():
            counts[targets[found]] += 1
        for modality, outs in processed.items():
            if counts[modality] != len(outs):
                raise ValueError(
                    f"the prompt has {counts[modality]} {mm.target(modality)!r} placeholder(s) "
                    f"for {len(outs)} {modality}(s): write {mm.placeholder(modality)!r} once "
                    "per item where it belongs (chat messages insert them for you)")
        taken = {m: 0 for m in processed}

        def expand(match: re.Match) -> str:
            modality = targets[match.group(0)]
            item = processed[modality][taken[modality]]
            taken[modality] += 1
            return mm.expansion(modality, item)

        return re.sub("|".join(map(re.escape, targets)), expand, text) if targets else text

    def _expand_tokens(self, token_ids: list[int],
                       processed: dict[str, list[ProcessedItem]]) -> list[int]:
        """Token-id prompts: one target token per item is expanded; a prompt that holds
        every embedding token already (expanded by the caller) is taken as it is."""
        mm = self.mm_processor
        ids = np.asarray(token_ids, dtype=np.int64)
        replace: dict[int, list[int]] = {}  # prompt index -> expansion ids
        for modality, outs in processed.items():
            target_id = self._token_id(mm.target(modality))
            where = np.flatnonzero(ids == target_id)
            total = sum(item.num_embeds for item in outs)
            if target_id == mm.embed_token_id(modality) and len(where) == total:
                continue  # already expanded
            if len(where) != len(outs):
                raise ValueError(
                    f"the prompt has {len(where)} {mm.target(modality)!r} token(s) "
                    f"(id {target_id}) for {len(outs)} {modality}(s)")
            for index, item in zip(where.tolist(), outs):
                replace[index] = list(self.tokenizer.encode(
                    mm.expansion(modality, item), add_special_tokens=False))
        if not replace:
            return token_ids
        out: list[int] = []
        last = 0
        for index in sorted(replace):
            out.extend(token_ids[last:index])
            out.extend(replace[index])
            last = index + 1
        out.extend(token_ids[last:])
        return out

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no {token!r} token")
        return int(token_id)

    # -- features -------------------------------------------------------------------------
    def _features(self, token_ids: list[int], processed: dict[str, list[ProcessedItem]]
                  ) -> list[MultiModalFeature]:
        """Each item's run of embedding tokens, in prompt order."""
        ids = np.asarray(token_ids, dtype=np.int64)
        features = []
        for modality, outs in processed.items():
            embed_id = self.mm_processor.embed_token_id(modality)
            where = np.flatnonzero(ids == embed_id)
            want = sum(item.num_embeds for item in outs)
            if len(where) != want:
                raise ValueError(
                    f"the prompt holds {len(where)} {modality} embedding tokens (id "
                    f"{embed_id}) where its {len(outs)} {modality}(s) need {want}: do not "
                    "write that token in the prompt text yourself")
            start = 0
            for item in outs:
                run = where[start : start + item.num_embeds]
                start += item.num_embeds
                if item.num_embeds <= 0 or run[-1] - run[0] + 1 != item.num_embeds:
                    raise ValueError(f"a {modality}'s embedding tokens are not contiguous "
                                     "in the prompt")
                features.append(MultiModalFeature(
                    modality=modality,
                    identifier=hash_item(modality, item.tensors),
                    offset=int(run[0]),
                    length=item.num_embeds,
                    data={name: PackedTensor.of(t) for name, t in item.tensors.items()},
                ))
        features.sort(key=lambda f: f.offset)
        return features


def _is_image(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image)


def _as_image(value: Any) -> Any:
    """A PIL image (numpy ``[H, W, 3]`` uint8 arrays are converted)."""
    from PIL import Image

    if _is_image(value):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 3 and value.dtype == np.uint8:
        return Image.fromarray(value)
    raise ValueError(f"an image must be a PIL.Image.Image (or a uint8 [H, W, 3] numpy "
                     f"array), got {type(value).__name__}")


def _as_image_list(value: Any) -> list[Any]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_as_image(v) for v in values]


def _as_video(value: Any) -> list[Any]:
    """One video: a list of PIL frames or a uint8 ``[F, H, W, 3]`` array."""
    if isinstance(value, np.ndarray) and value.ndim == 4:
        frames = list(value)
    elif isinstance(value, (list, tuple)):
        frames = list(value)
    else:
        raise ValueError("a video must be a list of frames (PIL images) or a uint8 "
                         f"[frames, H, W, 3] array, got {type(value).__name__}")
    if not frames:
        raise ValueError("a video needs at least one frame")
    return [_as_image(f) for f in frames]


def _as_video_list(value: Any) -> list[list[Any]]:
    """One video, or a list of them."""
    if isinstance(value, np.ndarray) and value.ndim == 5:
        return [_as_video(v) for v in value]
    if isinstance(value, (list, tuple)) and value and not (
            _is_image(value[0]) or (isinstance(value[0], np.ndarray) and value[0].ndim == 3)):
        return [_as_video(v) for v in value]
    return [_as_video(value)]
