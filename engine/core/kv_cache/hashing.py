"""Prefix-cache block hashes.

A full block's hash is SHA-256 over the msgpack encoding of
``(parent block hash, the block's token ids, extra keys)``. msgpack encodes ints and
strings in one canonical form, so the digest depends only on the values (never on
Python's randomized ``hash()``), is stable across processes and runs, and chaining the
parent makes a block's hash name its whole prefix. The first block's parent is a fixed
root digest. Extra keys (the request's cache salt) go into every block, so requests with
different salts never share a block. A block holding tokens of an image (video) adds
the item's content hash, so the same placeholder tokens with another image never match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from engine.core.request import Request

BlockHash = bytes
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"engine.prefix-cache.root.v1").digest()

_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str | int | bytes, ...] = (),
) -> BlockHash:
    """Hash one full block given the hash of the block before it (None: first block)."""
    parent = ROOT_BLOCK_HASH if parent_hash is None else parent_hash
    return hashlib.sha256(_encode((parent, token_ids, extra_keys))).digest()


def request_extra_keys(request: Request) -> tuple[str | int, ...]:
    """What besides the tokens decides a block's KV: the cache salt, and the adapter the
    request runs under (the same prompt under another adapter has other K/V)."""
    keys: tuple[str | int, ...] = () if request.cache_salt is None else (request.cache_salt,)
    lora = request.lora_request
    if lora is not None:
        keys += ("lora", lora.lora_int_id, lora.lora_name, lora.lora_path)
    return keys


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens.

    Incremental: only blocks filled since the last call are hashed, so the per-step
    cost is the number of newly full blocks, not the context length.
    """
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) >= num_full:
        return hashes
    extra = request_extra_keys(request)
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    features = request.mm_features
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        keys = extra
        if features:  # the content of every image whose tokens the block holds
            keys = extra + tuple(f.identifier for f in features
                                 if f.offset < end and f.end > start)
        parent = hash_block_tokens(parent, tokens[start:end], keys)
        hashes.append(parent)
    return hashes
