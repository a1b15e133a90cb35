"""Scheduler with images: each item is encoded once, in the step that first reaches its
tokens (also when its prompt is chunked across it); chunks stop before an item the
step's encoder budget cannot take; the encoder cache keeps items for reuse by content
and evicts unused ones; prefix-cache blocks are keyed on the image content."""

from __future__ import annotations

from engine.core.kv_cache.hashing import update_block_hashes
from engine.core.request import Request, RequestStatus
from engine.multimodal.inputs import MultiModalFeature
from tests.core.test_scheduler import (
    BS,
    add,
    assert_all_free,
    drain,
    make_request,
    make_scheduler,
    run_step,
)


def image(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length)


def with_images(rid: str, prompt: int | list[int], *features: MultiModalFeature,
                **kw) -> Request:
    request = make_request(rid, prompt, **kw)
    request.mm_features = list(features)
    return request


def encoded(so) -> dict[str, list[int]]:
    return {rid: list(v) for rid, v in so.scheduled_encoder_inputs.items()}


def test_an_image_chunked_across_steps_is_encoded_once():
    s = make_scheduler(budget=8, max_model_len=64)
    add(s, with_images("a", 24, image("img", 4, 12), max_tokens=2))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 8} and encoded(so) == {"a": [0]}
    assert s.encoder_inputs.cache.users["img"] == {"a"}  # tokens 8..15 still to come
    so, _ = run_step(s)  # still inside the image: its rows are cached, not re-encoded
    assert so.num_scheduled_tokens == {"a": 8} and encoded(so) == {}
    # All its tokens are computed: released, kept for reuse by content.
    assert "img" in s.encoder_inputs.cache.unused
    drain(s)
    assert_all_free(s)


def test_chunk_stops_before_an_item_the_encoder_budget_cannot_take():
    # Encoder budget = max(batched tokens, max_model_len) = 32 rows per step.
    s = make_scheduler(budget=32, max_model_len=32, num_blocks=64)
    add(s, with_images("a", 30, image("x", 2, 20), max_tokens=1),
        with_images("b", 30, image("y", 4, 20), max_tokens=1))
    so, _ = run_step(s)
    # a encodes x (20 rows); b's chunk must end before y (only 12 rows of budget left)
    # and the token budget leaves b the 2 tokens before it.
    assert encoded(so) == {"a": [0]}
    assert so.num_scheduled_tokens["a"] == 30
    assert so.num_scheduled_tokens.get("b", 0) <= 2
    so, _ = run_step(s)
    assert encoded(so) == {"b": [0]}
    drain(s)
    assert_all_free(s)


def test_same_content_in_another_request_reuses_the_cached_rows():
    s = make_scheduler(budget=64, caching=False)
    add(s, with_images("a", 20, image("same", 2, 10), max_tokens=3),
        with_images("b", 20, image("same", 5, 10), max_tokens=3))
    so, _ = run_step(s)
    assert encoded(so) == {"a": [0]}  # b uses what a's step encodes
    assert s.encoder_inputs.cache.users["same"] == set()  # both done with it after step 1
    drain(s)
    add(s, with_images("c", 20, image("same", 2, 10), max_tokens=1))
    so, _ = run_step(s)
    assert encoded(so) == {}  # still cached: no encoding
    drain(s)
    assert_all_free(s)


def test_unused_entries_are_evicted_for_new_ones_and_the_worker_told():
    s = make_scheduler(budget=16, max_model_len=24, caching=False)  # cache: 24 rows
    add(s, with_images("a", 20, image("p", 0, 16), max_tokens=1))
    drain(s)
    add(s, with_images("b", 20, image("q", 0, 16), max_tokens=1))
    so, _ = run_step(s)
    assert encoded(so) == {"b": [0]} and so.free_encoder_ids == ["p"]
    drain(s)
    assert_all_free(s)


def test_preempted_and_aborted_requests_release_their_items():
    s = make_scheduler(budget=8, max_model_len=64)
    add(s, with_images("a", 24, image("img", 4, 12), max_tokens=2))
    run_step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.encoder_inputs.cache.users["img"] == set()
    assert "img" in s.encoder_inputs.cache.unused
    assert_all_free(s)


def test_prefix_cache_hits_depend_on_the_image_content():
    s = make_scheduler(budget=64)
    tokens = list(range(100, 116))  # the same text (placeholders included) each time
    first = with_images("a", tokens, image("cat", 4, 8), max_tokens=1)
    add(s, first)
    drain(s)
    same = with_images("b", tokens, image("cat", 4, 8), max_tokens=1)
    other = with_images("c", tokens, image("dog", 4, 8), max_tokens=1)
    assert update_block_hashes(same, BS) == update_block_hashes(first, BS)
    hashes = update_block_hashes(other, BS)
    assert hashes[0] == first.block_hashes[0]  # block 0 holds no image token
    assert hashes[1] != first.block_hashes[1]
    add(s, same)
    so, outs = run_step(s)
    assert outs["b"].num_cached_tokens == 12 and encoded(so) == {}  # hit ends past the image
    add(s, other)
    so, outs = run_step(s)
    assert outs["c"].num_cached_tokens == 4 and encoded(so) == {"c": [0]}
    drain(s)
    assert_all_free(s)


def whole_items_scheduler(**kw):
    from engine.core.config import CacheConfig, SchedulerConfig
    from engine.core.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=kw.pop("budget", 8),
                             max_model_len=64, disable_chunked_mm_input=True, **kw)
    return Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=True), 64)


def test_whole_items_a_chunk_stops_before_an_image_it_cannot_finish():
    """--disable-chunked-mm-input (Gemma 3): each image's tokens run in one step."""
    s = whole_items_scheduler(budget=8)
    add(s, with_images("a", 20, image("img", 5, 6), max_tokens=1))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 5} and encoded(so) == {}  # stops before it
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 8} and encoded(so) == {"a": [0]}  # 5..12
    drain(s)
    assert_all_free(s)


def test_whole_items_an_image_longer_than_a_step_is_refused():
    s = whole_items_scheduler(budget=8)
    try:
        add(s, with_images("a", 20, image("img", 2, 9)))
    except ValueError as exc:
        assert "does not fit one step of 8 tokens" in str(exc)
    else:
        raise AssertionError("an image longer than a step was accepted")
    s = whole_items_scheduler(budget=16, long_prefill_token_threshold=4)
    try:
        add(s, with_images("b", 20, image("img", 2, 5)))
    except ValueError as exc:
        assert "one step of 4 tokens" in str(exc)
    else:
        raise AssertionError("an image longer than the prefill threshold was accepted")
