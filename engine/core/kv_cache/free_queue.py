"""The free-block queue: an intrusive doubly linked list in eviction order.

The head is evicted first. Freed blocks that hold prefix-cache content go to the tail
(least recently used at the head); freed blocks with nothing worth keeping go to the
head. A prefix hit removes a freed-but-cached block from the middle in O(1). Two
sentinel blocks bound the list so no operation branches on emptiness of a neighbour.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from engine.core.kv_cache.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block to evict next."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV cache blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(
                f"asked for {n} free KV cache blocks, only {self.num_free_blocks} free"
            )
        return [self.popleft() for _ in range(n)]

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        self._insert_before(self._tail, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (evicted first)."""
        self._insert_before(self._head.next_free, block)  # type: ignore[arg-type]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev = anchor.prev_free
        assert prev is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = anchor
        anchor.prev_free = block
        self.num_free_blocks += 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head (next evicted) to tail; for tests and debugging, not the hot path."""
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free
