"""MXFP4 (OCP microscaling fp4) expert weights: checkpoints with ``quant_method: mxfp4``
(GPT-OSS releases).

Only the MoE experts are quantized; attention, router, embedding and LM head stay dense
(``linear_method`` answers None for every linear layer). Per expert projection ``P``
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]`` as ``[E, rows, in]``):

- ``P_blocks`` uint8 ``[E, rows, in / 32, 16]``: two e2m1 fp4 codes per byte, element
  ``2j`` in the low nibble, ``2j + 1`` in the high nibble;
- ``P_scales`` uint8 ``[E, rows, in / 32]``: one e8m0 exponent per 32 values,
  ``scale = 2 ** (e - 127)``.

A code ``c`` (sign bit 3, exponent bits 2-1, mantissa bit 0) means ``FP4_VALUES[c]``:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. The weights are dequantized once at load
to the model dtype (:func:`dequantize_mxfp4`: a lookup-table gather on the nibbles and an
``ldexp`` by the block exponent, all in bulk torch ops; the Triton kernel
:func:`engine.kernels.mxfp4.mxfp4_dequantize` computes the same on a GPU), so the
experts then run as dense weights.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.interfaces import QuantMethod

BLOCK = 32  # values per e8m0 scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
E8M0_NAN = 255  # the one e8m0 code that is no power of two


def check_mxfp4_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales are uint8, not {blocks.dtype} / "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4 blocks end in {BLOCK // 2} bytes (32 fp4 values), not shape "
                         f"{tuple(blocks.shape)}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (one scale per block of 16 bytes)")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 + ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in
    ``dtype`` (exact: every fp4 value times a power of two is representable unless it
    leaves ``dtype``'s range). A scale of 255 (e8m0 NaN) is a ValueError."""
    check_mxfp4_shapes(blocks, scales)
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("mxfp4 scales hold the e8m0 NaN code 255 (a corrupt checkpoint?)")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(FP4_VALUES, dtype=work, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32] in element order
    exponents = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).to(work))
    return out.flatten(-2).to(dtype)


def dequantizer_for(device: torch.device) -> Any:
    """The dequantization that runs where the checkpoint tensors sit: the Triton kernel
    (engine.kernels.mxfp4) on an accelerator, the vectorized torch one on the host."""
    if torch.device(device).type == "cpu":
        return dequantize_mxfp4
    from engine.kernels.mxfp4 import mxfp4_dequantize

    return mxfp4_dequantize


class Mxfp4ExpertsMethod:
    """Registers a MoE layer's ``{P}_blocks`` / ``{P}_scales`` checkpoint tensors and
    turns them into dense expert weights after loading (see the module docstring)."""

    scheme = "mxfp4"

    def create_weights(self, layer: torch.nn.Module, name: str, shape: tuple[int, ...],
                       device: Any, loader: Any = None) -> None:
        """``layer.{name}_blocks`` / ``_scales`` for a ``[E, rows, in]`` projection
        (``in`` a multiple of 32); ``loader(param, tensor)`` fills them (e.g. this rank's
        part), default a plain copy."""
        experts, rows, cols = shape
        if cols % BLOCK:
            raise ValueError(f"mxfp4: {cols} input features of {name} are not whole blocks "
                             f"of {BLOCK}")
        for suffix, dims in (("blocks", (experts, rows, cols // BLOCK, BLOCK // 2)),
                             ("scales", (experts, rows, cols // BLOCK))):
            param = torch.nn.Parameter(torch.zeros(dims, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            if loader is not None:
                param.weight_loader = loader
            layer.register_parameter(f"{name}_{suffix}", param)

    def dequantize(self, layer: torch.nn.Module, name: str, dtype: torch.dtype
                   ) -> torch.Tensor:
        """The dense ``[E, rows, in]`` weight of ``name``; drops its checkpoint tensors."""
        blocks, scales = getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales")
        try:
            dense = dequantizer_for(blocks.device)(blocks.detach(), scales.detach(), dtype)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        delattr(layer, f"{name}_blocks")
        delattr(layer, f"{name}_scales")
        return dense


class Mxfp4Config(QuantMethod):
    """``quant_method: mxfp4``: MoE experts in MXFP4, everything else dense."""

    name = "mxfp4"

    def __init__(self, modules_to_not_convert: tuple[str, ...] = ()) -> None:
        self.modules_to_not_convert = modules_to_not_convert
        self.experts = Mxfp4ExpertsMethod()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Mxfp4Config:
        skipped = quant_config.get("modules_to_not_convert") or ()
        return cls(tuple(skipped))

    def linear_method(self, prefixes: tuple[str, ...]) -> Any:
        return None  # only the experts are quantized

    def experts_method(self) -> Mxfp4ExpertsMethod:
        return self.experts

    def describe(self) -> str:
        return "mxfp4 (experts dequantized at load)"
