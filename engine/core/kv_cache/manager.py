"""The KV cache manager: per-request block tables of every KV cache group over one pool.

Device-neutral bookkeeping only; the executor owns the actual K/V tensors and reads
block ids from the scheduler's output.

Block regions of one request's table after ``allocate_slots``::

    | prefix hits (shared) | blocks of computed tokens | blocks for new tokens | lookahead |
    '------ touched ------' '--------- owned (ref_cnt may be > 1 for hits) ------------'

Full blocks are registered in the prefix cache as soon as they are allocated for tokens
scheduled this step (like vLLM V1): the model runner writes every new K/V of a step
before any attention of that step reads, so a request scheduled later in the same step
may already hit them.

With several KV cache groups (:mod:`engine.core.kv_cache.groups`) each request has one
table per group; block ids come back per group (``tuple[list[int], ...]``, one list per
group, also with a single group). A prefix hit is the longest prefix every group can
serve: the full groups' runs of cached blocks, cut back until each windowed group has the
blocks the next query reads.

A model with state layers (Mamba, DeltaNet) also holds one state slot per request
(:mod:`engine.core.kv_cache.state_slots`, ``num_state_slots`` > 0): taken at the
request's first allocation, given back by :meth:`KVCacheManager.free`. Its KV cache
groups then cover only its attention layers (none for a pure state-space model).
"""

from __future__ import annotations

from engine.core.kv_cache.block import KVCacheBlock
from engine.core.kv_cache.block_pool import BlockPool
from engine.core.kv_cache.group_manager import GroupKVManager
from engine.core.kv_cache.groups import KVCacheGroupSpec
from engine.core.kv_cache.hashing import update_block_hashes
from engine.core.kv_cache.state_slots import StateSlotAllocator
from engine.core.kv_cache.stats import PrefixCacheStats
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


BlockIds = tuple[list[int], ...]  # per group
GroupBlocks = tuple[list[KVCacheBlock], ...]  # per group


