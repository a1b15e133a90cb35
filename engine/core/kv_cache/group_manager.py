"""The block tables of one KV cache group over the shared pool.

A full-attention group keeps every block of a request, so a prefix hit is the longest
run of cached blocks from the start. A windowed group (sliding window, chunked local)
replaces blocks no future query reads with the null block and frees them as the
request advances, so it holds about a window's worth per request; its prefix hit of
``k`` blocks needs only the blocks the next query reads (the ones before are held as
the null block and never touched).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.kv_cache.block import KVCacheBlock
from engine.core.kv_cache.block_pool import BlockPool
from engine.core.kv_cache.groups import KVCacheGroupSpec
from engine.core.kv_cache.hashing import BlockHash


class GroupKVManager:
    def __init__(self, spec: KVCacheGroupSpec, group_id: int, pool: BlockPool,
                 block_size: int) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request registered in the prefix cache / already
        # replaced by the null block (windowed groups).
        self.num_cached_blocks: dict[str, int] = {}
        self._num_skipped: dict[str, int] = {}
        # Block references the requests hold in this group now / at most (reports).
        self.num_held_refs = 0
        self.peak_held_refs = 0
        # Group 0 keys its blocks by the hash itself; the others by the hash and their id,
        # so the same tokens' blocks of different groups are different cache entries.
        self._key_suffix = b"" if group_id == 0 else group_id.to_bytes(2, "little")

    def cache_key(self, block_hash: BlockHash) -> BlockHash:
        return block_hash + self._key_suffix if self._key_suffix else block_hash

    # -- prefix hits ----------------------------------------------------------------------
    def find_hits(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The longest usable prefix hit of at most ``max_blocks`` blocks (windowed
        groups: null blocks in front of the blocks the next query reads)."""
        get = self.pool.get_cached_block
        if not self.spec.is_windowed:
            hits: list[KVCacheBlock] = []
            for i in range(max_blocks):
                block = get(self.cache_key(hashes[i]))
                if block is None:
                    break
                hits.append(block)
            return hits
        found = [get(self.cache_key(hashes[i])) for i in range(max_blocks)]
        # last_miss[k]: the last block index below k without a cached block (-1: none).
        last_miss = -1
        misses = [-1] * (max_blocks + 1)
        for i, block in enumerate(found):
            if block is None:
                last_miss = i
            misses[i + 1] = last_miss
        bs = self.block_size
        for k in range(max_blocks, 0, -1):
            first = self.spec.first_needed_position(k * bs) // bs
            if misses[k] < first:
                return [self.pool.null_block] * first + found[first:k]
        return []

    # -- allocation -----------------------------------------------------------------------
    def num_held(self, request_id: str) -> int:
        """Table entries (null ones included) the request has in this group."""
        blocks = self.req_to_blocks.get(request_id)
        return 0 if blocks is None else len(blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query at ``num_computed_tokens`` or later reads."""
        if not self.spec.is_windowed:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first = min(self.spec.first_needed_position(num_computed_tokens) // self.block_size,
                    len(blocks))
        start = self._num_skipped.get(request_id, 0)
        if first <= start:
            return
        null = self.pool.null_block
        dropped = [b for b in blocks[start:first] if not b.is_null]
        blocks[start:first] = [null] * (first - start)
        self._num_skipped[request_id] = first
        self.num_held_refs -= len(dropped)
        # Latest first: the oldest tokens' blocks end up evicted first.
        self.pool.free_blocks(reversed(dropped))

    def allocate(self, request_id: str, hits: list[KVCacheBlock], num_new: int) -> list[int]:
        """Append ``hits`` (first allocation only; the caller has already taken their
        references) and ``num_new`` fresh blocks; the new table entries' ids."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self._num_skipped[request_id] = sum(1 for b in hits if b.is_null)
        start = len(blocks)
        blocks.extend(hits)
        if num_new:
            blocks.extend(self.pool.get_new_blocks(num_new))
        self.num_held_refs += num_new + sum(1 for b in hits if not b.is_null)
        self.peak_held_refs = max(self.peak_held_refs, self.num_held_refs)
        return [block.block_id for block in blocks[start:]]

    def cache_full_blocks(self, request_id: str, hashes: Sequence[BlockHash],
                          num_full: int) -> None:
        blocks = self.req_to_blocks[request_id]
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_full > num_cached:
            keys = hashes if not self._key_suffix else [
                self.cache_key(h) for h in hashes[num_cached:num_full]]
            offset = 0 if not self._key_suffix else num_cached
            self.pool.cache_full_blocks(blocks, keys, num_cached, num_full, key_offset=offset)
            self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self._num_skipped.pop(request_id, None)
        if blocks:
            held = [b for b in reversed(blocks) if not b.is_null]
            self.num_held_refs -= len(held)
            self.pool.free_blocks(held)
