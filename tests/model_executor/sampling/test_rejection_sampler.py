"""RejectionSampler against an independent float64 reference of the speculative rule.

The statistical checks draw many independent requests in ONE sampler call (vectorized)
and compare the empirical distribution of the emitted tokens with the target's exact
distribution by a chi-square test (fixed torch seed, so every run is the same run).
The same check functions are run against deliberately wrong rules (monkeypatched into
the sampler) and must then reject: that is what shows the checks have power.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import SamplingState
from engine.model_executor.sampling import rejection_sampler as rs_module
from engine.model_executor.sampling.penalties import apply_batch_penalties
from engine.model_executor.sampling.rejection_sampler import RejectionSampler
from engine.model_executor.sampling.sampler import Sampler, apply_logits_processors
from engine.model_executor.sampling.state import SpecLayout, draw_seed

CPU = torch.device("cpu")
V = 8
# Target p and draft q, deliberately different: sum(min(p, q)) = 0.57.
P = [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02]
Q = [0.05, 0.10, 0.30, 0.05, 0.20, 0.05, 0.05, 0.20]
P_BONUS = [0.02, 0.03, 0.05, 0.10, 0.10, 0.15, 0.25, 0.30]
N_STAT = 20000
PASS_P = 1e-4  # a right rule must not be rejected at this level
FAIL_P = 1e-12  # a wrong rule must be rejected at least this strongly


# -- float64 reference and statistics ----------------------------------------------------
def logits_for(p: Sequence[float]) -> torch.Tensor:
    """float32 logits ``log p`` (``-inf`` where p is 0)."""
    return torch.tensor(p, dtype=torch.float64).log().to(torch.float32)


def exact_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None
                ) -> np.ndarray:
    """The target distribution of float32 ``logits`` ``[V]``, computed in float64:
    tempered softmax, then the ``top_k`` largest renormalized (no ties in these tests)."""
    x = logits.double() / temperature
    if top_k is not None:
        kth = torch.sort(x, descending=True).values[top_k - 1]
        x = torch.where(x >= kth, x, torch.tensor(float("-inf"), dtype=torch.float64))
    return x.softmax(-1).numpy()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``probs``; bins with an expected count below
    5 are merged into one. An observed count where the probability is 0 gives 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    expected = n * probs
    small = expected < 5
    obs = list(counts[~small])
    exp = list(expected[~small])
    if small.any() and expected[small].sum() > 0:
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.asarray(obs), np.asarray(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    if dof < 1:
        return 1.0
    # chi2.sf(stat, dof) = Q(dof / 2, stat / 2), the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def tv_bound(probs: np.ndarray, n: int, z: float = 5.0) -> float:
    """A bound on the total-variation distance of an n-sample empirical distribution
    from ``probs``: every bin within z standard errors, halved."""
    probs = np.asarray(probs, dtype=np.float64)
    return 0.5 * float(np.sum(z * np.sqrt(probs * (1 - probs) / n)))


def tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


# -- building batches --------------------------------------------------------------------
def make_state(params: Sequence[SamplingParams], vocab_size: int = V,
               prompts: Sequence[list[int]] | None = None,
               outputs: Sequence[list[int]] | None = None,
               eos_token_id: int | None = None) -> SamplingState:
    """A state with ``params[i]`` seated in row ``i``."""
    state = SamplingState(len(params), vocab_size, CPU)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts is not None else [0, 1]
        output = outputs[i] if outputs is not None else []
        state.add_request(i, p, prompt, output, eos_token_id=eos_token_id)
    return state


@dataclasses.dataclass
class SpecRun:
    out: rs_module.RejectionOutput
    layout: SpecLayout
    drafts: np.ndarray  # flat
    logits: torch.Tensor  # what went in (a copy)


def run_spec(state: SamplingState, logits: torch.Tensor, num_drafts: np.ndarray,
             drafts: np.ndarray, draft_probs: torch.Tensor | None = None,
             token_bitmask: torch.Tensor | None = None, seed: int = 0,
             sampler: RejectionSampler | None = None) -> SpecRun:
    rows = np.arange(len(num_drafts), dtype=np.int64)
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    drafts = np.asarray(drafts, dtype=np.int64)
    metadata = state.build_spec_metadata(rows, num_drafts, drafts)
    layout = SpecLayout.of(num_drafts, drafts)
    torch.manual_seed(seed)
    sampler = sampler or RejectionSampler()
    out = sampler(logits.clone(), metadata, layout, draft_probs=draft_probs,
                  token_bitmask=token_bitmask)
    return SpecRun(out, layout, drafts, logits)


def first_tokens(out: rs_module.RejectionOutput) -> np.ndarray:
    return np.fromiter((t[0] for t in out.token_ids), dtype=np.int64, count=len(out.token_ids))


@dataclasses.dataclass
class OneDraftResult:
    pvalue: float
    tv: float
    tv_bound: float
    acceptance: float
    expected_acceptance: float
    acceptance_se: float
    counts: np.ndarray
    run: SpecRun


def one_draft_check(p: Sequence[float], q: Sequence[float], *, n: int = N_STAT,
                    one_hot: bool = False, seed: int = 0,
                    sampler: RejectionSampler | None = None,
                    params: SamplingParams | None = None,
                    target_probs: np.ndarray | None = None) -> OneDraftResult:
    """n requests with one draft d ~ q each, target logits ``log p`` at the draft row and
    ``log P_BONUS`` at the bonus row; the first emitted token against the target.

    ``one_hot``: the sampler gets no draft_probs (a deterministic proposer), so the
    expected acceptance is ``sum_d q(d) p(d)`` instead of ``sum min(p, q)``."""
    params = params or SamplingParams(temperature=1.0)
    if params.seed is not None:  # one seed per request: seed, seed + 1, ...
        state = make_state([params.clone(seed=params.seed + i) for i in range(n)])
    else:
        state = make_state([params] * n)
    gen = torch.Generator().manual_seed(1000 + seed)
    q_t = torch.tensor(q, dtype=torch.float32)
    drafts = torch.multinomial(q_t, n, replacement=True, generator=gen).numpy()
    logits = torch.stack([logits_for(p), logits_for(P_BONUS)]).repeat(n, 1)
    draft_probs = None if one_hot else q_t.expand(n, V).contiguous()
    run = run_spec(state, logits, np.ones(n), drafts, draft_probs, seed=seed, sampler=sampler)
    target = exact_probs(logits_for(p)) if target_probs is None else target_probs
    q64 = np.asarray(q, dtype=np.float64)
    expected_acc = float((q64 * target).sum() if one_hot else np.minimum(target, q64).sum())
    counts = np.bincount(first_tokens(run.out), minlength=V)
    return OneDraftResult(
        pvalue=chi_square_pvalue(counts, target),
        tv=tv(counts, target),
        tv_bound=tv_bound(target, n),
        acceptance=float(run.out.num_accepted.mean()),
        expected_acceptance=expected_acc,
        acceptance_se=math.sqrt(expected_acc * (1 - expected_acc) / n),
        counts=counts,
        run=run,
    )


def assert_matches_target(res: OneDraftResult) -> None:
    assert res.pvalue > PASS_P, (res.pvalue, res.counts)
    assert res.tv < res.tv_bound, (res.tv, res.tv_bound)
    assert abs(res.acceptance - res.expected_acceptance) < 5 * res.acceptance_se, (
        res.acceptance, res.expected_acceptance)


# -- deliberately wrong rules ------------------------------------------------------------
def _resample_from_p(monkeypatch):
    """After a rejection draw from p instead of norm(max(0, p - q)) (q = 0 makes the
    residual p itself)."""
    original = RejectionSampler._final_tokens

    def wrong(self, probs, greedy, metadata, layout, num_accepted, final_rows, draft_probs):
        zeros = torch.zeros(int(layout.num_drafts.sum()), metadata.vocab_size)
        return original(self, probs, greedy, metadata, layout, num_accepted, final_rows, zeros)

    monkeypatch.setattr(RejectionSampler, "_final_tokens", wrong)


def _always_accept(monkeypatch):
    def wrong(self, probs, greedy, metadata, draft_rows, drafts, draft_probs):
        return torch.ones(drafts.numel(), dtype=torch.bool)

    monkeypatch.setattr(RejectionSampler, "_accept", wrong)


def _accept_with_p_ignoring_q(monkeypatch):
    """Accept with probability p(d) (the one-hot rule) although the draft came from q."""
    original = RejectionSampler._accept

    def wrong(self, probs, greedy, metadata, draft_rows, drafts, draft_probs):
        return original(self, probs, greedy, metadata, draft_rows, drafts, None)

    monkeypatch.setattr(RejectionSampler, "_accept", wrong)


WRONG_RULES = {
    "resample_from_p": _resample_from_p,
    "always_accept": _always_accept,
    "accept_with_p_ignoring_q": _accept_with_p_ignoring_q,
}


# -- the rule is right ------------------------------------------------------------------
@pytest.mark.parametrize("seeded", [False, True])
def test_first_token_follows_target_and_acceptance_is_sum_min(seeded):
    """Unseeded rows share the global generator; seeded rows take their acceptance
    uniform and their residual draw from keys of their own (seed, position)."""
    params = SamplingParams(temperature=1.0, seed=5000 if seeded else None)
    res = one_draft_check(P, Q, params=params)
    assert_matches_target(res)
    assert res.expected_acceptance == pytest.approx(0.57, abs=1e-6)


def test_seeded_wrong_rule_fails_the_same_check(monkeypatch):
    _resample_from_p(monkeypatch)
    res = one_draft_check(P, Q, params=SamplingParams(temperature=1.0, seed=5000))
    assert res.pvalue < FAIL_P, res.pvalue


def test_seeded_request_repeats_itself_whatever_the_batch():
    """Same seed, same logits, same drafts: same verdict and tokens, in another row of
    another batch and whatever the global generator holds."""
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(4, V, generator=gen)  # 3 drafts + bonus
    drafts = [1, 2, 3]
    q = torch.softmax(torch.randn(3, V, generator=gen), -1)
    seeded = SamplingParams(temperature=1.0, seed=4242)
    results = []
    for others, seed in ((0, 1), (5, 2), (11, 3)):
        params = [SamplingParams(temperature=1.0)] * others + [seeded]
        state = make_state(params, outputs=[[]] * others + [[4, 4]])
        lg = torch.cat([torch.randn(2 * others, V, generator=gen), logits])
        probs = torch.cat([torch.rand(others, V, generator=gen).softmax(-1), q])
        run = run_spec(state, lg, np.asarray([1] * others + [3]),
                       np.asarray([0] * others + drafts), probs, seed=seed)
        results.append((run.out.token_ids[-1], int(run.out.num_accepted[-1])))
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("rule", sorted(WRONG_RULES))
def test_wrong_rule_fails_the_same_check(monkeypatch, rule):
    WRONG_RULES[rule](monkeypatch)
    res = one_draft_check(P, Q)
    assert res.pvalue < FAIL_P, (rule, res.pvalue, res.counts)


def test_one_hot_drafts_accept_with_p_of_draft_and_keep_target():
    res = one_draft_check(P, Q, one_hot=True, seed=1)
    assert_matches_target(res)
    # Per draft token the acceptance is p(d): check it bin by bin too.
    run = res.run
    for d in range(V):
        mask = run.drafts == d
        got = run.out.num_accepted[mask].mean()
        se = math.sqrt(P[d] * (1 - P[d]) / mask.sum())
        assert abs(got - P[d]) < 5 * se + 1e-9, (d, got, P[d])


def test_one_hot_wrong_residual_fails_the_same_check(monkeypatch):
    _resample_from_p(monkeypatch)
    res = one_draft_check(P, Q, one_hot=True, seed=1)
    assert res.pvalue < FAIL_P, (res.pvalue, res.counts)


def test_tempered_top_k_target_is_what_drafts_are_verified_against():
    """The target p is the processed distribution (temperature, top-k), not raw softmax."""
    params = SamplingParams(temperature=0.7, top_k=5)
    target = exact_probs(logits_for(P), temperature=0.7, top_k=5)
    res = one_draft_check(P, Q, params=params, target_probs=target, seed=2)
    assert_matches_target(res)
    assert res.counts[target == 0].sum() == 0


def test_bonus_token_is_drawn_from_the_last_row():
    """Accepted requests' second token follows the bonus row; drafts the target is
    certain of are always accepted and then the bonus row alone decides."""
    res = one_draft_check(P, Q, seed=3)
    out = res.run.out
    accepted = np.flatnonzero(out.num_accepted == 1)
    second = np.fromiter((out.token_ids[i][1] for i in accepted), dtype=np.int64)
    target = exact_probs(logits_for(P_BONUS))
    assert chi_square_pvalue(np.bincount(second, minlength=V), target) > PASS_P
    assert all(len(out.token_ids[i]) == 1 for i in np.flatnonzero(out.num_accepted == 0))

    # Two drafts the target is certain of (one-hot rows): always accepted.
    n, k = 6000, 2
    gen = torch.Generator().manual_seed(7)
    drafts = torch.randint(0, V, (n, k), generator=gen).numpy()
    logits = torch.full((n, k + 1, V), float("-inf"))
    logits[np.arange(n)[:, None], np.arange(k)[None, :], drafts] = 0.0
    logits[:, k] = logits_for(P_BONUS)
    state = make_state([SamplingParams(temperature=1.0)] * n)
    run = run_spec(state, logits.reshape(-1, V), np.full(n, k), drafts.reshape(-1), seed=3)
    assert (run.out.num_accepted == k).all()
    tokens = np.asarray(run.out.token_ids)
    assert (tokens[:, :k] == drafts).all()
    assert chi_square_pvalue(np.bincount(tokens[:, k], minlength=V), target) > PASS_P


def test_two_drafts_second_token_follows_its_row_given_the_first_was_accepted():
    """K = 2, independent draft distributions per position: the first token follows row
    0, and given draft 0 was kept the second follows row 1 (both the rule's claim)."""
    n = N_STAT
    p0, p1 = P, P_BONUS[::-1]
    q0, q1 = Q, Q[::-1]
    gen = torch.Generator().manual_seed(11)
    d0 = torch.multinomial(torch.tensor(q0), n, replacement=True, generator=gen)
    d1 = torch.multinomial(torch.tensor(q1), n, replacement=True, generator=gen)
    drafts = torch.stack([d0, d1], 1).numpy()
    row = torch.stack([logits_for(p0), logits_for(p1), logits_for(P)])
    draft_probs = torch.tensor([q0, q1], dtype=torch.float32).repeat(n, 1)
    state = make_state([SamplingParams(temperature=1.0)] * n)
    run = run_spec(state, row.repeat(n, 1), np.full(n, 2), drafts.reshape(-1), draft_probs,
                   seed=4)
    out = run.out
    first = first_tokens(out)
    assert chi_square_pvalue(np.bincount(first, minlength=V), exact_probs(logits_for(p0))) > PASS_P
    kept = np.flatnonzero(out.num_accepted >= 1)
    second = np.fromiter((out.token_ids[i][1] for i in kept), dtype=np.int64)
    assert chi_square_pvalue(np.bincount(second, minlength=V), exact_probs(logits_for(p1))) > PASS_P
    a0 = np.minimum(p0, q0).sum()
    a1 = np.minimum(p1, q1).sum()
    for m, want in ((1, a0 * (1 - a1)), (2, a0 * a1), (0, 1 - a0)):
        got = (out.num_accepted == m).mean()
        assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / n), (m, got, want)


