"""Incremental detokenization: token ids in, only the new *stable* text out.

Decoding the whole output every step costs O(length) per token; instead each step decodes
a few recent tokens. Two strategies give identical text:

* Fast path: ``tokenizers.decoders.DecodeStream`` (Rust) for fast tokenizers whose
  ``decode`` adds no Python post-processing (no ``clean_up_tokenization_spaces``).
* Fallback, the classic prefix/read offsets algorithm: ``prefix_offset..read_offset`` is a
  short window of tokens whose text was already emitted; each step decodes
  ``ids[prefix_offset:]`` and emits what extends past ``decode(ids[prefix_offset:read_offset])``.
  The window gives the decoder context (leading-space rules of SentencePiece/Metaspace,
  bytes split across tokens) without decoding the whole text.

Both hold text back while the decoded tail ends in U+FFFD (a multi-byte UTF-8 character
split across tokens); ``flush()`` at the end releases whatever is still pending (as U+FFFD
if it never completed), so the joined deltas equal a full ``tokenizer.decode`` of the output
(for tokenizers whose decoding of a token does not depend on the prompt before it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens given as decoding context: at least this many, at most _MAX_CONTEXT.
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24
_MAX_UTF8_BYTES = 4


def decode_stream_supported(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether DecodeStream reproduces ``tokenizer.decode`` exactly for this tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return (
        bool(getattr(tokenizer, "is_fast", False))
        and backend is not None
        and hasattr(backend, "decode")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas, step by step."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = self._context_suffix(prompt_token_ids)
        # Context tokens followed by every output token; only a short tail is ever decoded.
        self._ids: list[int] = list(context)
        self._num_context = len(context)
        self._read_offset = len(context)  # text of ids[:read_offset] has been emitted
        self._prefix_offset = max(len(context) - _MIN_CONTEXT, 0)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), lazily
        if use_decode_stream is None:
            use_decode_stream = decode_stream_supported(tokenizer)
        elif use_decode_stream and not decode_stream_supported(tokenizer):
            raise ValueError(
                f"DecodeStream cannot reproduce decode() for {type(tokenizer).__name__}"
                " (slow tokenizer or clean_up_tokenization_spaces=True)"
            )
        self._stream: DecodeStream | None = None
        if use_decode_stream:
            self._stream = DecodeStream(list(context), skip_special_tokens=skip_special_tokens)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text that became stable (possibly "")."""
        if not new_token_ids:
            return ""
        new_token_ids = list(new_token_ids)
        self._ids.extend(new_token_ids)
        if self._stream is not None:
            try:
                chunk = self._stream.step(self.tokenizer._tokenizer, new_token_ids)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
                # Non-monotonic decoding (rare byte-fallback cases) breaks DecodeStream's
                # state; the offsets algorithm has none to break, so continue with it.
                logger.debug("DecodeStream failed (%s); using the offsets algorithm", exc)
                self._stream = None
            else:
                if chunk is None:
                    return ""
                self._advance()
                return chunk
        return self._window_step(final=False)

    def flush(self) -> str:
        """Release text still held back (an incomplete character decodes as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        return self._window_step(final=True)

    # -- internals ------------------------------------------------------------------------
    def _window_step(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text) or (not final and full.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = full[len(self._prefix_text) :]
        self._advance()
        return delta

    def _advance(self) -> None:
        """Everything up to the last id is emitted: slide the window forward."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _context_suffix(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """A short prompt tail that decodes cleanly, as context for the first tokens.

        Tokens of a character left incomplete at the end of the prompt are dropped (the
        output's continuation bytes then decode as U+FFFD, as in a full decode of the
        output), and the tail grows from _MIN_CONTEXT tokens until it does not start
        inside a multi-byte character, which would make the decoder's prefix unstable.
        """
        tail = list(prompt_token_ids[-_MAX_CONTEXT:])
        end = len(tail)
        while (
            end > 0
            and len(tail) - end < _MAX_UTF8_BYTES
            and self._decode(tail[:end]).endswith(REPLACEMENT_CHAR)
        ):
            end -= 1
        tail = tail[:end]
        for k in range(min(_MIN_CONTEXT, len(tail)), len(tail) + 1):
            suffix = tail[len(tail) - k :]
            if not self._decode(suffix).startswith(REPLACEMENT_CHAR):
                return suffix
        return tail[-_MIN_CONTEXT:]
