"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method:
compressed-tensors``), in their compressed form.

``config_groups`` map module ``targets`` (the class name ``Linear``, a module name, or
``re:`` + a regular expression over names) to a scheme: a ``format`` and the arguments of
the ``weights`` and ``input_activations``; ``ignore`` lists modules left unquantized.
The formats and their tensors (a linear ``[N, K]``; S = fused shards):

- ``pack-quantized`` (int4 / int8 weight-only, W4A16 / W8A16): ``weight_packed`` int32
  ``[N, K * bits / 32]``, codes packed densely along K (element j at bits ``bits * j``),
  stored with the offset ``2^(bits-1)`` added; ``weight_scale [N, K / group]`` (``[N, 1]``
  per channel); asymmetric: ``weight_zero_point`` int32 ``[N * bits / 32, K / group]``,
  packed along N the same way; ``weight_shape [2]``; ``weight_g_idx [K]`` with
  ``actorder: group``;
- ``int-quantized`` / ``naive-quantized`` (W8A8 int8): ``weight`` int8, ``weight_scale``
  per channel ``[N, 1]`` or per tensor ``[1]``; activations int8 per token (dynamic) or
  per tensor (static ``input_scale``);
- ``float-quantized`` (FP8 e4m3): ``weight`` fp8, ``weight_scale`` per tensor ``[1]``, per
  channel ``[N, 1]`` or per 128 x 128 block ``[N / 128, K / 128]``; activations fp8 per
  token, per group of 128 (dynamic) or per tensor (static ``input_scale``), or none;
- ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K / 2]`` (two e2m1 codes a
  byte, even k low), ``weight_scale`` fp8 ``[N, K / 16]``, ``weight_global_scale [1]``;
  with NVFP4 activations ``input_global_scale [1]``. Weight = e2m1 * scale / global.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.core.interfaces import (
    ActivationQuant,
    QuantizedLayerSpec,
    QuantizedWeights,
    QuantMethod,
)
from engine.model_executor.layers.linear import DENSE_WEIGHT, ParamLayout
from engine.quantization.base import (
    FEATURE_SHAPE,
    GROUP_INDEX,
    QuantizedLinearMethod,
    add_param,
    check_whole_blocks,
    expand_rows,
    num_shards,
    shard_g_idx,
    trivial_g_idx,
    unpack_codes,
    whole_group,
)

PER_SHARD = ParamLayout(output_dim=None, input_dim=None, per_shard=True)
PER_ROW = ParamLayout(output_dim=0, input_dim=None)  # [N, 1]


@dataclass(frozen=True)
class QuantArgs:
    """The parts of a compressed-tensors QuantizationArgs the engine reads."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # tensor | channel | group | block | token | tensor_group
    group_size: int | None
    block_structure: tuple[int, int] | None
    dynamic: bool | str  # True, False or "local"
    actorder: str | None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "QuantArgs":
        strategy = raw.get("strategy")
        group = raw.get("group_size")
        if strategy is None:  # compressed-tensors infers it from the group size
            strategy = "tensor" if group is None else ("channel" if group == -1 else "group")
        block = raw.get("block_structure")
        return cls(
            num_bits=int(raw.get("num_bits", 8)),
            type=str(raw.get("type", "int")),
            symmetric=bool(raw.get("symmetric", True)),
            strategy=str(strategy),
            group_size=None if group in (None, -1) else int(group),
            block_structure=tuple(block) if block else None,
            dynamic=raw.get("dynamic", False),
            actorder=raw.get("actorder"),
        )


@dataclass(frozen=True)
class Scheme:
    format: str
    weights: QuantArgs
    activations: QuantArgs | None

    @property
    def name(self) -> str:
        """llm-compressor's scheme name with its details, e.g. "compressed-tensors W4A16
        (int4 g128) pack-quantized"."""
        w, a = self.weights, self.activations
        if w.type == "float" and w.num_bits == 4:
            label, detail = ("NVFP4" if a else "NVFP4A16"), "e2m1 g16"
        else:
            kind = f"int{w.num_bits}" if w.type == "int" else "fp8"
            label = (f"W{w.num_bits}A16" if a is None else
                     "FP8" if w.type == "float" else f"W{w.num_bits}A{a.num_bits}")
            grouping = f"g{w.group_size}" if w.strategy == "group" else w.strategy
            if w.block_structure:
                grouping = "block " + "x".join(map(str, w.block_structure))
            detail = f"{kind} {grouping}{'' if w.symmetric else ' asym'}"
            if a is not None:
                detail += (f", {'dynamic' if a.dynamic else 'static'} per-"
                           f"{'group ' + str(a.group_size) if a.strategy == 'group' else a.strategy}"
                           " activations")
        return f"compressed-tensors {label} ({detail}) {self.format}"


def _activation(args: QuantArgs | None, scheme: str) -> ActivationQuant | None:
    """The engine's description of a scheme's input activations (ValueError for ones
    it does not run)."""
    if args is None:
        return None
    if not args.symmetric:
        raise ValueError(f"{scheme}: asymmetric input activations are not supported")
    dynamic = args.dynamic in (True, "local")
    if args.type == "int" and args.num_bits == 8 and args.strategy in ("token", "tensor"):
        return ActivationQuant("int8", args.strategy, dynamic)
    if args.type == "float" and args.num_bits == 8 and args.strategy in ("token", "tensor", "group"):
        if args.strategy == "group" and not args.group_size:
            raise ValueError(f"{scheme}: group activations without a group size")
        return ActivationQuant("fp8", args.strategy, dynamic, args.group_size)
    if (args.type == "float" and args.num_bits == 4 and args.strategy == "tensor_group"
            and args.group_size == 16 and args.dynamic == "local"):
        return ActivationQuant("nvfp4", "group", True, 16)
    raise ValueError(f"{scheme}: input activations {args} are not supported")


def _shard_rows(layer: nn.Module) -> tuple[int, ...]:
    return tuple(layer.shard_sizes.values())


def _group(in_features: int, args: QuantArgs, scheme: str) -> int:
    """Input features per weight scale; ValueError when K is not a whole number of them."""
    if args.strategy in ("tensor", "channel"):
        return in_features
    group = args.block_structure[1] if args.strategy == "block" else args.group_size
    if not group:
        raise ValueError(f"{scheme}: {in_features} input features are not a multiple of the "
                         f"group size {group}")
    return whole_group(scheme, group, in_features)


class _CTMethod(QuantizedLinearMethod):
    scale_params = ("weight_scale", "input_scale", "weight_global_scale", "input_global_scale")

    def __init__(self, scheme: Scheme) -> None:
        self.s = scheme
        self.scheme = scheme.name
        self.activation = _activation(scheme.activations, scheme.name)

    def _spec(self, layer: nn.Module, encoding: str, group: int, **extra: Any
              ) -> QuantizedLayerSpec:
        return QuantizedLayerSpec(
            scheme=self.scheme, encoding=encoding, weight_bits=self.s.weights.num_bits,
            group_size=group, in_features=layer.in_features, out_features=layer.out_features,
            act_dtype=layer.params_dtype, activation=self.activation, **extra)

    def _input_scale_params(self, layer: nn.Module, name: str = "input_scale") -> None:
        act = self.activation
        if act is not None and (not act.dynamic or act.encoding == "nvfp4"):
            add_param(layer, name, (num_shards(layer),), torch.float32, PER_SHARD)

    def _input_scales(self, layer: nn.Module, name: str = "input_scale") -> torch.Tensor | None:
        param = getattr(layer, name, None)
        return None if param is None else param.detach().float().clone()


