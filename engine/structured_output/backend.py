"""The backend interface: compile a constraint for a tokenizer into per-request matchers.

A backend is built once per engine for the model's tokenizer and logits width
(``vocab_size``, which may exceed ``len(tokenizer)``: the padding ids are never
allowed). Its :meth:`StructuredOutputBackend.compile` turns one
:class:`StructuredOutputsParams` into a :class:`Grammar`, the request's own matcher.

Bitmask layout (the one xgrammar, llguidance and the sampler share): int32
``[rows, ceil(V / 32)]``; token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32``
is set. A row of all ``-1`` allows everything.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


class Grammar(ABC):
    """A request's matcher: where its output stands in the grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False (state undefined) if one is not allowed."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar allows (state unchanged)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the output is complete: nothing but a stop token may follow, or a
        stop token was accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar (no tokens accepted)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer; fills many matchers' bitmasks at once."""

    name: ClassVar[str]

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.num_threads = num_threads

    @classmethod
    @abstractmethod
    def check(cls, params: StructuredOutputsParams, lenient: bool = False) -> None:
        """Raise ValueError if this backend cannot compile ``params`` (no tokenizer needed,
        so the front end can reject bad requests before they reach the engine core).

        ``lenient``: best effort, ignoring JSON Schema keywords the backend cannot enforce
        (e.g. ``uniqueItems``) and references to other documents, instead of refusing."""

    @classmethod
    @abstractmethod
    def check_regex(cls, regex: str) -> None:
        """Raise ValueError if this backend's regex parser rejects ``regex``."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams, lenient: bool = False) -> Grammar:
        """A fresh matcher for ``params``; ValueError naming the problem if it cannot
        (``lenient`` as in :meth:`check`)."""

    def build(self, params: StructuredOutputsParams, lenient: bool = False) -> Any:
        """What :meth:`compile` makes once per constraint and its matchers share (the
        manager caches it by the normalized constraint); ValueError as in :meth:`compile`."""
        return params, lenient

    def instantiate(self, artifact: Any) -> Grammar:
        """A fresh matcher from :meth:`build`'s result."""
        params, lenient = artifact
        return self.compile(params, lenient)

    def fill_bitmasks(
        self, grammars: Sequence[Grammar], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``grammars[i]``; backends override this with one
        parallel native call."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Make ``bitmask[row]`` allow exactly ``token_ids``."""
    import torch

    words = [0] * bitmask.shape[1]
    for t in token_ids:
        if 0 <= t < 32 * len(words):
            words[t >> 5] |= 1 << (t & 31)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    bitmask[row] = torch.tensor(signed, dtype=torch.int32)


def describe_error(exc: BaseException) -> str:
    """One readable line from a native library's exception (drops the C++ source prefix
    such as ``[10:50:33] /project/cpp/regex_converter.cc:94:``)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return _NATIVE_PREFIX.sub("", lines[0])[:500]


_NATIVE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
