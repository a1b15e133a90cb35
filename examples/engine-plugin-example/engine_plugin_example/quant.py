"""The "example_int8" checkpoint format: weight-only, per-output-channel, symmetric int8.

A checkpoint's ``config.json`` says ``"quantization_config": {"quant_method":
"example_int8"}`` (optionally ``"ignore": [module name substrings]`` for layers kept in
float). Each quantized linear ``[N, K]`` stores::

    <module>.weight        int8    [N, K]
    <module>.weight_scale  float32 [N, 1]    weight = int8 * scale

The format only describes tensors. After loading, :meth:`ExampleInt8LinearMethod.decode`
turns them into the engine's canonical ``int`` encoding (8-bit unsigned codes = int8 +
128, zero point the midpoint 128, one scale per row) and the platform's quantized-GEMM
kernels (e.g. the CPU plugin's) do the multiplication. Fused layers (q/k/v, gate/up)
load each shard's rows where the layer puts them: both tensors index output features
along dim 0.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.interfaces import QuantizedLayerSpec, QuantizedWeights, QuantMethod
from engine.model_executor.layers.linear import DENSE_WEIGHT, ParamLayout
from engine.quantization.base import QuantizedLinearMethod, add_param

PER_ROW = ParamLayout(output_dim=0, input_dim=None)  # [N, 1]


class ExampleInt8LinearMethod(QuantizedLinearMethod):
    scheme = "example_int8"
    scale_params = ("weight_scale",)  # finite and positive, checked before decoding

    def create_weights(self, layer, in_features, out_features, params_dtype):
        add_param(layer, "weight", (out_features, in_features), torch.int8, DENSE_WEIGHT)
        add_param(layer, "weight_scale", (out_features, 1), torch.float32, PER_ROW)

    def decode(self, layer) -> QuantizedWeights:
        spec = QuantizedLayerSpec(
            scheme=self.scheme, encoding="int", weight_bits=8, group_size=layer.in_features,
            in_features=layer.in_features, out_features=layer.out_features,
            act_dtype=layer.params_dtype, has_zero_points=False, activation=None)
        codes = (layer.weight.detach().to(torch.int16) + 128).to(torch.uint8)
        scales = layer.weight_scale.detach().float().reshape(layer.out_features, 1).clone()
        return QuantizedWeights(spec, codes, scales, None, None, None,
                                tuple(layer.shard_sizes.values()))


class ExampleInt8Config(QuantMethod):
    name = "example_int8"

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = ignore
        self._method = ExampleInt8LinearMethod()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "ExampleInt8Config":
        bits = quant_config.get("bits", 8)
        if bits != 8:
            raise ValueError(f"example_int8: {bits}-bit weights are not supported (8 are)")
        return cls(tuple(quant_config.get("ignore") or ()))

    def linear_method(self, prefixes: tuple[str, ...]):
        skipped = [p for p in prefixes if p == "lm_head" or any(s in p for s in self.ignore)]
        if skipped and len(skipped) != len(prefixes):
            raise ValueError(f"example_int8: the fused modules {list(prefixes)} are partly "
                             "quantized")
        return None if skipped else self._method

    def describe(self) -> str:
        return "example_int8 (weight-only int8, per-channel scales)"


def quantize_linear(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [N, K], float32 [N, 1])`` for a float ``[N, K]`` (what a converter writes)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale
