"""Default sampling values from the model's ``generation_config.json`` (vLLM's
``--generation-config auto``).

Model authors ship the sampling settings their model is meant to be used with (e.g.
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). Like vLLM, the engine
uses them for every field a request leaves unset: ``LLM.generate`` without sampling
params and server requests that omit a field. ``max_new_tokens`` caps requests that
set no ``max_tokens``. ``"vllm"`` ignores the file; a directory path reads that
directory's ``generation_config.json`` instead of the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The generation_config.json fields that become sampling defaults (vLLM's list).
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# What a field means when neither the request nor the model sets it (OpenAI / vLLM).
NEUTRAL_VALUES: dict[str, float | int] = {
    "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's sampling defaults (empty: OpenAI's neutral values everywhere)."""

    values: dict[str, float | int] = field(default_factory=dict)
    max_tokens: int | None = None  # generation_config max_new_tokens
    source: str | None = None  # the file they came from

    def value(self, name: str, requested: Any) -> Any:
        """The request's value when it set one, else the model's, else the neutral one."""
        if requested is not None:
            return requested
        return self.values.get(name, NEUTRAL_VALUES[name])

    def describe(self) -> str | None:
        """One log line when the model overrides the neutral defaults, else None."""
        settings = dict(self.values)
        if self.max_tokens is not None:
            settings["max_tokens"] = self.max_tokens
        if not settings:
            return None
        return f"default sampling parameters from {self.source}: {settings}"

    def sampling_params(self):
        """SamplingParams with these defaults (what ``LLM.generate`` uses when given none)."""
        from engine.core.sampling_params import SamplingParams

        extra = {} if self.max_tokens is None else {"max_tokens": self.max_tokens}
        return SamplingParams(**self.values, **extra)


def load_sampling_defaults(model_dir: str, generation_config: str = "auto") -> SamplingDefaults:
    """Defaults for the model in ``model_dir`` under ``--generation-config`` mode
    ``generation_config``: "auto" (the model's file), "vllm" (none) or a directory."""
    from engine.model_executor.model_loader import read_generation_config

    if generation_config == "vllm":
        return SamplingDefaults()
    directory = model_dir if generation_config == "auto" else generation_config
    if generation_config != "auto" and not Path(directory).is_dir():
        raise ValueError(
            f"--generation-config must be 'auto', 'vllm' or a directory, got {generation_config!r}"
        )
    config = read_generation_config(directory)
    if config is None:
        if generation_config != "auto":
            raise ValueError(f"{directory} has no generation_config.json")
        return SamplingDefaults()
    values = {name: getattr(config, name) for name in SAMPLING_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    return SamplingDefaults(values, config.max_new_tokens,
                            str(Path(directory) / "generation_config.json"))
