"""Triton weight-only int GEMMs (plain W4A16 / W8A16 layout and the Marlin-style one) vs a
float64 reference of the dequantized weights, ``x.double() @ W.double().T (+ bias)``.

Runs on CPU tensors under TRITON_INTERPRET=1 (conftest.py); sizes stay tiny. The cases
cover odd M (1, 3, 17), K not a multiple of the K step, groups smaller than the K tile
(several per tile), larger than it (several tiles per group), neither (tiles straddling
groups), per-channel scales, act-order permutations, zero points and symmetric codes, 4
and 8 bits, bias, split-K and single-pass launches. Every output and split-K workspace
starts NaN-filled (:func:`poisoned`), so an element left unwritten, or a workspace entry
read before it is written, fails the comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import engine.kernels.quant_gemm_int as qi
from engine.core.interfaces import (
    ActivationQuant,
    DeviceCapability,
    QuantizedLayerSpec,
    QuantizedWeights,
)
from engine.kernels.quant_gemm_int import (
    IntGemmConfig,
    TritonMarlinGemm,
    TritonW4A16Gemm,
    int_gemm,
    int_gemm_kernels,
    marlin_repack,
    marlin_stripes,
    marlin_unpack,
    pack_int_weight,
    pack_words,
    unpack_words,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Outputs and split-K workspaces start as NaN."""

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(qi, "_new_buffer", nan_buffer)
    qi.launches.reset()


def make_weights(n, k, group, bits, zero_points, act_order=False, seed=0,
                 dtype=torch.float32) -> QuantizedWeights:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.005
    zeros = None
    if zero_points:  # fractional zero points too: the canonical form allows any float
        zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
        zeros[:, ::2] += 0.25
    g_idx = None
    if act_order:  # a GPTQ desc_act g_idx: group sizes kept, features shuffled
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)]
    spec = QuantizedLayerSpec("test", "int", bits, group, k, n, dtype,
                              has_zero_points=zero_points, act_order=act_order)
    return QuantizedWeights(spec, codes, scales, zeros, g_idx, shard_sizes=(n,))


def dequantized(weights: QuantizedWeights) -> torch.Tensor:
    """float64 [N, K], written out independently of the kernels' packing."""
    spec = weights.spec
    k = spec.in_features
    groups = weights.g_idx if weights.g_idx is not None else torch.arange(k) // spec.group_size
    zero = (weights.zeros.double()[:, groups] if weights.zeros is not None
            else float(1 << (spec.weight_bits - 1)))
    return (weights.codes.double() - zero) * weights.scales.double()[:, groups]


