"""The CPU plugin's encoder (non-causal) attention against an independent float64
reference (tests/kernels/attention_reference.py: per-request softmax attention with the
window and soft-cap masks), directly and through CPUAttentionBackend; and the base
validate refusing encoder layers on a backend without them.

Tolerances hold on any x86 CPU (AVX2 through AMX): float32 results differ from float64
only by float32 accumulation order; bf16 ones by bf16 rounding of inputs, probabilities
and output.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from engine.core.interfaces import AttentionBatch, AttentionLayerSpec
from engine.core.interfaces.attention import AttentionBackend, AttentionImpl
from engine.plugins.cpu.attention import CPUAttentionBackend
from engine.plugins.cpu.encoder_attention import encoder_attention
from tests.kernels.attention_reference import make_encoder_batch, reference_encoder_attention

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# Many requests of mixed lengths (single tokens among them) and one request alone.
MANY = [3, 1, 8, 5, 2, 12, 1, 4]


def _check(out: torch.Tensor, batch, scale: float, window=None, soft_cap=None) -> None:
    expected = reference_encoder_attention(
        batch.q, batch.k, batch.v, batch.query_start_loc, scale, window, soft_cap
    )
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert not out.isnan().any()
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


CASES = [
    pytest.param(MANY, 2, 2, 32, None, None, id="many-mha"),
    pytest.param([9], 4, 4, 16, None, None, id="single"),
    pytest.param([9], 4, 2, 16, 4, None, id="single-window"),
    pytest.param(MANY, 6, 2, 40, None, None, id="gqa3-d40"),
    # window 4 (2 either side) < longest; the padded rows of short requests see no key
    pytest.param([1, 12, 6], 4, 1, 32, 4, None, id="gqa4-window4"),
    pytest.param(MANY, 4, 2, 32, 64, None, id="window-wider-than-all"),
    pytest.param(MANY, 4, 2, 32, None, 3.0, id="softcap"),
    pytest.param([1, 12, 6], 4, 2, 32, 5, 3.0, id="window5-softcap"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths,heads,kv_heads,head_size,window,soft_cap", CASES)
def test_function_matches_reference(lengths, heads, kv_heads, head_size, window, soft_cap,
                                    dtype):
    gen = torch.Generator().manual_seed(sum(lengths) * 100 + heads * 10 + kv_heads)
    batch = make_encoder_batch(lengths, heads, kv_heads, head_size, dtype, gen)
    scale = head_size**-0.5
    out = encoder_attention(batch.q, batch.k, batch.v, batch.query_start_loc.numpy(), scale,
                            window, soft_cap)
    _check(out, batch, scale, window, soft_cap)


def _encoder_step(batch, block_size: int) -> AttentionBatch:
    """An encoder step: every token new, seq_len = query_len, no cache slots."""
    lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    num_reqs, num_tokens = lens.shape[0], batch.q.shape[0]
    return AttentionBatch(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        query_start_loc=batch.query_start_loc,
        seq_lens=lens.to(torch.int32),
        block_tables=torch.zeros(num_reqs, math.ceil(int(lens.max()) / block_size),
                                 dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        query_start_loc_cpu=batch.query_start_loc.numpy(),
        seq_lens_cpu=lens.numpy(),
    )


@pytest.mark.parametrize(
    "dtype,lengths,window,soft_cap",
    [
        pytest.param(torch.float32, MANY, 6, None, id="fp32-many-window"),
        pytest.param(torch.float32, [7], None, 4.0, id="fp32-single-softcap"),
        pytest.param(torch.bfloat16, MANY, None, None, id="bf16-many"),
    ],
)
def test_backend_runs_encoder_layers_without_a_cache(dtype, lengths, window, soft_cap):
    assert CPUAttentionBackend.supports_encoder_attention()
    gen = torch.Generator().manual_seed(5)
    batch = make_encoder_batch(lengths, 4, 2, 40, dtype, gen)
    spec = AttentionLayerSpec(num_heads=4, head_size=40, num_kv_heads=2, scale=0.15,
                              sliding_window=window, logits_soft_cap=soft_cap, causal=False)
    backend = CPUAttentionBackend(block_size=8, device=CPU)
    assert backend.validate(spec, 8) is None
    impl = backend.make_impl(spec)
    metadata = backend.build_metadata(_encoder_step(batch, 8))
    out = impl.forward(batch.q, batch.k, batch.v, None, metadata)
    _check(out, batch, 0.15, window, soft_cap)


class _CausalOnlyImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata):
        raise AssertionError("never run: validate refuses encoder layers first")


class _CausalOnlyBackend(AttentionBackend):
    """A backend that keeps the default supports_encoder_attention() (False)."""

    name: ClassVar[str] = "causal-only"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> Any:
        return batch

    def make_impl(self, spec: AttentionLayerSpec) -> AttentionImpl:
        return _CausalOnlyImpl(spec)


def test_validate_refuses_encoder_layers_without_support():
    decoder = AttentionLayerSpec(num_heads=4, head_size=32, num_kv_heads=2, scale=0.2)
    encoder = AttentionLayerSpec(num_heads=4, head_size=32, num_kv_heads=2, scale=0.2,
                                 causal=False)
    assert not _CausalOnlyBackend.supports_encoder_attention()
    assert _CausalOnlyBackend.validate(decoder, 16) is None
    assert _CausalOnlyBackend.validate(encoder, 16) == (
        "causal-only has no non-causal (encoder) attention")
    assert CPUAttentionBackend.validate(encoder, 16) is None


def test_validate_refuses_non_causal_mla_even_where_encoders_run():
    mla = AttentionLayerSpec(num_heads=4, head_size=80, num_kv_heads=1, scale=0.1,
                             kv_lora_rank=64, causal=False)
    assert "non-causal (encoder) attention" in CPUAttentionBackend.validate(mla, 16)
    with pytest.raises(ValueError, match="non-causal"):
        CPUAttentionBackend(block_size=16, device=CPU).make_impl(mla)


@pytest.mark.parametrize("lengths", [[5], [7, 7, 7], [1, 90, 3, 44, 45, 46, 200, 2, 150] * 5])
def test_step_plan_covers_every_token_once(lengths) -> None:
    """The length groups of a step: each token in exactly one group slot, groups padded
    within the limits (no padding at all past the long-prompt length)."""
    from engine.plugins.cpu import encoder_attention as ea

    qsl = np.concatenate([[0], np.cumsum(lengths)])
    plan = ea.plan_encoder_step(qsl)
    tokens = np.concatenate([g.tokens.numpy() for g in plan.groups])
    assert sorted(tokens.tolist()) == list(range(int(qsl[-1])))
    for group in plan.groups:
        assert len(group.lengths) <= ea.MAX_GROUP
        padded, real = group.longest * len(group.lengths), int(group.lengths.sum())
        limit = ea.MAX_PADDING if group.longest <= ea.LONG_PROMPT else 1.0
        assert padded <= limit * real or len(group.lengths) == 1
        assert (group.valid_slots is None) == (padded == real)
