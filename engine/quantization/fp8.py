"""FP8 (e4m3) weights: checkpoints with ``quant_method: fp8`` (vLLM's format, DeepSeek-V3
and Qwen FP8 releases) and ``--quantization fp8`` of an unquantized checkpoint.

Checkpoint tensors of a linear ``[N, K]``: ``weight`` fp8; ``weight_scale [1]`` per
tensor, or with ``weight_block_size [128, 128]`` ``weight_scale_inv [N / 128, K / 128]``
per block (the dequantization factor despite its name); ``input_scale [1]`` with
``activation_scheme: static``. Activations are fp8 too: per tensor (static, or dynamic
from each input), per token group of 128 for block checkpoints.

Online quantization (``--quantization fp8`` of a bf16 / fp16 / fp32 checkpoint) loads
the dense weights, then quantizes each output row to e4m3 with its own scale
(``max |w| / 448``); activations are quantized per token, dynamically.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.interfaces import ActivationQuant, QuantizedLayerSpec, QuantizedWeights, QuantMethod
from engine.model_executor.layers.linear import DENSE_WEIGHT, ParamLayout
from engine.quantization.base import (
    QuantizedLinearMethod,
    add_param,
    check_whole_blocks,
    expand_rows,
    num_shards,
)
from engine.quantization.numerics import FP8_MAX

PER_SHARD = ParamLayout(output_dim=None, input_dim=None, per_shard=True)


def _spec(layer, group: int, activation: ActivationQuant, scheme: str) -> QuantizedLayerSpec:
    return QuantizedLayerSpec(
        scheme=scheme, encoding="fp8", weight_bits=8, group_size=group,
        in_features=layer.in_features, out_features=layer.out_features,
        act_dtype=layer.params_dtype, activation=activation)


class Fp8CheckpointMethod(QuantizedLinearMethod):
    """A layer of an FP8 checkpoint."""

    scale_params = ("weight_scale", "weight_scale_inv", "input_scale")

    def __init__(self, config: "Fp8Config") -> None:
        self.config = config
        self.scheme = "fp8"

    def create_weights(self, layer, in_features, out_features, params_dtype):
        block = self.config.block
        add_param(layer, "weight", (out_features, in_features), torch.float8_e4m3fn, DENSE_WEIGHT)
        if block is None:
            add_param(layer, "weight_scale", (num_shards(layer),), torch.float32, PER_SHARD)
        else:
            rows, cols = block
            check_whole_blocks(layer, "fp8", rows, cols, in_features)
            add_param(layer, "weight_scale_inv", (-(-out_features // rows), -(-in_features // cols)),
                      torch.float32, ParamLayout(0, 1, packed_dim=0, packed_factor=rows))
        if self.config.static:
            add_param(layer, "input_scale", (num_shards(layer),), torch.float32, PER_SHARD)

    def decode(self, layer):
        shards = tuple(layer.shard_sizes.values())
        block = self.config.block
        if block is None:
            scales, group = expand_rows(layer.weight_scale.detach(), shards), layer.in_features
            activation = ActivationQuant("fp8", "tensor", not self.config.static)
        else:
            rows, group = block
            if layer.in_features % group:
                raise ValueError(f"fp8: {layer.in_features} input features are not whole "
                                 f"blocks of {group}")
            scales = layer.weight_scale_inv.detach().float().repeat_interleave(rows, dim=0)
            scales = scales[: layer.out_features].contiguous()
            activation = ActivationQuant("fp8", "group", True, group)
        input_scales = layer.input_scale.detach().float().clone() if self.config.static else None
        return QuantizedWeights(_spec(layer, group, activation, "fp8"), layer.weight.detach().clone(),
                                scales.clone(), None, None, input_scales, shards)


class Fp8OnlineMethod(QuantizedLinearMethod):
    """A dense layer quantized to FP8 as it loads (``--quantization fp8``)."""

    scheme = "fp8 (online)"

    def create_weights(self, layer, in_features, out_features, params_dtype):
        add_param(layer, "weight", (out_features, in_features), layer.weight_dtype, DENSE_WEIGHT)

    def decode(self, layer):
        weight = layer.weight.detach().float()
        scales = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        codes = (weight / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        activation = ActivationQuant("fp8", "token", True)
        return QuantizedWeights(_spec(layer, layer.in_features, activation, self.scheme), codes,
                                scales, None, None, None, tuple(layer.shard_sizes.values()))


class Fp8Config(QuantMethod):
    name = "fp8"

    def __init__(self, serialized: bool, static: bool = False,
                 block: tuple[int, int] | None = None, ignored: tuple[str, ...] = ()) -> None:
        if static and block is not None:
            raise ValueError("fp8: static activation scales with block weights are not supported")
        self.serialized, self.static, self.block, self.ignored = serialized, static, block, ignored
        self._method = Fp8CheckpointMethod(self) if serialized else Fp8OnlineMethod()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "Fp8Config":
        scheme = quant_config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} (dynamic or static)")
        fmt = quant_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8: {fmt!r} weights are not supported (e4m3 are)")
        block = quant_config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"fp8: weight_block_size {block} is not [rows, cols]")
        ignored = tuple(quant_config.get("ignored_layers") or
                        quant_config.get("modules_to_not_convert") or ())
        return cls(True, scheme == "static", tuple(block) if block else None, ignored)

    @classmethod
    def online(cls) -> "Fp8Config":
        """``--quantization fp8`` of an unquantized checkpoint."""
        return cls(serialized=False)

    def linear_method(self, prefixes: tuple[str, ...]):
        skipped = [p for p in prefixes if p == "lm_head" or any(part in p for part in self.ignored)]
        if skipped and len(skipped) != len(prefixes):
            raise ValueError(f"fp8: the fused modules {list(prefixes)} are partly quantized")
        return None if skipped else self._method

    def describe(self) -> str:
        if not self.serialized:
            return "fp8 (online: per-channel weights, per-token activations)"
        return "fp8 " + (f"{self.block[0]}x{self.block[1]} blocks" if self.block else
                         ("static" if self.static else "dynamic") + " per-tensor")
