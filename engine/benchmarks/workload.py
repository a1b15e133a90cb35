"""The reference benchmark workload: fixed random token-id prompts, greedy, EOS ignored.

Prompts are drawn exactly as the reference measurements drew them: one
``random.Random(seed)`` and ``randrange(10, high)`` for every token, row-major
(prompt 0's tokens first), so every engine measured on it sees the same ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

REFERENCE_VOCAB_HIGH = 16000  # the reference models' vocabulary
# "--structured-output json": every request constrained to a JSON array of 64 integers,
# long enough that requests still run to the output length, so the batch stays full and
# the throughput difference is the cost of the grammar (bitmask fill, apply, accept).
JSON_WORKLOAD_SCHEMA = {
    "type": "array", "items": {"type": "integer"}, "minItems": 64, "maxItems": 64,
}
LOWEST_TOKEN_ID = 10  # keeps clear of special tokens


@dataclass(frozen=True)
class Workload:
    """``num_prompts`` prompts of ``input_len`` ids, each generating ``output_len`` tokens."""

    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    ignore_eos: bool = True
    seed: int = 0
    vocab_high: int = REFERENCE_VOCAB_HIGH  # exclusive upper bound of the drawn ids
    structured_output: str | None = None  # None or "json" (JSON_WORKLOAD_SCHEMA)
    # A text prompt every request uses instead of random ids (``input_len`` is then
    # whatever it tokenizes to): speculative decoding needs text a proposer can predict.
    prompt: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_high <= LOWEST_TOKEN_ID:
            raise ValueError(
                f"vocab_high ({self.vocab_high}) must exceed the lowest drawn id {LOWEST_TOKEN_ID}"
            )

    def prompt_token_ids(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(LOWEST_TOKEN_ID, self.vocab_high) for _ in range(self.input_len)]
            for _ in range(self.num_prompts)
        ]

    def prompts(self) -> list[dict[str, Any]]:
        """Offline-API prompts: ``{"prompt_token_ids": ids}`` each (``{"prompt": text}``
        for a text workload)."""
        if self.prompt is not None:
            return [{"prompt": self.prompt} for _ in range(self.num_prompts)]
        return [{"prompt_token_ids": ids} for ids in self.prompt_token_ids()]

    def sampling_params(self):
        from engine.core.sampling_params import SamplingParams

        structured = None
        if self.structured_output == "json":
            structured = {"json": JSON_WORKLOAD_SCHEMA, "disable_any_whitespace": True}
        elif self.structured_output is not None:
            raise ValueError(f"unknown structured_output {self.structured_output!r} (json)")
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.output_len,
            ignore_eos=self.ignore_eos,
            structured_outputs=structured,
        )

    @property
    def expected_output_tokens(self) -> int:
        return self.num_prompts * self.output_len


def vocab_high_for(vocab_size: int) -> int:
    """The reference bound, lowered for models whose vocabulary is smaller."""
    return min(REFERENCE_VOCAB_HIGH, vocab_size)
