"""The unified scheduler: one rule for prompts, outputs, prefix hits and drafts.

Each step every scheduled request is granted ::

    min(num_tokens_with_spec - num_computed_tokens, remaining budget,
        long_prefill_token_threshold (if set, and chunked prefill is on))

further capped so it never runs past ``max_model_len`` nor past the whole KV pool. There
are no prefill and decode phases: a prompt that gets less than it needs is a chunked
prefill, a decode is a grant of one token, speculative drafts are extra tokens.

``schedule()`` runs in phases:

1. running requests, in policy order; a request whose blocks cannot grow preempts the
   last running request in policy order (possibly itself) until it fits;
2. waiting requests, in policy order, while seats, budget and blocks last (skipped in a
   step that preempted, so the victims are not re-admitted at once); requests not ready
   (grammar compiling, remote KV in flight) are passed over without blocking others;
3. the diff for the executor; then every scheduled request's ``num_computed_tokens``
   advances by its grant.

With pipeline parallelism the engine keeps several steps in flight (one per stage): a
request scheduled in a step whose output has not come back is *in flight* and is passed
over by later ``schedule()`` calls, and never chosen as a preemption victim (its blocks
are being written); ``update_from_output`` lands it again. The executor's ranks that do
not sample then need the accepted tokens: ``send_new_token_ids`` puts them in the diff. Advancing at schedule time (like vLLM V1) keeps the next
   ``schedule()`` right even before outputs arrive; ``update_from_output`` only winds it
   back for rejected speculative drafts.

A request that needs more blocks than the whole pool (its tokens alone exceed it) can
never run: it is finished as FINISHED_IGNORED, reported with finish_reason LENGTH (the
capacity of the cache is its length limit) and no new tokens.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_io import EngineCoreOutput
from engine.core.kv_cache import KVCacheGroupSpec, KVCacheManager
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.scheduler.output import (
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PooledData,
    SchedulerOutput,
)
from engine.core.scheduler.encoder_inputs import EncoderInputScheduler
from engine.core.scheduler.policy import SchedulingPolicy
from engine.core.scheduler.stats import SchedulerStats, SpecDecodingStats
from engine.core.scheduler.stop import check_stop

if TYPE_CHECKING:
    from engine.core.scheduler.spec_governor import SpeculationGovernor
    from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

ReadyCheck = Callable[[Request], bool]
_NOT_READY_STATES = (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KV)
_ADMISSIBLE_STATES = (RequestStatus.WAITING, *_NOT_READY_STATES)


@dataclass
class _Step:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    max_reqs: int  # requests this step may hold (a micro-batch's share)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Multimodal requests: the items (indices into mm_features) each encodes this step.
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    def record(self, request: Request, num_tokens: int, block_ids: tuple[list[int], ...],
               is_new: bool) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if is_new:
            self.new_reqs.append(request)
        else:
            self.cached_reqs.append(request)
            self.new_block_ids[request.request_id] = block_ids


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        num_lookahead_tokens: int = 0,
        num_speculative_tokens: int = 0,
        structured_output_manager: StructuredOutputManager | None = None,
        spec_governor: SpeculationGovernor | None = None,
        send_new_token_ids: bool = False,
        num_micro_batches: int = 1,
        kv_connector: Any = None,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] | None = None,
        num_state_slots: int = 0,
        max_loras: int = 0,
    ) -> None:
        """``kv_cache_groups``: the model's KV cache groups (the executor's
        ``kv_cache_layout``); None: one group. ``num_state_slots``: per-request state
        slots of a model with state layers (the layout's; 0: none). ``max_loras``: the
        most distinct LoRA adapters the running batch may hold (0: LoRA is off).

        Prefix caching is off for a model with state layers: a request's recurrent state
        exists only at the end of its last computed token, so cached blocks of a prefix
        would come without the state at their end (vLLM keeps states at chosen block
        boundaries for that; not done here yet)."""
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens={num_lookahead_tokens} must be >= 0")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        # Slots reserved past the scheduled tokens for speculative drafts.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Most drafts a request may carry into a step (0: speculative decoding is off);
        # the executor proposes them, update_from_output trims them to what can be used.
        self.num_speculative_tokens = num_speculative_tokens
        self._spec_stats = SpecDecodingStats() if num_speculative_tokens else None
        # Whether the coming steps draft (measured per batch size), and what each decode
        # step scheduled for it: (batch size, drafted) until its time is reported.
        self.spec_governor = spec_governor if num_speculative_tokens else None
        self._governed: dict[int, tuple[int, bool]] = {}
        self._step_tokens: dict[int, int] = {}

        if kv_connector is not None and kv_cache_groups is not None and len(kv_cache_groups) > 1:
            raise ValueError("KV connectors move one block table per request: run a hybrid "
                             "model with one KV cache group (--disable-hybrid-kv-cache-manager)")
        enable_caching = cache_config.enable_prefix_caching
        if num_state_slots and enable_caching:
            logger.info("prefix caching disabled: the model has state (Mamba) layers, whose "
                        "per-request state is only known after the last computed token "
                        "(block-aligned state caching is not implemented)")
            enable_caching = False
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, enable_caching,
            groups=kv_cache_groups,
            max_step_tokens=self.max_num_batched_tokens + num_lookahead_tokens,
            num_state_slots=num_state_slots,
        )
        # A connector that keeps evicted prefix blocks (the KV offloading tier) hears of them.
        if getattr(kv_connector, "on_block_evicted", None) is not None:
            self.kv_cache_manager.block_pool.on_evict = kv_connector.on_block_evicted
        self.max_loras = max_loras
        # Images / videos: which step encodes each, and the worker's encoder cache. Any
        # item fits both (a prompt is shorter than max_model_len).
        encoder_rows = max(self.max_num_batched_tokens, self.max_model_len)
        self.encoder_inputs = EncoderInputScheduler(
            encoder_rows, encoder_rows, scheduler_config.disable_chunked_mm_input)
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.new_waiting_queue()
        self.running: list[Request] = []  # kept sorted by self.policy.key
        # Finished since the last schedule(): the executor drops their state.
        self.finished_req_ids: set[str] = set()
        # Outputs produced inside schedule() (ignored requests), returned by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self._ready_checks: dict[RequestStatus, ReadyCheck] = {}
        self._num_preemptions_interval = 0
        self.num_preemptions_total = 0
        # Advances constrained requests' matchers and forgets them when they finish.
        self.structured_output_manager = structured_output_manager
        # Scheduled in a step whose output has not been processed yet (how many such
        # steps: async scheduling runs a request one step ahead of its output).
        self.in_flight: Counter[str] = Counter()
        # Async scheduling: a request in flight may be scheduled again, its next token a
        # placeholder the executor fills from its own sampling (Request
        # .num_output_placeholders); constrained requests wait for their output.
        self.async_scheduling = scheduler_config.async_scheduling
        # Tokens each request's executor state holds (send_new_token_ids only).
        self.send_new_token_ids = send_new_token_ids
        self._executor_num_tokens: dict[str, int] = {}
        # Steps kept in flight (pipeline stages): each takes its share of the requests.
        self.num_micro_batches = num_micro_batches
        self._expert_load: list[int] | None = None  # MoE routing counts, this interval
        # KV connector (scheduler side): loads in flight report here, finished requests
        # whose blocks a consumer still has to pull stay here.
        self.kv_connector = kv_connector
        self._loaded: set[str] = set()
        self._failed_loads: set[str] = set()
        self._held_for_send: dict[str, Request] = {}
        # Aborted while their KV was still arriving: freed once the load ends either way.
        self._held_for_load: dict[str, Request] = {}
        self._kv_stats: Any = None  # the worker side's latest KVConnectorOutput
        self._prompt_tokens_computed = 0  # this interval
        self._external_tokens_loaded = 0
        if kv_connector is not None:
            self._ready_checks[RequestStatus.WAITING_FOR_REMOTE_KV] = self._remote_kv_ready

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already scheduled")
        if request.mm_features and self.encoder_inputs.whole_items:
            longest = max(f.length for f in request.mm_features)
            room = self.scheduler_config.max_chunk_tokens
            if longest > room:
                raise ValueError(
                    f"an image of {longest} tokens does not fit one step of {room} tokens, "
                    "and this model runs an image's tokens in one step (raise "
                    "max_num_batched_tokens)")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        if request.status not in _ADMISSIBLE_STATES:
            raise ValueError(f"request {rid!r} arrives in state {request.status.name}")
        self.policy.register(request)
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish waiting or running requests from outside (abort, stop string).

        Unknown or already finished ids are ignored: an abort may race a natural finish.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """Running or waiting requests, or finished ones whose blocks a KV consumer has
        still to pull (the steps keep polling the connector for them)."""
        return (bool(self.running) or bool(self.waiting) or bool(self._held_for_send)
                or bool(self._held_for_load))

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- readiness hook ---------------------------------------------------------------------
    def register_ready_check(self, status: RequestStatus, check: ReadyCheck) -> None:
        """Let a component (grammar compiler, KV connector) say when a request may run."""
        if status not in _NOT_READY_STATES:
            raise ValueError(f"no ready check is consulted for state {status.name}")
        self._ready_checks[status] = check

    def is_ready(self, request: Request) -> bool:
        """False while the request waits for its grammar or its remote KV.

        The registered check for its state decides; once it says yes the request becomes
        plain WAITING. With no check registered the request stays parked until someone
        sets its status to WAITING.
        """
        if request.status not in _NOT_READY_STATES:
            return True
        check = self._ready_checks.get(request.status)
        if check is None or not check(request):
            return False
        request.status = RequestStatus.WAITING
        return True

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(token_budget=self.max_num_batched_tokens, max_reqs=self._micro_batch_seats())
        self.encoder_inputs.begin_step()
        self._schedule_running(step)
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        return self._make_output(step)

    def _schedule_running(self, step: _Step) -> None:
        kv = self.kv_cache_manager
        i = 0
        while (i < len(self.running) and step.token_budget > 0
               and len(step.num_scheduled_tokens) < step.max_reqs):
            request = self.running[i]
            if request.request_id in self.in_flight and not self._runs_ahead(request):
                i += 1
                continue
            if request.num_tokens > kv.max_num_tokens:
                del self.running[i]
                self._finish_ignored(request)
                continue
            num_new = self._grant(request, request.num_computed_tokens, step.token_budget)
            to_encode: list[int] = []
            if request.mm_features and num_new > 0:
                num_new, to_encode = self.encoder_inputs.plan(
                    request, request.num_computed_tokens, num_new)
            if num_new <= 0:
                i += 1
                continue
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while True:
                block_ids = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if block_ids is not None:
                    break
                # The last running request has the lowest precedence and, being at or
                # after index i, is not scheduled yet this step; in-flight ones are
                # skipped (their step still writes their blocks).
                victim_idx = self._victim_index(i)
                if victim_idx is None:  # only in-flight requests could give blocks back
                    return
                victim = self.running.pop(victim_idx)
                self._preempt(victim, step)
                if victim is request:
                    return
            if request.mm_features:
                self._commit_encoder_inputs(step, request, request.num_computed_tokens,
                                            num_new, to_encode)
            step.record(request, num_new, block_ids, is_new=False)
            i += 1

    def _runs_ahead(self, request: Request) -> bool:
        """Async scheduling: whether a request whose last step is still running may be
        scheduled again (its grammar needs that step's token; so does a request the step
        may finish by length)."""
        if not self.async_scheduling or request.sampling_params.structured_outputs is not None:
            return False
        placeholders = request.num_output_placeholders
        return (request.num_output_tokens + placeholders < request.max_tokens
                and request.num_tokens + placeholders < self.max_model_len)

    def _victim_index(self, first: int) -> int | None:
        """The last running request at or after ``first`` that is not in flight."""
        for j in range(len(self.running) - 1, first - 1, -1):
            if self.running[j].request_id not in self.in_flight:
                return j
        return None

    def _schedule_waiting(self, step: _Step) -> None:
        kv = self.kv_cache_manager
        skipped: list[Request] = []
        adapters = _AdapterAdmission(self.max_loras, self.running)
        while (self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs
               and len(step.num_scheduled_tokens) < step.max_reqs):
            request = self.waiting.peek()
            if not self.is_ready(request) or not adapters.admits(request):
                skipped.append(self.waiting.pop())
                continue
            if request.num_tokens > kv.max_num_tokens:
                self.waiting.pop()
                self._finish_ignored(request)
                continue
            owns_blocks = kv.holds_blocks(request.request_id)  # its external KV landed
            if owns_blocks:
                hit_blocks, num_hit = [], request.num_computed_tokens
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                if self.kv_connector is not None and self._start_external_load(
                        request, hit_blocks, num_hit):
                    skipped.append(self.waiting.pop())  # waits for its KV
                    continue
            num_new = self._grant(request, num_hit, step.token_budget)
            to_encode = []
            if request.mm_features and num_new > 0:
                num_new, to_encode = self.encoder_inputs.plan(request, num_hit, num_new)
            if num_new <= 0:
                break
            if not self.enable_chunked_prefill and num_new < request.num_tokens_with_spec - num_hit:
                break  # the whole prompt must fit this step's remaining budget
            lookahead = self._lookahead(num_hit + num_new)
            if owns_blocks:
                block_ids = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            else:
                block_ids = kv.allocate_slots(request, num_new, num_hit, hit_blocks, lookahead)
            if block_ids is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit  # local hits and loaded tokens
            bisect.insort(self.running, request, key=self.policy.key)
            adapters.add(request)
            if request.mm_features:
                self._commit_encoder_inputs(step, request, num_hit, num_new, to_encode)
            step.record(request, num_new, block_ids, is_new=True)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _commit_encoder_inputs(self, step: _Step, request: Request, num_computed: int,
                               num_new: int, to_encode: list[int]) -> None:
        self.encoder_inputs.commit(request, num_computed, num_new, to_encode)
        if to_encode:
            step.encoder_inputs[request.request_id] = to_encode

    def _micro_batch_seats(self) -> int:
        """With several steps in flight each takes ``1 / num_micro_batches`` of the
        requests that can run (rounded up), so every pipeline stage has work; else all."""
        if self.num_micro_batches == 1:
            return self.max_num_seqs
        runnable = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // self.num_micro_batches))

    # -- KV connector ---------------------------------------------------------------------
    def _start_external_load(self, request: Request, hit_blocks: list, num_hit: int) -> bool:
        """Ask the connector whether prompt tokens past the local prefix hits can come from
        outside; if so allocate their blocks (kept out of the prefix cache until loaded)
        and park the request in WAITING_FOR_REMOTE_KV. True when it was parked."""
        connector = self.kv_connector
        num_external, _asynchronous = connector.get_num_new_matched_tokens(request, num_hit)
        # The last prompt token is always computed here: its logits are the next token's.
        num_external = min(num_external, request.num_tokens - 1 - num_hit)
        if num_external <= 0:
            return False
        kv = self.kv_cache_manager
        block_ids = kv.allocate_slots(request, num_external, num_hit, hit_blocks,
                                      delay_cache_blocks=True)
        if block_ids is None:
            return False  # no room for them: the request prefills locally when it fits
        request.num_computed_tokens = num_hit
        request.num_local_hit_tokens = num_hit
        request.num_external_tokens = num_external
        # One KV cache group whenever a connector runs (checked at construction).
        connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id)[0],
                                           num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return True

    def _remote_kv_ready(self, request: Request) -> bool:
        """WAITING_FOR_REMOTE_KV's ready check: its load landed (the tokens count as
        computed) or failed (they are recomputed locally, into the same blocks)."""
        rid = request.request_id
        if rid in self._failed_loads:
            self._failed_loads.discard(rid)
            logger.warning("request %s: its external KV did not load; prefilling it here",
                           rid)
            request.num_computed_tokens = request.num_local_hit_tokens
            request.num_external_tokens = 0
            return True
        if rid not in self._loaded:
            return False
        self._loaded.discard(rid)
        request.num_computed_tokens = request.num_local_hit_tokens + request.num_external_tokens
        self._external_tokens_loaded += request.num_external_tokens
        return True

    def _apply_connector_output(self, out: Any) -> None:
        if out is None:
            return
        self._kv_stats = out
        self._loaded.update(out.finished_recving)
        self._failed_loads.update(out.failed_loads)
        for rid in (*out.finished_recving, *out.failed_loads):
            request = self._held_for_load.pop(rid, None)
            if request is not None:
                self._loaded.discard(rid)
                self._failed_loads.discard(rid)
                self.kv_cache_manager.free(request)
        for rid in out.finished_sending:  # the consumer pulled them: free the blocks now
            request = self._held_for_send.pop(rid, None)
            if request is not None:
                self.kv_cache_manager.free(request)

    def _finish_transfer(self, request: Request) -> bool:
        """The connector's say on a finished request: its kv_transfer_params for the
        client, and whether its blocks stay until a consumer pulls them."""
        if self.kv_connector is None or request.kv_transfer_params_out is not None:
            return False
        delay, params = self.kv_connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id)[0])
        request.kv_transfer_params_out = params or {}
        return bool(delay)

    def _grant(self, request: Request, num_computed: int, token_budget: int) -> int:
        """The unified rule: how many of the request's pending tokens run this step."""
        pending = request.num_tokens_with_spec + request.num_output_placeholders
        num_new = min(pending - num_computed, token_budget)
        threshold = self.long_prefill_token_threshold
        if self.enable_chunked_prefill and 0 < threshold < num_new:
            num_new = threshold
        return min(
            num_new,
            self.max_model_len - num_computed,
            self.kv_cache_manager.max_num_tokens - num_computed,
        )

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """Draft slots past the step's tokens, within the pool and ``max_model_len``."""
        room = min(self.kv_cache_manager.max_num_tokens, self.max_model_len)
        return max(0, min(self.num_lookahead_tokens, room - num_tokens_after_step))

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt by recompute: drop the blocks, start over from the waiting queue."""
        self.kv_cache_manager.free(request)
        self.encoder_inputs.release_all(request)
        self._executor_num_tokens.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.waiting.prepend(request)
        step.preempted_req_ids.add(request.request_id)
        self._num_preemptions_interval += 1
        self.num_preemptions_total += 1

    def _finish_ignored(self, request: Request) -> None:
        logger.warning(
            "request %s needs %d tokens of KV cache but the whole cache holds %d: "
            "finishing it (finish_reason=length)",
            request.request_id,
            request.num_tokens,
            self.kv_cache_manager.max_num_tokens,
        )
        request.status = RequestStatus.FINISHED_IGNORED
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=int(FinishReason.LENGTH),
                num_cached_tokens=max(0, request.num_cached_tokens),
            )
        )
        self._release(request)

    def _make_output(self, step: _Step) -> SchedulerOutput:
        """Build the executor's diff, then advance every scheduled request."""
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_id=r.eos_token_id,
                pooling_params=r.pooling_params,
                token_type_ids=r.token_type_ids,
                state_slot=kv.get_state_slot(r.request_id),
                lora_request=r.lora_request,
                mm_features=r.mm_features or None,
            )
            for r in step.new_reqs
        ]
        cached = CachedRequestData()
        known = self._executor_num_tokens
        for r in step.cached_reqs:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(step.new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if self.send_new_token_ids:
                cached.new_token_ids.append(r.all_token_ids[known[r.request_id] : r.num_tokens])
        if self.send_new_token_ids:
            for r in (*step.new_reqs, *step.cached_reqs):
                known[r.request_id] = r.num_tokens
        self.in_flight.update(step.num_scheduled_tokens.keys())

        spec_tokens: dict[str, list[int]] = {}
        decode_only = not step.new_reqs
        seeded = False
        for r in (*step.new_reqs, *step.cached_reqs):
            num_new = step.num_scheduled_tokens[r.request_id]
            decode_only = decode_only and r.num_computed_tokens >= r.num_prompt_tokens
            seeded = seeded or _draws_seeded(r)
            self._prompt_tokens_computed += max(0, min(r.num_computed_tokens + num_new,
                                                       r.num_prompt_tokens)
                                                - min(r.num_computed_tokens, r.num_prompt_tokens))
            # Tokens past the known ones: drafts to verify, apart from the token a step
            # still in flight samples (async scheduling), which the executor fills in.
            num_spec = (r.num_computed_tokens + num_new - r.num_tokens
                        - r.num_output_placeholders)
            if num_spec > 0:
                del r.spec_token_ids[num_spec:]
                spec_tokens[r.request_id] = list(r.spec_token_ids)
            else:  # no room for its drafts this step: they are dropped, not kept stale
                r.spec_token_ids.clear()
            if self.async_scheduling and (r.num_computed_tokens + num_new
                                          >= r.num_tokens + r.num_output_placeholders):
                r.num_output_placeholders += 1  # the step samples a token not known yet
            r.num_computed_tokens += num_new
        # Constrained requests that sample this step, in the executor's row order (one
        # still in its reasoning is not constrained yet).
        manager = self.structured_output_manager
        structured_ids = [
            rid
            for rid in step.num_scheduled_tokens
            if (r := self.requests[rid]).sampling_params.structured_outputs is not None
            and r.num_computed_tokens >= r.num_tokens
            and not (manager is not None and manager.in_reasoning(rid))
        ]

        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=step.preempted_req_ids,
            structured_output_req_ids=structured_ids,
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_ids=self.encoder_inputs.take_evicted(),
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
        if self.spec_governor is not None and output.num_scheduled_tokens and not seeded:
            # (A seeded sampled request always drafts: its tokens depend on whether its
            # draws went through the rejection sampler, and it must repeat itself.)
            batch = len(output.num_scheduled_tokens)
            output.max_draft_tokens = self.spec_governor.draft_budget(batch)
            output.drafts_settled_off = self.spec_governor.plain_settled(batch)
            if len(self._governed) > 64:  # steps whose time never came (defensive)
                self._governed.clear()
                self._step_tokens.clear()
            if decode_only:
                self._governed[id(output)] = (batch, output.max_draft_tokens > 0)
        return output

    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long a step took, schedule to update (the engine core measures it): the
        speculation governor's evidence, for decode-only steps."""
        governed = self._governed.pop(id(scheduler_output), None)
        tokens = self._step_tokens.pop(id(scheduler_output), 0)
        if governed is not None and self.spec_governor is not None:
            batch, drafted = governed
            verified = any(scheduler_output.scheduled_spec_decode_tokens.values())
            self.spec_governor.observe(batch, drafted, seconds, tokens, verified=verified)

    # -- update -----------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests."""
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduled = scheduler_output.num_scheduled_tokens
        self.in_flight.subtract(scheduled.keys())
        self.in_flight += Counter()  # drops the ids no step in flight holds any more
        self._add_expert_load(model_runner_output.expert_load)
        self._apply_connector_output(model_runner_output.kv_connector_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        proposed = model_runner_output.spec_token_ids
        governed = id(scheduler_output) in self._governed
        emitted = 0
        finished: list[Request] = []
        for i, rid in enumerate(model_runner_output.req_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING or rid not in scheduled:
                continue  # finished or aborted since schedule()
            if request.mm_features:
                self.encoder_inputs.release_computed(request)
            if request.pooling_params is not None:
                pooled = model_runner_output.pooler_output.get(rid)
                if pooled is not None:  # its prompt is done: the result is the output
                    outputs.append(self._finish_pooled(request, pooled))
                    finished.append(request)
                continue
            sampled = model_runner_output.sampled_token_ids[i]
            drafts = spec.get(rid)
            if drafts:
                if sampled:
                    # Drafts after the first rejection were computed in vain.
                    request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                    if self._spec_stats is not None:
                        self._spec_stats.observe(len(drafts), len(sampled) - 1)
                request.spec_token_ids.clear()
            if request.num_output_placeholders:  # async scheduling: the step's own token
                if sampled:
                    request.num_output_placeholders -= 1
            elif request.num_computed_tokens < request.num_tokens:
                sampled = []  # mid-prefill: the chunk's last logits are not a next token
            emitted += len(sampled)
            new_token_ids = self._append_tokens(request, sampled)
            if proposed is not None and proposed[i] and not request.is_finished:
                self._set_drafts(request, proposed[i])
            prompt_logprobs = model_runner_output.prompt_logprobs.get(rid)
            if not (new_token_ids or request.is_finished or prompt_logprobs):
                continue
            if request.is_finished:
                request.hold_blocks = self._finish_transfer(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_token_ids,
                    finish_reason=_finish_reason(request),
                    stop_reason=request.stop_reason,
                    new_logprobs=_take_rows(
                        model_runner_output.logprobs.get(rid), len(new_token_ids)
                    ),
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(0, request.num_cached_tokens),
                    kv_transfer_params=request.kv_transfer_params_out or None,
                )
            )
            if request.is_finished:
                finished.append(request)
        if governed:
            self._step_tokens[id(scheduler_output)] = emitted
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self._release(request)
        return outputs

    def _finish_pooled(self, request: Request, pooled: PooledData) -> EngineCoreOutput:
        """A pooling request ends with its prompt: no token is sampled, its blocks go."""
        request.status = RequestStatus.FINISHED_STOPPED
        request.hold_blocks = False
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=int(FinishReason.STOP),
            num_cached_tokens=max(0, request.num_cached_tokens),
            pooling_output=pooled,
        )

    def _add_expert_load(self, load: list[int] | None) -> None:
        if not load:
            return
        if self._expert_load is None:
            self._expert_load = list(load)
        else:
            self._expert_load = [a + b for a, b in zip(self._expert_load, load)]

    def _set_drafts(self, request: Request, drafts: list[int]) -> None:
        """Keep the drafts the next step can use: at most K, none past the request's
        ``max_tokens`` (the verification adds one token of its own) or ``max_model_len``."""
        room = min(
            self.num_speculative_tokens,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
        )
        request.spec_token_ids = list(drafts[: max(0, room)])

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Accept sampled tokens one by one until a stop rule fires or the request's
        grammar completes (accepted drafts may run past either; the rest is dropped)."""
        structured = request.sampling_params.structured_outputs is not None
        for n, token in enumerate(sampled, start=1):
            request.append_output_token_ids([token])
            check_stop(request, self.max_model_len)
            if structured:
                self._advance_grammar(request, [token])
            if request.is_finished:
                return sampled[:n]
        return sampled

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> None:
        """Feed accepted tokens to the request's matcher; a complete grammar stops it."""
        manager = self.structured_output_manager
        if manager is None:
            return
        if not manager.accept_tokens(request.request_id, token_ids):
            logger.error(
                "request %s: the grammar rejected sampled tokens %s; aborting it",
                request.request_id, token_ids,
            )
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = "structured output error: the grammar rejected a token"
        elif not request.is_finished and manager.is_terminated(request.request_id):
            request.status = RequestStatus.FINISHED_STOPPED

    def _release(self, request: Request) -> None:
        """Forget a finished request (already out of both queues) and free its blocks,
        unless a KV consumer still has to pull them (freed when the send completes)."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(request.request_id)
        if request.mm_features:
            self.encoder_inputs.release_all(request)
        hold = request.hold_blocks
        if hold is None:  # finished from outside (abort): the connector decides too
            hold = self._finish_transfer(request)
        rid = request.request_id
        if hold:
            self._held_for_send[rid] = request
        elif (request.status == RequestStatus.FINISHED_ABORTED and request.num_external_tokens
              and rid not in self._loaded and rid not in self._failed_loads
              and request.num_computed_tokens == request.num_local_hit_tokens):
            self._held_for_load[rid] = request  # its KV is still being written
        else:
            self._loaded.discard(rid)
            self._failed_loads.discard(rid)
            self.kv_cache_manager.free(request)
        self._executor_num_tokens.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.policy.forget(request)
        self.finished_req_ids.add(request.request_id)

    # -- stats and cache control ------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, self._num_preemptions_interval = self._num_preemptions_interval, 0
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            prefix_cache_requests=prefix.requests,
            spec=self._take_spec_stats(),
            expert_load=self._take_expert_load(),
            prompt_tokens_computed=self._take("_prompt_tokens_computed"),
            external_tokens_loaded=self._take("_external_tokens_loaded"),
            kv_transfer=self._kv_stats,
            num_held_for_send=len(self._held_for_send),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """Requests per adapter name, running and waiting (vLLM's lora_requests_info)."""
        if not self.max_loras:
            return {}
        running = Counter(r.lora_request.lora_name for r in self.running if r.lora_request)
        waiting = Counter(r.lora_request.lora_name for r in self.waiting if r.lora_request)
        return {"max_loras": self.max_loras, "running_lora_adapters": dict(running),
                "waiting_lora_adapters": dict(waiting)}

    def _take(self, counter: str) -> int:
        value = getattr(self, counter)
        setattr(self, counter, 0)
        return value

    def _take_expert_load(self) -> list[int] | None:
        load, self._expert_load = self._expert_load, None
        return load

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        stats = self._spec_stats
        if stats is not None:
            self._spec_stats = SpecDecodingStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


class _AdapterAdmission:
    """Which waiting requests may join the running batch without it holding more than
    ``max_loras`` distinct LoRA adapters (a step runs every running request, and the
    executor has one device slot per adapter of a step).

    A request whose adapter finds no room waits; so does every later request with an
    adapter, even one already running (requests without an adapter pass): the running
    adapters' requests then drain and the blocked one takes the first free slot, rather
    than waiting for as long as the running adapters keep getting new requests."""

    def __init__(self, max_loras: int, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.active = {r.lora_int_id for r in running if r.lora_int_id} if max_loras else set()
        self.blocked = False

    def admits(self, request: Request) -> bool:
        lora_id = request.lora_int_id
        if not lora_id or not self.max_loras:
            return True
        if self.blocked:
            return False
        if lora_id in self.active or len(self.active) < self.max_loras:
            return True
        self.blocked = True
        return False

    def add(self, request: Request) -> None:
        if request.lora_int_id and self.max_loras:
            self.active.add(request.lora_int_id)


def _draws_seeded(request: Request) -> bool:
    """A request that samples from a seed (its draws must repeat run after run)."""
    params = request.sampling_params
    return params.seed is not None and params.temperature > 0


def _finish_reason(request: Request) -> int | None:
    reason = request.status.finish_reason
    return None if reason is None else int(reason)


def _take_rows(logprobs: LogprobsLists | None, n: int) -> LogprobsLists | None:
    """The logprob rows of the first ``n`` sampled tokens (the ones accepted)."""
    if logprobs is None or n == 0:
        return None
    if len(logprobs.token_ids) <= n:
        return logprobs
    return LogprobsLists(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
