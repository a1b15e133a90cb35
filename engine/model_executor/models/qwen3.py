"""Qwen3: the Llama decoder with per-head q/k RMSNorm and an explicit ``head_dim``."""

from __future__ import annotations

from typing import Any

from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    config_head_size,
    layer_type_windows,
)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            qkv_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            sliding_windows=layer_type_windows(hf_config),
        )
