"""Device-neutral paged KV cache bookkeeping: block pool, free queue, prefix cache."""

from engine.core.kv_cache.block import KVCacheBlock
from engine.core.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from engine.core.kv_cache.free_queue import FreeKVCacheBlockQueue
from engine.core.kv_cache.groups import (
    KVCacheGroupSpec,
    KVCacheLayout,
    build_kv_cache_layout,
    single_group_layout,
)
from engine.core.kv_cache.hashing import (
    ROOT_BLOCK_HASH,
    BlockHash,
    hash_block_tokens,
    update_block_hashes,
)
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.kv_cache.sizing import kv_cache_block_bytes, num_blocks_for_memory
from engine.core.kv_cache.stats import PrefixCacheStats

__all__ = [
    "NULL_BLOCK_ID",
    "ROOT_BLOCK_HASH",
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheManager",
    "PrefixCacheStats",
    "build_kv_cache_layout",
    "hash_block_tokens",
    "kv_cache_block_bytes",
    "num_blocks_for_memory",
    "single_group_layout",
    "update_block_hashes",
]
