"""Tokenizer loading and the few cached look-ups the front end makes per step.

Tokenizers come from local directories only (no hub downloads): a model directory with
``tokenizer.json`` / ``tokenizer_config.json`` (or the legacy vocab files) loaded through
``AutoTokenizer`` with ``trust_remote_code=False``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.tokenizer_choice import TokenizerChoices, choices_enabled

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Any of these in a directory means a tokenizer can be built from it.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def load_tokenizer(path: str | os.PathLike, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored in the local directory ``path``.

    Raises ValueError (naming the directory and the files looked for) when ``path`` is not
    a directory or holds no tokenizer files; loading errors are re-raised as ValueError too.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"tokenizer path {str(path)!r} is not a local directory")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer files in {str(directory)!r}: "
            f"expected one of {', '.join(TOKENIZER_FILES)}"
        )
    kwargs = {"revision": revision, "trust_remote_code": False, "local_files_only": True}
    try:
        choices = TokenizerChoices() if choices_enabled() else None
        cls = choices.recorded_class(directory) if choices is not None else None
        if cls is not None:
            return cls.from_pretrained(str(directory), **kwargs)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        if choices is not None:
            choices.record(directory, tokenizer, kwargs)
        return tokenizer
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"could not load the tokenizer in {str(directory)!r}: {exc}") from exc


def get_eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | None, generation_config_eos: int | Sequence[int] | None
) -> tuple[int | None, set[int]]:
    """Return ``(primary eos id, extra stop ids)``.

    The primary id is the tokenizer's ``eos_token_id`` (falling back to the first id of the
    generation config); the extras are the generation config's other EOS ids (e.g. Llama 3's
    ``<|eot_id|>``), which the processor adds to each request's stop token ids.
    """
    if generation_config_eos is None:
        config_ids: list[int] = []
    elif isinstance(generation_config_eos, int):
        config_ids = [generation_config_eos]
    else:
        config_ids = [int(t) for t in generation_config_eos]
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and config_ids:
        primary = config_ids[0]
    return primary, {t for t in config_ids if t != primary}


class TokenDecoder:
    """Decodes single token ids (for logprobs) with a per-id cache.

    Logprob rows name the same few thousand ids over and over; caching their strings makes
    the per-step cost a dict lookup instead of a tokenizer call.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.vocab_len = len(tokenizer)

    def decode_token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if 0 <= token_id < self.vocab_len else ""
            self._cache[token_id] = text
        return text

    def decode_tokens(self, token_ids: Iterable[int]) -> list[str]:
        return [self.decode_token(t) for t in token_ids]
