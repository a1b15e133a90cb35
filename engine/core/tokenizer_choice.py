"""Which tokenizer class ``AutoTokenizer`` picks for a directory, remembered.

Why: ``AutoTokenizer.from_pretrained`` loads the model's config to choose the class, and in
transformers 5 a config class costs ~1 s of imports (see
engine.model_executor.hf_config_snapshot). The choice depends only on the directory's
tokenizer and config files, so the first load records it under a key of those files'
bytes and the transformers version; later loads build the recorded class directly.

A choice is recorded only after the class, loaded directly, gave the same tokenizer as
``AutoTokenizer`` did (class, backend state, vocabulary, special and added tokens, chat
template, init arguments, and the ids of a probe text): a class whose loading depends on
more than its files is never taken this way.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.core.cache_paths import cache_dirs, entry_key, read_entries, write_entry

logger = logging.getLogger(__name__)

FORMAT = 1
CHOICE_ENV = "ENGINE_TOKENIZER_CHOICES"  # "0": always AutoTokenizer
# The files AutoTokenizer reads to choose and build a tokenizer from a local directory
# (which of them exist decides between classes too: fast or sentencepiece, say).
_KEY_FILES = (
    "config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
_PROBE = "Hello world! 123 <s> über 日本語 \n\t  end"


def choices_enabled() -> bool:
    return os.environ.get(CHOICE_ENV, "1") != "0"


def choice_key(directory: Path) -> str:
    """The key of ``directory``'s tokenizer files (names, whether present, bytes)."""
    def chunks() -> Iterator[bytes]:
        for name in _KEY_FILES:
            file = directory / name
            yield f"\0{name}\0".encode()
            if file.is_file():
                yield file.read_bytes()

    return entry_key(chunks(), FORMAT)


def _fingerprint(tokenizer: Any) -> Any:
    """What two tokenizers of the same files must share to be taken for the same."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    init = {k: repr(v) for k, v in getattr(tokenizer, "init_kwargs", {}).items()}
    return (
        type(tokenizer),
        backend.to_str() if backend is not None else None,
        tokenizer.get_vocab(),
        repr(getattr(tokenizer, "added_tokens_decoder", None)),
        repr(tokenizer.special_tokens_map),
        getattr(tokenizer, "chat_template", None),
        init,
        getattr(tokenizer, "model_max_length", None),
        getattr(tokenizer, "padding_side", None),
        tokenizer.encode(_PROBE),
        tokenizer.encode(_PROBE, add_special_tokens=False),
    )


class TokenizerChoices:
    """The recorded choices of one cache directory list."""

    def __init__(self, directories: list[Path] | None = None) -> None:
        self.directories = directories if directories is not None else cache_dirs("tokenizers")
        self._keys: dict[Path, str] = {}  # one load looks up, then records: hash once

    def _key(self, directory: Path) -> str:
        if directory not in self._keys:
            self._keys[directory] = choice_key(directory)
        return self._keys[directory]

    def recorded_class(self, directory: Path) -> type | None:
        """The class recorded for ``directory``'s files, or None."""
        for text in read_entries(self.directories, f"{self._key(directory)}.json"):
            try:
                record = json.loads(text)
                if record.get("format") != FORMAT:
                    continue
                module = importlib.import_module(record["module"])
                return getattr(module, record["qualname"])
            except (json.JSONDecodeError, KeyError, ImportError, AttributeError):
                continue
        return None

    def record(self, directory: Path, chosen: Any, load_kwargs: dict[str, Any]) -> bool:
        """Record the class of ``chosen`` (AutoTokenizer's tokenizer for ``directory``) when
        loading that class directly gives the same tokenizer."""
        cls = type(chosen)
        try:
            direct = cls.from_pretrained(str(directory), **load_kwargs)
            if _fingerprint(direct) != _fingerprint(chosen):
                logger.debug("tokenizer of %s: %s loaded directly differs from AutoTokenizer's",
                             directory, cls.__name__)
                return False
            text = json.dumps({"format": FORMAT, "module": cls.__module__,
                               "qualname": cls.__qualname__})
            key = self._key(directory)
        except Exception as exc:  # noqa: BLE001 (any refusal: just no shortcut next time)
            logger.debug("tokenizer of %s: no recorded choice (%s)", directory, exc)
            return False
        return write_entry(self.directories, f"{key}.json", text) is not None
