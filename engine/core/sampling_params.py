"""Sampling parameters of one request, validated on construction.

Field names and meanings follow vLLM's ``SamplingParams`` (and the OpenAI API where
they overlap), so code written for either works here. Every bad value raises a
``ValueError`` that names the field and the value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per sampled token (-1: whole vocab)
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    extra_args: dict[str, Any] | None = None
    # Constrain the output to a JSON schema / regex / choice / grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the processor from the tokenizer; not user input.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    # -- validation -----------------------------------------------------------------------
    def _validate(self) -> None:
        _check_int(self, "n", minimum=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, value, "must be in [-2, 2]")
        if _check_float(self, "repetition_penalty") <= 0.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0")
        if _check_float(self, "temperature") < 0.0:
            _fail("temperature", self.temperature, "must be >= 0")
        top_p = _check_float(self, "top_p")
        if not 0.0 < top_p <= 1.0:
            _fail("top_p", top_p, "must be in (0, 1]")
        _check_int(self, "top_k", minimum=0)
        min_p = _check_float(self, "min_p")
        if not 0.0 <= min_p <= 1.0:
            _fail("min_p", min_p, "must be in [0, 1]")
        if self.seed is not None:
            _check_int(self, "seed")
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", minimum=1)
        _check_int(self, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=-1)
        if self.truncate_prompt_tokens is not None:
            _check_int(self, "truncate_prompt_tokens", minimum=1)
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                _fail("stop", self.stop, "must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                _fail("stop", self.stop, "must not contain empty strings")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not _is_int_list(ids):
                _fail(name, ids, "must be a list of non-negative token ids")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            _fail("allowed_token_ids", self.allowed_token_ids, "must not be empty")
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            _fail("bad_words", self.bad_words, "must be a list of strings")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a boolean")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            _fail("structured_outputs", self.structured_outputs,
                  "must be a StructuredOutputsParams (or a dict of its fields)")

    # -- derived --------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


def _init_rejecting_unknown(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    unknown = sorted(set(kwargs) - _FIELD_NAMES)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_rejecting_unknown  # type: ignore[method-assign]


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"invalid sampling parameter {name}={value!r}: {why}")


def _check_int(params: SamplingParams, name: str, minimum: int | None = None) -> int:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")
    if minimum is not None and value < minimum:
        _fail(name, value, f"must be >= {minimum}")
    return value


def _check_float(params: SamplingParams, name: str) -> float:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, "must be a number")
    if value != value:  # NaN
        _fail(name, value, "must not be NaN")
    setattr(params, name, float(value))
    return float(value)


def _is_int_list(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )
