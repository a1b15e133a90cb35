"""Prompt + SamplingParams -> validated EngineCoreRequests (the front end's input side).

Runs in the front-end process (so tokenization never stalls the step loop). Bad input
raises ValueError naming the problem before anything reaches the engine core.

Fan-out: a request with ``n > 1`` becomes n independent sequences. Child ``i`` has id
``f"{i}_{request_id}"`` (vLLM's scheme); with ``n == 1`` the single child keeps the
parent's id. Child ``i`` of a seeded request samples with ``seed + i``, so the samples
differ yet stay reproducible; only child 0 computes prompt logprobs (they are the same for
every child).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.frontend.chat_template import render_chat_template
from engine.core.engine_io import EngineCoreRequest
from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import SamplingParams
from engine.lora.request import LoRARequest
from engine.multimodal.prompt import MultiModalPrompt
from engine.structured_output import check_compilable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptType = str | Sequence[int] | Mapping[str, Any]


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


@dataclass
class ProcessedRequest:
    """A validated user request and the core requests (one per sample) it became."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # resolved copy (max_tokens, stop ids, bad word ids); n as given
    child_requests: list[EngineCoreRequest]
    arrival_time: float
    # A pooling request's resolved params (engine.frontend.pooling_processor); None: generate.
    pooling_params: PoolingParams | None = None

    @property
    def child_request_ids(self) -> list[str]:
        return [child.request_id for child in self.child_requests]