def check(weights, m, *, tiled, config=None, bias=False, dtype=torch.float32, lead=(),
          seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n, k = weights.codes.shape
    x = torch.randn(*lead, m, k, generator=gen).to(dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(dtype) if bias else None
    packed = pack_int_weight(weights, tiled=tiled)
    got = int_gemm(x, packed, b, config=config)
    assert got.shape == (*lead, m, n) and got.dtype == dtype
    want = x.double() @ dequantized(weights).T
    if b is not None:
        want = want + b.double()
    assert not got.isnan().any(), "an output element was left unwritten (NaN)"
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g}"
    return got


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips(bits):
    w = make_weights(128, 192, 64, bits, True)
    words = pack_words(w.codes, bits)
    assert words.dtype == torch.int32 and words.shape == (128, 192 * bits // 32)
    assert torch.equal(unpack_words(words, bits), w.codes)
    tiled = marlin_repack(w.codes, bits)
    assert tiled.shape == (2, 192 * bits // 32, 64) and tiled.is_contiguous()
    assert torch.equal(marlin_unpack(tiled, bits), w.codes)
    # the plain layout and the Marlin-style one hold the same words, in other places
    assert torch.equal(tiled[1, :, 5], words[64 + 5])


def test_marlin_tile_is_one_contiguous_range():
    """The BLOCK_K x 64 tile at K step k0 of stripe s is one slice of the flat buffer."""
    bits, n, k, block_k = 4, 128, 256, 64
    w = make_weights(n, k, 64, bits, False)
    flat = marlin_repack(w.codes, bits).reshape(-1)
    pack = 32 // bits
    stripe, k0 = 1, 128
    start = stripe * (k // pack) * 64 + (k0 // pack) * 64
    tile = flat[start:start + block_k // pack * 64].reshape(block_k // pack, 64)
    codes = unpack_words(tile.t().contiguous(), bits)  # [64 cols, block_k]
    assert torch.equal(codes, w.codes[stripe * 64:(stripe + 1) * 64, k0:k0 + block_k])
    scales = marlin_stripes(w.scales)
    assert torch.equal(scales[1, 3], w.scales[64:128, 3])


def test_act_order_is_sorted_into_groups():
    w = make_weights(64, 128, 32, 4, True, act_order=True)
    packed = pack_int_weight(w)
    assert packed.perm is not None
    assert torch.equal(w.g_idx[packed.perm], torch.arange(128) // 32)
    assert torch.equal(unpack_words(packed.words.t().contiguous(), 4), w.codes[:, packed.perm])
    plain = make_weights(64, 128, 32, 4, True)
    plain.g_idx = torch.arange(128) // 32  # a trivial g_idx needs no permutation
    assert pack_int_weight(plain).perm is None
    bad = make_weights(64, 128, 32, 4, True)
    bad.g_idx = torch.zeros(128, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not put 32 input features"):
        pack_int_weight(bad)


# --------------------------------------------------------------------------- plain kernel

# n, k, group, block_k: what the tiles see
PLAIN_CASES = [
    (96, 200, 200, 64),  # per-channel, K tail (200 = 3 x 64 + 8)
    (80, 192, 32, 64),  # two groups per K tile
    (64, 256, 64, 32),  # two K tiles per group
    (72, 240, 48, 32),  # tiles straddle groups, K tail of 16
]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "group", "block_k"), PLAIN_CASES)
def test_plain_kernel(m, n, k, group, block_k):
    for bits, zp in ((4, True), (8, False)):
        w = make_weights(n, k, group, bits, zp, seed=m)
        config = IntGemmConfig(16, 32, block_k)
        check(w, m, tiled=False, config=config, bias=m == 3)
    assert qi.launches.int_gemm == 2 and qi.launches.split_k_reduce == 0


@pytest.mark.parametrize(("bits", "zp"), [(4, False), (8, True)])
@pytest.mark.parametrize("m", [1, 17])
def test_plain_split_k(bits, zp, m):
    """Three splits over 240 features in 32-steps (8 tiles -> 3, 3, 2), bias in the reduce."""
    w = make_weights(72, 240, 48, bits, zp, act_order=True)
    check(w, m, tiled=False, config=IntGemmConfig(16, 32, 32, split_k=3), bias=True)
    assert qi.launches.int_gemm == 1 and qi.launches.split_k_reduce == 1


@pytest.mark.parametrize("m", [1, 3, 17])
def test_plain_act_order(m):
    w = make_weights(48, 128, 32, 4, True, act_order=True, seed=m)
    check(w, m, tiled=False, config=IntGemmConfig(16, 16, 64))  # group 32 < block_k 64
    check(w, m, tiled=False, config=IntGemmConfig(16, 16, 32))


def test_plain_word_per_row_loads():
    w = make_weights(40, 96, 32, 4, True, act_order=True)
    check(w, 3, tiled=False, config=IntGemmConfig(16, 32, 64, wide_load=False), bias=True)
    check(w, 1, tiled=False, config=IntGemmConfig(16, 32, 32, split_k=2, wide_load=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations(dtype):
    w = make_weights(64, 128, 64, 4, True, dtype=dtype)
    check(w, 3, tiled=False, config=IntGemmConfig(16, 32, 64), bias=True, dtype=dtype)
    check(w, 3, tiled=True, config=IntGemmConfig(16, 64, 64, split_k=2), bias=True,
          dtype=dtype)


def test_default_configs_and_leading_dims(monkeypatch):
    """The host's own choice: decode splits K when the device has room (64 "units"
    here), prefill does not; x may have leading dims."""
    monkeypatch.setattr(qi, "compute_units", lambda device: 64)
    w = make_weights(64, 512, 128, 4, True)
    check(w, 2, tiled=False, lead=(2,))
    assert qi.launches.split_k_reduce == 1
    check(w, 17, tiled=False)
    assert qi.launches.split_k_reduce == 1 and qi.launches.int_gemm == 2
    check(w, 1, tiled=True)
    assert qi.launches.split_k_reduce == 2 and qi.launches.marlin_gemm == 1


def test_choose_config():
    w = pack_int_weight(make_weights(4096, 4096, 128, 4, True))
    decode = qi.choose_config(1, w, torch.bfloat16, 132)
    assert (decode.block_m, decode.block_k) == (16, 128) and decode.split_k == 4
    assert qi.choose_config(2048, w, torch.bfloat16, 132).split_k == 1
    small_group = pack_int_weight(make_weights(64, 256, 32, 4, True))
    cfg = qi.choose_config(1, small_group, torch.bfloat16, 132)
    assert cfg.block_k == 32 and qi.group_mode(cfg.block_k, small_group) == 0
    tiled = pack_int_weight(make_weights(128, 192, 192, 4, True), tiled=True)
    cfg = qi.choose_config(1, tiled, torch.bfloat16, 132)
    assert cfg.block_n == 64 and 192 % cfg.block_k == 0


def test_split_k_is_deterministic():
    w = make_weights(64, 256, 64, 4, True)
    config = IntGemmConfig(16, 32, 32, split_k=5)
    first = check(w, 3, tiled=False, config=config)
    assert torch.equal(first, check(w, 3, tiled=False, config=config))


def test_out_buffer_and_empty_batch():
    w = make_weights(64, 128, 64, 4, True)
    packed = pack_int_weight(w)
    x = torch.randn(3, 128)
    out = torch.full((3, 64), float("nan"))
    assert int_gemm(x, packed, out=out) is out
    assert not out.isnan().any()
    assert int_gemm(torch.randn(0, 128), packed).shape == (0, 64)
    with pytest.raises(ValueError, match="out must be"):
        int_gemm(x, packed, out=torch.empty(3, 65))
    with pytest.raises(ValueError, match="powers of two"):
        int_gemm(x, packed, config=IntGemmConfig(16, 48, 64))


# --------------------------------------------------------------------------- Marlin-style

# n, k, group, block_k
MARLIN_CASES = [
    (128, 192, 32, 64),  # two groups per tile
    (64, 256, 128, 64),  # two tiles per group
    (64, 192, 192, 64),  # per-channel
    (128, 192, 96, 64),  # tiles straddle groups (96 = 1.5 tiles)
]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "group", "block_k"), MARLIN_CASES)
def test_marlin_kernel(m, n, k, group, block_k):
    for bits, zp in ((4, False), (8, True)):
        w = make_weights(n, k, group, bits, zp, seed=m)
        check(w, m, tiled=True, config=IntGemmConfig(16, 64, block_k), bias=m == 17)
    assert qi.launches.marlin_gemm == 2 and qi.launches.split_k_reduce == 0


@pytest.mark.parametrize("m", [1, 3, 17])
def test_marlin_split_k_and_act_order(m):
    w = make_weights(128, 256, 32, 4, True, act_order=True, seed=m)
    check(w, m, tiled=True, config=IntGemmConfig(16, 64, 32, split_k=3), bias=True)
    check(w, m, tiled=True, config=IntGemmConfig(16, 64, 64))
    assert qi.launches.split_k_reduce == 1 and qi.launches.marlin_gemm == 2


def test_marlin_config_checks():
    packed = pack_int_weight(make_weights(64, 192, 64, 4, True), tiled=True)
    x = torch.randn(1, 192)
    with pytest.raises(ValueError, match="stripe width"):
        int_gemm(x, packed, config=IntGemmConfig(16, 32, 64))
    with pytest.raises(ValueError, match="does not divide K"):
        int_gemm(x, packed, config=IntGemmConfig(16, 64, 128))


# --------------------------------------------------------------------------- interface


def spec(**overrides) -> QuantizedLayerSpec:
    fields = {"scheme": "gptq", "encoding": "int", "weight_bits": 4, "group_size": 64,
              "in_features": 256, "out_features": 128, "act_dtype": torch.bfloat16}
    fields.update(overrides)
    return QuantizedLayerSpec(**fields)


def test_can_implement_refusals(monkeypatch):
    for kernel in (TritonW4A16Gemm, TritonMarlinGemm):
        assert kernel.can_implement(spec()) is None
        assert kernel.can_implement(spec(weight_bits=8, act_dtype=torch.float32)) is None
        assert "fp8 weights" in kernel.can_implement(spec(encoding="fp8", weight_bits=8))
        assert "3-bit" in kernel.can_implement(spec(weight_bits=3))
        act = ActivationQuant("int8", "token", True)
        assert "weight-only" in kernel.can_implement(spec(weight_bits=8, activation=act))
        assert "activations in torch.int8" in kernel.can_implement(spec(act_dtype=torch.int8))
        assert "groups of 96" in kernel.can_implement(spec(group_size=96))
    assert "int32 words" in TritonW4A16Gemm.can_implement(spec(in_features=100, group_size=100))
    assert TritonW4A16Gemm.can_implement(spec(out_features=72, in_features=200,
                                              group_size=200)) is None
    assert "multiples of 64" in TritonMarlinGemm.can_implement(spec(out_features=72))
    assert "multiples of 64" in TritonMarlinGemm.can_implement(spec(in_features=96,
                                                                    group_size=32))
    monkeypatch.setattr(qi, "INTERPRETED", False)
    assert "TRITON_INTERPRET=1" in TritonW4A16Gemm.can_implement(spec())
    hopper = DeviceCapability("nvidia", "sm_90", 9, 0)
    assert TritonMarlinGemm.for_capability(hopper).can_implement(spec()) is None
    volta = TritonW4A16Gemm.for_capability(DeviceCapability("nvidia", "sm_70", 7, 0))
    assert "bfloat16" in volta.can_implement(spec())
    assert volta.can_implement(spec(act_dtype=torch.float16)) is None
    pascal = TritonW4A16Gemm.for_capability(DeviceCapability("nvidia", "sm_60", 6, 0))
    assert "7.0" in pascal.can_implement(spec(act_dtype=torch.float16))
    monkeypatch.setattr(qi, "triton", None)
    assert "triton" in TritonW4A16Gemm.for_capability(hopper).can_implement(spec())


def test_binding_and_platform_order(monkeypatch):
    cap = DeviceCapability("amd", "gfx942", 9, 4)
    kernels = int_gemm_kernels(cap)
    assert [k.name for k in kernels] == ["triton_marlin", "triton_w4a16"]
    assert all(k.capability == cap for k in kernels) and kernels == int_gemm_kernels(cap)
    assert issubclass(kernels[0], TritonMarlinGemm) and kernels[0].family == "marlin"
    assert int_gemm_kernels(None) == [TritonMarlinGemm, TritonW4A16Gemm]
    monkeypatch.setenv(qi.ORDER_ENV, "plain")
    assert [k.name for k in int_gemm_kernels(cap)] == ["triton_w4a16", "triton_marlin"]
    monkeypatch.setenv(qi.ORDER_ENV, "fast")
    with pytest.raises(ValueError, match="expected auto or plain"):
        int_gemm_kernels(cap)
    monkeypatch.delenv(qi.ORDER_ENV)

    from engine.plugins.cuda.platform import CUDAPlatform
    from engine.quantization import KernelFamily

    monkeypatch.setattr(CUDAPlatform, "device_capability", lambda self: cap)
    offered = CUDAPlatform.__new__(CUDAPlatform).quantized_gemm_kernels()
    assert offered[:2] == kernels
    marlin = KernelFamily("marlin", "gptq_marlin")
    assert [k.name for k in offered if marlin(k)] == ["triton_marlin"]


@pytest.mark.parametrize("kernel_cls", [TritonMarlinGemm, TritonW4A16Gemm])
def test_kernel_interface(kernel_cls):
    """prepare keeps the packed weights as the layer's buffers; apply runs them."""
    w = make_weights(128, 256, 64, 4, True, act_order=True)
    layer = nn.Module()
    kernel = kernel_cls()
    kernel.prepare(layer, w)
    buffers = dict(layer.named_buffers())
    assert set(buffers) == {"tq_words", "tq_scales", "tq_perm", "tq_zeros"}
    assert buffers["tq_words"].numel() * 4 == 128 * 256 // 2  # 4 bits a code
    assert kernel.description == f"{kernel_cls.name} (int4)"
    x = torch.randn(2, 5, 256)
    bias = torch.randn(128)
    want = x.double() @ dequantized(w).T + bias.double()
    got = kernel.apply(layer, x, bias)
    assert got.shape == (2, 5, 128)
    assert float((got.double() - want).abs().max() / want.abs().max()) <= 2e-5
