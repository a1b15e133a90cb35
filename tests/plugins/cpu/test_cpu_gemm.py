"""The CPU platform's GEMMs (the plugin's C GEMM on every ISA level, prepacked oneDNN)
against a float64 reference, and the packing pass that hands them the model's linears."""

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
from engine.plugins.cpu.gemm import CPUPackedGemm, CPUPlainGemm, OneDNNPackedGemm
from engine.plugins.cpu.platform import CPUPlatform
from tests.plugins.cpu.references import BF16, F16, F32
from tests.plugins.cpu.references import assert_gemm_close as _assert_close

CPU = torch.device("cpu")
# (activations, weights): what the engine runs -- one dtype, or narrow weights computed in
# float32 (a bf16 / fp16 checkpoint on a CPU without native arithmetic for it).
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (F32, F16)]
_PAIR_IDS = [f"{str(a)[6:]}-x-{str(w)[6:]}-w" for a, w in DTYPE_PAIRS]


def _spec(dtype: torch.dtype, act: torch.dtype | None = None, **kw) -> DenseLayerSpec:
    return DenseLayerSpec(kw.get("in_features", 8), kw.get("out_features", 16), dtype,
                          kw.get("device", CPU), activation_dtype=act)


def _operands(gen, m, n, k, act, wdt, with_bias):
    weight = torch.randn(n, k, generator=gen).to(wdt)
    bias = torch.randn(n, generator=gen).to(act) if with_bias else None
    x = torch.randn(m, k, generator=gen).to(act)
    return x, weight, bias


# -- kernel order -------------------------------------------------------------------------

def _fake_cpu(monkeypatch, flags, amx_kernels=False):
    class Kernels:
        has_amx = amx_kernels

    monkeypatch.setattr(cpu_gemm.kernel_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_gemm, "load_kernels", lambda: Kernels())


def test_the_plugins_gemm_comes_first_then_onednn(monkeypatch):
    monkeypatch.delenv(cpu_gemm.GEMM_ENV, raising=False)
    _fake_cpu(monkeypatch, {"avx2"})
    assert CPUPlatform().dense_gemm_kernels() == [CPUPackedGemm, OneDNNPackedGemm, CPUPlainGemm]


def test_amx_cpus_without_amx_kernels_and_the_environment_put_onednn_first(monkeypatch):
    onednn_first = [OneDNNPackedGemm, CPUPackedGemm, CPUPlainGemm]
    monkeypatch.delenv(cpu_gemm.GEMM_ENV, raising=False)
    _fake_cpu(monkeypatch, {"avx512_bf16", "amx_bf16", "amx_tile"})
    # oneDNN's AMX GEMM is several times faster at prefill sizes than vdpbf16ps.
    assert CPUPlatform().dense_gemm_kernels() == onednn_first
    _fake_cpu(monkeypatch, {"avx512_bf16", "amx_bf16", "amx_tile"}, amx_kernels=True)
    assert CPUPlatform().dense_gemm_kernels()[0] is CPUPackedGemm
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "native")
    _fake_cpu(monkeypatch, {"avx512_bf16", "amx_bf16", "amx_tile"})
    assert CPUPlatform().dense_gemm_kernels()[0] is CPUPackedGemm
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "avx512_bf16")  # the older name of "native"
    assert CPUPlatform().dense_gemm_kernels()[0] is CPUPackedGemm
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "onednn")
    _fake_cpu(monkeypatch, set())
    assert CPUPlatform().dense_gemm_kernels() == onednn_first
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="ENGINE_CPU_GEMM='mkl'"):
        CPUPlatform().dense_gemm_kernels()


# -- the packed GEMM ------------------------------------------------------------------------

ROWS = (0, 1, 2, 3, 5, 6, 7, 13, 48, 53, 100)


@pytest.mark.parametrize(("act", "wdt"), DTYPE_PAIRS, ids=_PAIR_IDS)
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(16, 2), (96, 80), (208, 130), (64, 600), (48, 256), (32, 67)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_matches_float64(kernels, act, wdt, out_features, in_features, with_bias):
    """Every register block height (decode sizes 1-6 streamed, larger M in chunks of
    rows), full and narrow panels (16 = one narrow panel; 208 = 3 x 64 + 16 on AVX-512),
    one and several K blocks (600 k); on the amx level, K = 256 from 32 rows on runs the
    tiles; K not a multiple of the decode loops' unrolling (2: pairs, 130: four k a pass
    and a pair left, 67: a single k left)."""
    gemm = CPUPackedGemm(kernels)
    spec = DenseLayerSpec(in_features, out_features, wdt, CPU, activation_dtype=act)
    assert CPUPackedGemm.can_implement(spec) is None
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    x, weight, bias = _operands(gen, max(ROWS), out_features, in_features, act, wdt, with_bias)
    packed = gemm.prepare(weight, spec)
    assert packed.dtype == wdt and packed.numel() == weight.numel()  # stays in its dtype
    for m in ROWS:
        _assert_close(gemm.apply(packed, x[:m], bias), x[:m], weight, bias)


