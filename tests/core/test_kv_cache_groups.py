"""KV cache groups (the hybrid manager): grouping by attention kind, windowed groups that
drop blocks no query reads any more, prefix hits every group can serve, and accounting
that returns every block."""

from __future__ import annotations

import pytest

from engine.core.kv_cache import (
    KVCacheGroupSpec,
    KVCacheManager,
    build_kv_cache_layout,
)
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

BS = 4
W = 8  # sliding window (tokens)


def make_request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def hybrid_manager(num_blocks: int = 64, **kwargs) -> KVCacheManager:
    """Layers 0, 2 full; 1, 3 sliding (window 8): two groups of two layers."""
    layout = build_kv_cache_layout([None, W, None, W])
    return KVCacheManager(num_blocks, BS, groups=layout.groups, **kwargs)


def admit(mgr: KVCacheManager, req: Request, chunk: int | None = None) -> None:
    """Prefill the whole prompt the way the scheduler does (hits, then chunks)."""
    hits, num_hit = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    first = True
    done = num_hit
    while done < req.num_tokens:
        n = min(chunk or req.num_tokens, req.num_tokens - done)
        if first:
            assert mgr.allocate_slots(req, n, num_hit, hits) is not None
            first = False
        else:
            assert mgr.allocate_slots(req, n) is not None
        done += n
        req.num_computed_tokens = done


def decode(mgr: KVCacheManager, req: Request, steps: int) -> list[list[int]]:
    """``steps`` one-token steps; the real blocks held per group after each."""
    held = []
    for i in range(steps):
        req.append_output_token_ids([1000 + i])
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        held.append(mgr.num_blocks_held(req.request_id))
    return held


# -- grouping -------------------------------------------------------------------------------
def test_layout_groups_layers_by_kind_full_first():
    # Gemma-3-like: five sliding layers per full one.
    windows = [W, W, W, W, W, None, W, W, W, W, W, None]
    layout = build_kv_cache_layout(windows)
    assert layout.group_size == 2
    kinds = [(g.kind, g.layer_indices) for g in layout.groups]
    assert kinds[0] == ("full", (5, 11))
    assert [k for k, _ in kinds[1:]] == [f"sliding_window({W})"] * 5
    assert sorted(i for g in layout.groups for i in g.layer_indices) == list(range(12))
    slots = layout.layer_slots()
    assert slots[5] == (0, 0) and slots[11] == (0, 1) and slots[0] == (1, 0)


def test_layout_single_group_when_uniform_or_disabled():
    assert build_kv_cache_layout([None] * 4).num_groups == 1
    assert not build_kv_cache_layout([None] * 4).is_hybrid
    all_sliding = build_kv_cache_layout([W] * 3)
    assert all_sliding.num_groups == 1 and all_sliding.groups[0].sliding_window == W
    off = build_kv_cache_layout([None, W], hybrid=False)
    assert off.num_groups == 1 and not off.groups[0].is_windowed
    chunked = build_kv_cache_layout([None, None, None, None], [16, 16, 16, None])
    assert [g.kind for g in chunked.groups] == ["full", "chunked_local(16)"] * 1 + [
        "chunked_local(16)"] * 2
    with pytest.raises(ValueError, match="both"):
        KVCacheGroupSpec((0,), sliding_window=4, attention_chunk_size=4)


# -- windowed groups hold only the window --------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 5])
def test_sliding_group_holds_only_the_window_at_four_windows(chunk):
    mgr = hybrid_manager()
    req = make_request("a", range(10, 10 + 2 * W))
    admit(mgr, req, chunk)
    held = decode(mgr, req, 2 * W)  # context reaches 4 windows
    assert req.num_tokens == 4 * W
    bound = W // BS + 1  # the window's blocks plus one partly filled block
    full_held = [h[0] for h in held]
    sliding_held = [h[1] for h in held]
    assert full_held[-1] == 4 * W // BS  # the full group keeps everything
    assert max(sliding_held) <= bound and sliding_held[-1] <= bound
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_chunked_local_group_drops_finished_chunks():
    layout = build_kv_cache_layout([None, None], [None, 8])
    mgr = KVCacheManager(64, BS, groups=layout.groups)
    req = make_request("a", range(3))
    admit(mgr, req)
    held = decode(mgr, req, 30)
    # At 33 tokens the next query (position 32) starts a new chunk: only its block.
    for i, (_, local) in enumerate(held):
        position = req.num_tokens - len(held) + i  # the next query after step i
        assert local <= 8 // BS + 1
        assert local >= (position % 8) // BS  # never fewer than the chunk so far
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.num_usable_blocks


# -- prefix hits across groups --------------------------------------------------------------
def test_prefix_hit_serves_the_window_and_nulls_the_rest():
    mgr = hybrid_manager()
    tokens = list(range(100, 100 + 9 * BS + 1))  # 9 full blocks and one token
    a = make_request("a", tokens)
    admit(mgr, a)
    mgr.free(a)
    b = make_request("b", tokens)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 9 * BS
    full, sliding = hits
    assert len(full) == len(sliding) == 9 and not any(h.is_null for h in full)
    first_needed = (9 * BS - W + 1) // BS  # blocks before the window are not needed
    assert all(h.is_null for h in sliding[:first_needed])
    assert not any(h.is_null for h in sliding[first_needed:])
    free_before = mgr.num_free_blocks
    ids = mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert ids[1][:first_needed] == [0] * first_needed
    # b takes back its hit blocks: 9 full + the window's sliding ones, plus one new each.
    assert free_before - mgr.num_free_blocks == 9 + (9 - first_needed) + 2
    mgr.free(b)
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_prefix_hit_shrinks_to_what_the_sliding_group_still_has():
    """The sliding group's blocks were evicted at the end of the prompt but not at its
    start: the hit falls back to a length whose window the group can still serve."""
    mgr = hybrid_manager(num_blocks=64)
    tokens = list(range(200, 200 + 8 * BS + 1))
    a = make_request("a", tokens)
    admit(mgr, a, chunk=BS)  # chunk by chunk: every block of both groups gets cached
    mgr.free(a)
    sliding = mgr.group_managers[1]
    hashes = a.block_hashes
    # Evict the sliding group's blocks 4.. (the last window): only blocks 0-3 remain.
    for i in range(4, 8):
        block = mgr.block_pool.get_cached_block(sliding.cache_key(hashes[i]))
        mgr.block_pool._evict(block)
    b = make_request("b", tokens)
    hits, num_hit = mgr.get_computed_blocks(b)
    # Longest k <= 8 whose needed sliding blocks [(4k - 7) // 4, k) are all cached: 4.
    assert num_hit == 4 * BS and [len(h) for h in hits] == [4, 4]
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is not None
    mgr.free(b)
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_max_num_tokens_counts_every_group():
    one = KVCacheManager(65, BS)
    assert one.max_num_tokens == 64 * BS
    mgr = hybrid_manager(num_blocks=65, max_step_tokens=16)
    # Full group: n/4 blocks; sliding: at most ceil((8 - 1 + 16) / 4) + 1 = 7.
    assert mgr.max_num_tokens == (64 - 7) * BS
    req = make_request("long", range(mgr.max_num_tokens))
    admit(mgr, req, chunk=16)
    assert mgr.num_free_blocks >= 0
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.num_usable_blocks
