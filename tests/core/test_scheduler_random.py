"""Randomized scheduler runs checked against invariants after every step.

A fake model runner keeps its own request state from the scheduler's diffs only (as the
real executor does) and simulates the paged KV cache: each step it writes every
scheduled token into its slot, then checks that every position the step attends to
holds the request's own token. So a prefix hit on wrong content, a block shared by two
writers, a lost block id or a wrong ``num_computed_tokens`` in a diff all fail here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput

EOS = 0
VOCAB = 4  # tiny, so sampled tokens often recreate cached blocks
MAX_MODEL_LEN = 24


@dataclass
class _RunnerRequest:
    token_ids: list[int]  # accepted tokens, as the runner learned them
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """Plays the executor: state from diffs only, a simulated paged KV cache, and a
    "model" whose next token is a random draw (drafts are accepted while they match)."""

    def __init__(self, block_size: int, chooser: Chooser) -> None:
        self.block_size = block_size
        self.chooser = chooser
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.requests: dict[str, _RunnerRequest] = {}
        self.num_draft_tokens = self.num_rejected_drafts = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(so)
        # All writes of the step happen before any read.
        step_tokens: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens = step_tokens[rid] = state.token_ids + drafts
            end = state.num_computed_tokens + n
            assert end <= len(tokens), f"{rid}: scheduled past its known tokens"
            assert not drafts or end == len(tokens), f"{rid}: drafts scheduled only in part"
            assert len(state.block_ids) * self.block_size >= end, f"{rid}: too few blocks"
            for pos in range(state.num_computed_tokens, end):
                self.kv[self._slot(state, pos)] = tokens[pos]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            state, tokens = self.requests[rid], step_tokens[rid]
            end = state.num_computed_tokens + n
            for pos in range(end):
                assert self.kv.get(self._slot(state, pos)) == tokens[pos], (
                    f"{rid}: KV slot of position {pos} holds another token"
                )
            req_ids.append(rid)
            if end < len(tokens):
                state.num_computed_tokens = end
                sampled.append([])
                continue
            drafts = tokens[len(state.token_ids) :]
            accepted = self._verify(drafts)
            state.num_computed_tokens = len(state.token_ids) + len(accepted) - 1
            state.token_ids += accepted
            sampled.append(accepted)
        return ModelRunnerOutput(req_ids, sampled)

    def _apply_diffs(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, "new request the runner already holds"
            self.requests[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids[0]),
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[rid]
            assert state.num_computed_tokens == computed, f"{rid}: diff disagrees on progress"
            state.block_ids.extend(blocks[0])
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(
            cached.req_ids
        )
        for state in self.requests.values():
            assert 0 not in state.block_ids, "the null block was handed to a request"

    def _verify(self, drafts: list[int]) -> list[int]:
        """Accepted drafts, then the model's own token (the first mismatch or a bonus)."""
        accepted = []
        self.num_draft_tokens += len(drafts)
        for i, draft in enumerate(drafts):
            token = self.chooser.integer(0, VOCAB - 1)
            accepted.append(token)
            if token != draft:
                self.num_rejected_drafts += len(drafts) - i
                return accepted
        accepted.append(self.chooser.integer(0, VOCAB - 1))
        return accepted

    def _slot(self, state: _RunnerRequest, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // self.block_size], pos % self.block_size


def check_invariants(s: Scheduler, so: SchedulerOutput | None = None) -> None:
    kv = s.kv_cache_manager
    pool = kv.block_pool
    cfg = s.scheduler_config
    if so is not None:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        assert not so.preempted_req_ids & set(so.num_scheduled_tokens)
    assert len(s.running) <= cfg.max_num_seqs
    running_ids = {r.request_id for r in s.running}
    waiting_ids = {r.request_id for r in s.waiting}
    assert not running_ids & waiting_ids
    assert running_ids | waiting_ids == set(s.requests)
    assert s.running == sorted(s.running, key=s.policy.key)

    # Ownership: a block appears in as many tables as its ref count says.
    owners = [0] * pool.num_blocks
    for rid, blocks in kv.group_managers[0].req_to_blocks.items():
        assert rid in running_ids, f"{rid} holds blocks but is not running"
        assert len({b.block_id for b in blocks}) == len(blocks)
        for b in blocks:
            owners[b.block_id] += 1
    assert owners[0] == 0
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners[block.block_id]
    free = [b.block_id for b in pool.free_queue]
    assert len(free) == kv.num_free_blocks == len(set(free))
    assert all(owners[i] == 0 for i in free)
    assert kv.num_free_blocks + sum(1 for n in owners if n) == kv.num_usable_blocks
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash

    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.get_block_ids(r.request_id)[0]) * kv.block_size >= r.num_computed_tokens
        assert r.num_computed_tokens <= min(r.num_tokens_with_spec, cfg.max_model_len)
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and not kv.get_block_ids(r.request_id)[0]


class Chooser:
    """The source of random decisions: hypothesis draws (shrinkable) or a seeded RNG."""

    def __init__(self, data=None, rng: random.Random | None = None) -> None:
        self._data, self._rng = data, rng

    def integer(self, lo: int, hi: int) -> int:
        if self._rng is not None:
            return self._rng.randint(lo, hi)
        return self._data.draw(st.integers(lo, hi))

    def choice(self, options):
        return options[self.integer(0, len(options) - 1)]

    def chance(self, one_in: int) -> bool:
        return self.integer(1, one_in) == 1