# -- greedy, mixed, zero drafts ---------------------------------------------------------
def _greedy_case(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n * (k + 1), V, generator=gen)
    argmax = logits.argmax(-1).view(n, k + 1).numpy()
    hit = torch.rand(n, k, generator=gen).numpy() < 0.6
    other = (argmax[:, :k] + torch.randint(1, V, (n, k), generator=gen).numpy()) % V
    drafts = np.where(hit, argmax[:, :k], other)
    return logits, argmax, drafts


def _greedy_expected(argmax: np.ndarray, drafts: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    n, k = drafts.shape
    num, tokens = [], []
    for i in range(n):
        a = 0
        while a < k and drafts[i, a] == argmax[i, a]:
            a += 1
        num.append(a)
        tokens.append([*drafts[i, :a].tolist(), int(argmax[i, a])])
    return np.asarray(num), tokens


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_accepts_iff_argmax_and_emits_argmax_at_first_mismatch(with_draft_probs):
    n, k = 500, 3
    logits, argmax, drafts = _greedy_case(n, k, seed=5)
    state = make_state([SamplingParams(temperature=0.0)] * n)
    # Draft probabilities that would make a random row accept other tokens: ignored.
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.zeros(n * k, V)
        draft_probs[np.arange(n * k), drafts.reshape(-1)] = 1e-6
    run = run_spec(state, logits, np.full(n, k), drafts.reshape(-1), draft_probs)
    want_num, want_tokens = _greedy_expected(argmax, drafts)
    np.testing.assert_array_equal(run.out.num_accepted, want_num)
    assert run.out.token_ids == want_tokens


def test_mixed_greedy_and_random_rows_in_one_batch():
    n, k = 8000, 1
    greedy = np.arange(n) % 2 == 0
    params = [SamplingParams(temperature=0.0) if g else SamplingParams(temperature=1.0)
              for g in greedy]
    state = make_state(params)
    glogits, gargmax, gdrafts = _greedy_case(n, k, seed=6)
    gen = torch.Generator().manual_seed(12)
    rdrafts = torch.multinomial(torch.tensor(Q), n, replacement=True, generator=gen).numpy()
    rlogits = torch.stack([logits_for(P), logits_for(P_BONUS)]).repeat(n, 1)
    row_is_greedy = np.repeat(greedy, k + 1)
    logits = torch.where(torch.from_numpy(row_is_greedy)[:, None], glogits, rlogits)
    drafts = np.where(greedy, gdrafts[:, 0], rdrafts)
    draft_probs = torch.tensor(Q).expand(n, V).contiguous()
    run = run_spec(state, logits, np.ones(n), drafts, draft_probs, seed=6)
    out = run.out
    g = np.flatnonzero(greedy)
    want_num, want_tokens = _greedy_expected(gargmax[g], gdrafts[g])
    np.testing.assert_array_equal(out.num_accepted[g], want_num)
    assert [out.token_ids[i] for i in g] == want_tokens
    r = np.flatnonzero(~greedy)
    counts = np.bincount(first_tokens(out)[r], minlength=V)
    assert chi_square_pvalue(counts, exact_probs(logits_for(P))) > PASS_P
    acc = out.num_accepted[r].mean()
    assert abs(acc - 0.57) < 5 * math.sqrt(0.57 * 0.43 / len(r))


def test_zero_draft_requests_sample_like_the_plain_sampler():
    """Requests without drafts (beside drafted ones) emit one token from their row: the
    target's distribution, and for seeded ones exactly the plain sampler's token."""
    n = 6000
    has = np.arange(n) % 3 == 0  # a third carries one draft
    num_drafts = has.astype(np.int64)
    state = make_state([SamplingParams(temperature=1.0)] * n)
    logits = logits_for(P).expand(int(num_drafts.sum() + n), V).contiguous()
    gen = torch.Generator().manual_seed(13)
    drafts = torch.multinomial(torch.tensor(Q), int(has.sum()), replacement=True,
                               generator=gen).numpy()
    run = run_spec(state, logits, num_drafts, drafts, seed=7)
    out = run.out
    zero = np.flatnonzero(~has)
    assert all(len(out.token_ids[i]) == 1 for i in zero)
    assert (out.num_accepted[zero] == 0).all()
    counts = np.bincount(first_tokens(out)[zero], minlength=V)
    assert chi_square_pvalue(counts, exact_probs(logits_for(P))) > PASS_P

    # Seeded, no drafts at all: token for token what the plain sampler draws.
    m = 64
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(m)]
    outputs = [[i % V] * (i % 3) for i in range(m)]  # various output positions
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(m, V, generator=gen)
    plain_state = make_state(seeded, outputs=outputs)
    rows = np.arange(m)
    plain = Sampler()(logits.clone(), plain_state.build_metadata(rows)).sampled_token_ids
    spec_state = make_state(seeded, outputs=outputs)
    run = run_spec(spec_state, logits, np.zeros(m), np.zeros(0), seed=99)
    assert [t[0] for t in run.out.token_ids] == plain.tolist()


