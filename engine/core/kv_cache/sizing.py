"""How many KV cache blocks fit in a memory budget.

One block of one layer holds K and V for ``block_size`` tokens:
``2 * block_size * num_kv_heads * head_size * dtype_bytes`` bytes.
"""

from __future__ import annotations


def kv_cache_block_bytes(
    block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int, num_layers: int
) -> int:
    """Bytes one block takes across all layers."""
    for name, value in (
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("dtype_bytes", dtype_bytes),
        ("num_layers", num_layers),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    return 2 * block_size * num_kv_heads * head_size * dtype_bytes * num_layers


def num_blocks_for_memory(
    bytes_available: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype_bytes: int,
    num_layers: int,
) -> int:
    """Whole blocks that fit in ``bytes_available`` (including the reserved null block)."""
    if bytes_available < 0:
        raise ValueError(f"bytes_available={bytes_available!r} must be >= 0")
    per_block = kv_cache_block_bytes(block_size, num_kv_heads, head_size, dtype_bytes, num_layers)
    return int(bytes_available) // per_block