class KVCacheManager:
    """``groups``: the model's KV cache groups (None: one full-attention group);
    ``max_step_tokens``: the most tokens one step writes for a request (bounds what a
    windowed group holds, for :attr:`max_num_tokens`); ``num_state_slots``: per-request
    state slots of a model with state layers (0: none)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: tuple[KVCacheGroupSpec, ...] | None = None,
                 max_step_tokens: int | None = None, num_state_slots: int = 0) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.groups = tuple(groups) if groups else (KVCacheGroupSpec(()),)
        self.group_managers = [GroupKVManager(spec, gid, self.block_pool, block_size)
                               for gid, spec in enumerate(self.groups)]
        self._max_step_tokens = max_step_tokens
        self.state_slots = StateSlotAllocator(num_state_slots) if num_state_slots else None
        self._max_num_tokens = self._compute_max_num_tokens()
        self.prefix_cache_stats = PrefixCacheStats()  # since make_prefix_cache_stats()
        self.total_prefix_cache_stats = PrefixCacheStats()  # since construction

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def max_num_tokens(self) -> int:
        """Most tokens one request can ever hold (the whole usable pool)."""
        return self._max_num_tokens

    def _compute_max_num_tokens(self) -> int:
        usable, bs = self.num_usable_blocks, self.block_size
        num_full = sum(1 for g in self.groups if not g.is_windowed)
        if self.num_groups == 1 and num_full == 1:
            return usable * bs
        step = self._max_step_tokens or usable * bs
        caps = [g.max_blocks_held(bs, step) for g in self.groups if g.is_windowed]

        def blocks_for(num_tokens: int) -> int:
            n = cdiv(num_tokens, bs)
            return num_full * n + sum(min(n, cap) for cap in caps)

        # The largest token count whose blocks fit (blocks_for is monotone).
        lo, hi = 0, usable * bs if num_full else usable * bs * self.num_groups
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks_for(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt token: nothing may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix of cached full blocks every group can serve.

        Never covers the last token (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks hit. Changes nothing: the hit blocks are
        only claimed by ``allocate_slots``.
        """
        empty: GroupBlocks = tuple([] for _ in self.groups)
        if not self.uses_prefix_cache(request):
            return empty, 0
        hashes = update_block_hashes(request, self.block_size)
        num_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits = [m.find_hits(hashes, num_blocks) for m in self.group_managers]
        # Each group's hit bounds the others'; shrink until all agree (a full group's hit
        # only shortens, a windowed group's is searched again below the new bound).
        while True:
            bound = min(len(h) for h in hits)
            if all(len(h) == bound for h in hits):
                break
            hits = [h if len(h) == bound else
                    (h[:bound] if not m.spec.is_windowed else m.find_hits(hashes, bound))
                    for m, h in zip(self.group_managers, hits)]
        return tuple(hits), bound * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (and nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The interval counters since the previous call (and start a new interval)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> BlockIds | None:
        """Grow the request's tables to hold ``num_new_tokens`` more tokens.

        ``num_new_computed_tokens`` / ``new_computed_blocks`` are the prefix hits from
        ``get_computed_blocks`` (first allocation only); ``num_lookahead_tokens`` reserves
        slots beyond the scheduled tokens (speculative drafts); ``delay_cache_blocks``
        keeps the new blocks out of the prefix cache (their KV is still being loaded from
        outside; a later allocation caches them). Windowed groups first free the blocks
        no query of this step or later reads. Returns the block ids appended to each
        group's table (hits first), or None when the pool cannot supply them; in that
        case no block was allocated.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be > 0")
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} and "
                f"num_lookahead_tokens={num_lookahead_tokens} must be >= 0"
            )
        request_id = request.request_id
        managers = self.group_managers
        hits = new_computed_blocks or tuple([] for _ in managers)
        is_first = request_id not in managers[0].req_to_blocks
        if any(hits) and not is_first:
            raise ValueError(
                f"request {request_id}: prefix hits are only valid at first allocation"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if not is_first:
            for manager in managers:
                manager.remove_skipped_blocks(request_id, num_computed)
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new = [max(0, num_required - m.num_held(request_id) - len(h))
                   for m, h in zip(managers, hits)]
        # Hits sitting in the free queue leave it when touched: they cost free blocks too.
        num_free_hits = sum(1 for h in hits for block in h
                            if block.ref_cnt == 0 and not block.is_null)
        if sum(num_new) + num_free_hits > self.block_pool.num_free_blocks:
            return None
        slots = self.state_slots
        if slots is not None and slots.allocate(request_id) is None:
            return None  # more requests than state slots: nothing was allocated

        # Touch every group's hits before allocating, so the allocation cannot evict them.
        self.block_pool.touch(b for h in hits for b in h if not b.is_null)
        new_ids = tuple(m.allocate(request_id, h, n)
                        for m, h, n in zip(managers, hits, num_new))

        if self.uses_prefix_cache(request):
            if is_first:
                hit_tokens = len(hits[0]) * self.block_size
                self.prefix_cache_stats.record(request.num_tokens, hit_tokens)
                self.total_prefix_cache_stats.record(request.num_tokens, hit_tokens)
            if not delay_cache_blocks:
                self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_ids

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        # Only real tokens are hashed: speculative drafts may still be rejected.
        hashes = update_block_hashes(request, self.block_size)
        num_full = min(
            len(hashes), min(num_tokens_after_step, request.num_tokens) // self.block_size
        )
        for manager in self.group_managers:
            manager.cache_full_blocks(request.request_id, hashes, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached longest."""
        for manager in reversed(self.group_managers):
            manager.free(request.request_id)
        if self.state_slots is not None:
            self.state_slots.free(request.request_id)

    # -- queries ----------------------------------------------------------------------------
    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.group_managers[0].req_to_blocks

    def get_state_slot(self, request_id: str) -> int | None:
        """The request's state slot (None: the model has no state layers, or it holds
        none)."""
        return None if self.state_slots is None else self.state_slots.slot_of(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.group_managers)

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())]
                     for m in self.group_managers)

    def group_usage(self) -> list[dict[str, int | str]]:
        """Per group: its kind, the block references requests hold now and at most."""
        return [{"kind": m.spec.kind, "held": m.num_held_refs, "peak": m.peak_held_refs}
                for m in self.group_managers]

    def num_blocks_held(self, request_id: str) -> list[int]:
        """Real (non-null) blocks the request holds, per group."""
        return [sum(1 for b in m.req_to_blocks.get(request_id, ()) if not b.is_null)
                for m in self.group_managers]
