"""The Triton W8A8 / FP8 / NVFP4 GEMMs (engine/kernels/quant_gemm_fp.py) under
TRITON_INTERPRET=1.

References are float64: the canonical weights dequantized here (independently of the
engine's decoder), the activations quantize-dequantized by the engine's own numerics
(engine.quantization.numerics, what the CPU plugin's kernels are bit-identical to),
per fused shard, then a float64 matmul. The activation quantizer is checked bit for bit
against the same numerics. Output buffers are NaN-poisoned, so an element the kernel
never writes fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from engine.core.interfaces import (
    ActivationQuant,
    DeviceCapability,
    QuantizedLayerSpec,
    QuantizedWeights,
    select_quantized_kernel,
)
from engine.kernels import quant_gemm_fp as qf
from engine.quantization.numerics import E2M1_TABLE, quantize_dequantize

# interpreter capabilities: unbound (decoded fp8, int8 mma), native fp8 dots in both
# flavours, and a device without int8 / fp8 matrix instructions
FP8_FN = DeviceCapability("test", "fp8-fn", fp8_dtype="e4m3fn", fp8_mma=True, int8_mma=True)
FP8_FNUZ = DeviceCapability("test", "fp8-fnuz", fp8_dtype="e4m3fnuz", fp8_mma=True,
                            int8_mma=True)
NO_MMA = DeviceCapability("test", "no-mma")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _spec(encoding, bits, group, k, n, dtype, act=None, shards=None, scheme="test"):
    return QuantizedLayerSpec(scheme=scheme, encoding=encoding, weight_bits=bits,
                              group_size=group, in_features=k, out_features=n, act_dtype=dtype,
                              activation=act, shard_sizes=tuple(shards or (n,)))


def fp8_weights(n, k, kind, dtype, act=None, shards=None, input_scales=None, seed=0):
    """fp8 codes with per-tensor / per-channel / 128 x 128 block scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if kind == "tensor":
        group, scales = k, torch.full((n, 1), float(w.abs().max()) / 448.0)
    elif kind == "channel":
        group, scales = k, w.abs().amax(dim=1, keepdim=True) / 448.0
    else:  # block
        group = 128
        blocks = w.abs().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)).amax(dim=(1, 3))
        scales = (blocks / 448.0).repeat_interleave(128, dim=0)
    full = scales.repeat_interleave(group, dim=1)
    codes = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    spec = _spec("fp8", 8, group, k, n, dtype, act, shards)
    return QuantizedWeights(spec, codes, scales.float(), input_scales=input_scales,
                            shard_sizes=spec.shard_sizes)


def int8_weights(n, k, dtype, act=None, shards=None, input_scales=None, group=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    group = group or k
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    spec = _spec("int", 8, group, k, n, dtype, act, shards)
    return QuantizedWeights(spec, codes, scales, input_scales=input_scales,
                            shard_sizes=spec.shard_sizes)


def nvfp4_weights(n, k, dtype, act=None, shards=None, input_scales=None, seed=2):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    fp8_scales = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    scales = fp8_scales.float() / 2688.0  # the fp8 group scales over a global scale
    spec = _spec("nvfp4", 4, 16, k, n, dtype, act, shards)
    return QuantizedWeights(spec, codes, scales, input_scales=input_scales,
                            shard_sizes=spec.shard_sizes)


def dequantized(weights: QuantizedWeights) -> torch.Tensor:
    """float64 [N, K] of canonical weights, written from the format's definition."""
    spec = weights.spec
    scales = weights.scales.double().repeat_interleave(spec.group_size, dim=1)
    if spec.encoding == "fp8":
        return weights.codes.double() * scales
    if spec.encoding == "int":
        return (weights.codes.double() - 128.0) * scales
    packed = weights.codes.long()
    values = E2M1_TABLE[torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)]
    return (values.double() * scales).bfloat16().double()  # weight = bf16(e2m1 * scale)


def reference(weights: QuantizedWeights, x: torch.Tensor, bias=None) -> torch.Tensor:
    spec = weights.spec
    act = spec.activation
    w = dequantized(weights)
    rows = x.reshape(-1, spec.in_features).float()
    parts, start = [], 0
    for s, size in enumerate(spec.shard_sizes):
        xq = rows
        if act is not None:
            scale = None if weights.input_scales is None else weights.input_scales.reshape(-1)
            scale = None if scale is None else scale[min(s, scale.numel() - 1)]
            if act.encoding == "nvfp4":
                xq = quantize_dequantize(rows, act, global_scale=scale)
            else:
                xq = quantize_dequantize(rows, act, static_scale=None if act.dynamic else scale)
        parts.append(xq.double() @ w[start:start + size].T)
        start += size
    out = torch.cat(parts, dim=-1)
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], spec.out_features)


