"""One KV cache block: a fixed run of ``block_size`` token slots in the paged cache.

The block also carries the links of the free-block queue (intrusive list, DESIGN
lesson 4): taking a cached block back out of the queue on a prefix hit is O(1) and
allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    # Requests currently holding this block (prefix sharing, n > 1 samples).
    ref_cnt: int = 0
    # Prefix hash while the block is registered in the prefix cache, else None.
    block_hash: bytes | None = None
    # Free-queue links; both None while the block is not in the queue.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    # Block 0: the padding target of block tables; never allocated, never freed.
    is_null: bool = False

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"cached={self.block_hash is not None})"
        )
