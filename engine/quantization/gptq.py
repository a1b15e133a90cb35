"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: gptq``).

Tensors of a linear ``[N, K]`` with ``bits`` of 4 or 8 (``p = 32 / bits`` codes an int32):

- ``qweight`` int32 ``[K / p, N]``: the codes of p consecutive input features of a
  column, code j at bits ``bits * j``;
- ``qzeros`` int32 ``[K / group, N / p]``: zero points packed along N the same way; the
  original ("v1", ``checkpoint_format: gptq``) format stores zero - 1, v2 the zero;
- ``scales [K / group, N]`` (fp16); ``g_idx`` int32 ``[K]``: the group of each input
  feature, a permutation of the plain ``k // group`` with ``desc_act`` (act-order).

Weight = (code - zero) * scale of the feature's group. Symmetric checkpoints store the
midpoint as their zero point, so every GPTQ layer decodes with zero points.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.interfaces import QuantizedLayerSpec, QuantizedWeights, QuantMethod
from engine.model_executor.layers.linear import ParamLayout
from engine.quantization.base import (
    GROUP_INDEX,
    QuantizedLinearMethod,
    add_param,
    num_shards,
    shard_g_idx,
    trivial_g_idx,
    unpack_codes,
    whole_group,
)

PER_SHARD = ParamLayout(output_dim=None, input_dim=None, per_shard=True)


class GPTQLinearMethod(QuantizedLinearMethod):
    scale_params = ("scales",)

    def __init__(self, config: "GPTQConfig") -> None:
        self.config = config
        self.scheme = "gptq"

    def _group(self, in_features: int) -> int:
        return whole_group("gptq", self.config.group_size, in_features)

    def create_weights(self, layer, in_features, out_features, params_dtype):
        per_word = 32 // self.config.bits
        groups = in_features // self._group(in_features)
        if in_features % per_word or out_features % per_word:
            raise ValueError(f"gptq: a [{out_features}, {in_features}] layer does not fill "
                             f"int32 words of {per_word} codes")
        add_param(layer, "qweight", (in_features // per_word, out_features), torch.int32,
                  ParamLayout(1, 0, packed_dim=0, packed_factor=per_word))
        add_param(layer, "qzeros", (groups, out_features // per_word), torch.int32,
                  ParamLayout(1, 0, packed_dim=1, packed_factor=per_word))
        add_param(layer, "scales", (groups, out_features), torch.float32, ParamLayout(1, 0))
        add_param(layer, "g_idx", (num_shards(layer), in_features), torch.int32, GROUP_INDEX)

    def decode(self, layer):
        bits = self.config.bits
        group = self._group(layer.in_features)
        codes = unpack_codes(layer.qweight, bits, dim=0).t().contiguous()
        zeros = unpack_codes(layer.qzeros, bits, dim=1).t().float()
        if self.config.checkpoint_format == "gptq":  # v1 stores zero - 1
            zeros = (zeros + 1) % (1 << bits)
        g_idx = shard_g_idx(layer, layer.g_idx)
        groups = layer.in_features // group
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"gptq: g_idx names groups outside [0, {groups})")
        if trivial_g_idx(g_idx, group):
            g_idx = None
        spec = QuantizedLayerSpec(
            scheme="gptq", encoding="int", weight_bits=bits, group_size=group,
            in_features=layer.in_features, out_features=layer.out_features,
            act_dtype=layer.params_dtype, has_zero_points=True, act_order=g_idx is not None)
        return QuantizedWeights(spec, codes, layer.scales.detach().t().float().contiguous(),
                                zeros.contiguous(), g_idx, None, tuple(layer.shard_sizes.values()))


class GPTQConfig(QuantMethod):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, sym: bool, desc_act: bool,
                 checkpoint_format: str) -> None:
        self.bits, self.group_size, self.sym, self.desc_act = bits, group_size, sym, desc_act
        self.checkpoint_format = checkpoint_format
        self._method = GPTQLinearMethod(self)

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "GPTQConfig":
        bits = int(quant_config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq: {bits}-bit checkpoints are not supported (4 and 8 are)")
        if quant_config.get("lm_head"):
            raise ValueError("gptq: checkpoints with a quantized lm_head are not supported")
        fmt = quant_config.get("checkpoint_format") or quant_config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint format {fmt!r} is not supported "
                             "(gptq, gptq_v2 are)")
        return cls(bits, int(quant_config.get("group_size", 128)),
                   bool(quant_config.get("sym", True)), bool(quant_config.get("desc_act", False)),
                   fmt)

    def linear_method(self, prefixes: tuple[str, ...]):
        return None if prefixes == ("lm_head",) else self._method

    def describe(self) -> str:
        return f"gptq {self.bits}-bit g{self.group_size}" + (" act-order" if self.desc_act else "")