# -- bookkeeping ------------------------------------------------------------------------
def test_num_accepted_emitted_rows_and_logprobs_are_consistent():
    n = 400
    gen = torch.Generator().manual_seed(15)
    num_drafts = torch.randint(0, 4, (n,), generator=gen).numpy()
    total_rows = int((num_drafts + 1).sum())
    logits = torch.randn(total_rows, V, generator=gen) * 1.5
    drafts = torch.randint(0, V, (int(num_drafts.sum()),), generator=gen).numpy()
    draft_probs = torch.softmax(torch.randn(int(num_drafts.sum()), V, generator=gen), -1)
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, logprobs=2,
                             seed=i if i % 4 == 1 else None) for i in range(n)]
    state = make_state(params)
    run = run_spec(state, logits, num_drafts, drafts, draft_probs, seed=8)
    out, layout = run.out, run.layout
    assert out.num_accepted.shape == (n,)
    assert ((0 <= out.num_accepted) & (out.num_accepted <= num_drafts)).all()
    flat_tokens, want_rows = [], []
    for i in range(n):
        a = int(out.num_accepted[i])
        tokens = out.token_ids[i]
        assert len(tokens) == a + 1
        assert tokens[:a] == layout.drafts[i, :a].tolist()
        if a < num_drafts[i] and i % 4 == 0:  # greedy rejection: argmax, not the draft
            assert tokens[a] == int(logits[layout.starts[i] + a].argmax())
            assert tokens[a] != layout.drafts[i, a]
        flat_tokens += tokens
        want_rows += [int(layout.starts[i]) + o for o in range(a + 1)]
    np.testing.assert_array_equal(out.emitted_rows, want_rows)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape[0] == len(flat_tokens)
    assert lp.token_ids[:, 0].tolist() == flat_tokens
    raw = torch.log_softmax(logits.double(), -1)
    want_lp = raw[torch.tensor(want_rows), torch.tensor(flat_tokens)]
    torch.testing.assert_close(lp.logprobs[:, 0].double(), want_lp, atol=1e-5, rtol=1e-5)
    # the top-2 alternatives are those of the emitted row
    top2 = raw[torch.tensor(want_rows)].topk(2, -1).indices
    assert lp.token_ids[:, 1:3].tolist() == top2.tolist()
    np.testing.assert_array_equal(lp.num_logprobs, np.full(len(flat_tokens), 2))


