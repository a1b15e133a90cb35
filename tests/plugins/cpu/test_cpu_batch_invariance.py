"""The C kernels in batch-invariant mode, at every ISA level this CPU runs: a row's
result is bitwise the same whatever the number of rows in the call and its place among
them (GEMMs), and a query's attention output the same alone or among many (no key
splits sized to the batch). Outside the mode the kernels may differ by float32 rounding
(a second accumulator chain for one row, AMX from some rows on, key splits)."""

from __future__ import annotations

import pytest
import torch

from engine.core.interfaces import DenseLayerSpec
from engine.plugins.cpu.gemm import CPUPackedGemm

K, N = 200, 96  # K not a multiple of any vector width: the tails run too
ROW_COUNTS = (1, 2, 3, 7, 40, 130)  # decode (streamed) and prefill schedules, several chunks


@pytest.fixture
def invariant(kernels):
    kernels.set_batch_invariant(True)
    yield kernels
    kernels.set_batch_invariant(False)


def _rows_everywhere(gemm, x_all: torch.Tensor) -> None:
    """Row 0 of ``x_all`` placed first, in the middle and last of calls of every size."""
    reference = gemm(x_all[:1])[0]
    for m in ROW_COUNTS:
        for place in sorted({0, m // 2, m - 1}):
            x = x_all[1 : m + 1].clone()
            x[place] = x_all[0]
            got = gemm(x)[place]
            assert torch.equal(got, reference), f"{m} rows, row at {place}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemm_rows_do_not_depend_on_the_call(invariant, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    x_all = torch.randn(ROW_COUNTS[-1] + 1, K, generator=gen).to(dtype)
    spec = DenseLayerSpec(K, N, dtype, torch.device("cpu"), batch_invariant=True)
    if CPUPackedGemm.can_implement(spec) is not None:
        pytest.skip(CPUPackedGemm.can_implement(spec))
    packed = invariant.pack(weight, dtype)
    _rows_everywhere(lambda x: invariant.gemm(packed, x, bias), x_all)
    want = x_all[:3].double() @ weight.double().T + bias.double()
    torch.testing.assert_close(invariant.gemm(packed, x_all[:3], bias).double(), want,
                               rtol=2e-2, atol=2e-2 * K ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_gemm_rows_do_not_depend_on_the_call(invariant, dtype):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(N + 5, K, generator=gen).to(dtype)  # any N: the plain path takes it
    x_all = torch.randn(ROW_COUNTS[-1] + 1, K, generator=gen).to(dtype)
    _rows_everywhere(lambda x: invariant.gemm_plain(weight, x), x_all)


def test_decode_attention_is_not_split_by_the_batch(invariant):
    """One long query alone (outside the mode: split over the threads) and among 15."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d, bs, seq = 4, 1, 32, 16, 1500
    blocks = seq // bs + 1
    values = torch.randn(16 * blocks, kv_heads, bs, d, generator=gen)
    keys = torch.randn(16 * blocks, kv_heads, bs * d, generator=gen)
    tables = torch.arange(16 * blocks, dtype=torch.int64).view(16, blocks)
    seq_lens = torch.tensor([seq] + [100 + 37 * i for i in range(15)], dtype=torch.int64)
    query = torch.randn(16, heads, d, generator=gen)

    def attend(rows: slice) -> torch.Tensor:
        return invariant.paged_decode_attention(
            query[rows].contiguous(), keys, values, tables[rows].contiguous(),
            seq_lens[rows].contiguous(), d ** -0.5)

    alone = attend(slice(0, 1))[0]
    assert torch.equal(attend(slice(0, 16))[0], alone)
    assert torch.equal(attend(slice(0, 3))[0], alone)
    assert invariant.decode_key_splits(seq_lens[:1], kv_heads) == 1
    invariant.set_batch_invariant(False)  # what the test guards against: a split query
    assert invariant.decode_key_splits(seq_lens[:1], kv_heads) > 1