def run_kernel(cls, capability, weights, x, bias=None):
    kernel_cls = cls.for_capability(capability)
    assert kernel_cls.can_implement(weights.spec) is None, kernel_cls.can_implement(weights.spec)
    kernel = kernel_cls()
    layer = nn.Module()
    kernel.prepare(layer, weights)
    rows = x.numel() // x.shape[-1]
    out = torch.full((rows * weights.spec.out_features,), float("nan"), dtype=x.dtype)
    y = kernel.apply(layer, x, bias, out=out)
    assert y.shape == (*x.shape[:-1], weights.spec.out_features) and y.dtype == x.dtype
    assert y.data_ptr() == out.data_ptr()
    return y, kernel


def check(cls, capability, weights, x, bias=None):
    y, kernel = run_kernel(cls, capability, weights, x, bias)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    want = reference(weights, x, bias)
    err = float((y.double() - want).abs().max() / want.abs().max())
    assert err < TOL[x.dtype], f"{kernel.description}: relative error {err:.3g}"
    return kernel


def activations(m, k, dtype, seed=3, lead=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 2
    x[0, :3] = torch.tensor([7.0, -9.5, 0.003])  # an outlier row
    x = x.to(dtype)
    return x.reshape(*lead, k) if lead else x


# --------------------------------------------------------------------------- activations

QUANT_CASES = [
    (ActivationQuant("int8", "token", True), None),
    (ActivationQuant("int8", "tensor", True), None),
    (ActivationQuant("int8", "tensor", False), 0.021),
    (ActivationQuant("fp8", "token", True), None),
    (ActivationQuant("fp8", "tensor", True), None),
    (ActivationQuant("fp8", "tensor", False), 0.0071),
    (ActivationQuant("fp8", "group", True, 128), None),
    (ActivationQuant("int8", "group", True, 32), None),
]


@pytest.mark.parametrize("act,scale", QUANT_CASES, ids=lambda v: str(v))
def test_activation_codes_are_bit_identical(act, scale):
    x = activations(5, 256, torch.float32)
    x[1] = 0.0  # a zero row: the scale becomes float32's epsilon
    x[2, 128:] = 0.0  # a zero group
    x[3, 5] = 1e-7  # below e4m3's smallest subnormal once scaled
    static = None if scale is None else torch.tensor([scale])
    codes, scales = qf.quantize_activation(x, act, static)
    values = codes.float() if act.encoding == "int8" else codes.view(torch.float8_e4m3fn).float()
    got = (values.unflatten(-1, (scales.shape[1], -1)) * scales[:, :, None]).flatten(-2)
    assert torch.equal(got, quantize_dequantize(x, act, static_scale=static))
    if act.encoding == "fp8":
        assert not bool((codes == 0x80).any())  # never -0: fnuz's NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_activation_qdq_is_bit_identical(dtype):
    act = ActivationQuant("nvfp4", "group", True, 16)
    x = activations(4, 96, dtype)
    x[1, 16:32] = 0.0
    gs = torch.tensor([448.0 * 6.0 / 9.5])
    got, none = qf.quantize_activation(x, act, gs, qdq_dtype=dtype)
    assert none is None and got.dtype == dtype
    assert torch.equal(got, quantize_dequantize(x, act, global_scale=gs).to(dtype))


def test_fnuz_activation_scales_are_doubled():
    act = ActivationQuant("fp8", "token", True)
    x = activations(3, 64, torch.bfloat16)
    codes, scales = qf.quantize_activation(x, act)
    codes2, scales2 = qf.quantize_activation(x, act, scale_mul=2.0)
    assert torch.equal(codes, codes2) and torch.equal(scales2, scales * 2)
    fnuz = codes.view(torch.float8_e4m3fnuz).float() * scales2
    assert torch.equal(fnuz, codes.view(torch.float8_e4m3fn).float() * scales)


# --------------------------------------------------------------------------- fp8


@pytest.mark.parametrize("cap", [None, FP8_FN, FP8_FNUZ], ids=["decoded", "fn", "fnuz"])
def test_fp8_per_tensor_static_shards(cap):
    shards = (48, 16, 32)
    act = ActivationQuant("fp8", "tensor", False)
    scales = torch.tensor([0.011, 0.011, 0.02])  # the first two shards share a launch
    w = fp8_weights(96, 200, "tensor", torch.bfloat16, act, shards, scales)
    bias = torch.randn(96).bfloat16()
    kernel = check(qf.TritonFp8Gemm, cap, w, activations(3, 200, torch.bfloat16), bias)
    assert "static per-tensor" in kernel.description


@pytest.mark.parametrize("cap", [None, FP8_FN, FP8_FNUZ], ids=["decoded", "fn", "fnuz"])
def test_fp8_per_channel_per_token(cap):
    act = ActivationQuant("fp8", "token", True)
    w = fp8_weights(40, 72, "channel", torch.float32, act, (24, 16))
    check(qf.TritonFp8Gemm, cap, w, activations(5, 72, torch.float32, lead=(1, 5)))


def test_fp8_dynamic_per_tensor_fp16():
    act = ActivationQuant("fp8", "tensor", True)
    w = fp8_weights(24, 40, "tensor", torch.float16, act)
    check(qf.TritonFp8Gemm, FP8_FN, w, activations(3, 40, torch.float16))


@pytest.mark.parametrize("cap", [None, FP8_FN, FP8_FNUZ], ids=["decoded", "fn", "fnuz"])
def test_fp8_block_scales(cap):
    act = ActivationQuant("fp8", "group", True, 128)
    w = fp8_weights(256, 256, "block", torch.bfloat16, act)
    bias = torch.randn(256).bfloat16()
    kernel = check(qf.TritonFp8Gemm, cap, w, activations(5, 256, torch.bfloat16), bias)
    assert "groups of 128" in kernel.description


def test_fp8_block_scales_fp32_tight():
    act = ActivationQuant("fp8", "group", True, 128)
    w = fp8_weights(256, 256, "block", torch.float32, act, seed=5)
    check(qf.TritonFp8Gemm, FP8_FN, w, activations(1, 256, torch.float32))


@pytest.mark.parametrize("cap", [None, FP8_FN], ids=["decoded", "fn"])
def test_fp8_weight_only(cap):
    w = fp8_weights(40, 100, "channel", torch.bfloat16)
    check(qf.TritonFp8Gemm, cap, w, activations(3, 100, torch.bfloat16), torch.randn(40))


def test_fnuz_prepare_doubles_weight_scales():
    w = fp8_weights(16, 32, "channel", torch.bfloat16, ActivationQuant("fp8", "token", True))
    w.codes[0, 0] = torch.tensor(-0.0).to(torch.float8_e4m3fn)  # 0x80: fnuz's NaN
    layer = nn.Module()
    qf.TritonFp8Gemm.for_capability(FP8_FNUZ)().prepare(layer, w)
    assert int(layer.qf_codes[0, 0]) == 0 and not bool((layer.qf_codes == 0x80).any())
    assert torch.equal(layer.qf_scales, w.scales * 2)
    as_fnuz = layer.qf_codes.view(torch.float8_e4m3fnuz).float() * layer.qf_scales
    assert torch.equal(as_fnuz, w.codes.float() * w.scales)


# --------------------------------------------------------------------------- int8


@pytest.mark.parametrize("cap", [None, NO_MMA], ids=["int8-mma", "bf16"])
def test_int8_per_channel_per_token(cap):
    act = ActivationQuant("int8", "token", True)
    w = int8_weights(48, 136, torch.bfloat16, act)
    kernel = check(qf.TritonInt8Gemm, cap, w, activations(5, 136, torch.bfloat16),
                   torch.randn(48).bfloat16())
    assert ("int8 mma" if cap is None else "bf16") in kernel.description


@pytest.mark.parametrize("cap", [None, NO_MMA], ids=["int8-mma", "bf16"])
def test_int8_static_shards_fp32(cap):
    act = ActivationQuant("int8", "tensor", False)
    w = int8_weights(48, 64, torch.float32, act, (32, 16), torch.tensor([0.03, 0.05]))
    check(qf.TritonInt8Gemm, cap, w, activations(3, 64, torch.float32))


def test_int8_dynamic_tensor_fp16():
    act = ActivationQuant("int8", "tensor", True)
    w = int8_weights(32, 48, torch.float16, act)
    check(qf.TritonInt8Gemm, None, w, activations(4, 48, torch.float16))


def test_int8_group_scales():
    act = ActivationQuant("int8", "group", True, 64)
    w = int8_weights(32, 128, torch.float32, act, group=32)
    check(qf.TritonInt8Gemm, None, w, activations(3, 128, torch.float32))


def test_int8_weight_only():
    w = int8_weights(32, 80, torch.bfloat16)
    check(qf.TritonInt8Gemm, None, w, activations(2, 80, torch.bfloat16))


# --------------------------------------------------------------------------- nvfp4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_weight_only(dtype):
    w = nvfp4_weights(40, 96, dtype)
    kernel = check(qf.TritonNvfp4Gemm, None, w, activations(3, 96, dtype), torch.randn(40))
    assert "dequantized" in kernel.description


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_activations_per_shard_global_scale(dtype):
    act = ActivationQuant("nvfp4", "group", True, 16)
    w = nvfp4_weights(48, 160, dtype, act, (32, 16), torch.tensor([300.0, 120.0]))
    check(qf.TritonNvfp4Gemm, FP8_FN, w, activations(5, 160, dtype))


# --------------------------------------------------------------------------- selection


def test_kernels_bind_and_refuse_with_reasons():
    kernels = qf.fp_gemm_kernels(FP8_FNUZ)
    assert [k.name for k in kernels] == ["triton_fp8_gemm", "triton_int8_gemm",
                                         "triton_nvfp4_gemm"]
    assert all(k.capability == FP8_FNUZ for k in kernels)
    assert qf.TritonFp8Gemm.for_capability(FP8_FN) is qf.TritonFp8Gemm.for_capability(FP8_FN)
    fp8_act = ActivationQuant("fp8", "token", True)
    base = _spec("int", 8, 64, 64, 32, torch.bfloat16, ActivationQuant("int8", "token", True))
    refusals = {
        "int4": dataclasses.replace(base, weight_bits=4),
        "zeros": dataclasses.replace(base, has_zero_points=True),
        "act order": dataclasses.replace(base, act_order=True, group_size=32),
        "fp8 act on int": dataclasses.replace(base, activation=fp8_act),
        "int8 dtype": dataclasses.replace(base, act_dtype=torch.int8),
        "group 24": dataclasses.replace(base, group_size=24, in_features=48),
        "bad shards": dataclasses.replace(base, shard_sizes=(16, 8)),
    }
    for label, spec in refusals.items():
        assert qf.TritonInt8Gemm.for_capability(None).can_implement(spec), label
    nv = _spec("nvfp4", 4, 16, 64, 32, torch.bfloat16)
    assert qf.TritonNvfp4Gemm.can_implement(nv) is None
    static_nv = dataclasses.replace(nv, activation=ActivationQuant("nvfp4", "group", False, 16))
    assert "nvfp4" in qf.TritonNvfp4Gemm.can_implement(static_nv)
    assert "nvfp4 weights" in qf.TritonFp8Gemm.can_implement(nv)
    with pytest.raises(ValueError, match="triton_fp8_gemm: nvfp4 weights"):
        select_quantized_kernel(nv, [qf.TritonFp8Gemm])
    block_act = ActivationQuant("fp8", "group", True, 128)
    block = _spec("fp8", 8, 128, 256, 256, torch.bfloat16, block_act)
    assert select_quantized_kernel(block, kernels).name == "triton_fp8_gemm"


def test_unbound_kernels_refuse_on_a_gpu(monkeypatch):
    spec = _spec("fp8", 8, 64, 64, 32, torch.bfloat16, ActivationQuant("fp8", "token", True))
    monkeypatch.setattr(qf, "_INTERPRETED", False)
    assert "not bound to a device capability" in qf.TritonFp8Gemm.can_implement(spec)
    assert qf.TritonFp8Gemm.for_capability(FP8_FN).can_implement(spec) is None


def test_empty_batch_and_bad_inputs():
    w = fp8_weights(16, 32, "channel", torch.bfloat16, ActivationQuant("fp8", "token", True))
    kernel = qf.TritonFp8Gemm.for_capability(None)()
    layer = nn.Module()
    kernel.prepare(layer, w)
    assert kernel.apply(layer, torch.empty(0, 32, dtype=torch.bfloat16)).shape == (0, 16)
    with pytest.raises(ValueError, match="features"):
        kernel.apply(layer, torch.zeros(2, 31, dtype=torch.bfloat16))
