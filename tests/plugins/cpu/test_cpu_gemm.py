"""The CPU platform's prepacked oneDNN GEMM against a float64 reference, and the
packing pass that hands it the model's unquantized linears."""

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
from engine.plugins.cpu.gemm import OneDNNPackedGemm
from engine.plugins.cpu.platform import CPUPlatform

CPU = torch.device("cpu")


def _spec(dtype: torch.dtype) -> DenseLayerSpec:
    return DenseLayerSpec(in_features=8, out_features=4, dtype=dtype, device=CPU)


def test_cpu_platform_offers_the_packed_gemm():
    assert CPUPlatform().dense_gemm_kernels() == [OneDNNPackedGemm]


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
