"""Logits processors: logit_bias, allowed_token_ids, bad_words, min_tokens, bitmask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_helpers import make_state, rows

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler, apply_token_bitmask, unpack_token_bitmask
from engine.model_executor.sampling.sampler import apply_logits_processors

V = 12
INF = float("inf")


def processed(state, batch_rows, logits=None, bitmask=None) -> torch.Tensor:
    md = state.build_metadata(batch_rows)
    out = torch.zeros(len(batch_rows), V) if logits is None else logits.clone()
    apply_logits_processors(out, md, bitmask)
    return out


def banned(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row == -INF).flatten().tolist())


def test_logit_bias_adds_to_its_row_only():
    state = make_state(V, {2: SamplingParams(logit_bias={3: 2.5, 7: -1.0}), 5: SamplingParams()})
    logits = torch.randn(2, V)
    out = processed(state, rows(5, 2), logits)
    expected = logits.clone()
    expected[1, 3] += 2.5
    expected[1, 7] -= 1.0
    torch.testing.assert_close(out, expected)


def test_logit_bias_forces_a_token_under_sampling():
    state = make_state(V, {0: SamplingParams(temperature=1.0, logit_bias={9: 100.0})})
    out = Sampler()(torch.randn(1, V), state.build_metadata(rows(0)))
    assert out.sampled_token_ids.tolist() == [9]


def test_allowed_token_ids_mask_everything_else():
    state = make_state(V, {0: SamplingParams(allowed_token_ids=[1, 4, 11]), 1: SamplingParams()})
    out = processed(state, rows(1, 0))
    assert banned(out[0]) == set()
    assert banned(out[1]) == set(range(V)) - {1, 4, 11}
    torch.manual_seed(0)
    params = SamplingParams(temperature=5.0, allowed_token_ids=[1, 4, 11])
    state = make_state(V, {0: params})
    md = state.build_metadata(rows(0))
    seen = {Sampler()(torch.randn(1, V), md).sampled_token_ids.item() for _ in range(200)}
    assert seen == {1, 4, 11}


def test_single_token_bad_words_always_banned():
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[[5], [8]])
    state = make_state(V, {3: params, 4: SamplingParams()})
    assert banned(processed(state, rows(3, 4))[0]) == {5, 8}
    state.append_tokens(rows(3, 4), np.array([1, 2]))
    out = processed(state, rows(4, 3))
    assert banned(out[0]) == set() and banned(out[1]) == {5, 8}


def test_multi_token_bad_words_ban_last_token_after_prefix():
    # "7 8 3" and "2 6 6 9": ban 3 after ...7 8, ban 9 after ...2 6 6.
    params = SamplingParams(bad_words=["w"], bad_words_token_ids=[[7, 8, 3], [2, 6, 6, 9], [10]])
    state = make_state(V, {1: params}, prompts={1: [0, 7, 8]})
    assert banned(processed(state, rows(1))[0]) == {3, 10}  # prefix ends the prompt
    state.append_tokens(rows(1), np.array([2]))
    assert banned(processed(state, rows(1))[0]) == {10}
    state.append_tokens(rows(1), np.array([6]))
    state.append_tokens(rows(1), np.array([6]))
    assert banned(processed(state, rows(1))[0]) == {9, 10}
    state.append_token_lists(rows(1), [[7, 8]])
    assert banned(processed(state, rows(1))[0]) == {3, 10}
    state.append_token_lists(rows(1), [[8, 8, 1]])
    assert banned(processed(state, rows(1))[0]) == {10}


def test_multi_token_bad_words_survive_moves_and_other_requests():
    params = SamplingParams(bad_words=["w"], bad_words_token_ids=[[4, 5]])
    state = make_state(V, {0: SamplingParams()}, prompts={0: [4]})
    state.add_request(2, params, [1, 4], [])
    state.move_row(2, 6)
    # A later request with a longer bad word widens the history window.
    state.add_request(
        3, SamplingParams(bad_words=["v"], bad_words_token_ids=[[1, 2, 3, 11]]), [1, 2], [3]
    )
    out = processed(state, rows(0, 6, 3))
    assert [banned(r) for r in out] == [set(), {5}, {11}]
    state.append_tokens(rows(0, 6, 3), np.array([4, 0, 0]))
    out = processed(state, rows(0, 6, 3))
    assert [banned(r) for r in out] == [set(), set(), set()]


def test_bad_words_without_token_ids_is_an_error():
    state = make_state(V, {})
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        state.add_request(0, SamplingParams(bad_words=["oops"]), [1], [])
    with pytest.raises(ValueError, match="outside"):
        state.add_request(0, SamplingParams(bad_words=["o"], bad_words_token_ids=[[V]]), [1], [])
    assert not state.active.any()


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[4, 6])
    state = make_state(V, {0: params, 1: SamplingParams(stop_token_ids=[4])}, eos_token_id=11)
    md = state.build_metadata(rows(0, 1))
    assert not md.no_min_tokens
    out = processed(state, rows(0, 1))
    assert banned(out[0]) == {4, 6, 11} and banned(out[1]) == set()
    state.append_tokens(rows(0, 1), np.array([1, 1]))
    assert banned(processed(state, rows(0, 1))[0]) == {4, 6, 11}
    state.append_tokens(rows(0), np.array([2]))
    md = state.build_metadata(rows(0, 1))
    assert md.no_min_tokens
    assert banned(processed(state, rows(0, 1))[0]) == set()


def test_min_tokens_respects_ignore_eos_and_resume():
    params = SamplingParams(min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    state = make_state(V, {0: params}, eos_token_id=11)
    assert banned(processed(state, rows(0))[0]) == {2}
    state = make_state(
        V, {0: SamplingParams(min_tokens=3)}, outputs={0: [1, 1, 1]}, eos_token_id=11
    )
    assert state.build_metadata(rows(0)).no_min_tokens


def test_fast_path_flags_when_nothing_is_used():
    state = make_state(V, {0: SamplingParams(), 1: SamplingParams(temperature=0.0)})
    md = state.build_metadata(rows(0, 1))
    assert md.no_penalties and md.no_min_tokens and md.no_logit_bias
    assert md.no_allowed_token_ids and md.no_bad_words and md.max_num_logprobs is None
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.temperature is None


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """Reference packing with plain Python ints: bit t%32 of word t//32."""
    n, vocab = allowed.shape
    words = (vocab + 31) // 32
    out = np.zeros((n, words), dtype=np.int64)
    for i in range(n):
        for t in range(vocab):
            if allowed[i, t]:
                out[i, t // 32] |= 1 << (t % 32)
    out = np.where(out >= 2**31, out - 2**32, out)  # two's complement int32
    return torch.from_numpy(out.astype(np.int32))


def test_bitmask_masks_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32
    allowed = rng.random((3, vocab)) < 0.4
    allowed[:, 31] = True  # the sign bit of word 0
    allowed[2] = True  # an all-allowed row
    bitmask = _pack(allowed)
    assert torch.equal(unpack_token_bitmask(bitmask, vocab), torch.from_numpy(allowed))
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    expected[~torch.from_numpy(allowed)] = -INF
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_bitmask_through_the_sampler():
    state = make_state(V, {0: SamplingParams(temperature=0.0), 1: SamplingParams()})
    allowed = np.zeros((2, V), dtype=bool)
    allowed[0, [2, 9]] = True
    allowed[1, 7] = True
    logits = torch.randn(2, V)
    logits[0, 9] = logits[0, 2] + 1.0
    out = Sampler()(logits, state.build_metadata(rows(0, 1)), token_bitmask=_pack(allowed))
    assert out.sampled_token_ids.tolist() == [9, 7]


def test_bitmask_bad_shape_is_an_error():
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64))