class IntWeightOnly(_CTMethod):
    """pack-quantized int4 / int8 weights, group or channel scales, symmetric or with
    packed zero points, optional act-order g_idx."""

    def create_weights(self, layer, in_features, out_features, params_dtype):
        w = self.s.weights
        per_word = 32 // w.num_bits
        group = _group(in_features, w, self.scheme)
        groups = in_features // group
        if in_features % per_word:
            raise ValueError(f"{self.scheme}: {in_features} input features do not fill "
                             f"int32 words of {per_word} codes")
        add_param(layer, "weight_packed", (out_features, in_features // per_word), torch.int32,
                  ParamLayout(0, 1, packed_dim=1, packed_factor=per_word))
        add_param(layer, "weight_scale", (out_features, groups), torch.float32, DENSE_WEIGHT)
        if not w.symmetric:
            add_param(layer, "weight_zero_point", (out_features // per_word, groups), torch.int32,
                      ParamLayout(0, 1, packed_dim=0, packed_factor=per_word))
        add_param(layer, "weight_shape", (num_shards(layer), 2), torch.int64, FEATURE_SHAPE)
        if w.actorder == "group":
            add_param(layer, "weight_g_idx", (num_shards(layer), in_features), torch.int32,
                      GROUP_INDEX)

    def decode(self, layer):
        w = self.s.weights
        if w.num_bits not in (4, 8):
            raise ValueError(f"{self.scheme}: {w.num_bits}-bit weights are not supported")
        for rows, (n, k) in zip(_shard_rows(layer), layer.weight_shape.tolist()):
            if (n, k) != (rows, layer.in_features):
                raise ValueError(f"{self.scheme}: weight_shape {[n, k]} does not match the "
                                 f"layer's [{rows}, {layer.in_features}]")
        group = _group(layer.in_features, w, self.scheme)
        codes = unpack_codes(layer.weight_packed, w.num_bits, dim=1)
        zeros = None
        if not w.symmetric:
            zeros = unpack_codes(layer.weight_zero_point, w.num_bits, dim=0).float()
        g_idx = None
        if hasattr(layer, "weight_g_idx"):
            g_idx = shard_g_idx(layer, layer.weight_g_idx)
            if trivial_g_idx(g_idx, group):
                g_idx = None
        spec = self._spec(layer, "int", group, has_zero_points=zeros is not None,
                          act_order=g_idx is not None)
        return QuantizedWeights(spec, codes, layer.weight_scale.detach().float().clone(), zeros,
                                g_idx, None, _shard_rows(layer))


class Int8W8A8(_CTMethod):
    """int-quantized int8 weights (per channel or tensor) with int8 activations."""

    def create_weights(self, layer, in_features, out_features, params_dtype):
        add_param(layer, "weight", (out_features, in_features), torch.int8, DENSE_WEIGHT)
        if self.s.weights.strategy == "tensor":
            add_param(layer, "weight_scale", (num_shards(layer),), torch.float32, PER_SHARD)
        else:
            add_param(layer, "weight_scale", (out_features, 1), torch.float32, PER_ROW)
        self._input_scale_params(layer)

    def decode(self, layer):
        w = self.s.weights
        if w.num_bits != 8 or not w.symmetric or w.strategy not in ("tensor", "channel"):
            raise ValueError(f"{self.scheme}: weights {w} are not supported")
        codes = (layer.weight.detach().to(torch.int16) + 128).to(torch.uint8)
        scales = layer.weight_scale.detach().float()
        if w.strategy == "tensor":
            scales = expand_rows(scales, _shard_rows(layer))
        spec = self._spec(layer, "int", layer.in_features)
        return QuantizedWeights(spec, codes, scales.clone(), None, None, self._input_scales(layer),
                                _shard_rows(layer))


class Fp8(_CTMethod):
    """float-quantized e4m3 weights (tensor, channel or block scales), fp8 activations
    or none."""

    def create_weights(self, layer, in_features, out_features, params_dtype):
        w = self.s.weights
        add_param(layer, "weight", (out_features, in_features), torch.float8_e4m3fn, DENSE_WEIGHT)
        if w.strategy == "tensor":
            add_param(layer, "weight_scale", (num_shards(layer),), torch.float32, PER_SHARD)
        elif w.strategy == "channel":
            add_param(layer, "weight_scale", (out_features, 1), torch.float32, PER_ROW)
        elif w.strategy == "block":
            rows, cols = w.block_structure
            check_whole_blocks(layer, self.scheme, rows, cols, in_features)
            add_param(layer, "weight_scale", (-(-out_features // rows), -(-in_features // cols)),
                      torch.float32, ParamLayout(0, 1, packed_dim=0, packed_factor=rows))
        else:
            raise ValueError(f"{self.scheme}: fp8 weights with {w.strategy} scales are not "
                             "supported")
        self._input_scale_params(layer)

    def decode(self, layer):
        w = self.s.weights
        if w.num_bits != 8 or not w.symmetric:
            raise ValueError(f"{self.scheme}: weights {w} are not supported")
        scales = layer.weight_scale.detach().float()
        group = _group(layer.in_features, w, self.scheme)
        if w.strategy == "tensor":
            scales = expand_rows(scales, _shard_rows(layer))
        elif w.strategy == "block":
            scales = scales.repeat_interleave(w.block_structure[0], dim=0)[: layer.out_features]
        spec = self._spec(layer, "fp8", group)
        return QuantizedWeights(spec, layer.weight.detach().clone(), scales.contiguous().clone(),
                                None, None, self._input_scales(layer), _shard_rows(layer))


class Nvfp4(_CTMethod):
    """nvfp4-pack-quantized e2m1 weights, fp8 group-16 scales and a global scale per
    shard; NVFP4 activations or none."""

    def create_weights(self, layer, in_features, out_features, params_dtype):
        if in_features % 16:
            raise ValueError(f"{self.scheme}: {in_features} input features are not groups of 16")
        add_param(layer, "weight_packed", (out_features, in_features // 2), torch.uint8,
                  ParamLayout(0, 1, packed_dim=1, packed_factor=2))
        add_param(layer, "weight_scale", (out_features, in_features // 16), torch.float8_e4m3fn,
                  DENSE_WEIGHT)
        add_param(layer, "weight_global_scale", (num_shards(layer),), torch.float32, PER_SHARD)
        self._input_scale_params(layer, "input_global_scale")

    def decode(self, layer):
        w = self.s.weights
        if w.num_bits != 4 or w.type != "float" or w.group_size != 16:
            raise ValueError(f"{self.scheme}: weights {w} are not supported")
        global_scale = expand_rows(layer.weight_global_scale.detach(), _shard_rows(layer))
        if not bool((global_scale > 0).all()):
            raise ValueError(f"{self.scheme}: a weight_global_scale is not positive")
        scales = layer.weight_scale.detach().float() / global_scale
        spec = self._spec(layer, "nvfp4", 16)
        return QuantizedWeights(spec, layer.weight_packed.detach().clone(), scales, None, None,
                                self._input_scales(layer, "input_global_scale"),
                                _shard_rows(layer))


_FORMATS = {
    "pack-quantized": IntWeightOnly,
    "int-quantized": Int8W8A8,
    "naive-quantized": Int8W8A8,
    "float-quantized": Fp8,
    "nvfp4-pack-quantized": Nvfp4,
}


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or target == "Linear"


class CompressedTensorsConfig(QuantMethod):
    """A compressed-tensors checkpoint's ``quantization_config``."""

    name = "compressed-tensors"

    def __init__(self, groups: dict[str, tuple[list[str], Scheme]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore
        self._methods: dict[str, QuantizedLinearMethod] = {}

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "CompressedTensorsConfig":
        status = quant_config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors checkpoint in state {status!r}: only "
                             "'compressed' checkpoints (save_compressed=True) load")
        if quant_config.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity is not supported")
        default_format = quant_config.get("format", "dense")
        groups: dict[str, tuple[list[str], Scheme]] = {}
        for name, raw in (quant_config.get("config_groups") or {}).items():
            weights = raw.get("weights")
            if weights is None:
                raise ValueError(f"compressed-tensors group {name!r} quantizes no weights")
            fmt = raw.get("format") or default_format
            if fmt not in _FORMATS:
                raise ValueError(f"compressed-tensors format {fmt!r} (group {name!r}) is not "
                                 f"supported; supported: {', '.join(_FORMATS)}")
            acts = raw.get("input_activations")
            scheme = Scheme(fmt, QuantArgs.parse(weights), QuantArgs.parse(acts) if acts else None)
            groups[name] = (list(raw.get("targets") or []), scheme)
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(groups, list(quant_config.get("ignore") or []))

    def _group_of(self, prefix: str) -> str | None:
        if any(t == prefix or t.startswith("re:") and re.match(t[3:], prefix)
               for t in self.ignore):
            return None
        for name, (targets, _) in self.groups.items():
            if any(_matches(prefix, target) for target in targets):
                return name
        return None

    def linear_method(self, prefixes: tuple[str, ...]) -> QuantizedLinearMethod | None:
        groups = {self._group_of(p) for p in prefixes}
        if len(groups) > 1:
            raise ValueError(f"the fused modules {list(prefixes)} are quantized differently "
                             f"(config groups {sorted(map(str, groups))}); they share one GEMM")
        (group,) = groups
        if group is None:
            return None
        if group not in self._methods:
            scheme = self.groups[group][1]
            self._methods[group] = _FORMATS[scheme.format](scheme)
        return self._methods[group]

    def describe(self) -> str:
        return ", ".join(sorted({s.format for _, s in self.groups.values()}))
