"""The CPU plugin's quantized GEMM (csrc/gemm_quant.h, quant_gemm.py) on every ISA level
this CPU runs, against float64 products of weights dequantized here from their
definitions, and its activation quantize-dequantize against the torch reference bit
for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.core.interfaces import ActivationQuant, QuantizedLayerSpec, QuantizedWeights
from engine.plugins.cpu import kernel_build, quant_gemm
from engine.plugins.cpu.native import QACT_CODES, QSTRATEGY_CODES
from engine.plugins.cpu.platform import CPUPlatform
from engine.plugins.cpu.quant_gemm import CPUQuantizedGemm, act_order_permutation
from engine.quantization.numerics import quantize_dequantize
from engine.quantization.reference import TorchQuantizedGemm
from tests.plugins.cpu.references import assert_qgemm_close as _assert_close
from tests.plugins.cpu.references import qgemm_reference as _reference
from tests.plugins.cpu.references import quantized_weights as _weights

def _run(kernels, w: QuantizedWeights, x, bias=None) -> torch.Tensor:
    assert CPUQuantizedGemm.can_implement(w.spec) is None
    layer = nn.Module()
    kernel = CPUQuantizedGemm(kernels)
    kernel.prepare(layer, w)
    return kernel.apply(layer, x, bias)


# M = 1, 2 (two accumulator chains), 5 (a full decode block on 16-register levels), 7 and
# 97 (the prefill schedule, across one GEMM_CHUNK of 96 rows); K not a multiple of any
# level's K block.
ROWS = [1, 2, 5, 7, 97]
SCHEMES = [  # encoding, bits, group, zero points
    ("int", 4, 64, True), ("int", 4, 320, False), ("int", 8, 32, True), ("int", 8, 320, False),
    ("fp8", 8, 64, False), ("fp8", 8, 320, False), ("nvfp4", 4, 16, False),
]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s[0]}{s[1]}-g{s[2]}-z{int(s[3])}")
def test_weight_only_matches_float64(kernels, scheme, m):
    encoding, bits, group, zeros = scheme
    gen = torch.Generator().manual_seed(m * 31 + bits)
    w = _weights(gen, encoding, bits, 112, 320, group, zeros=zeros)
    x, bias = torch.randn(m, 320, generator=gen), torch.randn(112, generator=gen)
    _assert_close(_run(kernels, w, x, bias), _reference(w, x, bias))


@pytest.mark.parametrize("m", [3, 40])
def test_act_order_permutes_activations_once(kernels, m):
    gen = torch.Generator().manual_seed(5)
    w = _weights(gen, "int", 4, 64, 256, 32, act_order=True)
    assert act_order_permutation(w.g_idx, 32) is not None
    x = torch.randn(m, 256, generator=gen)
    _assert_close(_run(kernels, w, x), _reference(w, x, None))


def test_act_order_with_uneven_groups_is_refused():
    g_idx = torch.tensor([0, 0, 0, 1])
    with pytest.raises(ValueError, match="2 input features in each of 2 groups"):
        act_order_permutation(g_idx, 2)
    assert act_order_permutation(torch.arange(8) // 4, 4) is None


ACTIVATIONS = [
    ActivationQuant("int8", "token", True), ActivationQuant("int8", "tensor", False),
    ActivationQuant("fp8", "token", True), ActivationQuant("fp8", "tensor", True),
    ActivationQuant("fp8", "tensor", False), ActivationQuant("fp8", "group", True, 128),
    ActivationQuant("nvfp4", "group", True, 16),
]


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 33])
@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: f"{a.encoding}-{a.strategy}-"
                         f"{'dyn' if a.dynamic else 'static'}")
def test_activation_schemes_on_fused_shards(kernels, act, m, act_dtype):
    """Three output shards with their own static / global input scales (q / k / v of a
    fused layer), each shard's GEMM fed its own quantized activations (bf16 from the
    prefill sizes: rounded to bf16 as a bf16 model's quantize-dequantize returns them, on
    the bf16 schedule)."""
    gen = torch.Generator().manual_seed(m)
    encoding, bits, group = {"int8": ("int", 8, 256), "fp8": ("fp8", 8, 128),
                             "nvfp4": ("nvfp4", 4, 16)}[act.encoding]
    w = _weights(gen, encoding, bits, 96, 256, group, zeros=False, act=act, shards=(64, 16, 16),
                 act_dtype=act_dtype)
    x = (torch.randn(m, 256, generator=gen) * 3).to(act_dtype)
    bias = torch.randn(96, generator=gen).to(act_dtype)
    _assert_close(_run(kernels, w, x, bias), _reference(w, x, bias), act_dtype)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 20])
def test_narrow_activations(kernels, act_dtype, m):
    gen = torch.Generator().manual_seed(2)
    w = _weights(gen, "int", 4, 64, 256, 128, act_dtype=act_dtype)
    x = torch.randn(m, 256, generator=gen).to(act_dtype)
    bias = torch.randn(64, generator=gen).to(act_dtype)
    _assert_close(_run(kernels, w, x, bias), _reference(w, x, bias), act_dtype)


# int4 codes with bf16 activations where the level multiplies bf16 (vdpbf16ps): 1-2 rows
# (two accumulator sets), 6 (a full block), 7 and 63 (blocks and a remainder), 64 and 130
# (from QINT4_DEQUANTIZE_ROWS: each panel dequantized to bf16 once).
INT4_BF16_ROWS = [1, 2, 6, 7, 63, 64, 130]
INT4_BF16_LAYOUTS = {  # zero points, act-order, fused shards, group
    "zeros": (True, False, None, 64), "symmetric": (False, False, None, 128),
    "act-order": (True, True, None, 32), "shards": (False, False, (64, 32, 32), 256),
}


@pytest.mark.parametrize("m", INT4_BF16_ROWS)
@pytest.mark.parametrize("layout", list(INT4_BF16_LAYOUTS))
def test_int4_with_bf16_activations(kernels, layout, m):
    """The int4 x bf16 path against float64: output rounding to bf16 (2^-9 of a value) and
    the prefill's bf16 weights (as a bf16 model's dequantized weights) bound the error."""
    zeros, act_order, shards, group = INT4_BF16_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(m * 7 + len(layout))
    w = _weights(gen, "int", 4, 128, 512, group, zeros=zeros, act_order=act_order,
                 shards=shards, act_dtype=torch.bfloat16)
    x = (torch.randn(m, 512, generator=gen) * 2).bfloat16()
    bias = torch.randn(128, generator=gen).bfloat16()
    layer = nn.Module()
    kernel = CPUQuantizedGemm(kernels)
    kernel.prepare(layer, w)
    bf16_dot = kernel_build.LEVELS[kernels.level].bf16_dot
    assert kernel.path == ("int4 x bf16" if bf16_dot else "float32")
    got = kernel.apply(layer, x, bias)
    want = _reference(w, x, bias)
    assert got.dtype == torch.bfloat16
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < 4e-3, f"relative error {err:.2e}"


def test_int4_layer_packed_for_bf16_called_with_float32(kernels):
    """Where int4 layers of a bf16 model are packed for vdpbf16ps, float32 activations are
    an error, not a wrong product; elsewhere the layer multiplies them as any other."""
    gen = torch.Generator().manual_seed(3)
    w = _weights(gen, "int", 4, 64, 256, 64, act_dtype=torch.bfloat16)
    layer = nn.Module()
    kernel = CPUQuantizedGemm(kernels)
    kernel.prepare(layer, w)
    x = torch.randn(3, 256, generator=gen)
    if kernel_build.LEVELS[kernels.level].bf16_dot:
        with pytest.raises(ValueError, match="packed for bfloat16 activations"):
            kernel.apply(layer, x)
    else:
        _assert_close(kernel.apply(layer, x), _reference(w, x, None))


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: f"{a.encoding}-{a.strategy}")
def test_activation_qdq_is_bit_identical_to_the_reference(kernels, act):
    """Every rounding decision equals numerics.py's (torch's float8 conversion, round
    half to even, compressed-tensors' e2m1 table): values on and beside the ties."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=gen) * torch.logspace(-3, 2, 7)[:, None]
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 1e-6, 0.5])
    if act.encoding == "nvfp4":  # multiples of a scale landing on the e2m1 ties
        x[1, :16] = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25,
                                  -1.75, -2.5, -3.5, -5, 0.1])
    scale = 0.0 if act.dynamic and act.encoding != "nvfp4" else 0.37
    got = kernels.quantize_activations(x, QACT_CODES[act.encoding],
                                       QSTRATEGY_CODES[act.strategy], act.dynamic,
                                       act.group_size or 0, scale)
    tensor = torch.tensor(scale)
    want = quantize_dequantize(x, act, static_scale=None if act.dynamic else tensor,
                               global_scale=tensor if act.encoding == "nvfp4" else None)
    assert torch.equal(got, want)


