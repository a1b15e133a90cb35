"""Qwen3: the Llama decoder with per-head q/k RMSNorm and an explicit ``head_dim``."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    layer_type_windows,
)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        """Llama's switches, plus q/k norm and the per-layer sliding windows."""
        return dataclasses.replace(
            super().decoder_options(hf_config),
            qk_norm=True,
            sliding_windows=layer_type_windows(hf_config),
        )