# -- a target that forbids the draft ------------------------------------------------------
def _forbidden_case(n: int, forbidden: int):
    p = list(P)
    state = make_state([SamplingParams(temperature=1.0)] * n)
    drafts = np.full(n, forbidden)
    q = torch.zeros(V)
    q[forbidden] = 1.0  # the draft is sure of it
    return p, state, drafts, q.expand(n, V).contiguous()


@pytest.mark.parametrize("one_hot", [False, True])
def test_minus_inf_logit_never_accepts_the_draft(one_hot):
    n, d = 4000, 0  # token 0 is the target's favourite before the ban
    p, state, drafts, q = _forbidden_case(n, d)
    row = logits_for(p)
    row[d] = float("-inf")
    logits = torch.stack([row, logits_for(P_BONUS)]).repeat(n, 1)
    run = run_spec(state, logits, np.ones(n), drafts, None if one_hot else q, seed=9)
    assert (run.out.num_accepted == 0).all()
    counts = np.bincount(first_tokens(run.out), minlength=V)
    assert counts[d] == 0
    assert chi_square_pvalue(counts, exact_probs(row)) > PASS_P


@pytest.mark.parametrize("one_hot", [False, True])
def test_bitmask_forbidding_the_draft_never_accepts_it(one_hot):
    n, d = 4000, 0
    p, state, drafts, q = _forbidden_case(n, d)
    logits = torch.stack([logits_for(p), logits_for(P_BONUS)]).repeat(n, 1)
    bitmask = torch.full((2 * n, 1), (1 << V) - 1, dtype=torch.int32)
    bitmask[0::2] = ((1 << V) - 1) & ~(1 << d)  # draft rows forbid d; bonus rows allow all
    run = run_spec(state, logits, np.ones(n), drafts, None if one_hot else q,
                   token_bitmask=bitmask, seed=10)
    assert (run.out.num_accepted == 0).all()
    counts = np.bincount(first_tokens(run.out), minlength=V)
    assert counts[d] == 0
    masked = logits_for(p)
    masked[d] = float("-inf")
    assert chi_square_pvalue(counts, exact_probs(masked)) > PASS_P