class Processor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        eos_token_id: int | None,
        extra_eos_token_ids: set[int] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = set(extra_eos_token_ids or ())
        if vocab_size is None:
            if tokenizer is None:
                raise ValueError("vocab_size is required when there is no tokenizer")
            vocab_size = len(tokenizer)
        self.vocab_size = vocab_size
        # The pooling side (engine.frontend.pooling_processor.PoolingProcessor) of an engine
        # run with runner "pooling"; None: the engine generates.
        self.pooling: Any = None
        self.lora_enabled = False  # requests may name a LoRA adapter (enable_lora)
        # A vision-language model's image / video step
        # (engine.multimodal.prompt.MultiModalInputProcessor); None: text only.
        self.multimodal: Any = None

    # -- public ---------------------------------------------------------------------------
    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate one request; fan ``n > 1`` out into child requests.

        ``add_special_tokens``: add the tokenizer's BOS etc. to text prompts; pass False
        for text rendered by a chat template (the template already has them).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.pooling is not None:
            raise ValueError("this engine runs a pooling model (runner 'pooling'): it cannot "
                             "generate; use embed, classify, score, reward or encode")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError("lora_request must be an engine.LoRARequest, got "
                                 f"{type(lora_request).__name__}")
            if not self.lora_enabled:
                raise ValueError("a lora_request needs an engine started with "
                                 "enable_lora=True (--enable-lora)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, token_ids, mm_features = self._parse_prompt(prompt, add_special_tokens)
        if params.truncate_prompt_tokens is not None:
            if mm_features:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images or "
                                 "videos (their tokens would be cut apart)")
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        self._validate_prompt(token_ids)
        self._validate_params(params)
        resolved = self._resolve_params(params, len(token_ids))
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        children = [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i, resolved.n),
                prompt_token_ids=token_ids,
                sampling_params=self._child_params(resolved, i),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                max_tokens=resolved.max_tokens,
                lora_request=lora_request,
                mm_features=mm_features or None,
            )
            for i in range(resolved.n)
        ]
        return ProcessedRequest(request_id, text, token_ids, resolved, children, arrival)

    def apply_chat_template(
        self,
        messages: Any,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages with the model's (or the given) Jinja chat template."""
        if self.tokenizer is None:
            raise ValueError("chat templates need a tokenizer, and this engine has none")
        return render_chat_template(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )

    # -- prompt ---------------------------------------------------------------------------
    def _parse_prompt(
        self, prompt: PromptType, add_special_tokens: bool
    ) -> tuple[str | None, list[int], list[Any]]:
        """(text, token ids, multimodal features) of a prompt."""
        if isinstance(prompt, MultiModalPrompt):  # processed already (the server does)
            if self.multimodal is None:
                raise ValueError("this model takes text only: it accepts no images or videos")
            return prompt.text, list(prompt.token_ids), list(prompt.features)
        if isinstance(prompt, Mapping):
            keys = set(prompt)
            if "multi_modal_data" in keys:
                return self._parse_multimodal(prompt, add_special_tokens)
            if keys == {"prompt"}:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(
                        f"prompt['prompt'] must be a string, got {type(prompt).__name__}"
                    )
            elif keys == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise ValueError(
                        "prompt['prompt_token_ids'] must be a list of token ids, got a string"
                    )
            else:
                raise ValueError(
                    "a dict prompt must have exactly one key, 'prompt' (text) or "
                    "'prompt_token_ids' (list of ints), plus 'multi_modal_data' for images / "
                    "videos; got keys "
                    f"{sorted(map(str, keys))}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt token ids instead")
            return prompt, list(
                self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            ), []
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _as_token_ids(prompt), []
        raise ValueError(
            "prompt must be a string, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def parse_text_prompt(self, prompt: PromptType, add_special_tokens: bool = True
                          ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt without images (beam search takes no images)."""
        text, token_ids, mm_features = self._parse_prompt(prompt, add_special_tokens)
        if mm_features:
            raise ValueError("beam search does not take images or videos")
        return text, token_ids

    def _parse_multimodal(self, prompt: Mapping[str, Any], add_special_tokens: bool
                          ) -> tuple[str | None, list[int], list[Any]]:
        """vLLM's shape: ``{"prompt" or "prompt_token_ids": ..., "multi_modal_data":
        {"image": ..., "video": ...}}``."""
        keys = set(prompt) - {"multi_modal_data"}
        if keys not in ({"prompt"}, {"prompt_token_ids"}):
            raise ValueError("a prompt with multi_modal_data needs exactly one of 'prompt' "
                             f"or 'prompt_token_ids' beside it; got keys {sorted(map(str, prompt))}")
        if self.multimodal is None:
            raise ValueError("this model takes text only: it accepts no multi_modal_data "
                             "(images or videos)")
        if self.tokenizer is None:
            raise ValueError("multimodal prompts need the model's tokenizer")
        if "prompt" in keys:
            source = prompt["prompt"]
            if not isinstance(source, str):
                raise ValueError(f"prompt['prompt'] must be a string, got {type(source).__name__}")
        else:
            source = prompt["prompt_token_ids"]
            if isinstance(source, str) or not isinstance(source, (list, tuple, np.ndarray)):
                raise ValueError("prompt['prompt_token_ids'] must be a list of token ids")
            source = _as_token_ids(source)
        mm = self.multimodal.process(source, prompt["multi_modal_data"], add_special_tokens)
        return mm.text, mm.token_ids, mm.features

    def _validate_prompt(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("The prompt is empty (0 tokens)")
        lo, hi = min(token_ids), max(token_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"The prompt contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt ({n} tokens) is longer than the maximum model length of "
                f"{self.max_model_len} allows (at most {self.max_model_len - 1} prompt tokens, "
                "leaving room to generate one)"
            )

    # -- sampling params ------------------------------------------------------------------
    def _validate_params(self, params: SamplingParams) -> None:
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ValueError(
                "stop strings and bad_words need a tokenizer, and this engine has none"
            )
        for name in ("stop_token_ids", "allowed_token_ids"):
            self._check_ids_in_vocab(name, getattr(params, name) or ())
        self._check_ids_in_vocab("logit_bias", (params.logit_bias or {}).keys())
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name}={value} exceeds the vocabulary size {self.vocab_size}")
        if params.structured_outputs is not None:
            # Tokenizer-free backend check: a schema, regex or grammar no backend can
            # compile fails here, before it reaches the engine core.
            check_compilable(params.structured_outputs)

    def _check_ids_in_vocab(self, name: str, ids: Any) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{name} contains token id(s) {bad[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A copy with max_tokens resolved, model EOS ids merged and bad words tokenized."""
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        changes: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": min(params.min_tokens, max_tokens),
        }
        extra_eos = self.extra_eos_token_ids - {self.eos_token_id}
        if extra_eos and not params.ignore_eos:
            changes["stop_token_ids"] = sorted(extra_eos | set(params.stop_token_ids or ()))
        if params.bad_words:
            changes["bad_words_token_ids"] = self._bad_words_token_ids(params.bad_words)
        return params.clone(**changes)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word as tokens at the start of text and after a space (vLLM's rule).

        The spaced variant is kept only when it is a different token sequence of the same
        length (i.e. a distinct "word" token), as vLLM does.
        """
        assert self.tokenizer is not None
        result: list[list[int]] = []
        for word in bad_words:
            if not word.strip():
                raise ValueError(f"bad_words must not contain empty words, got {word!r}")
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            result.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        self._check_ids_in_vocab("bad_words", [t for ids in result for t in ids])
        return result

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        return params.clone(
            n=1,
            seed=None if params.seed is None else params.seed + index,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        )


def _as_token_ids(values: Sequence[Any]) -> list[int]:
    ids = []
    for i, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"prompt token ids must be integers; item {i} is {value!r}")
        ids.append(int(value))
    return ids
