"""Sampled-token and prompt logprobs against a float64 log_softmax of the raw logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_helpers import make_state, rows

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler, compute_prompt_logprobs

V = 20


def check_row(
    raw: torch.Tensor, token_ids: list[int], logprobs: list[float], rank: int, chosen: int, k: int
) -> None:
    ref = torch.log_softmax(raw.double(), dim=-1)
    order = torch.argsort(ref, descending=True).tolist()
    assert len(token_ids) == len(logprobs) == 1 + k
    assert token_ids[0] == chosen
    assert rank == order.index(chosen) + 1
    assert token_ids[1:] == order[:k]
    np.testing.assert_allclose(logprobs, ref[token_ids].numpy(), rtol=0, atol=1e-5)


def test_sampled_logprobs_are_raw_with_ranks_and_top_k():
    torch.manual_seed(0)
    state = make_state(
        V,
        {
            0: SamplingParams(temperature=0.0, logprobs=3),
            1: SamplingParams(temperature=0.8, logprobs=0),
            2: SamplingParams(temperature=1.0),  # asks for nothing
            # Processing pushes the pick away from the raw argmax; logprobs stay raw.
            3: SamplingParams(
                temperature=0.0, logprobs=5, logit_bias={17: 50.0}, repetition_penalty=1.7
            ),
            4: SamplingParams(temperature=1.0, logprobs=-1),
        },
    )
    batch = rows(3, 0, 2, 1, 4)
    raw = torch.randn(5, V)
    md = state.build_metadata(batch)
    assert md.max_num_logprobs == V
    out = Sampler()(raw.clone(), md)
    assert out.sampled_token_ids[0].item() == 17
    lists = out.logprobs.tolists()
    want_k = {0: 5, 1: 3, 3: 0, 4: V}
    for i, k in want_k.items():
        one = lists.select(i)
        check_row(
            raw[i],
            one.token_ids[0],
            one.logprobs[0],
            one.ranks[0],
            out.sampled_token_ids[i].item(),
            k,
        )
    assert [state.wants_logprobs(r) for r in (0, 1, 2, 3, 4)] == [True, True, False, True, True]


def test_no_logprobs_when_nobody_asks():
    state = make_state(V, {0: SamplingParams(), 1: SamplingParams(temperature=0.0)})
    assert Sampler()(torch.randn(2, V), state.build_metadata(rows(0, 1))).logprobs is None


@pytest.mark.parametrize("k", [0, 2, -1])
def test_prompt_logprobs(k):
    torch.manual_seed(1)
    logits = torch.randn(7, V) * 3
    targets = torch.randint(0, V, (7,))
    lists = compute_prompt_logprobs(logits, targets, k)
    kk = V if k == -1 else k
    assert len(lists.token_ids) == 7
    for i in range(7):
        check_row(
            logits[i], lists.token_ids[i], lists.logprobs[i], lists.ranks[i], targets[i].item(), kk
        )


def test_prompt_logprobs_bad_input():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        compute_prompt_logprobs(torch.randn(2, V), torch.tensor([0, 1]), -2)
    with pytest.raises(ValueError, match="next_token_ids"):
        compute_prompt_logprobs(torch.randn(2, V), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="prompt token ids"):
        compute_prompt_logprobs(torch.randn(2, V), torch.tensor([0, V]), 1)