def test_greedy_target_that_forbids_its_argmax_rejects_it():
    n = 50
    state = make_state([SamplingParams(temperature=0.0)] * n)
    row = logits_for(P)  # argmax is token 0
    logits = torch.stack([row, row]).repeat(n, 1)
    bitmask = torch.full((2 * n, 1), ((1 << V) - 1) & ~1, dtype=torch.int32)
    run = run_spec(state, logits, np.ones(n), np.zeros(n), token_bitmask=bitmask)
    assert (run.out.num_accepted == 0).all()
    assert all(t == [1] for t in run.out.token_ids)  # the argmax of what is allowed


# -- build_spec_metadata: row o sees the first o drafts as output --------------------------
VB = 16
EOS = 15


def _spec_requests():
    """(params, prompt, output, drafts) per row: penalties, min_tokens, multi-token bad
    words matching across the history/draft boundary, seeds, mixed together."""
    bad = dict(bad_words=["w"], bad_words_token_ids=[[10, 11, 12], [13, 14], [9]])
    return [
        (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6),
         [1, 2, 3], [4], [4, 5, 4]),
        (SamplingParams(temperature=0.0), [0], [], [6]),
        (SamplingParams(temperature=0.8, seed=77, repetition_penalty=0.7, **bad),
         [5, 10], [], [11, 13, 2]),
        (SamplingParams(min_tokens=3, stop_token_ids=[7]), [2], [9], [7, 8, 9]),
        (SamplingParams(min_tokens=2, frequency_penalty=-0.5, seed=5, top_p=0.9, **bad),
         [1], [10], [11, 12, 3, 3]),
        (SamplingParams(seed=123, presence_penalty=1.5, min_tokens=4, top_k=6), [4, 4], [],
         []),
        (SamplingParams(**bad), [3], [13], [14, 10, 11]),
        # a longer word widens the shared history window; bias and whitelist ride along
        (SamplingParams(bad_words=["l"], bad_words_token_ids=[[1, 2, 3, 4], [2, 5]],
                        logit_bias={6: 2.5}, frequency_penalty=0.3, seed=9),
         [0, 1], [2], [3, 0, 1, 2, 5]),
        (SamplingParams(allowed_token_ids=[1, 2, 3, 4, 5, 6], repetition_penalty=1.6,
                        min_tokens=1, stop_token_ids=[3]), [6], [], [6, 6]),
    ]


