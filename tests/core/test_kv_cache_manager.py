"""KV cache manager: block accounting, prefix hits, LRU eviction, hashing, sizing."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import msgspec
import pytest

from engine.core.kv_cache import (
    NULL_BLOCK_ID,
    ROOT_BLOCK_HASH,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
    kv_cache_block_bytes,
    num_blocks_for_memory,
    update_block_hashes,
)
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), cache_salt=salt)


def allocate_prompt(mgr: KVCacheManager, req: Request) -> list[int]:
    """Admit a request the way the scheduler does: hits first, then its whole prompt."""
    hits, num_hit = mgr.get_computed_blocks(req)
    ids = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    assert ids is not None and len(ids) == 1  # one KV cache group
    req.num_computed_tokens = req.num_tokens
    return ids[0]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_queue]


# -- free queue ------------------------------------------------------------------------------
def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.popleft_n(5)] == [0, 1, 3, 4, 2]
    assert len(q) == 0
    with pytest.raises(ValueError, match="no free"):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    q.append(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[1])


# -- hashing ---------------------------------------------------------------------------------
def test_block_hash_matches_reference_encoding():
    tokens = [5, 300, 70000, 2**40]
    expected = hashlib.sha256(msgspec.msgpack.encode([ROOT_BLOCK_HASH, tokens, ["salt"]])).digest()
    assert hash_block_tokens(None, tokens, ("salt",)) == expected
    child = hash_block_tokens(expected, [1, 2, 3, 4])
    ref_child = hashlib.sha256(msgspec.msgpack.encode([expected, [1, 2, 3, 4], []])).digest()
    assert child == ref_child and len(child) == 32


def test_block_hash_is_stable_across_processes():
    code = (
        "from engine.core.kv_cache import hash_block_tokens as h;"
        "print(h(h(None,[1,2,3,4],('s',)),[9,9,9,9],('s',)).hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    local = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], ("s",)), [9] * 4, ("s",)).hex()
    assert outs == {local}


def test_hashes_differ_by_content_salt_and_parent():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",)
    )
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base


def test_block_hashes_extend_incrementally_over_full_blocks_only():
    req = make_request("r", list(range(10)))
    hashes = update_block_hashes(req, BS)
    assert len(hashes) == 2  # 10 tokens: 2 full blocks
    assert hashes[1] == hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), [4, 5, 6, 7])
    first = list(hashes)
    req.append_output_token_ids([10, 11])
    assert update_block_hashes(req, BS)[:2] == first and len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])


# -- allocation accounting -----------------------------------------------------------------------
def test_null_block_is_reserved_and_accounting_balances():
    mgr = KVCacheManager(num_blocks=9, block_size=BS)
    assert mgr.num_usable_blocks == 8 and mgr.num_free_blocks == 8 and mgr.usage == 0.0
    req = make_request("a", range(10))
    ids = allocate_prompt(mgr, req)
    assert len(ids) == 3 and NULL_BLOCK_ID not in ids
    assert mgr.get_block_ids("a")[0] == ids and mgr.num_free_blocks == 5
    assert mgr.usage == pytest.approx(3 / 8)
    # Growing inside the last block needs nothing new; crossing a boundary needs one block.
    req.append_output_token_ids([1])
    assert mgr.allocate_slots(req, 1) == ([],)
    req.num_computed_tokens += 1
    req.append_output_token_ids([2, 3])
    assert mgr.allocate_slots(req, 2) == ([mgr.get_block_ids("a")[0][-1]],) and mgr.num_free_blocks == 4
    mgr.free(req)
    assert mgr.num_free_blocks == 8 and mgr.get_block_ids("a") == ([],)
    mgr.free(req)  # idempotent
    assert mgr.num_free_blocks == 8


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = make_request("a", range(8))
    allocate_prompt(mgr, a)
    b = make_request("b", range(100, 109))
    before = (mgr.num_free_blocks, dict(mgr.group_managers[0].req_to_blocks))
    assert mgr.allocate_slots(b, 9) is None
    assert (mgr.num_free_blocks, dict(mgr.group_managers[0].req_to_blocks)) == before
    assert mgr.prefix_cache_stats.requests == 1  # only a's admission was counted
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(b, 0)


def test_lookahead_reserves_extra_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", range(4))
    assert len(mgr.allocate_slots(req, 4, num_lookahead_tokens=5)[0]) == 3  # ceil(9 / 4)


def test_invalid_construction():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=8, block_size=0)


# -- prefix caching ------------------------------------------------------------------------------
def test_prefix_hit_shares_blocks_with_ref_counts():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))
    a = make_request("a", prompt)
    a_ids = allocate_prompt(mgr, a)
    b = make_request("b", prompt + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits[0]] == a_ids[:2] and num_hit == 8
    b_ids = mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)[0]
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    blocks = mgr.block_pool.blocks
    assert [blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    mgr.free(a)
    assert [blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    mgr.free(b)
    assert mgr.num_free_blocks == mgr.num_usable_blocks
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)
    assert mgr.prefix_cache_stats.queries == 0 and mgr.total_prefix_cache_stats.hits == 8


@pytest.mark.parametrize(
    "prompt_len,expected_hit_blocks", [(8, 1), (9, 2), (12, 2), (13, 3), (4, 0)]
)
def test_last_prompt_token_never_hits(prompt_len, expected_hit_blocks):
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(mgr, make_request("a", range(prompt_len)))
    hits, num_hit = mgr.get_computed_blocks(make_request("b", range(prompt_len)))
    assert len(hits[0]) == expected_hit_blocks == (prompt_len - 1) // BS
    assert num_hit == expected_hit_blocks * BS < prompt_len


def test_different_content_or_salt_never_shares():
    mgr = KVCacheManager(num_blocks=32, block_size=BS)
    allocate_prompt(mgr, make_request("a", range(13), salt="tenant-1"))
    assert mgr.get_computed_blocks(make_request("b", range(13), salt="tenant-2"))[1] == 0
    assert mgr.get_computed_blocks(make_request("c", range(13)))[1] == 0
    assert mgr.get_computed_blocks(make_request("d", range(13), salt="tenant-1"))[1] == 12
    # A change in the first block breaks every later block; in the second, only from there.
    assert (
        mgr.get_computed_blocks(make_request("e", [7] + list(range(1, 13)), salt="tenant-1"))[1]
        == 0
    )
    diverge = list(range(13))
    diverge[5] = 1000
    assert mgr.get_computed_blocks(make_request("f", diverge, salt="tenant-1"))[1] == 4


def test_prompt_logprobs_and_disabled_caching_skip_the_cache():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(mgr, make_request("a", range(12)))
    assert mgr.get_computed_blocks(make_request("b", range(12), prompt_logprobs=1)) == (([],), 0)
    off = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    allocate_prompt(off, make_request("a", range(12)))
    assert off.get_computed_blocks(make_request("b", range(12))) == (([],), 0)
    assert not off.block_pool.cached_blocks


def test_blocks_are_cached_when_allocated_for_this_step():
    """A block is hittable once allocated for scheduled tokens, before they are computed."""
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(11))
    mgr.allocate_slots(a, 6)  # a chunk of 6: one full block so far
    assert mgr.get_computed_blocks(make_request("b", range(11)))[1] == 4
    a.num_computed_tokens = 6
    mgr.allocate_slots(a, 5)
    assert mgr.get_computed_blocks(make_request("c", range(11)))[1] == 8


def test_cache_hit_takes_free_block_out_of_the_queue():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)  # 7 usable
    a = make_request("a", range(9))
    a_ids = allocate_prompt(mgr, a)
    mgr.free(a)
    assert mgr.num_free_blocks == 7
    b = make_request("b", range(9))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and mgr.num_free_blocks == 7  # looking changes nothing
    mgr.allocate_slots(b, 1, num_hit, hits)
    # Two hits left the free queue, and the third block was freshly allocated.
    assert mgr.num_free_blocks == 4
    assert set(a_ids[:2]).isdisjoint(free_ids(mgr))


def test_free_hits_count_against_capacity():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", range(9))
    allocate_prompt(mgr, a)
    mgr.free(a)
    c = make_request("c", range(50, 54))
    allocate_prompt(mgr, c)  # takes the uncached third block; 2 cached blocks stay free
    b = make_request("b", range(9))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    # b needs its 2 hits (both in the free queue) plus one new block: 3 > 2 free.
    assert mgr.allocate_slots(b, 1, num_hit, hits) is None
    assert mgr.num_free_blocks == 2 and all(h.ref_cnt == 0 for h in hits[0])


def test_lru_eviction_order():
    """Freed requests' blocks are evicted oldest-freed first, each sequence tail first."""
    mgr = KVCacheManager(num_blocks=9, block_size=BS)  # 8 usable
    a = make_request("a", range(12))
    b = make_request("b", range(100, 112))
    a_ids, b_ids = allocate_prompt(mgr, a), allocate_prompt(mgr, b)
    mgr.free(a)
    mgr.free(b)
    unused = [i for i in range(1, 9) if i not in a_ids + b_ids]
    assert free_ids(mgr) == unused + a_ids[::-1] + b_ids[::-1]
    # A new request evicts the never-used blocks first, then a's tail.
    c = make_request("c", range(200, 212))
    c_ids = allocate_prompt(mgr, c)
    assert c_ids == unused + [a_ids[2]]
    assert mgr.get_computed_blocks(make_request("a2", range(12)))[1] == 8
    # Hitting a's prefix makes it most recently used (a2's one new block evicts b's tail):
    # b's remaining blocks are evicted next, then a2's tail, and a's prefix survives.
    a2 = make_request("a2", range(12))
    a2_ids = allocate_prompt(mgr, a2)
    assert a2_ids == a_ids[:2] + [b_ids[2]]
    mgr.free(a2)
    d = make_request("d", range(300, 312))
    assert allocate_prompt(mgr, d) == [b_ids[1], b_ids[0], a2_ids[2]]
    assert mgr.get_computed_blocks(make_request("b2", range(100, 112)))[1] == 0
    assert mgr.get_computed_blocks(make_request("a3", range(12)))[1] == 8


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)  # 5 usable
    a = make_request("a", range(6))  # one full (cached) block + one partial
    a_ids = allocate_prompt(mgr, a)
    mgr.free(a)
    assert free_ids(mgr)[0] == a_ids[1] and free_ids(mgr)[-1] == a_ids[0]


