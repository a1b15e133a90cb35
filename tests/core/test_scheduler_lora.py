"""Scheduler with LoRA: at most max_loras adapters in the running batch, no starvation,
prefix-cache keys per adapter, the adapters in the stats."""

from __future__ import annotations

from engine.core.kv_cache.hashing import update_block_hashes
from engine.core.request import Request
from engine.lora.request import LoRARequest
from tests.core.test_scheduler import (
    BS,
    add,
    assert_all_free,
    make_request,
    make_scheduler,
    run_step,
)


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, ord(name), f"/adapters/{name}")


def with_lora(rid: str, adapter: str | None, prompt: int | list[int] = 8, **kw) -> Request:
    request = make_request(rid, prompt, **kw)
    request.lora_request = None if adapter is None else lora(adapter)
    return request


def running_adapters(s) -> set[int]:
    return {r.lora_int_id for r in s.running if r.lora_int_id}


def test_running_batch_never_holds_more_than_max_loras_adapters():
    s = make_scheduler(max_loras=2, budget=256)
    add(s, *(with_lora(f"r{i}", "abcd"[i % 4], max_tokens=3) for i in range(8)),
        with_lora("base", None, max_tokens=3))
    seen_steps = 0
    while s.has_unfinished_requests():
        so, _ = run_step(s)
        adapters = {s.requests[r].lora_int_id for r in so.num_scheduled_tokens
                    if r in s.requests and s.requests[r].lora_int_id}
        assert len(adapters) <= 2 and len(running_adapters(s)) <= 2
        seen_steps += 1
        assert seen_steps < 100
    assert_all_free(s)


def test_requests_without_adapter_pass_a_full_adapter_batch():
    s = make_scheduler(max_loras=1, budget=256)
    add(s, with_lora("a", "a", max_tokens=5), with_lora("b", "b", max_tokens=5),
        with_lora("base", None, max_tokens=5))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"a", "base"}


def test_a_blocked_adapter_is_not_starved_by_new_requests_of_running_adapters():
    """b waits for the slot a holds; a's later requests wait behind b instead of
    keeping a's slot busy forever."""
    s = make_scheduler(max_loras=1, budget=256)
    add(s, with_lora("a0", "a", max_tokens=2), with_lora("b0", "b", max_tokens=2))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"a0"}
    add(s, with_lora("a1", "a", max_tokens=2))  # arrives after b0
    order = []
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        so, _ = run_step(s)
        order.extend(r for r in so.num_scheduled_tokens if r not in order)
    assert order.index("b0") < order.index("a1")
    assert_all_free(s)


def test_the_same_prompt_under_another_adapter_has_other_block_hashes():
    tokens = list(range(3 * BS))
    hashes = {}
    for adapter in ("a", "b", None):
        request = with_lora(f"r{adapter}", adapter, tokens)
        hashes[adapter] = update_block_hashes(request, BS)
    assert len({tuple(h) for h in hashes.values()}) == 3
    again = update_block_hashes(with_lora("again", "a", tokens), BS)
    assert again == hashes["a"]


def test_prefix_cache_hits_only_under_the_same_adapter():
    s = make_scheduler(max_loras=2, budget=256)
    tokens = list(range(1, 4 * BS + 2))
    add(s, with_lora("first", "a", tokens, max_tokens=1))
    while s.has_unfinished_requests():
        run_step(s)
    other, same = with_lora("other", "b", tokens, max_tokens=1), with_lora("same", "a", tokens,
                                                                        max_tokens=1)
    add(s, other, same)
    run_step(s)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 4 * BS


def test_stats_name_running_and_waiting_adapters():
    s = make_scheduler(max_loras=1, budget=256)
    add(s, with_lora("a0", "a", max_tokens=4), with_lora("a1", "a", max_tokens=4),
        with_lora("b0", "b", max_tokens=4))
    run_step(s)
    stats = s.make_stats()
    assert stats.max_loras == 1
    assert stats.running_lora_adapters == {"a": 2}
    assert stats.waiting_lora_adapters == {"b": 1}
    assert make_scheduler().make_stats().max_loras == 0