# Request i sits in persistent row STATE_ROWS[i]; the batch order differs from the rows.
STATE_ROWS = [7, 0, 9, 3, 5, 1, 8, 4, 2]


def _state_of(requests) -> SamplingState:
    state = SamplingState(len(STATE_ROWS) + 1, VB, CPU)
    for i, (params, prompt, output, _) in enumerate(requests):
        state.add_request(STATE_ROWS[i], params, prompt, output, eos_token_id=EOS)
    return state


def _processed(logits: torch.Tensor, metadata) -> torch.Tensor:
    """The sampler's stages 2-3 (logits processors, penalties) on a copy."""
    logits = logits.clone()
    apply_logits_processors(logits, metadata, None)
    if metadata.penalties is not None:
        apply_batch_penalties(logits, metadata.penalties)
    return logits


def test_spec_metadata_row_o_equals_plain_metadata_after_o_drafts():
    requests = _spec_requests()
    n = len(requests)
    num_drafts = np.asarray([len(r[3]) for r in requests], dtype=np.int64)
    flat = np.asarray([t for r in requests for t in r[3]], dtype=np.int64)
    rows = np.asarray(STATE_ROWS[:n], dtype=np.int64)
    gen = torch.Generator().manual_seed(16)
    logits = torch.randn(int((num_drafts + 1).sum()), VB, generator=gen) * 2
    spec_state = _state_of(requests)
    spec_md = spec_state.build_spec_metadata(rows, num_drafts, flat)
    layout = SpecLayout.of(num_drafts, flat)
    spec_logits = _processed(logits, spec_md)
    spec_probs = rs_module._target_probs(spec_logits.clone(), spec_md)
    for o in range(int(num_drafts.max()) + 1):
        live = np.flatnonzero(num_drafts >= o)
        ref_state = _state_of(requests)
        ref_state.append_token_lists(rows[live], [requests[i][3][:o] for i in live])
        ref_md = ref_state.build_metadata(rows[live])
        spec_rows = layout.starts[live] + o
        ref_logits = _processed(logits[spec_rows], ref_md)
        torch.testing.assert_close(spec_logits[spec_rows], ref_logits, atol=0, rtol=0,
                                   msg=lambda m: f"offset {o}: {m}")
        ref_probs = rs_module._target_probs(ref_logits.clone(), ref_md)
        torch.testing.assert_close(spec_probs[spec_rows], ref_probs, atol=1e-6, rtol=1e-6)
        for j, i in enumerate(live.tolist()):
            params, _, output, _ = requests[i]
            spec_row = int(spec_rows[j])
            if params.seed is None:
                assert spec_row not in spec_md.generators
                continue
            want = draw_seed(params.seed, len(output) + o)
            assert spec_md.generators[spec_row].initial_seed() == want
            assert ref_md.generators[j].initial_seed() == want


