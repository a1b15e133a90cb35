"""The Triton MXFP4 dequantization kernel (interpreted on CPU tensors) against the float64
reference written from the format definition and against the CPU dequantizer."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.mxfp4 import mxfp4_dequantize
from engine.quantization.mxfp4 import dequantize_mxfp4
from tests.quantization.test_mxfp4 import random_mxfp4, reference_dequantize, reference_quantize


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 * 2^127 is inf in float32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead", [(1,), (3, 7), (2, 5, 3)])  # rows not a multiple of 64 too
def test_triton_dequant_matches_reference_and_cpu(dtype, lead):
    blocks, scales = random_mxfp4(lead, 3, seed=len(lead))
    if dtype == torch.float16:  # keep the values inside float16's range
        scales = scales.clamp(115, 135)
    elif dtype == torch.bfloat16:  # no subnormal results (casts to bf16 may flush them)
        scales = scales.clamp(min=2)
    got = mxfp4_dequantize(blocks, scales, dtype)
    assert got.shape == (*lead, 96) and got.dtype == dtype
    want = reference_dequantize(blocks, scales)
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(got, dequantize_mxfp4(blocks, scales, dtype), rtol=0, atol=0)


def test_triton_dequant_of_a_quantized_expert_tensor():
    w = torch.randn(2, 8, 64, dtype=torch.float64) * 0.02  # [E, rows, in]
    blocks, scales = reference_quantize(w)
    got = mxfp4_dequantize(blocks, scales, torch.float32)
    torch.testing.assert_close(got, reference_dequantize(blocks, scales).float(), rtol=0, atol=0)
    assert float((got.double() - w).abs().max()) < 0.5 * float(w.abs().max())


def test_triton_dequant_rejects_bad_inputs():
    blocks, scales = random_mxfp4((2,), 2)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_dequantize(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="not torch.float64"):
        mxfp4_dequantize(blocks, scales, torch.float64)


def test_checkpoint_dequantizer_follows_the_device():
    """Expert tensors loaded onto an accelerator dequantize with this Triton kernel; on
    the host with the vectorized torch one."""
    from engine.quantization.mxfp4 import dequantizer_for

    assert dequantizer_for(torch.device("cpu")) is dequantize_mxfp4
    assert dequantizer_for(torch.device("cuda", 0)) is mxfp4_dequantize
    assert dequantizer_for(torch.device("xpu")) is mxfp4_dequantize
