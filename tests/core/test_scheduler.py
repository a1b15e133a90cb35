"""Scheduler: the unified token-budget rule, policies, preemption, diffs, stop rules."""

from __future__ import annotations

import zlib

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_io import EngineCoreOutput
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerStats
from engine.core.scheduler.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler.stop import check_stop

BS = 4
TOKEN = 7  # what the fake model samples unless told otherwise


def make_scheduler(
    num_blocks: int = 64,
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    policy: str = "fcfs",
    chunked: bool = True,
    threshold: int = 0,
    caching: bool = True,
    **kwargs,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=policy,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        **kwargs,
    )


def make_request(
    rid: str,
    prompt: int | list[int],
    *,
    max_tokens: int = 16,
    priority: int = 0,
    eos: int | None = None,
    status: RequestStatus = RequestStatus.WAITING,
    **params,
) -> Request:
    # Distinct prompts per request id unless given explicitly (no accidental prefix hits).
    tokens = (
        prompt
        if isinstance(prompt, list)
        else [1000 * (zlib.crc32(rid.encode()) % 997 + 1) + i for i in range(prompt)]
    )
    return Request(
        rid,
        tokens,
        SamplingParams(**params),
        eos_token_id=eos,
        priority=priority,
        max_tokens=max_tokens,
        status=status,
    )


