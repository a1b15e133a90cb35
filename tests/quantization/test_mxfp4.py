"""MXFP4 (e2m1 fp4 values, one e8m0 exponent per 32) dequantization on the CPU against a
float64 reference written from the format definition, and the ``mxfp4`` quant method's
registration. The float64 quantizer here also makes the GPT-OSS MXFP4 test checkpoint
(tests/model_executor/models/test_gpt_oss.py) and feeds the Triton kernel's test."""

from __future__ import annotations

import pytest
import torch

from engine.quantization import registered_formats, resolve_quantization
from engine.quantization.mxfp4 import Mxfp4Config, dequantize_mxfp4


def fp4_value(code: torch.Tensor) -> torch.Tensor:
    """e2m1 code (bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa) -> float64."""
    code = code.to(torch.int64)
    sign = torch.where((code >> 3) & 1 == 1, -1.0, 1.0).double()
    exp = ((code >> 1) & 3).double()
    man = (code & 1).double()
    normal = torch.pow(2.0, exp - 1) * (1 + man / 2)
    return sign * torch.where(exp == 0, man / 2, normal)


def reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[..., G * 32]``: byte ``j`` of a block holds element ``2j`` (low
    nibble) and ``2j + 1`` (high nibble); each block times ``2 ** (scale - 127)``."""
    lo, hi = fp4_value(blocks & 0xF), fp4_value(blocks >> 4)
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]
    power = torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return (values * power).flatten(-2)


_GRID = fp4_value(torch.arange(8)).tolist()  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def reference_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MXFP4 quantizer of ``[..., K]`` (K a multiple of 32): per block the
    exponent that maps its largest magnitude into [4, 8) (OCP MX: floor(log2 amax) - 2,
    the largest fp4 value being 1.5 * 2^2), each value rounded to the nearest fp4 value
    (saturating at 6). -> (blocks ``[..., K/32, 16]``, scales ``[..., K/32]``)."""
    w = weight.double().reshape(*weight.shape[:-1], -1, 32)
    amax = w.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-300))) - 2,
                      torch.zeros_like(amax)).clamp(-127, 127)
    scaled = (w / torch.pow(2.0, exp).unsqueeze(-1)).clamp(-6, 6)
    grid = torch.tensor(_GRID, dtype=torch.float64)
    index = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # nearest magnitude
    codes = index + 8 * (scaled < 0).to(torch.int64)
    codes = codes.reshape(*codes.shape[:-1], 16, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


def random_mxfp4(shape_lead: tuple[int, ...], groups: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks with every byte value and scales over a wide exponent range
    (including 0, the subnormal 2^-127, and 254, 2^127)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape_lead, groups, 16), generator=g).to(torch.uint8)
    scales = torch.randint(100, 140, (*shape_lead, groups), generator=g).to(torch.uint8)
    scales.view(-1)[0], scales.view(-1)[-1] = 0, 254
    return blocks, scales


def test_every_code_decodes_to_the_e2m1_value():
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | (codes.flip(0) << 4)).reshape(1, 16)
    out = dequantize_mxfp4(blocks, torch.full((1,), 127, dtype=torch.uint8), torch.float64)
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert out[0::2].tolist() == expected
    assert out[1::2].tolist() == expected[::-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dequantize_matches_the_float64_reference(dtype):
    blocks, scales = random_mxfp4((3, 5), 4)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 5, 128) and got.dtype == dtype
    want = reference_dequantize(blocks, scales)
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # exact wherever the dtype holds the value (2^-127 * 0.5 is below float32's range)
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


def test_quantizer_round_trips_through_the_dequantizer():
    w = torch.randn(4, 64, dtype=torch.float64) * 0.05
    blocks, scales = reference_quantize(w)
    back = dequantize_mxfp4(blocks, scales, torch.float64)
    torch.testing.assert_close(back, reference_dequantize(blocks, scales), rtol=0, atol=0)
    # the grid's widest gap is 2 * 2^e (4 -> 6), and a block's largest values in [6, 8) *
    # 2^e saturate to 6 * 2^e: every error within 2^e * 2
    step = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, -1)
    assert bool(((back - w).abs() <= 2 * step + 1e-12).all())
    assert float((back - w).abs().mean()) < 0.2 * float(w.abs().mean())
    # representable values are fixed points (up to the sign of zero)
    torch.testing.assert_close(reference_dequantize(*reference_quantize(back)), back,
                               rtol=0, atol=0)


def test_bad_inputs_are_clear_errors():
    blocks, scales = random_mxfp4((2,), 2)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="16 bytes|32 fp4"):
        dequantize_mxfp4(blocks[..., :8], scales)
    bad = scales.clone()
    bad[0, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, bad)


def test_mxfp4_is_a_registered_format_that_quantizes_only_experts():
    assert registered_formats()["mxfp4"] is Mxfp4Config

    class Cfg:
        def __init__(self) -> None:
            self.quantization_config = {"quant_method": "mxfp4",
                                        "modules_to_not_convert": ["model.layers.*.self_attn"]}

    plan = resolve_quantization(Cfg())
    assert isinstance(plan.method, Mxfp4Config)
    assert plan.method.linear_method(("model.layers.0.self_attn.q_proj",)) is None
    assert plan.method.experts_method().scheme == "mxfp4"
