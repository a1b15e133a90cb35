"""Temperature, min-p, top-k and top-p: support and distribution of the sampled tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sampling_helpers import chi_square_critical, make_state, rows, softmax64

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler
from engine.model_executor.sampling.metadata import SamplingMetadata
from engine.model_executor.sampling.topk_topp import (
    TOP_P_CANDIDATES,
    apply_top_k_top_p,
    top_k_top_p_by_sort,
)

# Distinct logits, so every top-k / top-p boundary is unambiguous.
LOGITS = [2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.0, 0.7]
V = len(LOGITS)


def random_metadata(n: int, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Metadata for ``n`` identical unseeded random rows (i.i.d. draws in one call)."""

    def full(value, dtype):
        return None if value is None else torch.full((n,), value, dtype=dtype)

    return SamplingMetadata(
        num_rows=n,
        vocab_size=V,
        all_greedy=False,
        all_random=True,
        temperature=full(temperature, torch.float32),
        greedy_mask=None,
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        max_top_k=top_k if top_k is not None else V,
    )


def draw(n: int, **kw) -> np.ndarray:
    logits = torch.tensor([LOGITS] * n, dtype=torch.float32)
    return Sampler()(logits, random_metadata(n, **kw)).sampled_token_ids.numpy()


def expected_distribution(temperature: float, top_k: int, top_p: float) -> list[float]:
    """float64 reference: softmax(l/T), keep the k best, renormalize, keep the tokens whose
    strictly-more-likely mass is below top_p, renormalize."""
    probs = softmax64([x / temperature for x in LOGITS])
    order = sorted(range(V), key=lambda t: -probs[t])
    kept = order[:top_k]
    mass = sum(probs[t] for t in kept)
    renorm = {t: probs[t] / mass for t in kept}
    nucleus, above = [], 0.0
    for t in kept:
        if above < top_p:
            nucleus.append(t)
        above += renorm[t]
    mass = sum(renorm[t] for t in nucleus)
    return [renorm[t] / mass if t in nucleus else 0.0 for t in range(V)]


def test_top_k_never_emits_excluded_tokens():
    torch.manual_seed(0)
    tokens = draw(4000, temperature=3.0, top_k=3)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_never_emits_excluded_tokens():
    torch.manual_seed(1)
    probs = softmax64([x / 2.0 for x in LOGITS])
    order = sorted(range(V), key=lambda t: -probs[t])
    allowed, above = set(), 0.0
    for t in order:
        if above < 0.6:
            allowed.add(t)
        above += probs[t]
    tokens = draw(4000, temperature=2.0, top_p=0.6)
    assert set(tokens.tolist()) == allowed


def test_min_p_never_emits_excluded_tokens():
    torch.manual_seed(2)
    probs = softmax64(LOGITS)
    allowed = {t for t in range(V) if probs[t] >= 0.3 * max(probs)}
    tokens = draw(4000, min_p=0.3)
    assert set(tokens.tolist()) == allowed


def test_temperature_top_k_top_p_distribution_chi_square():
    temperature, top_k, top_p, n = 1.5, 6, 0.85, 20_000
    expected = expected_distribution(temperature, top_k, top_p)
    torch.manual_seed(1234)
    counts = np.bincount(draw(n, temperature=temperature, top_k=top_k, top_p=top_p), minlength=V)
    support = [t for t in range(V) if expected[t] > 0]
    assert 2 <= len(support) < top_k  # top-p really cut inside the top-k set
    assert all(counts[t] == 0 for t in range(V) if expected[t] == 0)
    stat = sum((counts[t] - n * expected[t]) ** 2 / (n * expected[t]) for t in support)
    assert stat < chi_square_critical(len(support) - 1), (stat, counts, expected)