def draw_config(c: Chooser) -> tuple[SchedulerConfig, CacheConfig, int]:
    block_size = c.choice([1, 2, 4])
    chunked = c.chance(4) is False
    # Pool from "smaller than some prompts" (ignored) through "a few requests at once"
    # (preemption) to roomy, plus the null block.
    pool_tokens = c.choice([(6, 16), (16, 40), (16, 40), (40, 72)])
    num_blocks = 1 + max(1, c.integer(*pool_tokens) // block_size)
    scheduler = SchedulerConfig(
        max_num_seqs=c.choice([1, 2, 3, 4, 6]),
        max_num_batched_tokens=c.integer(1, 32) if chunked else c.integer(MAX_MODEL_LEN, 40),
        max_model_len=MAX_MODEL_LEN,
        policy=c.choice(["fcfs", "priority"]),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=c.choice([0, 0, 3, 8]),
    )
    return (
        scheduler,
        CacheConfig(block_size=block_size, enable_prefix_caching=not c.chance(4)),
        num_blocks,
    )


PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2], [3, 3, 2, 2, 1, 1, 3, 3])


def random_request(c: Chooser, rid: str) -> Request:
    prefix = list(c.choice(PREFIXES))[: c.integer(0, 8)]
    suffix = [c.integer(0, VOCAB - 1) for _ in range(c.integer(1, MAX_MODEL_LEN - 4 - len(prefix)))]
    return Request(
        rid,
        prefix + suffix,
        SamplingParams(ignore_eos=c.chance(2)),
        eos_token_id=EOS,
        priority=c.integer(0, 2),
        cache_salt=c.choice([None, None, "s"]),
        max_tokens=c.integer(1, 12),
        status=RequestStatus.WAITING_FOR_GRAMMAR if c.chance(6) else RequestStatus.WAITING,
    )


def simulate(c: Chooser) -> tuple[list[Request], FakeRunner]:
    """Drive one scheduler with random traffic to completion; returns every request."""
    s = Scheduler(*draw_config(c))
    runner = FakeRunner(s.kv_cache_manager.block_size, c)
    grammar_ready: set[str] = set()
    s.register_ready_check(
        RequestStatus.WAITING_FOR_GRAMMAR, lambda r: r.request_id in grammar_ready
    )
    num_arrivals = c.integer(1, 12)
    requests: dict[str, Request] = {}
    reported: dict[str, list[int]] = {}
    finished: set[str] = set()

    for step in range(500):
        traffic = step < 40 and len(requests) < num_arrivals
        for _ in range(c.choice([0, 0, 1, 3]) if traffic else 0):  # bursts build up pressure
            request = random_request(c, f"r{len(requests)}")
            requests[request.request_id] = request
            reported[request.request_id] = []
            s.add_request(request)
        for r in s.waiting:  # grammars finish compiling after a while
            if r.status == RequestStatus.WAITING_FOR_GRAMMAR and (not traffic or c.chance(4)):
                grammar_ready.add(r.request_id)
        if traffic and s.requests and c.chance(10):  # abort, or a stop string matched
            victim = c.choice(sorted(s.requests))
            s.finish_requests(
                victim, c.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
            )
            finished.add(victim)
            check_invariants(s)
        for r in s.running:  # a drafter proposes tokens for some decoding requests
            if r.num_computed_tokens == r.num_tokens - 1 and c.chance(3):
                r.spec_token_ids = [c.integer(0, VOCAB - 1) for _ in range(c.integer(1, 3))]
        if not s.has_unfinished_requests():
            if not traffic:
                break
            continue

        so = s.schedule()
        check_invariants(s, so)
        outs = s.update_from_output(so, runner.execute(so))
        check_invariants(s)
        for out in outs:
            assert out.request_id not in finished, "output for a finished request"
            reported[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    else:
        raise AssertionError("requests never finished: the scheduler is stuck")

    assert finished == set(requests)
    assert not s.requests and not s.running and not s.waiting
    for rid, request in requests.items():
        assert reported[rid] == request.output_token_ids
        assert request.num_output_tokens <= request.max_tokens
        assert request.num_tokens <= MAX_MODEL_LEN
    s.schedule()  # hands the last finished ids to the runner
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks and not kv.group_managers[0].req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert s.reset_prefix_cache()
    return list(requests.values()), runner


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_traffic_keeps_invariants(data):
    requests, _ = simulate(Chooser(data=data))
    target(float(sum(r.num_preemptions for r in requests)), label="preemptions")


def test_seeded_traffic_reaches_preemption_hits_drafts_and_ignoring():
    """Guards the random test's reach: the interesting paths really run."""
    runs = [simulate(Chooser(rng=random.Random(seed))) for seed in range(40)]
    requests = [r for reqs, _ in runs for r in reqs]
    assert sum(runner.num_rejected_drafts for _, runner in runs) > 0
    assert sum(runner.num_draft_tokens for _, runner in runs) > sum(
        runner.num_rejected_drafts for _, runner in runs
    )
    assert sum(r.num_preemptions for r in requests) > 0
    assert sum(r.num_cached_tokens > 0 for r in requests) > 0
    assert sum(r.status == RequestStatus.FINISHED_IGNORED for r in requests) > 0
    assert sum(r.status == RequestStatus.FINISHED_ABORTED for r in requests) > 0
    statuses = {r.status for r in requests}
    assert {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH} <= statuses
