"""The per-step state metadata: decode steps, prefill steps, and mixed steps split into a
decode part and a prefill part with their token rows."""

from __future__ import annotations

import numpy as np
import torch

from engine.model_executor.state_cache import (
    StateCacheSpec,
    StateLayerSpec,
    allocate_state_caches,
    build_state_metadata,
)


def _build(slots, computed, lens):
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(lens)
    return build_state_metadata(np.array(slots), np.array(computed), qsl, max(lens),
                                torch.from_numpy)


def test_decode_and_prefill_steps_are_one_part():
    md = _build([3, 1], [5, 9], [1, 1])
    assert md.is_decode and not md.parts
    md = _build([3, 1], [0, 9], [4, 2])
    assert not md.is_decode and not md.parts
    assert md.has_initial_state.tolist() == [False, True]
    md = _build([2], [0], [1])  # a one-token prompt starts from zeros: not a decode
    assert not md.is_decode and not md.parts


def test_mixed_step_splits_into_decodes_and_the_rest():
    md = _build([4, 2, 7, 5], [10, 0, 3, 8], [1, 3, 1, 2])
    decode, prefill = md.parts
    assert decode.is_decode and decode.state_indices.tolist() == [4, 7]
    assert decode.token_index.tolist() == [0, 4]
    assert not prefill.is_decode and prefill.state_indices.tolist() == [2, 5]
    assert prefill.token_index.tolist() == [1, 2, 3, 5, 6]
    assert prefill.query_start_loc.tolist() == [0, 3, 5]
    assert prefill.has_initial_state.tolist() == [False, True]
    assert prefill.max_query_len == 3


def test_state_caches_have_a_null_slot_and_the_spec_bytes():
    layer = StateLayerSpec(((6, 3), (2, 4, 8)), (torch.float32, torch.bfloat16))
    spec = StateCacheSpec((layer, layer))
    caches = allocate_state_caches(spec, 3, torch.device("cpu"))
    assert [t.shape[0] for t in caches[0]] == [4, 4]
    per_slot = sum(t[0].numel() * t.element_size() for c in caches for t in c)
    assert per_slot == spec.bytes_per_slot() == 2 * (18 * 4 + 64 * 2)