def test_plain_temperature_distribution_chi_square():
    n = 20_000
    expected = softmax64([x / 0.7 for x in LOGITS])
    torch.manual_seed(99)
    counts = np.bincount(draw(n, temperature=0.7), minlength=V)
    stat = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(expected))
    assert stat < chi_square_critical(V - 1), (stat, counts)


def test_top_k_fast_path_matches_sort_path():
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    k = torch.tensor([1, 5, 50, 7, 50, 20])
    fast = apply_top_k_top_p(logits.clone(), k, None, max_top_k=20)
    sort = top_k_top_p_by_sort(logits.clone(), k, None)
    assert torch.equal(fast, sort)
    kept = torch.isfinite(fast).sum(dim=1).tolist()
    assert kept == [1, 5, 50, 7, 50, 20]
    for i, kk in enumerate(k.tolist()):  # the kept ones are the k largest
        top = set(logits[i].topk(kk).indices.tolist())
        assert set(torch.nonzero(torch.isfinite(fast[i])).flatten().tolist()) == top


def test_top_p_candidate_path_matches_sort_path():
    """Rows: top-p only (peaked, fits the candidates), top-p on a flat row (falls back to
    the sort), top-k + top-p, top-k only, neither; plus a masked token."""
    vocab = 4 * TOP_P_CANDIDATES
    torch.manual_seed(7)
    logits = torch.randn(6, vocab) * torch.tensor([[6.0], [0.05], [1.0], [1.0], [1.0], [4.0]])
    logits[0, 3] = float("-inf")
    k = torch.tensor([vocab, vocab, 40, 9, vocab, 300])
    p = torch.tensor([0.9, 0.95, 0.6, 1.0, 1.0, 0.97])
    fast = apply_top_k_top_p(logits.clone(), k, p, max_top_k=300)
    sort = top_k_top_p_by_sort(logits.clone(), k, p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(sort))
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])
    kept = torch.isfinite(fast).sum(dim=1).tolist()
    assert kept[1] > TOP_P_CANDIDATES and kept[3] == 9 and kept[4] == vocab
    assert 1 < kept[0] < TOP_P_CANDIDATES and 1 < kept[2] < 40 and 1 < kept[5] < 300
    # float64 reference for the top-p-only row
    probs = torch.softmax(logits[0].double(), dim=0)
    order = torch.argsort(probs, descending=True)
    above = torch.cumsum(probs[order], dim=0) - probs[order]
    assert kept[0] == int((above < 0.9).sum())


def test_greedy_is_argmax_and_temperature_zero_is_safe():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    params = {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=1e-7),
        2: SamplingParams(temperature=0.0, top_k=3, top_p=0.5),
    }
    state = make_state(40, params)
    md = state.build_metadata(rows(0, 1, 2))
    assert md.all_greedy and md.temperature is None
    out = Sampler()(logits.clone(), md).sampled_token_ids
    assert torch.equal(out, logits.argmax(dim=1))


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    state = make_state(
        30,
        {
            0: SamplingParams(temperature=0.0),
            1: SamplingParams(temperature=1.0, top_k=1),  # random but forced to the argmax
            2: SamplingParams(temperature=0.0),
            3: SamplingParams(temperature=0.5, top_k=2),
        },
    )
    md = state.build_metadata(rows(0, 1, 2, 3))
    assert not md.all_greedy and not md.all_random
    for _ in range(20):
        out = Sampler()(logits.clone(), md).sampled_token_ids
        assert out[:3].tolist() == logits[:3].argmax(dim=1).tolist()
        assert out[3].item() in logits[3].topk(2).indices.tolist()
        assert not math.isnan(out.float().sum().item())


@pytest.mark.parametrize("temperature", [0.05, 1.0, 30.0])
def test_temperature_never_picks_masked_token(temperature):
    torch.manual_seed(6)
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]] * 500)
    md = random_metadata(500, temperature=temperature)
    md.vocab_size = 4
    out = Sampler()(logits, md).sampled_token_ids
    assert set(out.tolist()) <= {0, 2}
