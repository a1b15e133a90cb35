"""AWQ checkpoints in the GEMM layout (AutoAWQ / GPTQModel, ``quant_method: awq``).

Tensors of a linear ``[N, K]``, int4 codes eight to an int32:

- ``qweight`` int32 ``[K, N / 8]``: eight output columns of one input feature, in the
  interleaved order AWQ's kernels unpack: bits ``4 i`` hold column ``[0, 2, 4, 6, 1, 3,
  5, 7][i]`` of the eight;
- ``qzeros`` int32 ``[K / group, N / 8]``, packed the same way; ``scales [K / group, N]``.

Weight = (code - zero) * scale. AWQ folds its smoothing scales into the preceding
RMSNorm weights, which therefore always load from the quantized checkpoint (they do: a
model loads every tensor from its own directory).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.interfaces import QuantizedLayerSpec, QuantizedWeights, QuantMethod
from engine.model_executor.layers.linear import ParamLayout
from engine.quantization.base import QuantizedLinearMethod, add_param, unpack_codes, whole_group

# AWQ_PACK_ORDER: bits 4 i of a word hold column ORDER[i]; column c sits at position INVERSE[c]
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INVERSE = tuple(ORDER.index(c) for c in range(8))


class AWQLinearMethod(QuantizedLinearMethod):
    scale_params = ("scales",)

    def __init__(self, config: "AWQConfig") -> None:
        self.config = config
        self.scheme = "awq"

    def _group(self, in_features: int) -> int:
        return whole_group("awq", self.config.group_size, in_features)

    def create_weights(self, layer, in_features, out_features, params_dtype):
        if out_features % 8:
            raise ValueError(f"awq: {out_features} output features do not fill int32 words")
        groups = in_features // self._group(in_features)
        add_param(layer, "qweight", (in_features, out_features // 8), torch.int32,
                  ParamLayout(1, 0, packed_dim=1, packed_factor=8))
        add_param(layer, "qzeros", (groups, out_features // 8), torch.int32,
                  ParamLayout(1, 0, packed_dim=1, packed_factor=8))
        add_param(layer, "scales", (groups, out_features), torch.float32, ParamLayout(1, 0))

    def decode(self, layer):
        codes = unpack_codes(layer.qweight, 4, dim=1, order=INVERSE).t().contiguous()
        zeros = unpack_codes(layer.qzeros, 4, dim=1, order=INVERSE).t().float().contiguous()
        group = self._group(layer.in_features)
        spec = QuantizedLayerSpec(
            scheme="awq", encoding="int", weight_bits=4, group_size=group,
            in_features=layer.in_features, out_features=layer.out_features,
            act_dtype=layer.params_dtype, has_zero_points=True)
        return QuantizedWeights(spec, codes, layer.scales.detach().t().float().contiguous(),
                                zeros, None, None, tuple(layer.shard_sizes.values()))


class AWQConfig(QuantMethod):
    name = "awq"

    def __init__(self, group_size: int, not_converted: tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.not_converted = not_converted  # name parts of modules left unquantized
        self._method = AWQLinearMethod(self)

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "AWQConfig":
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        version = str(quant_config.get("version", quant_config.get("format", "gemm"))).lower()
        if bits != 4:
            raise ValueError(f"awq: {bits}-bit checkpoints are not supported (4 is)")
        if version != "gemm":
            raise ValueError(f"awq: the {version!r} layout is not supported (gemm is)")
        if not quant_config.get("zero_point", True):
            raise ValueError("awq: checkpoints without zero points are not supported")
        return cls(int(quant_config.get("group_size", quant_config.get("q_group_size", 128))),
                   tuple(quant_config.get("modules_to_not_convert") or ()))

    def linear_method(self, prefixes: tuple[str, ...]):
        skipped = [p for p in prefixes if p == "lm_head" or any(part in p
                                                                for part in self.not_converted)]
        if skipped and len(skipped) != len(prefixes):
            raise ValueError(f"awq: the fused modules {list(prefixes)} are partly quantized")
        return None if skipped else self._method

    def describe(self) -> str:
        return f"awq 4-bit g{self.group_size}"
