"""State slots of models with state (Mamba) layers: the allocator, the KV cache manager
that hands them out with the first allocation, and the scheduler path (no slot leaks
after finish, abort or preemption; the slot travels to the executor with a new request)."""

from __future__ import annotations

import logging

import pytest

from engine.core.kv_cache import KVCacheManager
from engine.core.kv_cache.state_slots import NULL_STATE_SLOT, StateSlotAllocator
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from tests.core.test_scheduler import add, drain, make_request, make_scheduler, run_step


def test_allocator_hands_out_each_slot_once_and_never_the_null_slot():
    slots = StateSlotAllocator(3)
    got = [slots.allocate(r) for r in "abc"]
    assert sorted(got) == [1, 2, 3] and NULL_STATE_SLOT not in got
    assert slots.allocate("a") == got[0]  # idempotent for a holder
    assert slots.allocate("d") is None and slots.num_free == 0
    slots.free("b")
    slots.free("b")  # a second free is a no-op
    assert slots.num_free == 1 and slots.slot_of("b") is None
    assert slots.allocate("d") == got[1]
    with pytest.raises(ValueError):
        StateSlotAllocator(0)


def test_manager_takes_a_slot_at_first_allocation_and_frees_it():
    mgr = KVCacheManager(16, 4, enable_caching=False, num_state_slots=2)
    a, b, c = (Request(r, list(range(10)), SamplingParams()) for r in "abc")
    assert mgr.get_state_slot("a") is None
    assert mgr.allocate_slots(a, 5) is not None
    slot = mgr.get_state_slot("a")
    assert slot in (1, 2)
    a.num_computed_tokens = 5
    assert mgr.allocate_slots(a, 5) is not None and mgr.get_state_slot("a") == slot
    assert mgr.allocate_slots(b, 5) is not None
    free_blocks = mgr.num_free_blocks
    assert mgr.allocate_slots(c, 5) is None  # no slot left: nothing allocated
    assert mgr.num_free_blocks == free_blocks and not mgr.holds_blocks("c")
    mgr.free(a)
    assert mgr.get_state_slot("a") is None
    assert mgr.allocate_slots(c, 5) is not None and mgr.get_state_slot("c") == slot


def test_manager_without_state_layers_has_no_slots():
    mgr = KVCacheManager(16, 4)
    assert mgr.allocate_slots(Request("a", [1, 2, 3], SamplingParams()), 3) is not None
    assert mgr.state_slots is None and mgr.get_state_slot("a") is None


def _slots_all_free(s) -> bool:
    slots = s.kv_cache_manager.state_slots
    return slots.num_free == slots.num_slots and not slots._owner


def test_scheduler_sends_the_slot_and_frees_it_on_finish_and_abort(caplog):
    with caplog.at_level(logging.INFO, logger="engine.core.scheduler.scheduler"):
        s = make_scheduler(max_num_seqs=3, num_state_slots=3, budget=8)
    assert "prefix caching disabled" in caplog.text
    assert not s.kv_cache_manager.enable_caching
    reqs = [make_request(r, 10, max_tokens=4) for r in ("a", "b", "c")]
    add(s, *reqs)
    so, _ = run_step(s)
    sent = {new.req_id: new.state_slot for new in so.scheduled_new_reqs}
    assert sent and all(slot in (1, 2, 3) for slot in sent.values())
    assert len(set(sent.values())) == len(sent)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.get_state_slot("b") is None
    drain(s)
    assert _slots_all_free(s)


def test_preempted_request_gives_its_slot_back_and_restarts_from_zero():
    # 9 usable blocks of 4 tokens: two growing requests cannot both reach 24 tokens.
    s = make_scheduler(num_blocks=10, max_num_seqs=2, num_state_slots=2, budget=16,
                       max_model_len=32)
    add(s, make_request("a", 12, max_tokens=12), make_request("b", 12, max_tokens=12))
    resent: list[tuple[str, int | None, int]] = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        so, _ = run_step(s)
        for rid in so.preempted_req_ids:
            assert s.kv_cache_manager.get_state_slot(rid) is None
        resent += [(n.req_id, n.state_slot, n.num_computed_tokens)
                   for n in so.scheduled_new_reqs]
    assert s.num_preemptions_total > 0
    assert len(resent) > 2  # a preempted request came back as new ...
    assert all(slot is not None and computed == 0 for _, slot, computed in resent)
    assert _slots_all_free(s)  # ... and every slot is back
