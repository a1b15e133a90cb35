"""Repetition / frequency / presence penalties against a plain-Python float64 reference."""

from __future__ import annotations

import numpy as np
import torch
from sampling_helpers import make_state, rows

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler, apply_penalties
from engine.model_executor.sampling.penalties import apply_batch_penalties

V = 16


def reference(logits: list[float], prompt: list[int], output: list[int], rep, freq, pres):
    out = []
    for t, x in enumerate(logits):
        x = float(x)
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(t)
        x -= freq * count + pres * (1.0 if count > 0 else 0.0)
        out.append(x)
    return out


def test_pure_function_matches_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    prompts = [[1, 2, 2, 5], [], [0, 15]]
    outputs = [[2, 3, 3, 3], [4, 4, 9], []]
    params = [(1.3, 0.5, 0.25), (0.8, -0.4, 1.1), (2.0, 1.0, 1.0)]
    prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    counts = torch.zeros(3, V, dtype=torch.int32)
    for i in range(3):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    rep, freq, pres = (torch.tensor(c, dtype=torch.float32) for c in zip(*params))
    got = apply_penalties(logits, prompt_mask, counts, rep, freq, pres)
    for i in range(3):
        want = reference(logits[i].tolist(), prompts[i], outputs[i], *params[i])
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-6)


def test_state_counts_follow_appended_tokens():
    """Counts built at add_request (incl. a resumed output) and bumped by both appends."""
    torch.manual_seed(1)
    specs = {
        0: (SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3), [3, 3, 7], [1]),
        2: (SamplingParams(), [4], []),  # no penalties: untouched
        5: (SamplingParams(presence_penalty=0.7, frequency_penalty=-0.2), [9], [9, 9, 2]),
        6: (SamplingParams(repetition_penalty=0.9), [0, 1, 2], []),
    }
    state = make_state(
        V,
        {r: s[0] for r, s in specs.items()},
        prompts={r: s[1] for r, s in specs.items()},
        outputs={r: s[2] for r, s in specs.items()},
    )
    history = {r: list(s[2]) for r, s in specs.items()}
    batch = rows(5, 0, 6, 2)
    steps = [np.array([9, 1, 11, 4]), np.array([2, 2, 2, 4])]
    for tokens in steps:
        state.append_tokens(batch, tokens)
        for r, t in zip(batch.tolist(), tokens.tolist()):
            history[r].append(t)
    state.append_token_lists(rows(6, 0), [[0, 0, 13], []])
    history[6] += [0, 0, 13]

    logits = torch.randn(4, V)
    md = state.build_metadata(batch)
    got = logits.clone()
    apply_batch_penalties(got, md.penalties)
    for i, r in enumerate(batch.tolist()):
        p = specs[r][0]
        want = reference(
            logits[i].tolist(),
            specs[r][1],
            history[r],
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-6)


def test_greedy_picks_argmax_of_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0] + [-5.0] * (V - 4)])
    state = make_state(
        V,
        {0: SamplingParams(temperature=0.0, frequency_penalty=0.2)},
        prompts={0: [1]},
        outputs={0: [0]},
    )
    assert Sampler()(logits.clone(), state.build_metadata(rows(0))).sampled_token_ids.item() == 1
    state = make_state(
        V, {0: SamplingParams(temperature=0.0, repetition_penalty=2.0)}, prompts={0: [0]}
    )
    assert Sampler()(logits.clone(), state.build_metadata(rows(0))).sampled_token_ids.item() == 1


def test_slots_are_recycled_after_removal():
    state = make_state(V, {0: SamplingParams(presence_penalty=1.0)}, outputs={0: [3, 3]})
    slot = int(state.penalty_slot[0])
    state.remove_request(0)
    state.add_request(1, SamplingParams(presence_penalty=1.0), [5], [])
    assert int(state.penalty_slot[1]) == slot
    counts = state.token_counts.output_counts[slot]
    assert int(counts.sum()) == 0  # nothing left over from the previous owner
    assert state.token_counts.prompt_mask[slot].nonzero().flatten().tolist() == [5]