def test_e4m3_rounding_matches_torch_on_every_boundary(kernels):
    """Midpoints between consecutive e4m3 values (and their neighbours one float32 ulp
    away) round as torch's float8 conversion does, subnormals included."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    probes = torch.cat([mids, torch.nextafter(mids, torch.zeros_like(mids)),
                        torch.nextafter(mids, torch.full_like(mids, 1e9)), values])
    x = torch.cat([probes, -probes])[None]
    got = kernels.quantize_activations(x, QACT_CODES["fp8"], QSTRATEGY_CODES["tensor"],
                                       False, 0, 1.0)
    assert torch.equal(got, x.to(torch.float8_e4m3fn).float())


def test_refusals_leave_the_reference_kernel_to_take_the_layer():
    spec = QuantizedLayerSpec("gptq", "int", 2, 64, 256, 64, torch.float32)
    assert "2-bit" in CPUQuantizedGemm.can_implement(spec)
    assert TorchQuantizedGemm.can_implement(spec) is None
    odd = QuantizedLayerSpec("ct", "int", 4, 64, 256, 72, torch.float32, shard_sizes=(64, 8))
    assert "multiples of 16" in CPUQuantizedGemm.can_implement(odd)


def test_platform_order_and_its_override(monkeypatch):
    monkeypatch.delenv(quant_gemm.QUANT_GEMM_ENV, raising=False)
    assert CPUPlatform().quantized_gemm_kernels() == [CPUQuantizedGemm, TorchQuantizedGemm]
    monkeypatch.setenv(quant_gemm.QUANT_GEMM_ENV, "torch")
    assert CPUPlatform().quantized_gemm_kernels() == [TorchQuantizedGemm, CPUQuantizedGemm]
    monkeypatch.setenv(quant_gemm.QUANT_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="expected auto, native or torch"):
        CPUPlatform().quantized_gemm_kernels()


def test_packed_bytes_are_the_quantized_size(engine_kernels):
    """An int4 layer packs into ~a quarter of its bf16 bytes (plus group scales)."""
    gen = torch.Generator().manual_seed(1)
    w = _weights(gen, "int", 4, 256, 1024, 128)
    layer = nn.Module()
    CPUQuantizedGemm(engine_kernels).prepare(layer, w)
    bf16_bytes = 256 * 1024 * 2
    assert bf16_bytes / 4 < layer.q_packed.numel() < bf16_bytes / 3.3
    assert [name for name, _ in layer.named_buffers()] == ["q_packed"]


def test_malformed_calls_are_value_errors(engine_kernels):
    gen = torch.Generator().manual_seed(3)
    w = _weights(gen, "int", 4, 64, 256, 64)
    layer = nn.Module()
    kernel = CPUQuantizedGemm(engine_kernels)
    kernel.prepare(layer, w)
    with pytest.raises(ValueError, match="bias must be"):
        kernel.apply(layer, torch.randn(2, 256), torch.randn(63))
    with pytest.raises(ValueError, match="qgemm refused"):
        engine_kernels.qgemm(torch.zeros(4096, dtype=torch.uint8), torch.randn(1, 256), 64)


def test_w8a8_multiplies_int8_where_the_level_has_vnni(kernels):
    """Symmetric per-channel int8 weights with int8 activations take the int8 x int8 path
    on levels with VNNI (the avx512_bf16 and amx builds) and the float path elsewhere;
    both match the float64 product of the quantize-dequantized activations."""
    gen = torch.Generator().manual_seed(9)
    w = _weights(gen, "int", 8, 64, 512, 512, zeros=False,
                 act=ActivationQuant("int8", "token", True))
    layer = nn.Module()
    kernel = CPUQuantizedGemm(kernels)
    kernel.prepare(layer, w)
    assert kernel.vnni == (kernels.level in ("avx512_bf16", "amx"))
    assert kernel.description.endswith(", int8 vnni)") == kernel.vnni
    for m in (1, 7, 100):
        x = torch.randn(m, 512, generator=gen)
        _assert_close(kernel.apply(layer, x), _reference(w, x, None))
    with_zeros = _weights(gen, "int", 8, 64, 512, 512, act=ActivationQuant("int8", "token", True))
    asym = CPUQuantizedGemm(kernels)
    asym.prepare(nn.Module(), with_zeros)
    assert not asym.vnni  # zero points: the float path