def test_spec_metadata_bans_and_penalties_are_really_exercised():
    """Guard for the test above: the chosen requests do hit each rule at some offset."""
    requests = _spec_requests()
    num_drafts = np.asarray([len(r[3]) for r in requests], dtype=np.int64)
    flat = np.asarray([t for r in requests for t in r[3]], dtype=np.int64)
    layout = SpecLayout.of(num_drafts, flat)
    rows = np.asarray(STATE_ROWS[: len(requests)], dtype=np.int64)
    md = _state_of(requests).build_spec_metadata(rows, num_drafts, flat)
    zeros = _processed(torch.zeros(len(layout.offsets), VB), md)
    start = layout.starts
    neg = torch.isinf(zeros)
    # request 2: [10, 11] across prompt/draft bans 12 at row 1, draft 13 bans 14 at row 2
    assert neg[start[2] + 1, 12] and not neg[start[2], 12]
    assert neg[start[2] + 2, 14] and not neg[start[2] + 3, 14]
    # request 3: min_tokens 3 with one output: rows 0, 1 ban 7 and EOS, rows 2, 3 do not
    assert neg[start[3], 7] and neg[start[3] + 1, EOS]
    assert not neg[start[3] + 2, 7] and not neg[start[3] + 3, EOS]
    # request 6: output 13 then draft 14 -- banned at row 0 already; 10, 11 -> 12 at row 3
    assert neg[start[6], 14] and neg[start[6] + 3, 12] and not neg[start[6] + 2, 12]
    # request 7: [1, 2] + drafts 3 bans 4 at row 1 (history across output and draft)
    assert neg[start[7] + 1, 4] and not neg[start[7], 4] and not neg[start[7] + 2, 4]
    # ... and [2, 5] bans 5 after draft 2 at row 4, and after the output 2 at row 0
    assert neg[start[7], 5] and neg[start[7] + 4, 5] and not neg[start[7] + 1, 5]
    # request 0: frequency/presence grow with the repeated draft 4
    r0 = zeros[start[0] : start[0] + 4, 4].tolist()
    assert r0[0] > r0[1] > r0[3] and r0[1] == r0[2]
