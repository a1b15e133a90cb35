"""Prompt (or prompt pair) + PoolingParams -> one validated pooling EngineCoreRequest.

The front end's input side for ``--runner pooling``. Text gets the model's
sentence-transformers prompt (``prompt_name``, else its default prompt) and lower-casing
where the model's config asks for them; a pair (cross-encoder scoring) is encoded the way
the tokenizer encodes pairs, with its token types when the model reads them.
``truncate_prompt_tokens`` cuts text with the tokenizer's own truncation (its side, its
special tokens kept; -1 means max_model_len) and token-id prompts to their last tokens
(vLLM's rules); a prompt longer than max_model_len otherwise is refused, naming both
lengths. Params are resolved against the model (normalize default, what ``dimensions``
may be) so the engine core only executes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.engine_io import EngineCoreRequest
from engine.core.pooling_config import PoolerConfig
from engine.core.pooling_params import PoolingParams
from engine.frontend.processor import ProcessedRequest, PromptType, _as_token_ids
from engine.core.sampling_params import RequestOutputKind, SamplingParams

# What each pooler task of a model can answer (score on an embedder: cosine similarity
# of two embeddings, computed by the caller from "embed" requests).
TASKS_BY_MODEL = {
    "embed": ("embed", "encode"),
    "classify": ("classify", "score", "encode"),
    "reward": ("reward", "encode"),
}
# The slot a pooling request's SamplingParams fills: one step, nothing sampled.
_POOLING_SLOT = SamplingParams(max_tokens=1, detokenize=False,
                               output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the front end knows of a pooling model."""

    config: PoolerConfig
    embed_size: int  # the embedding width (after any Dense modules)
    uses_token_types: bool  # the model reads token types (BERT: type_vocab_size > 1)
    matryoshka: bool  # dimensions may be set (is_matryoshka / matryoshka_dimensions)
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def of(cls, config: PoolerConfig, hf_config: Any, model_dir: str | Path) -> PoolingModelInfo:
        embed_size = int(getattr(hf_config, "hidden_size", 0))
        for where in config.dense_modules:
            try:
                dense = json.loads((Path(model_dir) / where / "config.json").read_text())
                embed_size = int(dense["out_features"])
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"sentence-transformers Dense module {where}: {exc}") from exc
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        return cls(
            config=config,
            embed_size=embed_size,
            uses_token_types=int(getattr(hf_config, "type_vocab_size", 0) or 0) > 1,
            matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
            matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        )

    @property
    def tasks(self) -> tuple[str, ...]:
        return TASKS_BY_MODEL[self.config.task]


class PoolingProcessor:
    """Tokenizes and validates pooling requests (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 info: PoolingModelInfo) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.info = info

    def process(self, request_id: str, prompt: PromptType, params: PoolingParams | None,
                task: str, *, text_pair: str | None = None, prompt_name: str | None = None,
                arrival_time: float | None = None, priority: int = 0) -> ProcessedRequest:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be PoolingParams, not {type(params).__name__}")
        if task not in self.info.tasks:
            raise ValueError(f"this model ({self.info.config.task} pooler) cannot {task}; "
                             f"it supports {', '.join(self.info.tasks)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        resolved = params.resolved(
            task, normalize=self.info.config.normalize, embed_size=self.info.embed_size,
            matryoshka=list(self.info.matryoshka_dimensions or ()) or None,
            supports_dimensions=self.info.matryoshka, activation=self.info.config.activation)
        text, token_ids, token_types = self._encode(prompt, text_pair, prompt_name,
                                                    resolved.truncate_prompt_tokens)
        self._validate(token_ids)
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        child = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=_POOLING_SLOT,
            arrival_time=arrival,
            priority=priority,
            max_tokens=1,
            pooling_params=resolved,
            token_type_ids=token_types,
        )
        return ProcessedRequest(request_id, text, token_ids, _POOLING_SLOT, [child], arrival,
                                pooling_params=resolved)

    # -- prompt ---------------------------------------------------------------------------
    def _encode(self, prompt: PromptType, text_pair: str | None, prompt_name: str | None,
                truncate: int | None) -> tuple[str | None, list[int], list[int] | None]:
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise ValueError("a dict prompt must have exactly one key, 'prompt' (text) or "
                                 f"'prompt_token_ids'; got keys {sorted(map(str, prompt))}")
        limit = self.max_model_len if truncate == -1 else truncate
        if not isinstance(prompt, str):
            if text_pair is not None:
                raise ValueError("a prompt pair must be two texts")
            if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__"):
                raise ValueError("prompt must be a string, a list of token ids, or a dict with "
                                 f"'prompt' or 'prompt_token_ids'; got {type(prompt).__name__}")
            ids = _as_token_ids(prompt)
            return None, ids[-limit:] if limit else ids, None
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass prompt token ids instead")
        config = self.info.config
        text = config.prompt_text(prompt_name) + prompt
        pair = text_pair
        if config.do_lower_case:
            text, pair = text.lower(), None if pair is None else pair.lower()
        kwargs: dict[str, Any] = {"add_special_tokens": True}
        if limit:
            kwargs.update(truncation=True, max_length=limit)
        encoded = (self.tokenizer(text, **kwargs) if pair is None
                   else self.tokenizer(text, pair, **kwargs))
        ids = list(encoded["input_ids"])
        types = None
        if self.info.uses_token_types and "token_type_ids" in encoded:
            types = list(encoded["token_type_ids"])
            if not any(types):
                types = None
        return prompt, ids, types

    def _validate(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("The input is empty (0 tokens)")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = min(token_ids) if min(token_ids) < 0 else max(token_ids)
            raise ValueError(f"The input contains token id {bad}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if n > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, but "
                f"the input has {n} tokens; shorten it or set truncate_prompt_tokens")
