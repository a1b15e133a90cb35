"""Per-request seeds: same seed, same tokens, whatever the batch and the row."""

from __future__ import annotations

import numpy as np
import torch
from sampling_helpers import make_state, rows

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import Sampler
from engine.model_executor.sampling.state import draw_seed

V = 64
STEPS = 6


def fixed_logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 0.5  # flat-ish


def run(state, batch: np.ndarray, logit_seeds: list[int], steps: int = STEPS) -> np.ndarray:
    """Sample ``steps`` times; row i always sees the same logits. Returns [steps, N]."""
    sampler = Sampler()
    logits = torch.stack([fixed_logits(s) for s in logit_seeds])
    out = []
    for _ in range(steps):
        tokens = sampler(logits.clone(), state.build_metadata(batch)).sampled_token_ids.numpy()
        state.append_tokens(batch, tokens)
        out.append(tokens)
    return np.stack(out)


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)


def test_same_seed_same_tokens_across_batches_and_rows():
    torch.manual_seed(0)
    alone = run(make_state(V, {0: SEEDED}), rows(0), [7])[:, 0]
    assert len(set(alone.tolist())) > 1  # really random, not collapsed

    torch.manual_seed(1)  # different global state for the unseeded neighbours
    state = make_state(
        V,
        {
            1: SamplingParams(temperature=0.7),
            3: SamplingParams(temperature=1.0, seed=99),
            4: SEEDED,
            6: SamplingParams(temperature=0.0),
        },
    )
    mixed = run(state, rows(6, 1, 4, 3), [1, 2, 7, 3])
    assert mixed[:, 2].tolist() == alone.tolist()


def test_seed_survives_a_row_move_mid_sequence():
    torch.manual_seed(2)
    reference = run(make_state(V, {0: SEEDED}), rows(0), [7])[:, 0]
    state = make_state(V, {5: SEEDED, 2: SamplingParams(temperature=1.0)})
    first = run(state, rows(2, 5), [3, 7], steps=2)[:, 1]
    state.remove_request(2)
    state.move_row(5, 0)
    rest = run(state, rows(0), [7], steps=STEPS - 2)[:, 0]
    assert first.tolist() + rest.tolist() == reference.tolist()


def test_resumed_request_continues_its_sequence():
    """A request resumed after preemption (output non-empty) continues the same tokens."""
    torch.manual_seed(3)
    reference = run(make_state(V, {0: SEEDED}), rows(0), [7])[:, 0].tolist()
    state = make_state(V, {3: SEEDED}, outputs={3: reference[:2]})
    resumed = run(state, rows(3), [7], steps=STEPS - 2)[:, 0].tolist()
    assert resumed == reference[2:]


def test_different_seeds_and_unseeded_rows_differ():
    torch.manual_seed(4)
    a = run(make_state(V, {0: SEEDED}), rows(0), [7], steps=12)[:, 0]
    b = run(make_state(V, {0: SEEDED.clone(seed=4321)}), rows(0), [7], steps=12)[:, 0]
    assert a.tolist() != b.tolist()
    state = make_state(V, {0: SamplingParams(temperature=1.0), 1: SamplingParams(temperature=1.0)})
    both = run(state, rows(0, 1), [7, 7], steps=12)
    assert both[:, 0].tolist() != both[:, 1].tolist()  # one shared draw, independent rows


def test_rebuilding_a_step_redraws_the_same_token():
    """Draws are keyed by (seed, position): re-running a step repeats it exactly."""
    state = make_state(V, {2: SEEDED})
    logits = fixed_logits(7).unsqueeze(0)
    sampler = Sampler()
    first = [
        sampler(logits.clone(), state.build_metadata(rows(2))).sampled_token_ids.item()
        for _ in range(3)
    ]
    assert len(set(first)) == 1


def test_draw_seeds_are_distinct_64_bit_values():
    keys = {draw_seed(s, p) for s in (0, 1, 2**63 + 5) for p in range(200)}
    assert len(keys) == 600 and all(0 <= k < 2**64 for k in keys)
