"""SamplingState lifecycle: add / remove / move rows, metadata caching, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_helpers import CPU, make_state, rows

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler, SamplingState

V = 10


def test_metadata_gathers_rows_in_batch_order():
    state = make_state(
        V,
        {
            1: SamplingParams(temperature=0.5, top_k=3, min_p=0.1),
            4: SamplingParams(temperature=0.0, top_k=2),  # greedy: truncation ignored
            6: SamplingParams(temperature=2.0, top_p=0.9, top_k=50, seed=3),  # k > V clamps
        },
    )
    md = state.build_metadata(rows(6, 4, 1))
    assert md.num_rows == 3 and not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == pytest.approx([2.0, 1.0, 0.5])
    assert md.greedy_mask.tolist() == [False, True, False]
    assert md.top_k.tolist() == [V, V, 3] and md.max_top_k == 3
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert list(md.generators) == [0]


def test_unchanged_batch_reuses_tensors_and_changes_rebuild():
    state = make_state(V, {0: SamplingParams(temperature=0.5, top_k=3), 1: SamplingParams()})
    first = state.build_metadata(rows(0, 1))
    state.append_tokens(rows(0, 1), np.array([2, 3]))  # tokens alone change nothing static
    second = state.build_metadata(rows(0, 1))
    assert second.temperature is first.temperature and second.top_k is first.top_k
    assert state.build_metadata(rows(1, 0)).top_k.tolist() == [V, 3]  # new order rebuilds
    state.add_request(2, SamplingParams(), [1], [])
    assert state.build_metadata(rows(0, 1)).top_k is not first.top_k


def test_move_row_carries_everything():
    params = SamplingParams(
        temperature=0.7,
        top_p=0.8,
        presence_penalty=0.5,
        logprobs=2,
        min_tokens=3,
        logit_bias={2: 1.0},
        seed=5,
    )
    state = make_state(V, {3: params}, outputs={3: [4]}, eos_token_id=9)
    before = state.build_metadata(rows(3))
    state.move_row(3, 0)
    assert not state.active[3] and state.active[0] and state.num_requests == 1
    after = state.build_metadata(rows(0))
    for name in ("temperature", "top_p"):
        assert torch.equal(getattr(before, name), getattr(after, name))
    assert torch.equal(before.penalties.slots, after.penalties.slots)
    assert after.logit_bias.tokens.tolist() == [2]
    assert after.min_tokens.tokens.tolist() == [9]
    assert after.max_num_logprobs == 2 and state.wants_logprobs(0) and not state.wants_logprobs(3)
    assert before.generators[0] is after.generators[0]
    with pytest.raises(ValueError, match="hold no request"):
        state.build_metadata(rows(3))


def test_removed_row_is_reset_and_reusable():
    state = make_state(V, {2: SamplingParams(temperature=0.0, allowed_token_ids=[1])})
    state.remove_request(2)
    assert state.num_requests == 0 and state.rules[2] is None
    state.add_request(2, SamplingParams(temperature=0.9), [1], [])
    md = state.build_metadata(rows(2))
    assert md.all_random and md.no_allowed_token_ids
    assert md.temperature.tolist() == pytest.approx([0.9])


def test_bad_lifecycle_calls_raise():
    state = make_state(V, {0: SamplingParams(), 1: SamplingParams()}, max_num_reqs=3)
    with pytest.raises(ValueError, match="already holds"):
        state.add_request(0, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="outside"):
        state.add_request(3, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="holds no request"):
        state.remove_request(2)
    with pytest.raises(ValueError, match="occupied"):
        state.move_row(0, 1)
    with pytest.raises(ValueError, match="logit_bias"):
        state.add_request(2, SamplingParams(logit_bias={V: 1.0}), [1], [])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        state.add_request(2, SamplingParams(allowed_token_ids=[0, V + 3]), [1], [])
    with pytest.raises(ValueError, match="stop_token_ids"):
        state.add_request(2, SamplingParams(min_tokens=1, stop_token_ids=[V]), [1], [])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        state.add_request(2, SamplingParams(), [V], [])
    assert not state.active[2]
    with pytest.raises(ValueError, match="2 rows but 1"):
        state.append_tokens(rows(0, 1), np.array([1]))
    with pytest.raises(ValueError, match="repeat"):
        state.append_tokens(rows(0, 0), np.array([1, 2]))
    with pytest.raises(ValueError, match="appended token ids"):
        state.append_tokens(rows(0), np.array([V]))
    with pytest.raises(ValueError, match="integers"):
        state.build_metadata(np.array([0.0]))
    with pytest.raises(ValueError, match="positive"):
        SamplingState(0, V, CPU)


def test_sampler_rejects_mismatched_logits():
    state = make_state(V, {0: SamplingParams()})
    md = state.build_metadata(rows(0))
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(2, V), md)
    with pytest.raises(ValueError, match="floating point"):
        Sampler()(torch.zeros(1, V, dtype=torch.int32), md)
    half = torch.zeros(1, V, dtype=torch.bfloat16)
    half[0, 4] = 3.0
    greedy = make_state(V, {0: SamplingParams(temperature=0.0)}).build_metadata(rows(0))
    assert Sampler()(half, greedy).sampled_token_ids.tolist() == [4]


def test_many_penalty_requests_grow_the_pool():
    state = SamplingState(12, V, CPU)
    for row in range(12):
        state.add_request(row, SamplingParams(frequency_penalty=1.0), [row % V], [row % V])
    assert state.token_counts.capacity >= 12
    md = state.build_metadata(np.arange(12))
    counts = md.penalties.output_counts_pool[md.penalties.slots]
    assert counts.argmax(dim=1).tolist() == [r % V for r in range(12)]
    assert md.penalties.rows is None  # every row penalized: no row gather
