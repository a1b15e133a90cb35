"""The CPU plugin's fused norm / activation / rotary kernels against the torch op chains
they replace (HF's arithmetic order) and against float64, through the model layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeScaling, RotaryEmbedding
from engine.plugins.cpu.platform import CPUPlatform

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Each kernel rounds where the op chain does, so the narrow dtypes agree to one unit in
# the last place (a float32 sum in another order can tip a rounding); float32 differs by
# that order and the exponential's last bits.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=0, rtol=2**-7),
       torch.float16: dict(atol=0, rtol=2**-10)}


@pytest.fixture
def ops(kernels):
    return kernels  # the platform's FusedOps are the C kernels


def test_the_cpu_platform_offers_them(engine_kernels, ops):
    assert CPUPlatform().fused_ops() is engine_kernels
    assert all(ops.supports(d) for d in DTYPES) and not ops.supports(torch.int32)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: the parallel loop
def test_rms_norm_with_and_without_residual(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 2 * 96, generator=gen) * 4).to(dtype)
    x = wide[:, 96:]  # strided rows, as a slice of a wider output
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5),
                               **TOL[dtype])
    summed = residual + x
    out = ops.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(residual, summed, atol=0, rtol=0)  # written in place
    torch.testing.assert_close(out, _hf_rms_norm(summed, weight, 1e-5), **TOL[dtype])
    ref64 = summed.double() / summed.double().pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(out.double(), ref64 * weight.double(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 x 96: the parallel loop
def test_residual_add_rounds_as_torch_and_writes_in_place(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 2 * 96, generator=gen) * 4).to(dtype)
    x = wide[:, :96]  # strided rows
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    want = x + residual
    out = ops.residual_add_(x, residual)
    assert out is residual
    torch.testing.assert_close(residual, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="equal"):
        ops.residual_add_(x[:, :8], residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_per_head_rms_norm_reads_a_slice_of_a_fused_projection(ops, dtype, tokens):
    """Qwen3's q/k norms: [tokens, heads, D] straight from the qkv output (no copy)."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, 7 * 32, generator=gen) * 3).to(dtype)
    k = qkv[:, 4 * 32 : 6 * 32].view(tokens, 2, 32)  # token stride 224, heads contiguous
    weight = torch.randn(32, generator=gen).to(dtype)
    got = ops.rms_norm(k, weight, 1e-6)
    torch.testing.assert_close(got, _hf_rms_norm(k.reshape(-1, 32), weight, 1e-6), **TOL[dtype])
    with pytest.raises(ValueError, match="contiguous heads"):
        ops.rms_norm(qkv.view(tokens, 7, 32)[:, ::2], weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 2 * 80, generator=gen) * 6).to(dtype)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, 1e-3])  # saturation, zero
    expected = F.silu(x[:, :80]) * x[:, 80:]
    torch.testing.assert_close(ops.silu_and_mul(x), expected, **TOL[dtype])
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x).double(), gate * torch.sigmoid(gate) * up,
                               atol=0.5, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_the_torch_path(ops, dtype):
    scaling = RopeScaling(rope_type="default", theta=1e4, max_position_embeddings=300)
    fused = RotaryEmbedding(64, scaling, dtype=dtype, device="cpu", fused_ops=ops)
    plain = RotaryEmbedding(64, scaling, dtype=dtype, device="cpu")
    assert fused.fused_ops is ops and plain.fused_ops is None
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 1, 77, 299, 5])
    qkv = torch.randn(5, 7 * 64, generator=gen).to(dtype)
    qk = qkv[:, : 5 * 64]  # q and k heads of a fused projection, strided rows
    expected = plain.apply(qk, plain.prepare(positions))
    got = fused.apply(qk, fused.prepare(positions))
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(got, expected, **TOL[dtype])
    q, k = fused(positions, qkv[:, :64], qkv[:, 64:128])  # forward leaves its inputs alone
    torch.testing.assert_close(qkv[:, :64], expected[:, :64], atol=0, rtol=0)


