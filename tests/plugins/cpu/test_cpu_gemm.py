"""The CPU platform's GEMMs (the AVX512-BF16 C kernel, prepacked oneDNN) against a
float64 reference, and the packing pass that hands them the model's unquantized linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.core.interfaces import DenseGemmKernel, DenseLayerSpec
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.linear import (
    MergedLinear,
    ReplicatedLinear,
    pack_dense_weights,
)
from engine.plugins.cpu import gemm as cpu_gemm
from engine.plugins.cpu.gemm import AVX512BF16Gemm, AVX512BF16PlainGemv, OneDNNPackedGemm
from engine.plugins.cpu.platform import CPUPlatform

CPU = torch.device("cpu")


def _spec(dtype: torch.dtype) -> DenseLayerSpec:
    return DenseLayerSpec(in_features=8, out_features=4, dtype=dtype, device=CPU)


def test_cpu_platform_prefers_its_own_bf16_gemm_then_onednn(monkeypatch):
    monkeypatch.delenv(cpu_gemm.GEMM_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm.kernel_build, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert CPUPlatform().dense_gemm_kernels() == [
        AVX512BF16Gemm, OneDNNPackedGemm, AVX512BF16PlainGemv
    ]


def test_amx_cpus_and_the_environment_put_onednn_first(monkeypatch):
    onednn_first = [OneDNNPackedGemm, AVX512BF16Gemm, AVX512BF16PlainGemv]
    monkeypatch.delenv(cpu_gemm.GEMM_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm.kernel_build, "cpu_flags", lambda: frozenset(
        {"avx512_bf16", "amx_bf16", "amx_tile"}))
    # oneDNN's AMX GEMM is several times faster at prefill sizes.
    assert CPUPlatform().dense_gemm_kernels() == onednn_first
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "avx512_bf16")
    assert CPUPlatform().dense_gemm_kernels()[0] is AVX512BF16Gemm
    monkeypatch.setattr(cpu_gemm.kernel_build, "cpu_flags", lambda: frozenset())
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "onednn")
    assert CPUPlatform().dense_gemm_kernels() == onednn_first
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="ENGINE_CPU_GEMM='mkl'"):
        CPUPlatform().dense_gemm_kernels()


def _bf16_gemm() -> AVX512BF16Gemm:
    reason = AVX512BF16Gemm.can_implement(DenseLayerSpec(64, 64, torch.bfloat16, CPU))
    if reason is not None:
        pytest.skip(reason)
    return AVX512BF16Gemm()


def _bf16_reference(x, weight, bias):
    """float64 product, then what one rounding to bf16 may move it by."""
    ref = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    return ref, ref.abs() * 2.0**-8 + 1e-3


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 6, 7, 48, 53, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 2), (96, 80), (208, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_matches_float64(num_tokens, out_features, in_features, with_bias):
    """Every register block height (1-6 rows, several row chunks) and panel width
    (208 = three full panels of 64 and one of 16; 96 = 64 + 32)."""
    kernel = _bf16_gemm()
    gen = torch.Generator().manual_seed(num_tokens * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(num_tokens, in_features, generator=gen).bfloat16()
    y = kernel.apply(kernel.prepare(weight), x, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (num_tokens, out_features)
    ref, tol = _bf16_reference(x, weight, bias)
    assert bool(((y.double() - ref).abs() <= tol).all())


def test_bf16_gemm_reads_strided_and_batched_inputs():
    kernel = _bf16_gemm()
    weight = torch.randn(48, 64).bfloat16()
    packed = kernel.prepare(weight)
    wide = torch.randn(9, 3 * 64).bfloat16()
    x = wide[:, 64:128]  # a column slice of a fused projection's output
    ref, tol = _bf16_reference(x, weight, None)
    assert bool(((kernel.apply(packed, x).double() - ref).abs() <= tol).all())
    batched = torch.randn(2, 3, 64).bfloat16()
    y = kernel.apply(packed, batched)
    ref, tol = _bf16_reference(batched.reshape(6, 64), weight, None)
    assert y.shape == (2, 3, 48)
    assert bool(((y.reshape(6, 48).double() - ref).abs() <= tol).all())
    single = wide[4:5, 64:128]  # one row: its row stride does not matter
    ref, tol = _bf16_reference(single, weight, None)
    assert bool(((kernel.apply(packed, single).double() - ref).abs() <= tol).all())


def test_bf16_gemm_refuses_what_it_cannot_run():
    def spec(out_features=64, in_features=64, dtype=torch.bfloat16, device=CPU):
        return DenseLayerSpec(in_features, out_features, dtype, device)

    assert "bf16 only" in AVX512BF16Gemm.can_implement(spec(dtype=torch.float32))
    assert "not the CPU" in AVX512BF16Gemm.can_implement(spec(device=torch.device("meta")))
    kernel = _bf16_gemm()
    assert "multiples of 16" in AVX512BF16Gemm.can_implement(spec(out_features=40))
    assert "even number" in AVX512BF16Gemm.can_implement(spec(in_features=33))
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.prepare(torch.randn(16, 8))
    with pytest.raises(ValueError, match="refused"):
        kernel.prepare(torch.randn(20, 8).bfloat16())
    packed = kernel.prepare(torch.randn(16, 8).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.apply(packed, torch.randn(2, 8))
    with pytest.raises(ValueError, match="no rows of 6"):
        kernel.apply(packed, torch.randn(2, 6).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        kernel.apply(packed, torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16())


def test_packed_gemm_refuses_what_it_cannot_run():
    assert "float16" in OneDNNPackedGemm.can_implement(_spec(torch.float16))
    meta = DenseLayerSpec(8, 4, torch.float32, torch.device("meta"))
    assert "not the CPU" in OneDNNPackedGemm.can_implement(meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 67])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_matches_float64(dtype, num_tokens, with_bias):
    if OneDNNPackedGemm.can_implement(_spec(dtype)) is not None:
        pytest.skip(OneDNNPackedGemm.can_implement(_spec(dtype)))
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(num_tokens, 80, generator=gen).to(dtype)
    kernel = OneDNNPackedGemm()
    y = kernel.apply(kernel.prepare(weight), x, bias)
    ref = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert y.dtype == dtype and y.shape == (num_tokens, 96)
    # bf16 output: one rounding of a ~10-magnitude value; float32: accumulation order.
    tol = 0.1 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=1e-2)


def test_packed_gemm_reads_strided_inputs():
    kernel = OneDNNPackedGemm()
    weight = torch.randn(16, 8)
    x = torch.randn(4, 24)[:, 8:16]  # a column slice, as a fused projection hands over
    y = kernel.apply(kernel.prepare(weight), x)
    torch.testing.assert_close(y.double(), x.double() @ weight.double().T, atol=1e-4, rtol=0)


class _TinyNet(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        common = {"dtype": torch.float32, "device": CPU}
        self.embed = VocabEmbedding(32, 8, **common)
        self.proj = MergedLinear(8, {0: 6, 1: 6}, bias=True, **common)
        self.down = ReplicatedLinear(12, 8, bias=False, **common)
        self.head = LMHead(32, 8, **common)
        if tied:
            self.head.tie_to(self.embed)
        for p in self.parameters():
            p.data.normal_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.proj(self.embed(ids))))


@pytest.mark.parametrize("tied", [False, True])
def test_pack_dense_weights_keeps_the_model_output(tied):
    torch.manual_seed(0)
    net = _TinyNet(tied)
    ids = torch.tensor([1, 5, 31])
    expected = net(ids)
    packed = pack_dense_weights(net, [OneDNNPackedGemm])
    # An LM head tied to the embedding stays plain: the lookup needs the dense matrix.
    assert packed == (2 if tied else 3)
    assert net.proj.gemm_kernel is not None and net.down.weight.is_mkldnn
    assert (net.head.gemm_kernel is None) == tied
    assert not net.embed.weight.is_mkldnn
    torch.testing.assert_close(net(ids), expected, atol=1e-4, rtol=1e-4)
    assert pack_dense_weights(net, [OneDNNPackedGemm]) == 0  # packing happens once


class _Refuses(DenseGemmKernel):
    name = "refuses"

    @classmethod
    def can_implement(cls, spec):
        return "never"

    def prepare(self, weight):
        raise AssertionError("a refusing kernel is never asked to pack")

    def apply(self, weight, x, bias=None):
        raise AssertionError("a refusing kernel is never applied")


def test_kernels_are_offered_in_preference_order():
    net = _TinyNet(tied=False)
    assert pack_dense_weights(net, [_Refuses]) == 0
    assert net.proj.gemm_kernel is None  # F.linear stays
    assert pack_dense_weights(net, [_Refuses, OneDNNPackedGemm]) == 3
    assert isinstance(net.proj.gemm_kernel, OneDNNPackedGemm)


def _plain_gemv() -> AVX512BF16PlainGemv:
    reason = AVX512BF16PlainGemv.can_implement(DenseLayerSpec(64, 64, torch.bfloat16, CPU))
    if reason is not None:
        pytest.skip(reason)
    return AVX512BF16PlainGemv()


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(5, 33), (67, 100), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_gemv_matches_float64(num_tokens, out_features, in_features, with_bias):
    """Up to 4 rows through the C row GEMV (every tail of 4 weight rows and of 32 input
    features), more through F.linear; the weight is used as it is."""
    kernel = _plain_gemv()
    gen = torch.Generator().manual_seed(num_tokens * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(num_tokens, in_features, generator=gen).bfloat16()
    assert kernel.prepare(weight) is weight
    y = kernel.apply(weight, x, bias)
    ref, tol = _bf16_reference(x, weight, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (num_tokens, out_features)
    assert bool(((y.double() - ref).abs() <= tol).all())


def test_plain_gemv_reads_strided_rows_and_refuses_bad_input():
    kernel = _plain_gemv()
    weight = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 128).bfloat16()[:, 32:96]
    ref, tol = _bf16_reference(x, weight, None)
    assert bool(((kernel.apply(weight, x).double() - ref).abs() <= tol).all())
    with pytest.raises(ValueError, match="1 to 4 rows"):
        kernel.kernels.gemv_bf16(weight, torch.randn(5, 64).bfloat16())
    with pytest.raises(ValueError, match="row-major"):
        kernel.kernels.gemv_bf16(weight, torch.randn(1, 32).bfloat16())


def test_a_tied_head_keeps_the_shared_weight_and_takes_only_layout_keeping_kernels():
    _plain_gemv()
    torch.manual_seed(0)
    net = _TinyNet(tied=True).to(torch.bfloat16)
    ids = torch.tensor([1, 5, 31])
    expected = net(ids[:1])
    embedding = net.embed.weight
    packed = pack_dense_weights(net, [AVX512BF16Gemm, OneDNNPackedGemm, AVX512BF16PlainGemv])
    assert packed == 3
    assert isinstance(net.head.gemm_kernel, AVX512BF16PlainGemv)
    assert net.head.weight is embedding and net.embed.weight is embedding
    assert not isinstance(net.proj.gemm_kernel, AVX512BF16PlainGemv)
    torch.testing.assert_close(net(ids[:1]), expected, atol=0.1, rtol=2e-2)
