"""Comparing two engine runs of the same greedy requests (e.g. parallel vs one process)."""

from __future__ import annotations

LOGPROB_ATOL = 1e-4  # float32 sums in another order (all-reduce, expert combine)
TIE = 1e-3  # a divergence is accepted only where the reference's top-2 are this close


def top2(position_logprobs) -> list[tuple[int, float]]:
    ranked = sorted(position_logprobs.items(), key=lambda kv: -kv[1].logprob)
    return [(token, lp.logprob) for token, lp in ranked[:2]]


def assert_outputs_equivalent(reference, got, atol: float = LOGPROB_ATOL,
                              tie: float = TIE) -> None:
    """Two lists of RequestOutput (same prompts, greedy, logprobs >= 2): token ids equal
    up to a verified near-tie of the reference, sampled-token logprobs within ``atol``."""
    assert len(reference) == len(got)
    for i, (ref, out) in enumerate(zip(reference, got)):
        assert out.prompt_token_ids == ref.prompt_token_ids, f"prompt {i}: order not kept"
        want, have = ref.outputs[0], out.outputs[0]
        for j, (w, g) in enumerate(zip(want.token_ids, have.token_ids)):
            if w != g:
                top = top2(want.logprobs[j])
                gap = top[0][1] - top[1][1]
                assert gap < tie and g in [t for t, _ in top], (
                    f"prompt {i} diverged at output {j}: parallel {g}, single process {w}, "
                    f"single-process top-2 {top} (gap {gap:.2e} is no near-tie)")
                break
            lw, lg = want.logprobs[j][w].logprob, have.logprobs[j][g].logprob
            assert abs(lw - lg) <= atol, (
                f"prompt {i} output {j} (token {w}): logprob {lg} vs single process {lw}")
        else:
            assert list(have.token_ids) == list(want.token_ids), (i, have.token_ids)
            assert have.finish_reason == want.finish_reason
