"""One request's sparse sampling rules, validated and turned into numpy arrays once.

Whitelists, logit biases and bad words are short per request but vary in length, so
they are stored per request here and concatenated for a batch only when the batch's
membership changes (see ``SamplingState.build_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.sampling_params import SamplingParams


@dataclass
class RequestRules:
    """Sparse per-request rules; each field is None when the request has none."""

    allowed_token_ids: np.ndarray | None = None  # int64 [A]
    bias_token_ids: np.ndarray | None = None  # int64 [B]
    bias_values: np.ndarray | None = None  # float32 [B]
    bad_single: np.ndarray | None = None  # int64: one-token bad words, banned always
    # Multi-token bad words: (all tokens but the last, the last token).
    bad_multi: list[tuple[np.ndarray, int]] | None = None

    @property
    def max_bad_prefix(self) -> int:
        return max((len(p) for p, _ in self.bad_multi), default=0) if self.bad_multi else 0

    @property
    def is_empty(self) -> bool:
        return (
            self.allowed_token_ids is None
            and self.bias_token_ids is None
            and self.bad_single is None
            and self.bad_multi is None
        )


def parse_rules(params: SamplingParams, vocab_size: int) -> RequestRules | None:
    """The request's rules, or None when it has none. Out-of-vocab ids raise ValueError."""
    rules = RequestRules()
    if params.allowed_token_ids:
        rules.allowed_token_ids = _ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
    if params.logit_bias:
        rules.bias_token_ids = _ids(list(params.logit_bias), vocab_size, "logit_bias")
        rules.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        if not np.isfinite(rules.bias_values).all():
            raise ValueError(f"logit_bias values must be finite, got {params.logit_bias}")
    _parse_bad_words(params, vocab_size, rules)
    return None if rules.is_empty else rules


def _parse_bad_words(params: SamplingParams, vocab_size: int, rules: RequestRules) -> None:
    words = params.bad_words_token_ids
    if words is None:
        if params.bad_words:
            raise ValueError(
                "bad_words were given but bad_words_token_ids is unset: the processor must "
                "tokenize bad_words before the request reaches the sampler"
            )
        return
    single: list[int] = []
    multi: list[tuple[np.ndarray, int]] = []
    for word in words:
        ids = _ids(list(word), vocab_size, "bad_words_token_ids")
        if len(ids) == 0:
            raise ValueError("bad_words_token_ids must not contain an empty token list")
        if len(ids) == 1:
            single.append(int(ids[0]))
        else:
            multi.append((ids[:-1].copy(), int(ids[-1])))
    if single:
        rules.bad_single = np.unique(np.asarray(single, dtype=np.int64))
    if multi:
        rules.bad_multi = multi


def _ids(values: list[int], vocab_size: int, name: str) -> np.ndarray:
    ids = np.asarray(values, dtype=np.int64).reshape(-1)
    check_token_ids(ids, vocab_size, name)
    return ids


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise ValueError naming ``name`` when any id is outside ``[0, vocab_size)``."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise ValueError(f"{name} has token ids outside [0, {vocab_size}): {bad}")
