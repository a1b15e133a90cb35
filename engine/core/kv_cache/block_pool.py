"""The pool of KV cache blocks: allocation, ref counts, and the prefix-cache index.

Block 0 is reserved as the null block (the model runner pads block tables with 0), so
``num_blocks - 1`` blocks are usable. A block is in exactly one of three states:

- in use: ``ref_cnt > 0``, held by one or more requests, not in the free queue;
- free and cached: ``ref_cnt == 0``, in the free queue, still indexed by its hash, so a
  prefix hit can take it back (``touch``) until it is evicted;
- free and empty: ``ref_cnt == 0``, in the free queue, no hash.

Allocation pops the head of the free queue and drops the popped block's hash (eviction).
``on_evict(block_id, block_hash)``, when set, hears of each eviction first (the block
still holds that hash's KV): a KV offloading tier stores it there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.core.kv_cache.block import KVCacheBlock
from engine.core.kv_cache.free_queue import FreeKVCacheBlockQueue
from engine.core.kv_cache.hashing import BlockHash

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks}: the KV cache needs at least 2 blocks "
                "(block 0 is the reserved null block)"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached content."""
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        key_offset: int = 0,
    ) -> None:
        """Register ``blocks[start:end]`` (full) under ``block_hashes[start - key_offset :
        end - key_offset]`` (null entries of a windowed group's table are skipped).

        If another block already holds the same content (two requests computed the same
        prefix in one step), the first one stays the canonical copy and this one simply
        stays unindexed; it is still a valid block for its own request.
        """
        if not self.enable_caching:
            return
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # a prefix hit (already indexed) or a dropped block
            block_hash = block_hashes[i - key_offset]
            if block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue.

        ``ordered_blocks`` comes in eviction order (callers pass a request's table
        reversed, so a sequence's tail is evicted before its shared prefix). Cached blocks
        go to the tail (LRU); blocks without content go to the head (reused first).
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_id, block_hash)
        block.block_hash = None
