"""Which data-parallel rank a new request goes to (the rule ``engine.core.dp_client`` uses).

Plain Python on plain data, so the rule is unit-tested without processes. The rule, for
each engine-core request (an ``n > 1`` request's samples are routed one by one):

1. Only live ranks are candidates.
2. ``load(r) = in_flight(r) + KV_USAGE_WEIGHT * kv_cache_usage(r)``: ``in_flight`` is the
   requests this front end sent to rank ``r`` that have not finished (the core's waiting +
   running, counted here exactly and with no round trip); ``kv_cache_usage`` is the
   fraction of ``r``'s KV blocks held by requests, as ``r`` reported with its last step's
   outputs. A full cache weighs as ``KV_USAGE_WEIGHT`` more requests, so ranks holding
   long contexts get fewer new ones.
3. Prefix affinity: a prompt of at least one KV block has a key, the hash of its first
   block's token ids with its LoRA adapter and cache salt (what the core's block hash
   covers). If a live rank took the last request with this key and its load is at most
   the least load plus ``AFFINITY_SLACK``, it takes this one too: the shared prefix is
   probably cached there. Past that slack the rank counts as overloaded and the prefix is
   recomputed elsewhere rather than queue behind it.
4. Otherwise the least loaded live rank (ties: the lowest rank).
5. The key then points at the chosen rank (an LRU of ``MAX_AFFINITY_KEYS`` keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest

KV_USAGE_WEIGHT = 4.0
AFFINITY_SLACK = 2.0
MAX_AFFINITY_KEYS = 16384


class NoLiveRankError(RuntimeError):
    """Every data-parallel rank has died."""


class DPRouter:
    """Per-rank in-flight requests, KV usage and liveness; the routing rule above."""

    def __init__(self, num_ranks: int, block_size: int, *,
                 kv_usage_weight: float = KV_USAGE_WEIGHT,
                 affinity_slack: float = AFFINITY_SLACK,
                 max_affinity_keys: int = MAX_AFFINITY_KEYS) -> None:
        if num_ranks < 1:
            raise ValueError(f"a router needs at least one rank, got {num_ranks}")
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.kv_usage_weight = kv_usage_weight
        self.affinity_slack = affinity_slack
        self.max_affinity_keys = max_affinity_keys
        self.live = [True] * num_ranks
        self.in_flight: list[set[str]] = [set() for _ in range(num_ranks)]
        self.kv_usage = [0.0] * num_ranks
        self.owner: dict[str, int] = {}
        self._affinity: OrderedDict[int, int] = OrderedDict()

    # -- the rule ---------------------------------------------------------------------------
    def load(self, rank: int) -> float:
        return len(self.in_flight[rank]) + self.kv_usage_weight * self.kv_usage[rank]

    def live_ranks(self) -> list[int]:
        return [rank for rank, live in enumerate(self.live) if live]

    def prefix_key(self, request: EngineCoreRequest) -> int | None:
        """The affinity key of the prompt's first block; None for a shorter prompt."""
        if len(request.prompt_token_ids) < self.block_size:
            return None
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        return hash((lora, request.cache_salt, tuple(request.prompt_token_ids[:self.block_size])))

    def choose(self, request: EngineCoreRequest) -> int:
        """The rank the rule picks (nothing is recorded; :meth:`route` records)."""
        ranks = self.live_ranks()
        if not ranks:
            raise NoLiveRankError("every data-parallel rank has died")
        least = min(ranks, key=lambda r: (self.load(r), r))
        key = self.prefix_key(request)
        if key is not None:
            preferred = self._affinity.get(key)
            if (preferred is not None and self.live[preferred]
                    and self.load(preferred) <= self.load(least) + self.affinity_slack):
                return preferred
        return least

    def route(self, request: EngineCoreRequest) -> int:
        """Choose a rank for ``request`` and count it there."""
        if request.request_id in self.owner:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        rank = self.choose(request)
        self.owner[request.request_id] = rank
        self.in_flight[rank].add(request.request_id)
        key = self.prefix_key(request)
        if key is not None:
            self._affinity[key] = rank
            self._affinity.move_to_end(key)
            if len(self._affinity) > self.max_affinity_keys:
                self._affinity.popitem(last=False)
        return rank

    # -- bookkeeping ------------------------------------------------------------------------
    def on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        """A step of ``rank``: its finished requests leave the count; its KV usage."""
        done = [o.request_id for o in outputs.outputs if o.finish_reason is not None]
        done.extend(outputs.finished_requests)
        self._drop(done)
        self.kv_usage[rank] = outputs.kv_cache_usage

    def forget(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Stop counting ``request_ids`` (aborted); return them by owning rank (unknown or
        finished ids are left out)."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.owner.pop(request_id, None)
            if rank is not None:
                self.in_flight[rank].discard(request_id)
                by_rank.setdefault(rank, []).append(request_id)
        return by_rank

    def mark_dead(self, rank: int) -> list[str] | None:
        """Take ``rank`` out of routing; return the requests it held (None if it was
        already marked dead)."""
        if not self.live[rank]:
            return None
        self.live[rank] = False
        lost = sorted(self.in_flight[rank])
        self._drop(lost)
        self.kv_usage[rank] = 0.0
        return lost

    def _drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            rank = self.owner.pop(request_id, None)
            if rank is not None:
                self.in_flight[rank].discard(request_id)
