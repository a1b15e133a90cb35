"""Scheduler with steps in flight (pipeline parallelism): in-flight requests are passed
over and never preempted; non-sampling ranks get the accepted tokens in the diff."""

from __future__ import annotations

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler.scheduler import Scheduler
from tests.core.test_scheduler import (
    BS,
    TOKEN,
    add,
    assert_all_free,
    make_request,
    make_scheduler,
)


def _land(s, so: SchedulerOutput, token: int = TOKEN):
    """The model's answer to ``so``: TOKEN for every request that completed its tokens."""
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.get_request(rid)
        sampled.append([token] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    return s.update_from_output(so, ModelRunnerOutput(ids, sampled))


def test_in_flight_requests_are_passed_over_until_their_output_lands():
    s = make_scheduler(send_new_token_ids=True)
    add(s, make_request("a", 5), make_request("b", 6))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"a", "b"}
    assert s.schedule().is_empty  # both in flight: nothing to schedule
    add(s, make_request("c", 3))
    second = s.schedule()  # a second micro-batch while the first is in flight
    assert set(second.num_scheduled_tokens) == {"c"}
    _land(s, first)
    third = s.schedule()
    assert set(third.num_scheduled_tokens) == {"a", "b"}
    cached = third.scheduled_cached_reqs
    # The sampled token travels to the ranks that did not sample it.
    assert cached.new_token_ids == [[TOKEN], [TOKEN]]
    _land(s, second)
    _land(s, third)
    fourth = s.schedule()
    by_id = dict(zip(fourth.scheduled_cached_reqs.req_ids,
                     fourth.scheduled_cached_reqs.new_token_ids))
    assert by_id == {"a": [TOKEN], "b": [TOKEN], "c": [TOKEN]}


def test_new_token_ids_only_when_asked():
    s = make_scheduler()
    add(s, make_request("a", 4))
    _land(s, s.schedule())
    so = s.schedule()
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.new_token_ids == []


def test_in_flight_request_is_never_the_preemption_victim():
    s = make_scheduler(num_blocks=3, max_model_len=16)
    add(s, make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8))
    first = s.schedule()  # both prefill one full block each: the pool is full
    assert set(first.num_scheduled_tokens) == {"a", "b"}
    assert s.kv_cache_manager.num_free_blocks == 0
    _land(s, first)
    s.in_flight["b"] += 1  # b runs in another micro-batch
    so = s.schedule()
    # a needs a block; the only other running request is in flight, so a yields itself.
    assert so.preempted_req_ids == {"a"}
    assert s.get_request("b").num_computed_tokens == 4
    del s.in_flight["b"]
    _land(s, so)
    while s.has_unfinished_requests():
        _land(s, s.schedule())
    assert_all_free(s)


def test_abort_of_an_in_flight_request_frees_it_once_its_step_lands():
    s = make_scheduler(send_new_token_ids=True)
    add(s, make_request("a", 5))
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert _land(s, so) == []  # its late output is dropped
    assert not s.in_flight
    assert_all_free(s)


def test_async_step_ahead_sends_no_drafts_for_the_token_in_flight():
    """Async scheduling: the step scheduled while the previous one runs computes the
    token that step samples; it is not a draft, so the step is a plain decode step
    (no entry in scheduled_spec_decode_tokens, which would send it down the
    verification path)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                  async_scheduling=True),
                  CacheConfig(block_size=BS), 64)
    add(s, make_request("a", 5, max_tokens=6))
    first = s.schedule()
    ahead = s.schedule()  # a's prompt is in flight; its next token runs one step ahead
    assert ahead.num_scheduled_tokens == {"a": 1}
    assert ahead.scheduled_spec_decode_tokens == {}
    assert s.get_request("a").num_output_placeholders == 2
    _land(s, first)
    _land(s, ahead)
    assert s.get_request("a").output_token_ids == [TOKEN, TOKEN]
