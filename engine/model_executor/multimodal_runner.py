"""The worker side of images and videos: encode, cache, merge, and M-RoPE positions.

Per step, after the scheduler's diffs: (1) drop the encoder-cache entries the scheduler
evicted, (2) encode the items it scheduled (grouped by modality, one tower call each),
keeping each item's rows under its content hash, (3) for every request chunk that covers
an item's tokens, take the matching rows of its cached output and write them over the
text embeddings at those tokens' places in the flat batch. Models with multimodal RoPE
(Qwen2-VL) get ``[3, T]`` positions for prompt tokens from a table computed once per
request; every later token sits at ``p + delta`` on all three axes, which is plain RoPE
at a shifted position -- so decode steps keep 1-D positions (and their forward graphs).
Models whose image tokens attend to each other both ways (Gemma 3) get per-token key
ends for the attention backend (``AttentionBatch.key_ends_cpu``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from engine.model_executor.input_batch import StepIndices
from engine.multimodal.inputs import MultiModalFeature


class MultiModalRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # Gemma 3: an image's tokens attend to each other both ways (the scheduler keeps
        # each image within one step; key_ends tells the attention backend).
        self.bidirectional = bool(getattr(model, "bidirectional_mm_attention", False))
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.encoder_cache: dict[str, torch.Tensor] = {}  # identifier -> [length, hidden]
        # M-RoPE: per request, the prompt's [3, P] positions and the later tokens' delta.
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}

    # -- requests -------------------------------------------------------------------------
    def add_request(self, req_id: str, features: list[MultiModalFeature] | None,
                    prompt_token_ids: list[int]) -> None:
        if features:
            self.features[req_id] = list(features)
            if self.uses_mrope:
                table, delta = self.model.mrope_positions(prompt_token_ids, self.features[req_id])
                self._mrope[req_id] = (np.asarray(table, dtype=np.int64), int(delta))

    def remove_request(self, req_id: str) -> None:
        self.features.pop(req_id, None)
        self._mrope.pop(req_id, None)

    def free(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.encoder_cache.pop(identifier, None)

    # -- encoding -------------------------------------------------------------------------
    def encode(self, scheduled: dict[str, list[int]]) -> None:
        """Run the model's encoders on the items scheduled this step."""
        by_modality: dict[str, list[MultiModalFeature]] = defaultdict(list)
        seen: set[str] = set()
        for req_id, indices in scheduled.items():
            for index in indices:
                feature = self.features[req_id][index]
                if feature.identifier not in seen and feature.identifier not in self.encoder_cache:
                    seen.add(feature.identifier)
                    by_modality[feature.modality].append(feature)
        for modality, features in by_modality.items():
            outputs = self.model.embed_multimodal(modality, [f.tensors() for f in features])
            for feature, rows in zip(features, outputs, strict=True):
                if rows.shape[0] != feature.length:
                    raise RuntimeError(
                        f"the model's {modality} encoder gave {rows.shape[0]} rows for an "
                        f"item of {feature.length} placeholder tokens")
                self.encoder_cache[feature.identifier] = rows

    # -- the step's inputs ----------------------------------------------------------------
    def _covered(self, req_ids: list[str], step: StepIndices
                 ) -> Iterator[tuple[str, MultiModalFeature, int, int, int]]:
        """Every (request, item) whose tokens this step computes: ``(req_id, feature,
        lo, hi, row)`` with ``[lo, hi)`` the item's positions in the step and ``row`` the
        flat batch index of position ``lo``."""
        for i, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if not features:
                continue
            first = int(step.query_start_loc[i])
            start = int(step.positions[first])
            end = start + int(step.num_scheduled[i])
            for feature in features:
                lo, hi = max(feature.offset, start), min(feature.end, end)
                if lo < hi:
                    yield req_id, feature, lo, hi, first + lo - start

    def inputs_embeds(self, req_ids: list[str], step: StepIndices,
                      input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input rows with image rows merged, or None when no scheduled token
        is an image's (the model then embeds the ids itself)."""
        targets: list[np.ndarray] = []
        sources: list[torch.Tensor] = []
        for req_id, feature, lo, hi, row in self._covered(req_ids, step):
            rows = self.encoder_cache.get(feature.identifier)
            if rows is None:
                raise RuntimeError(f"request {req_id}: the encoder output of a "
                                   f"{feature.modality} it needs is not cached")
            sources.append(rows[lo - feature.offset : hi - feature.offset])
            targets.append(np.arange(row, row + hi - lo))
        if not sources:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        index = torch.from_numpy(np.concatenate(targets)).to(embeds.device)
        embeds[index] = torch.cat(sources).to(embeds.dtype)
        return embeds

    def positions(self, req_ids: list[str], step: StepIndices) -> np.ndarray | None:
        """M-RoPE models: the step's positions, ``[3, T]`` when a token of some prompt with
        images runs, else ``[T]`` shifted by each request's delta; None when unchanged."""
        if not self._mrope:
            return None
        shifted = step.positions.copy()
        tables: list[tuple[slice, np.ndarray, np.ndarray]] = []
        for i, req_id in enumerate(req_ids):
            entry = self._mrope.get(req_id)
            if entry is None:
                continue
            table, delta = entry
            span = slice(int(step.query_start_loc[i]), int(step.query_start_loc[i + 1]))
            pos = step.positions[span]
            shifted[span] = pos + delta
            in_prompt = pos < table.shape[1]
            if in_prompt.any():
                tables.append((span, in_prompt, table[:, pos[in_prompt]]))
        if not tables:
            return shifted
        full = np.repeat(shifted[None, :], 3, axis=0)
        for span, in_prompt, values in tables:
            idx = np.arange(span.start, span.stop)[in_prompt]
            full[:, idx] = values
        return full

    def key_ends(self, req_ids: list[str], step: StepIndices) -> np.ndarray | None:
        """``AttentionBatch.key_ends_cpu`` for a model whose image tokens attend to their
        whole image: each such token's keys end at its image's end (the image lies in the
        step: the scheduler never splits one), every other token's after itself. None
        when the step holds no image token."""
        if not self.bidirectional:
            return None
        ends = None
        for req_id, feature, lo, hi, row in self._covered(req_ids, step):
            if feature.end > hi:
                raise RuntimeError(f"request {req_id}: a step ends inside an image whose "
                                   "tokens attend both ways")
            if ends is None:
                ends = step.positions.astype(np.int64) + 1
            ends[row : row + hi - lo] = feature.end
        return ends

    @staticmethod
    def with_positions(step: StepIndices, positions: np.ndarray) -> StepIndices:
        """The step with 1-D positions replaced (for a forward graph's replay)."""
        return replace(step, positions=positions)
