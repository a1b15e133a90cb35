"""Ernie 4.5 (dense): the Llama decoder with interleaved (GPT-J style) RoPE computed in
float32, and ``use_bias`` on every projection (q / k / v / o and the MLP)."""

from __future__ import annotations

from typing import Any

import torch

from engine.model_executor.layers.rotary import RotaryEmbedding
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    config_head_size,
)
from engine.model_executor.models.phi3 import config_rotary


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderOptions(head_size=config_head_size(hf_config), qkv_bias=bias,
                              o_proj_bias=bias, mlp_bias=bias)

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions
                    ) -> RotaryEmbedding:
        return config_rotary(hf_config, ctx, opts.head_size, interleaved=True,
                             compute_dtype=torch.float32)