@pytest.mark.parametrize("bad", [16, -1])
def test_rotary_refuses_positions_outside_its_table(ops, bad):
    """The kernel checks positions itself (a replayed graph has no Python to do it) and
    rotates nothing when one is out of range."""
    scaling = RopeScaling(rope_type="default", theta=1e4, max_position_embeddings=16)
    rope = RotaryEmbedding(32, scaling, dtype=torch.float32, device="cpu", fused_ops=ops)
    x = torch.randn(2, 64)
    before = x.clone()
    with pytest.raises(ValueError, match="beyond the rotary table"):
        rope.apply(x, rope.prepare(torch.tensor([3, bad])))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_lookup_matches_torch_and_refuses_unknown_ids(ops, dtype):
    table = torch.randn(50, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids = torch.tensor([0, 49, 7, 7])
    assert torch.equal(ops.embedding(ids, table), F.embedding(ids, table))
    for wider in DTYPES:  # a narrow table looked up for wider activations (and back)
        got = ops.embedding(ids, table, wider)
        assert got.dtype == wider and torch.equal(got, F.embedding(ids, table).to(wider))
    for bad in (50, -1):
        with pytest.raises(ValueError, match="outside the vocabulary of 50"):
            ops.embedding(torch.tensor([1, bad]), table)
    with pytest.raises(ValueError, match="int64"):
        ops.embedding(ids.int(), table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_lookup_gives_its_rows_and_zeros_for_the_others(ops, dtype):
    """A tensor-parallel rank's lookup (rows 20..39 of a 50-word vocabulary, 17 of them
    real): its ids' rows, zero rows for every other id, an error outside the vocabulary."""
    vocab, start, num_real = 50, 20, 17
    shard = torch.randn(20, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids = torch.tensor([0, 20, 36, 37, 39, 49, 25, 19])
    for wider in DTYPES:
        want = torch.zeros(len(ids), 24, dtype=wider)
        for i, token in enumerate(ids.tolist()):
            if start <= token < start + num_real:
                want[i] = shard[token - start].to(wider)
        got = ops.embedding_shard(ids, shard, start, num_real, vocab, wider)
        assert got.dtype == wider and torch.equal(got, want)
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="outside the vocabulary of 50"):
            ops.embedding_shard(torch.tensor([21, bad]), shard, start, num_real, vocab)
    with pytest.raises(ValueError, match="does not fit"):
        ops.embedding_shard(ids, shard, start, 21, vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_give_the_same_results_fused_or_not(ops, dtype):
    gen = torch.Generator().manual_seed(3)
    norms = [RMSNorm(48, 1e-6, dtype=dtype, device="cpu", fused_ops=f) for f in (ops, None)]
    for norm in norms:
        norm.weight.data = torch.linspace(0.5, 2, 48).to(dtype)
    x = torch.randn(6, 48, generator=gen).to(dtype)
    res = torch.randn(6, 48, generator=gen).to(dtype)
    (out_f, res_f), (out_p, res_p) = norms[0](x, res.clone()), norms[1](x, res.clone())
    torch.testing.assert_close(out_f, out_p, **TOL[dtype])
    torch.testing.assert_close(res_f, res_p, atol=0, rtol=0)
    heads = x.view(6, 3, 16)  # a per-head norm (q_norm / k_norm) on a 3-D view
    head_norms = [RMSNorm(16, 1e-6, dtype=dtype, device="cpu", fused_ops=f) for f in (ops, None)]
    torch.testing.assert_close(head_norms[0](heads), head_norms[1](heads), **TOL[dtype])
    acts = [get_act_and_mul("silu", f, dtype) for f in (ops, None)]
    gate_up = torch.randn(6, 64, generator=gen).to(dtype)
    torch.testing.assert_close(acts[0](gate_up), acts[1](gate_up), **TOL[dtype])


def test_argmax_matches_torch_ties_nans_and_masked_rows(ops):
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(20, 3000, generator=gen)
    x = wide[:, :2999]  # strided rows
    x[1, 10] = x[1, 2000] = x[1].max() + 1  # a tie: the first index wins
    x[2, 5] = float("nan")  # a NaN wins, as in torch
    x[3] = float("-inf")  # a fully masked row
    x[4, 2998] = 1e30
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    assert ops.argmax(x[:0]).shape == (0,)


def _inverse_cdf64(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float64 reference: the first index whose running sum exceeds u x the row's sum."""
    running = probs.double().cumsum(dim=1)
    target = u.double().unsqueeze(1) * running[:, -1:]
    return (running <= target).sum(dim=1)


@pytest.mark.parametrize("cols", [7, 256, 1000, 16000, 40961])  # within, at, across blocks
def test_categorical_draws_as_the_float64_inverse_cdf(ops, cols):
    gen = torch.Generator().manual_seed(cols)
    rows = 40  # the parallel loop
    wide = torch.rand(rows, cols + 5, generator=gen) ** 4  # strided rows, skewed mass
    probs = wide[:, 5:]
    probs[probs < 0.02] = 0.0  # masked entries, as top-k / top-p leave them
    probs[0] *= 1e-20  # any scale
    probs[1] = 0.0
    probs[1, cols // 2] = 3.0  # one token of positive probability
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    u[2], u[3] = 0.0, 1.0 - 2.0 ** -53  # the ends of [0, 1)
    drawn = ops.categorical(probs, u)
    expected = _inverse_cdf64(probs, u)
    assert drawn.dtype == torch.int64 and drawn.shape == (rows,)
    assert torch.equal(drawn, expected)
    assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all())  # never a masked entry
    assert drawn[1] == cols // 2


def test_categorical_frequencies_follow_the_distribution(ops):
    """200,000 draws over 5,000 rows: each share within 5 standard deviations of its
    probability; entries of probability 0 never drawn."""
    weights = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.6] + [0.0] * 300)
    rows = 5000
    counts = torch.zeros_like(weights)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        drawn = ops.categorical(weights.expand(rows, -1).contiguous(),
                                torch.rand(rows, generator=gen, dtype=torch.float64))
        counts += torch.bincount(drawn, minlength=weights.numel()).float()
    total = counts.sum()
    share = weights / weights.sum()
    sigma = (share * (1 - share) / total).sqrt()
    assert bool(((counts / total - share).abs() <= 5 * sigma + 1e-12).all())
    assert counts[share == 0].sum() == 0


def test_categorical_refuses_what_it_cannot_run(ops):
    assert ops.categorical(torch.rand(2, 8, dtype=torch.float64),
                           torch.rand(2, dtype=torch.float64)) is None
    assert ops.categorical(torch.rand(8, 2).t(), torch.rand(2, dtype=torch.float64)) is None
    assert ops.categorical(torch.rand(0, 8), torch.rand(0, dtype=torch.float64)).shape == (0,)
    zero = ops.categorical(torch.zeros(2, 300), torch.rand(2, dtype=torch.float64))
    assert zero.tolist() == [0, 0]  # no positive entry: index 0, as documented


def test_sampler_random_rows_draw_through_the_kernel(ops):
    """The sampler's random rows come from ``categorical`` with one uniform per row; a
    seeded row's uniform from its own generator, whatever else is in the batch."""
    from engine.model_executor.sampling.sampler import Sampler, row_uniforms

    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 3000, generator=gen), dim=-1)
    torch.manual_seed(11)
    seeded = {2: torch.Generator().manual_seed(9)}
    drawn = Sampler(ops).draw(probs.clone(), seeded)
    torch.manual_seed(11)
    u = row_uniforms(4, {2: torch.Generator().manual_seed(9)}, torch.device("cpu"))
    assert torch.equal(drawn, _inverse_cdf64(probs, u))
    alone = Sampler(ops).draw(probs[2:3].clone(), {0: torch.Generator().manual_seed(9)})
    assert alone.item() == drawn[2].item()


def test_sampler_draws_the_same_tokens_with_the_fused_argmax(ops):
    from engine.model_executor.sampling.sampler import Sampler, exponential_race

    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(6, 500, generator=gen), dim=-1)
    draws = []
    for argmax in (ops.argmax, lambda t: t.argmax(dim=-1)):
        torch.manual_seed(0)  # unseeded rows share the default generator: same q twice
        seeded = {1: torch.Generator().manual_seed(9)}
        draws.append(exponential_race(probs.clone(), seeded, argmax))
    assert torch.equal(draws[0], draws[1])
    assert Sampler(ops).argmax == ops.argmax and Sampler().argmax is not ops.argmax
