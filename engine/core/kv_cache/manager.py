"""The KV cache manager: per-request block tables over one block pool.

Device-neutral bookkeeping only; the executor owns the actual K/V tensors and reads
block ids from the scheduler's output.

Block regions of one request's table after ``allocate_slots``::

    | prefix hits (shared) | blocks of computed tokens | blocks for new tokens | lookahead |
    '------ touched ------' '--------- owned (ref_cnt may be > 1 for hits) ------------'

Full blocks are registered in the prefix cache as soon as they are allocated for tokens
scheduled this step (like vLLM V1): the model runner writes every new K/V of a step
before any attention of that step reads, so a request scheduled later in the same step
may already hit them.
"""

from __future__ import annotations

from engine.core.kv_cache.block import KVCacheBlock
from engine.core.kv_cache.block_pool import BlockPool
from engine.core.kv_cache.hashing import update_block_hashes
from engine.core.kv_cache.stats import PrefixCacheStats
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()  # since make_prefix_cache_stats()
        self.total_prefix_cache_stats = PrefixCacheStats()  # since construction

    # -- capacity ---------------------------------------------------------------------------
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
        return self.num_usable_blocks * self.block_size

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt token: nothing may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Never covers the last token (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks hit. Changes nothing: the hit blocks are
        only claimed by ``allocate_slots``.
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for i in range(max_hit_blocks):
            block = get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_new_tokens`` more tokens.

        ``num_new_computed_tokens`` / ``new_computed_blocks`` are the prefix hits from
        ``get_computed_blocks`` (first allocation only); ``num_lookahead_tokens`` reserves
        slots beyond the scheduled tokens (speculative drafts); ``delay_cache_blocks``
        keeps the new blocks out of the prefix cache (their KV is still being loaded from
        outside; a later allocation caches them). Returns the block ids
        appended to the table (hits first), or None when the pool cannot supply them; in
        that case nothing changed.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be > 0")
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} and "
                f"num_lookahead_tokens={num_lookahead_tokens} must be >= 0"
            )
        hits = new_computed_blocks or []
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        is_first = req_blocks is None
        if hits and not is_first:
            raise ValueError(
                f"request {request_id}: prefix hits are only valid at first allocation"
            )
        num_held = 0 if req_blocks is None else len(req_blocks)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(hits))
        # Hits sitting in the free queue leave it when touched: they cost free blocks too.
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            return None

        # Touch before allocating, so the allocation cannot evict the hits.
        self.block_pool.touch(hits)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        req_blocks.extend(hits)
        if num_new_blocks:
            req_blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))

        if self.uses_prefix_cache(request):
            if is_first:
                hit_tokens = len(hits) * self.block_size
                self.prefix_cache_stats.record(request.num_tokens, hit_tokens)
                self.total_prefix_cache_stats.record(request.num_tokens, hit_tokens)
            if not delay_cache_blocks:
                self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return [block.block_id for block in req_blocks[num_held:]]

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens_after_step: int
    ) -> None:
        # Only real tokens are hashed: speculative drafts may still be rejected.
        hashes = update_block_hashes(request, self.block_size)
        num_full = min(
            len(hashes), min(num_tokens_after_step, request.num_tokens) // self.block_size
        )
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
            self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # -- queries ----------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