def add(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.add_request(r)


def run_step(
    s: Scheduler, sample: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """Schedule, then play the model: a request whose computed tokens reached its length
    samples TOKEN (or ``sample[rid]``), one mid-prefill samples nothing."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.get_request(rid)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        sampled.append((sample or {}).get(rid, [TOKEN]) if done else [])
    outs = s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return so, {o.request_id: o for o in outs}


def assert_all_free(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not any(m.req_to_blocks for m in kv.group_managers)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def drain(s: Scheduler, max_steps: int = 200) -> list[EngineCoreOutput]:
    outs: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        outs.extend(run_step(s)[1].values())
    raise AssertionError("scheduler did not finish its requests")


# -- the unified rule -----------------------------------------------------------------------------
def test_chunked_prefill_of_several_prompts_under_small_budget():
    s = make_scheduler(budget=10)
    add(s, make_request("a", 7), make_request("b", 7), make_request("c", 7))

    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 7, "b": 3}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert outs["a"].new_token_ids == [TOKEN] and "b" not in outs  # b is mid-prefill

    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 5}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [7, 3]
    assert set(outs) == {"a", "b"}

    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    assert so.total_num_scheduled_tokens == 4
    drain(s)
    assert_all_free(s)


def test_long_prefill_threshold_caps_every_grant():
    s = make_scheduler(threshold=4)
    add(s, make_request("a", 10), make_request("b", 3))
    assert run_step(s)[0].num_scheduled_tokens == {"a": 4, "b": 3}
    assert run_step(s)[0].num_scheduled_tokens == {"a": 4, "b": 1}
    assert run_step(s)[0].num_scheduled_tokens == {"a": 2, "b": 1}


def test_unchunked_prompt_waits_until_it_fits_whole():
    s = make_scheduler(budget=16, max_model_len=16, chunked=False)
    add(s, make_request("a", 10), make_request("b", 10), make_request("c", 3))
    # b does not fit the 6 tokens left, and FCFS does not let c overtake it.
    assert run_step(s)[0].num_scheduled_tokens == {"a": 10}
    assert run_step(s)[0].num_scheduled_tokens == {"a": 1, "b": 10, "c": 3}


def test_seat_limit():
    s = make_scheduler(max_num_seqs=2)
    add(s, make_request("a", 3, max_tokens=1), make_request("b", 3), make_request("c", 3))
    so, outs = run_step(s)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert outs["a"].finish_reason == FinishReason.LENGTH
    assert set(run_step(s)[0].num_scheduled_tokens) == {"b", "c"}


def test_never_schedules_past_max_model_len():
    s = make_scheduler(max_model_len=12)
    add(s, make_request("a", 10, max_tokens=100), make_request("b", 12, max_tokens=100))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        so, outs = run_step(s)
        for rid in so.num_scheduled_tokens:
            assert s.get_request(rid) is None or s.get_request(rid).num_computed_tokens <= 12
        for rid, out in outs.items():
            tokens[rid] += out.new_token_ids
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH
    assert tokens == {"a": [TOKEN, TOKEN], "b": [TOKEN]}
    assert_all_free(s)


# -- diffs ----------------------------------------------------------------------------------------
def test_new_then_cached_diffs_and_prefix_hits():
    s = make_scheduler()
    prompt = list(range(100, 110))
    add(s, make_request("a", prompt))
    so, _ = run_step(s)
    (new,) = so.scheduled_new_reqs
    a_blocks = s.kv_cache_manager.get_block_ids("a")[0]
    assert (new.prompt_token_ids, new.output_token_ids) == (prompt, [])
    assert new.block_ids == (a_blocks,) and len(a_blocks) == 3 and new.num_computed_tokens == 0

    add(s, make_request("b", prompt + [5, 6]))
    so, outs = run_step(s)
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.new_block_ids == [([],)]
    assert so.scheduled_cached_reqs.num_computed_tokens == [10]
    (new_b,) = so.scheduled_new_reqs
    # b reuses a's two full blocks and computes only its remaining 4 tokens.
    assert new_b.num_computed_tokens == 8 and new_b.block_ids[0][:2] == a_blocks[:2]
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert outs["b"].num_cached_tokens == 8
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (22, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 22)

    so, _ = run_step(s)
    assert so.scheduled_cached_reqs.num_computed_tokens == [11, 12]
    b_last = s.kv_cache_manager.get_block_ids("b")[0][-1]
    assert so.scheduled_cached_reqs.new_block_ids == [([],), ([b_last],)]  # b computes its 13th token
    so, _ = run_step(s)  # a computes its 13th token: a fourth block
    assert so.scheduled_cached_reqs.new_block_ids[0] == ([s.kv_cache_manager.get_block_ids("a")[0][-1]],)


# -- preemption -----------------------------------------------------------------------------------
def _two_growing_requests(policy: str, first_priority: int, second_priority: int) -> Scheduler:
    """Two 7-token prompts in a 4-block pool: both fit, then the third block runs out."""
    s = make_scheduler(num_blocks=5, policy=policy, caching=False)
    add(
        s,
        make_request("first", 7, priority=first_priority, max_tokens=4),
        make_request("second", 7, priority=second_priority, max_tokens=4),
    )
    run_step(s)
    run_step(s)  # both now hold 9 tokens in 2 full blocks
    return s


@pytest.mark.parametrize(
    "policy,priorities,victim,survivor",
    [
        ("fcfs", (0, 0), "second", "first"),  # the latest arrival
        ("fcfs", (5, 0), "second", "first"),  # FCFS ignores priority
        ("priority", (1, 0), "first", "second"),  # the lowest priority, though earlier
        ("priority", (0, 0), "second", "first"),  # ties: the latest arrival
    ],
)
def test_preemption_victim_order(policy, priorities, victim, survivor):
    s = _two_growing_requests(policy, *priorities)
    so, _outs = run_step(s)
    assert so.preempted_req_ids == {victim}
    assert so.num_scheduled_tokens == {survivor: 1}
    v = s.get_request(victim)
    assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0
    assert v.num_preemptions == 1 and s.kv_cache_manager.get_block_ids(victim) == ([],)
    assert next(iter(s.waiting)) is v and s.running == [s.get_request(survivor)]
    assert s.make_stats().num_preemptions == 1 and s.make_stats().num_preemptions == 0

    # The victim resumes once the survivor finishes, as a new request carrying its outputs.
    while s.get_request(survivor) is not None:
        so, _ = run_step(s)
    while not so.scheduled_new_reqs:
        so, _ = run_step(s)
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == victim and resumed.output_token_ids == [TOKEN, TOKEN]
    assert len(resumed.prompt_token_ids) == 7 and resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens == {victim: 9}
    drain(s)
    assert_all_free(s)


def test_request_being_scheduled_can_preempt_itself():
    s = make_scheduler(num_blocks=5, caching=False)
    add(s, make_request("a", 7, max_tokens=3), make_request("b", 8, max_tokens=3))
    run_step(s)  # a: 8 tokens, 7 computed; b: 9 tokens, 8 computed; 4 blocks used
    so, _ = run_step(s)
    # b needs a third block; the lowest-precedence running request is b itself.
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert s.get_request("b").status == RequestStatus.PREEMPTED
    drain(s)
    assert_all_free(s)


def test_request_larger_than_the_pool_is_ignored_not_looped():
    s = make_scheduler(num_blocks=3)  # 2 usable blocks: 8 tokens
    add(s, make_request("huge", 9), make_request("grows", 6, max_tokens=10))
    so, outs = run_step(s)
    assert set(so.num_scheduled_tokens) == {"grows"} and so.finished_req_ids == {"huge"}
    assert outs["huge"].finish_reason == FinishReason.LENGTH and outs["huge"].new_token_ids == []
    assert s.get_request("huge") is None

    # grows reaches 9 tokens (more than the pool holds) and is finished, not preempted forever.
    collected = [TOKEN]
    outs_all = drain(s, max_steps=10)
    for out in outs_all:
        collected += out.new_token_ids
    assert outs_all[-1].request_id == "grows" and outs_all[-1].finish_reason == FinishReason.LENGTH
    assert len(collected) == 3 and s.num_preemptions_total == 0
    assert_all_free(s)


# -- finishing from outside -----------------------------------------------------------------------
def test_abort_waiting_and_running_requests():
    s = make_scheduler(max_num_seqs=1)
    add(s, make_request("run", 9), make_request("wait", 5))
    run_step(s)
    assert s.get_request("run").status == RequestStatus.RUNNING
    assert s.kv_cache_manager.num_free_blocks < s.kv_cache_manager.num_usable_blocks
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.get_num_unfinished_requests() == 0
    assert_all_free(s)
    so = s.schedule()
    assert so.finished_req_ids == {"run", "wait"} and so.is_empty
    assert s.schedule().finished_req_ids == set()


def test_abort_between_schedule_and_update():
    s = make_scheduler()
    add(s, make_request("a", 5), make_request("b", 5))
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    outs = s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[TOKEN], [TOKEN]]))
    assert [o.request_id for o in outs] == ["b"]
    assert s.get_request("a") is None and [r.request_id for r in s.running] == ["b"]
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests("b", RequestStatus.RUNNING)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)


# -- readiness ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "state", [RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KV]
)
def test_requests_not_ready_are_skipped_without_blocking(state):
    s = make_scheduler(budget=64)
    add(s, make_request("parked", 5, status=state), make_request("b", 5), make_request("c", 5))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"b", "c"}
    assert next(iter(s.waiting)).request_id == "parked"  # keeps its place at the front
    assert s.get_request("parked").status == state

    ready = {"parked": False}
    s.register_ready_check(state, lambda r: ready[r.request_id])
    assert "parked" not in run_step(s)[0].num_scheduled_tokens
    ready["parked"] = True
    so, _ = run_step(s)
    assert so.num_scheduled_tokens["parked"] == 5
    assert s.get_request("parked").status == RequestStatus.RUNNING
    with pytest.raises(ValueError, match="no ready check"):
        s.register_ready_check(RequestStatus.RUNNING, lambda r: True)


# -- stop rules -----------------------------------------------------------------------------------
def _decoded(
    tokens: list[int],
    *,
    eos: int | None = 2,
    max_tokens: int = 16,
    max_model_len: int = 64,
    **params,
) -> Request:
    """Feed tokens through check_stop; returns the request as it stands after the stop."""
    r = make_request("r", 4, eos=eos, max_tokens=max_tokens, **params)
    for t in tokens:
        r.append_output_token_ids([t])
        if check_stop(r, max_model_len):
            break
    return r


@pytest.mark.parametrize(
    "tokens,kwargs,status,n_out,stop_reason",
    [
        ([5, 2, 5], {}, RequestStatus.FINISHED_STOPPED, 2, None),  # EOS
        ([2, 2, 5], {"min_tokens": 2}, RequestStatus.FINISHED_STOPPED, 2, None),  # not before min
        ([2, 2, 5], {"ignore_eos": True, "max_tokens": 3}, RequestStatus.FINISHED_LENGTH, 3, None),
        ([5, 9, 5], {"stop_token_ids": [9]}, RequestStatus.FINISHED_STOPPED, 2, 9),
        ([9, 9, 5], {"stop_token_ids": [9], "min_tokens": 2}, RequestStatus.FINISHED_STOPPED, 2, 9),
        ([5, 5, 5], {"max_tokens": 2}, RequestStatus.FINISHED_LENGTH, 2, None),
        ([5, 2], {"max_tokens": 2}, RequestStatus.FINISHED_STOPPED, 2, None),  # EOS beats LENGTH
        ([5, 5, 5], {"max_model_len": 6}, RequestStatus.FINISHED_LENGTH, 2, None),  # 4 + 2 tokens
        ([5, 5, 5], {"eos": None}, RequestStatus.WAITING, 3, None),
    ],
)
def test_stop_rules(tokens, kwargs, status, n_out, stop_reason):
    r = _decoded(tokens, **kwargs)
    assert (r.status, r.num_output_tokens, r.stop_reason) == (status, n_out, stop_reason)


def test_stop_through_scheduler_frees_blocks_and_reports_reason():
    s = make_scheduler()
    add(
        s,
        make_request("eos", 5, eos=2),
        make_request("stopid", 5, stop_token_ids=[3]),
        make_request("len", 5, max_tokens=1),
    )
    _, outs = run_step(s, sample={"eos": [2], "stopid": [3], "len": [8]})
    assert (outs["eos"].finish_reason, outs["eos"].stop_reason) == (FinishReason.STOP, None)
    assert (outs["stopid"].finish_reason, outs["stopid"].stop_reason) == (FinishReason.STOP, 3)
    assert outs["len"].finish_reason == FinishReason.LENGTH and outs["len"].new_token_ids == [8]
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"eos", "stopid", "len"}
    assert_all_free(s)


# -- speculative tokens, logprobs -----------------------------------------------------------------
def test_speculative_tokens_are_scheduled_and_rejections_rewound():
    s = make_scheduler()
    add(s, make_request("a", 6, eos=2))
    run_step(s)  # prefill: 7 tokens, 6 computed
    a = s.get_request("a")
    a.spec_token_ids = [11, 12, 13]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert a.num_computed_tokens == 10
    # Two drafts accepted plus the bonus token: the rejected third draft is rewound.
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], [[11, 12, 99]]))
    assert outs[0].new_token_ids == [11, 12, 99]
    assert a.num_tokens == 10 and a.num_computed_tokens == 9 and a.spec_token_ids == []

    # A tight budget trims the drafts to what fits.
    s2 = make_scheduler(budget=2)
    add(s2, make_request("b", 2))
    run_step(s2)
    s2.get_request("b").spec_token_ids = [4, 5, 6]
    so = s2.schedule()
    assert so.num_scheduled_tokens == {"b": 2} and so.scheduled_spec_decode_tokens == {"b": [4]}


def test_proposed_drafts_are_trimmed_counted_and_dropped_when_they_cannot_run():
    s = make_scheduler(budget=8, max_model_len=12, num_speculative_tokens=3)
    add(s, make_request("a", 6, max_tokens=4), make_request("b", 2))
    so = s.schedule()  # both prefills
    out = ModelRunnerOutput(["a", "b"], [[7], [7]], spec_token_ids=[[1, 2, 3, 4], [5, 6]])
    s.update_from_output(so, out)
    # K=3 caps a's four drafts; max_tokens=4 with one output token leaves room for 2 (the
    # verification adds a token of its own).
    assert s.get_request("a").spec_token_ids == [1, 2]
    assert s.get_request("b").spec_token_ids == [5, 6]
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2], "b": [5, 6]}
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[1, 9], [5, 6, 8]]))
    stats = s.make_stats().spec
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 4, 3)
    assert stats.num_accepted_tokens_per_pos == [2, 1]
    assert stats.mean_acceptance_length == pytest.approx(2.5)
    assert s.make_stats().spec.num_drafts == 0  # an interval count
    assert make_scheduler().make_stats().spec is None  # speculation off


def test_drafts_without_room_this_step_do_not_linger():
    s = make_scheduler(budget=3, num_speculative_tokens=3)
    add(s, make_request("a", 2), make_request("b", 2))
    run_step(s, sample={"a": [7], "b": [7]})
    s.get_request("a").spec_token_ids = [4, 4]
    s.get_request("b").spec_token_ids = [5, 5]
    so = s.schedule()  # a takes 3 tokens (itself + 2 drafts), b gets none
    assert so.scheduled_spec_decode_tokens == {"a": [4, 4]}
    assert "b" not in so.num_scheduled_tokens and s.get_request("b").spec_token_ids == [5, 5]
    s.update_from_output(so, ModelRunnerOutput(["a"], [[4, 1]]))
    s.get_request("a").spec_token_ids = [6]
    so = s.schedule()  # a takes 2, b gets 1 token of room: its drafts are dropped
    assert so.num_scheduled_tokens["b"] == 1 and "b" not in so.scheduled_spec_decode_tokens
    assert s.get_request("b").spec_token_ids == []


def test_lookahead_never_reaches_past_max_model_len():
    s = make_scheduler(max_model_len=8, num_lookahead_tokens=4)
    add(s, make_request("a", 7))
    so = s.schedule()
    assert len(so.scheduled_new_reqs[0].block_ids[0]) == 2  # 7 tokens + 1 slot, not 4


def test_stop_inside_accepted_tokens_truncates_tokens_and_logprobs():
    s = make_scheduler()
    add(s, make_request("a", 6, eos=2, logprobs=1))
    run_step(s)
    s.get_request("a").spec_token_ids = [4, 2]
    so = s.schedule()
    lp = LogprobsLists(
        [[4, 1], [2, 1], [9, 1]], [[-0.1, -3.0], [-0.2, -2.0], [-0.3, -1.5]], [1, 1, 1]
    )
    (out,) = s.update_from_output(so, ModelRunnerOutput(["a"], [[4, 2, 9]], logprobs={"a": lp}))
    assert out.new_token_ids == [4, 2] and out.finish_reason == FinishReason.STOP
    assert out.new_logprobs.token_ids == [[4, 1], [2, 1]] and out.new_logprobs.ranks == [1, 1]
    assert_all_free(s)


def test_prompt_logprobs_of_a_chunk_are_passed_through_and_mid_prefill_tokens_dropped():
    s = make_scheduler(budget=4)
    add(s, make_request("a", 10, prompt_logprobs=0))
    so = s.schedule()
    plp = LogprobsLists([[1], [2], [3]], [[-1.0], [-2.0], [-3.0]], [1, 1, 1])
    # A runner that wrongly samples mid-prefill: the token must not be accepted.
    (out,) = s.update_from_output(
        so, ModelRunnerOutput(["a"], [[TOKEN]], prompt_logprobs={"a": plp})
    )
    assert out.new_token_ids == [] and out.new_prompt_logprobs is plp and not out.finished
    assert s.get_request("a").num_output_tokens == 0


# -- policy, validation, stats --------------------------------------------------------------------
def test_priority_policy_admits_lowest_value_first():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    add(
        s,
        make_request("p2", 3, priority=2, max_tokens=1),
        make_request("p0", 3, priority=0, max_tokens=1),
        make_request("p1", 3, priority=1, max_tokens=1),
    )
    order = [next(iter(run_step(s)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["p0", "p1", "p2"]


def test_add_request_validation():
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("a", 8))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("long", 9))
    with pytest.raises(ValueError, match="RUNNING"):
        s.add_request(make_request("r", 3, status=RequestStatus.RUNNING))
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        make_scheduler(num_lookahead_tokens=-1)


def test_stats_and_prefix_cache_reset():
    s = make_scheduler(num_blocks=9, max_num_seqs=1)
    add(s, make_request("a", 9), make_request("b", 3))
    run_step(s)
    stats = s.make_stats()
    assert isinstance(stats, SchedulerStats)
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(3 / 8)
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries) == (1, 9)
    assert s.make_stats().prefix_cache_queries == 0  # interval counters reset
    assert s.reset_prefix_cache() is False
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache() is True


def test_lookahead_slots_are_reserved():
    s = make_scheduler(num_lookahead_tokens=4)
    add(s, make_request("a", 4))
    so = s.schedule()
    assert len(so.scheduled_new_reqs[0].block_ids[0]) == 2  # 4 tokens + 4 lookahead slots


def test_scheduler_and_kv_cache_import_no_device_libraries():
    """DESIGN: the scheduler and KV cache manager are plain Python on plain data."""
    import ast
    import pathlib

    import engine.core.kv_cache
    import engine.core.scheduler.scheduler

    roots = [
        pathlib.Path(engine.core.kv_cache.__file__).parent,
        pathlib.Path(engine.core.scheduler.scheduler.__file__).parent,
    ]
    for path in (p for root in roots for p in root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"torch", "numpy", "triton"}, (
                    f"{path} imports {name}"
                )