def test_duplicate_content_keeps_first_block_canonical():
    pool = BlockPool(num_blocks=4)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks([x], [h], 0, 1)
    pool.cache_full_blocks([y], [h], 0, 1)
    assert pool.get_cached_block(h) is x and y.block_hash is None
    pool.free_blocks([y])
    pool.get_new_blocks(2)  # evicts y (uncached, at the head) and the spare block
    assert pool.get_cached_block(h) is x
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([y, y, y])


def test_reset_prefix_cache_only_when_idle():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(12))
    allocate_prompt(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert mgr.get_computed_blocks(make_request("b", range(12)))[1] == 8
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("c", range(12)))[1] == 0
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)


# -- sizing ---------------------------------------------------------------------------------------
def test_block_bytes_and_blocks_for_memory():
    # 2 (K and V) * 16 tokens * 8 heads * 128 dims * 2 bytes * 32 layers
    assert kv_cache_block_bytes(16, 8, 128, 2, 32) == 2 * 16 * 8 * 128 * 2 * 32 == 2 * 2**20
    assert num_blocks_for_memory(10 * 2**20 + 5, 16, 8, 128, 2, 32) == 5
    assert num_blocks_for_memory(0, 16, 8, 128, 2, 32) == 0
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_block_bytes(16, 0, 128, 2, 32)
    with pytest.raises(ValueError, match="bytes_available"):
        num_blocks_for_memory(-1, 16, 8, 128, 2, 32)
