"""Serving-benchmark prompts: the reference token-id draw, as ids or as chat text.

Completions send the reference workload's ids as they are (``prompt: [ids]``), so the
server sees exactly the prompts the offline benchmarks measure. Chat needs text: the ids
are decoded with a local tokenizer when one is given, otherwise each id picks a word of a
fixed list built here (no download); the server's usage then reports the real length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.benchmarks.workload import Workload, vocab_high_for

# Every real vocabulary has at least this many ids, so prompts drawn below it are valid
# for any model when nothing tells us the actual size.
DEFAULT_VOCAB_HIGH = 1000
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def word_list() -> list[str]:
    """Deterministic pronounceable two-syllable words (4900 of them)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    return [a + b for a in syllables for b in syllables]


def ids_to_words(ids: list[int]) -> str:
    words = word_list()
    return " ".join(words[i % len(words)] for i in ids)


def load_vocab_high(tokenizer_path: str | Path) -> int:
    """The id bound for a local model/tokenizer directory (the smaller of the tokenizer's
    size and the model config's vocab_size, capped at the reference bound)."""
    from engine.core.tokenizer import load_tokenizer
    from engine.model_executor.model_loader import load_hf_config

    size = len(load_tokenizer(tokenizer_path))
    if (Path(tokenizer_path) / "config.json").is_file():
        size = min(size, int(load_hf_config(tokenizer_path).vocab_size))
    return vocab_high_for(size)


@dataclass(frozen=True)
class PromptSpec:
    """What every request of a run asks for."""

    endpoint: str  # a key of ENDPOINTS
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool = True
    seed: int = 0
    vocab_high: int = DEFAULT_VOCAB_HIGH
    temperature: float = 0.0  # 0: greedy; above it every request samples (unseeded)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def workload(self) -> Workload:
        return Workload(num_prompts=self.num_prompts, input_len=self.input_len,
                        output_len=self.output_len, ignore_eos=self.ignore_eos,
                        seed=self.seed, vocab_high=self.vocab_high)


def build_payloads(spec: PromptSpec, model: str, tokenizer_path: str | Path | None = None
                   ) -> list[dict[str, Any]]:
    """One streamed request body per prompt (greedy unless ``spec.temperature``), usage
    included at the end."""
    ids = spec.workload().prompt_token_ids()
    common = {
        "model": model, "max_tokens": spec.output_len, "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.endpoint == "completions":
        return [{**common, "prompt": prompt} for prompt in ids]
    if tokenizer_path is not None:
        from engine.core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
        texts = [tokenizer.decode(prompt) for prompt in ids]
    else:
        texts = [ids_to_words(prompt) for prompt in ids]
    return [{**common, "messages": [{"role": "user", "content": text}]} for text in texts]
