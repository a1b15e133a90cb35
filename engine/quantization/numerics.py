"""The number formats of quantized checkpoints, in torch: decoding weight codes and
quantize-dequantize (QDQ) of activations exactly as the checkpoint tools define them.

Activation QDQ follows compressed-tensors (what llm-compressor calibrates with and what
transformers runs when it loads such a checkpoint):

- a scale per token / tensor / group of ``g`` values: symmetric, ``max|x| / (range / 2)``
  with range 255 for int8 (so ``/ 127.5``), 896 for fp8 e4m3 (``/ 448``), 12 for e2m1
  (``/ 6``); a zero scale becomes the scale dtype's epsilon;
- ``q = round(clamp(x / scale, qmin, qmax))``: to nearest (ties to even) for int8, to the
  nearest e4m3 value for fp8, to the nearest e2m1 value (compressed-tensors' rounding
  table) for nvfp4; then ``x' = q * scale``;
- nvfp4: the group scale is multiplied by the global input scale ``gs``, rounded to
  e4m3 (saturating), then divided by ``gs`` again before use.

These functions are the reference the C kernels are checked against, and the torch
fallback kernel's arithmetic.
"""

from __future__ import annotations

import torch

from engine.core.interfaces import ActivationQuant

FP8_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# the 16 e2m1 codes as values: bit 3 the sign
E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])
_EPS = {"int8": torch.finfo(torch.float32).eps, "fp8": torch.finfo(torch.float32).eps,
        "nvfp4": 0.125}  # nvfp4 scales are fp8: its epsilon
_RANGE_HALF = {"int8": 127.5, "fp8": FP8_MAX, "nvfp4": 6.0}


def e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 ``[..., K / 2]`` packed e2m1 codes (even k in the low
    nibble): ``[..., K]``."""
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    return E2M1_TABLE.to(packed.device)[torch.stack((low, high), dim=-1).flatten(-2)]


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest e2m1 value, compressed-tensors' way (boundaries 0.25,
    0.75, 1.25, 1.75, 2.5, 3.5, 5: the ties at 0.25, 1.25 and 2.5 go down, at 0.75,
    1.75 and 3.5 up, as its comparisons put them)."""
    mag = x.abs()
    out = torch.zeros_like(mag)
    out = torch.where(mag > 0.25, 0.5, out)
    out = torch.where(mag >= 0.75, 1.0, out)
    out = torch.where(mag > 1.25, 1.5, out)
    out = torch.where(mag >= 1.75, 2.0, out)
    out = torch.where(mag > 2.5, 3.0, out)
    out = torch.where(mag >= 3.5, 4.0, out)
    out = torch.where(mag > 5.0, 6.0, out)
    return out * torch.sign(x)


def _scales(x: torch.Tensor, act: ActivationQuant) -> torch.Tensor:
    """Dynamic scales of float32 ``x [M, K]`` broadcastable against its groups view."""
    mag = x.abs()
    if act.strategy == "token":
        top = mag.amax(dim=-1, keepdim=True)  # [M, 1]
    elif act.strategy == "tensor":
        top = mag.amax().reshape(1, 1)
    else:
        top = mag.unflatten(-1, (-1, act.group_size)).amax(dim=-1, keepdim=True)
    # A tensor divisor, not a Python float: CUDA torch turns division by a scalar into a
    # multiply by its reciprocal (off by an ulp), the kernels and CPU torch divide exactly.
    return top / torch.full_like(top, _RANGE_HALF[act.encoding])


def _quantize_values(scaled: torch.Tensor, encoding: str) -> torch.Tensor:
    if encoding == "int8":
        return torch.round(scaled.clamp(-128.0, 127.0))
    if encoding == "fp8":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return round_e2m1(scaled.clamp(-6.0, 6.0))


def quantize_dequantize(x: torch.Tensor, act: ActivationQuant,
                        static_scale: torch.Tensor | None = None,
                        global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """QDQ of ``x [M, K]`` (float32 arithmetic) as ``act`` says; ``static_scale``: the
    checkpoint's scale of a static scheme, ``global_scale``: nvfp4's input global scale."""
    x = x.float()
    grouped = act.strategy == "group" or act.encoding == "nvfp4"
    if act.dynamic:
        scale = _scales(x, act)
    else:
        if static_scale is None:
            raise ValueError("a static activation scheme needs its checkpoint scale")
        scale = static_scale.float().reshape(1, 1)
    if act.encoding == "nvfp4":
        gs = global_scale.float().reshape(1, 1, 1)
        scale = (scale * gs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(scale == 0, torch.full_like(scale, _EPS["nvfp4"]), scale) / gs
    else:
        scale = torch.where(scale == 0, torch.full_like(scale, _EPS[act.encoding]), scale)
    if grouped and act.dynamic:
        view = x.unflatten(-1, (-1, act.group_size))
        return (_quantize_values(view / scale, act.encoding) * scale).flatten(-2)
    return _quantize_values(x / scale, act.encoding) * scale