@pytest.mark.parametrize(("act", "wdt"), [(BF16, BF16), (F32, BF16), (F32, F32)],
                         ids=["bf16-x-bf16-w", "f32-x-bf16-w", "f32-x-f32-w"])
def test_packed_gemm_reads_strided_and_batched_inputs(kernels, act, wdt):
    gemm = CPUPackedGemm(kernels)
    weight = torch.randn(48, 64).to(wdt)
    packed = gemm.prepare(weight, _spec(wdt, act, in_features=64, out_features=48))
    wide = torch.randn(9, 3 * 64).to(act)
    x = wide[:, 64:128]  # a column slice of a fused projection's output
    _assert_close(gemm.apply(packed, x), x, weight)
    batched = torch.randn(2, 3, 64).to(act)
    y = gemm.apply(packed, batched)
    assert y.shape == (2, 3, 48)
    _assert_close(y.reshape(6, 48), batched.reshape(6, 64), weight)
    single = wide[4:5, 64:128]  # one row: its row stride does not matter
    _assert_close(gemm.apply(packed, single), single, weight)


def test_packed_gemm_refuses_what_it_cannot_run(kernels):
    assert "not the CPU" in CPUPackedGemm.can_implement(_spec(BF16, device=torch.device("meta")))
    assert "multiples of 16" in CPUPackedGemm.can_implement(_spec(BF16, out_features=40))
    assert "float32 or the same" in CPUPackedGemm.can_implement(_spec(F32, BF16))
    assert "not float" in CPUPackedGemm.can_implement(_spec(torch.int8))
    with pytest.raises(ValueError, match="refused"):
        kernels.pack(torch.randn(20, 8).bfloat16(), BF16)
    packed = kernels.pack(torch.randn(16, 8).bfloat16(), BF16)
    with pytest.raises(ValueError, match="no rows of 6"):
        kernels.gemm(packed, torch.randn(2, 6).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        kernels.gemm(packed, torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="bias"):  # the bias follows the activations
        kernels.gemm(packed, torch.randn(2, 8).bfloat16(), torch.randn(16))


# -- the plain-layout GEMM (tied LM heads) -------------------------------------------------

@pytest.mark.parametrize(("act", "wdt"), DTYPE_PAIRS, ids=_PAIR_IDS)
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(5, 33), (67, 100), (130, 64), (96, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_gemm_matches_float64(kernels, act, wdt, out_features, in_features, with_bias):
    """Every tail of weight rows and of input features; 1 to 9 rows of x as dot products,
    30 rows through panels transposed on the fly (out features a multiple of 16); the
    weight is used as it is."""
    gemm = CPUPlainGemm(kernels)
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    x, weight, bias = _operands(gen, 30, out_features, in_features, act, wdt, with_bias)
    assert gemm.prepare(weight, _spec(wdt, act)) is weight
    for m in (1, 2, 3, 4, 5, 9, 30):
        _assert_close(gemm.apply(weight, x[:m], bias), x[:m], weight, bias)


def test_plain_gemm_reads_strided_rows_and_refuses_bad_input(kernels):
    gemm = CPUPlainGemm(kernels)
    weight = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 128).bfloat16()[:, 32:96]
    _assert_close(gemm.apply(weight, x), x, weight)
    with pytest.raises(ValueError, match="row-major"):
        kernels.gemm_plain(weight, torch.randn(1, 32).bfloat16())
    with pytest.raises(ValueError, match="float inputs"):
        kernels.gemm_plain(weight, torch.randn(1, 64).to(torch.int32))


# -- oneDNN -------------------------------------------------------------------------------

def test_onednn_refuses_what_it_cannot_run():
    assert "float16" in OneDNNPackedGemm.can_implement(_spec(F16))
    assert "not the CPU" in OneDNNPackedGemm.can_implement(_spec(F32, device=torch.device("meta")))
    assert "activations" in OneDNNPackedGemm.can_implement(_spec(BF16, F32))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_tokens", [1, 5, 67])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_matches_float64(dtype, num_tokens, with_bias):
    if OneDNNPackedGemm.can_implement(_spec(dtype)) is not None:
        pytest.skip(OneDNNPackedGemm.can_implement(_spec(dtype)))  # torch's build, not ours
    gen = torch.Generator().manual_seed(num_tokens)
    x, weight, bias = _operands(gen, num_tokens, 96, 80, dtype, dtype, with_bias)
    kernel = OneDNNPackedGemm()
    y = kernel.apply(kernel.prepare(weight, _spec(dtype)), x, bias)
    _assert_close(y, x, weight, bias)


def test_onednn_reads_strided_inputs():
    kernel = OneDNNPackedGemm()
    weight = torch.randn(16, 8)
    x = torch.randn(4, 24)[:, 8:16]  # a column slice, as a fused projection hands over
    _assert_close(kernel.apply(kernel.prepare(weight, _spec(F32)), x), x, weight)


# -- the packing pass ----------------------------------------------------------------------

class _TinyNet(nn.Module):
    def __init__(self, tied: bool, dtype=F32, weight_dtype=None) -> None:
        super().__init__()
        common = {"dtype": dtype, "device": CPU, "weight_dtype": weight_dtype}
        self.embed = VocabEmbedding(32, 16, **common)
        self.proj = MergedLinear(16, {0: 16, 1: 16}, bias=True, **common)
        self.down = ReplicatedLinear(32, 16, bias=False, **common)
        self.head = LMHead(32, 16, **common)
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

    def prepare(self, weight, spec):
        raise AssertionError("a refusing kernel is never asked to pack")

    def apply(self, weight, x, bias=None):
        raise AssertionError("a refusing kernel is never applied")


def test_kernels_are_offered_in_preference_order():
    net = _TinyNet(tied=False)
    assert pack_dense_weights(net, [_Refuses]) == 0
    assert net.proj.gemm_kernel is None  # F.linear stays
    assert pack_dense_weights(net, [_Refuses, OneDNNPackedGemm]) == 3
    assert isinstance(net.proj.gemm_kernel, OneDNNPackedGemm)


def test_a_tied_head_keeps_the_shared_weight_and_takes_only_layout_keeping_kernels(
    engine_kernels,
):
    torch.manual_seed(0)
    net = _TinyNet(tied=True, dtype=BF16)
    ids = torch.tensor([1, 5, 31])
    expected = net(ids[:1])
    embedding = net.embed.weight
    packed = pack_dense_weights(net, [CPUPackedGemm, OneDNNPackedGemm, CPUPlainGemm])
    assert packed == 3
    assert isinstance(net.head.gemm_kernel, CPUPlainGemm)
    assert net.head.weight is embedding and net.embed.weight is embedding
    assert isinstance(net.proj.gemm_kernel, CPUPackedGemm)
    torch.testing.assert_close(net(ids[:1]), expected, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_narrow_weights_stay_narrow_under_the_c_gemms_and_are_widened_without_them(
    engine_kernels, tied
):
    """bf16 weights with float32 activations: the C GEMMs take them as they are; layers
    no kernel takes get float32 weights once, for F.linear; the output is float32 and
    matches the same net in float32 throughout."""
    torch.manual_seed(0)
    narrow = _TinyNet(tied, dtype=F32, weight_dtype=BF16)
    wide = _TinyNet(tied, dtype=F32)
    wide.load_state_dict({k: v.float() for k, v in narrow.state_dict().items()})
    ids = torch.tensor([1, 5, 31])
    expected = wide(ids)
    plain = _TinyNet(tied, dtype=F32, weight_dtype=BF16)
    plain.load_state_dict(narrow.state_dict())
    assert pack_dense_weights(plain, []) == 0
    assert plain.proj.weight.dtype == F32 and plain.head.weight.dtype == F32
    torch.testing.assert_close(plain(ids), expected, atol=1e-4, rtol=1e-4)
    assert pack_dense_weights(narrow, [CPUPackedGemm, CPUPlainGemm]) == 3
    assert narrow.proj.weight.dtype == BF16 and narrow.embed.weight.dtype == BF16
    assert narrow.embed(ids).dtype == F32
    torch.testing.assert_close(narrow(ids), expected, atol=1e-4, rtol=1e-4)
