"""The torch reference kernel: every canonical encoding, in plain torch ops, on any
device.

It keeps the weights quantized (codes, scales, zero points as the layer's buffers) and
dequantizes them for each call, then quantize-dequantizes the activations as the scheme
says (:mod:`engine.quantization.numerics`) and runs ``F.linear``: the fallback of a
platform without a kernel for a scheme, and the second opinion the native kernels are
tested against. Slow (a full dequantization per call), never wrong by design.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.interfaces import QuantizedGemmKernel, QuantizedLayerSpec, QuantizedWeights
from engine.quantization.numerics import e2m1_decode, quantize_dequantize

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dequantize(weights: QuantizedWeights) -> torch.Tensor:
    """float32 ``[N, K]`` of canonical weights (``g_idx`` applied)."""
    spec = weights.spec
    values = e2m1_decode(weights.codes) if spec.encoding == "nvfp4" else weights.codes.float()
    groups = (weights.g_idx if weights.g_idx is not None
              else torch.arange(spec.in_features, device=values.device) // spec.group_size)
    if spec.encoding == "int":
        zeros = weights.zeros
        values = values - (zeros.float()[:, groups] if zeros is not None
                           else float(1 << (spec.weight_bits - 1)))
    weight = values * weights.scales.float()[:, groups]
    if spec.encoding == "nvfp4":  # the canonical NVFP4 weight is rounded to bf16
        weight = weight.bfloat16().float()
    return weight


def quantized_input(spec: QuantizedLayerSpec, x: torch.Tensor, input_scales,
                    shard: int) -> torch.Tensor:
    """x as the GEMM of output shard ``shard`` sees it: quantize-dequantized per the
    scheme (with that shard's static or global scale), else x itself."""
    act = spec.activation
    if act is None:
        return x
    scale = input_scales[shard] if input_scales is not None else None
    if act.encoding == "nvfp4":
        return quantize_dequantize(x, act, global_scale=scale)
    return quantize_dequantize(x, act, static_scale=None if act.dynamic else scale)


class TorchQuantizedGemm(QuantizedGemmKernel):
    """Dequantize, then ``F.linear`` (see the module docstring)."""

    name: ClassVar[str] = "torch_reference"

    @classmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.act_dtype not in FLOAT_DTYPES:
            return f"activations in {spec.act_dtype}"
        return None

    def prepare(self, layer: nn.Module, weights: QuantizedWeights) -> None:
        layer.quant_spec = weights.spec
        layer.quant_shards = weights.shard_sizes
        for name in ("codes", "scales", "zeros", "g_idx", "input_scales"):
            value = getattr(weights, name)
            layer.register_buffer(f"q_{name}", value, persistent=False)

    def _weights(self, layer: nn.Module) -> QuantizedWeights:
        return QuantizedWeights(layer.quant_spec, layer.q_codes, layer.q_scales, layer.q_zeros,
                                layer.q_g_idx, layer.q_input_scales, layer.quant_shards)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        spec = layer.quant_spec
        weight = dequantize(self._weights(layer))
        rows = x.reshape(-1, x.shape[-1]).float()
        shards = layer.quant_shards
        if spec.activation is None or len(shards) == 1 or spec.activation.dynamic and (
                spec.activation.encoding != "nvfp4"):
            # one quantized input for every shard (dynamic scales come from x alone)
            out = F.linear(quantized_input(spec, rows, layer.q_input_scales, 0), weight)
        else:
            parts, start = [], 0
            for s, size in enumerate(shards):
                xq = quantized_input(spec, rows, layer.q_input_scales, s)
                parts.append(F.linear(xq, weight[start:start + size]))
                start += size
            out = torch.cat(parts, dim=-1)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], spec.out_features)
