"""Sleep mode (vLLM's ``enable_sleep_mode``): ``LLM.sleep`` frees the KV cache (level 1)
and the weights too (level 2); ``wake_up`` brings them back and generation continues
exactly as before. Also ``pause_generation`` / ``resume_generation`` of the offline API.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine import SamplingParams
from tests.entrypoints.test_llm_equivalence import _hf_greedy, assert_greedy_equivalent
from tests.helpers.hf_reference import cpu_llm, load_hf_model

PROMPT = [5, 17, 42, 9, 33, 7]
MAX_TOKENS = 12


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def _tokens(llm, prompt=PROMPT) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _touch_kv_pool(llm) -> int:
    """Make every page of the KV pool resident (it is mapped lazily); its bytes."""
    caches = llm.llm_engine.client.core.executor.runner.kv_caches
    for cache in caches:
        cache.fill_(0.25)
    return sum(c.numel() * c.element_size() for c in caches)


@pytest.fixture(scope="module")
def sleepy(llama_dir):
    # A 256 MiB KV pool (32769 blocks), so the RSS it returns stands out from noise.
    llm = cpu_llm(llama_dir, enable_sleep_mode=True, cpu_kvcache_space_gib=1,
                  max_model_len=512, max_num_seqs=1024)
    yield llm
    llm.shutdown()


def test_level1_returns_kv_memory_and_generation_is_unchanged(sleepy, llama_dir):
    hf = load_hf_model(llama_dir)
    before = _tokens(sleepy)
    assert_greedy_equivalent(hf, PROMPT, before, _hf_greedy(hf, PROMPT, MAX_TOKENS))
    model = sleepy.llm_engine.client.core.executor.model
    pool = _touch_kv_pool(sleepy)
    assert pool >= 200 * 2**20
    rss = _rss()
    pool_blocks = sleepy.llm_engine.client.core.scheduler.kv_cache_manager.block_pool
    assert pool_blocks.cached_blocks  # the prompt's full blocks are cached
    sleepy.sleep(level=1)
    assert sleepy.is_sleeping()
    # the cached contents are gone: the prefix cache is empty, every block free
    assert not pool_blocks.cached_blocks
    assert pool_blocks.num_free_blocks == pool_blocks.num_usable_blocks
    freed = rss - _rss()
    assert freed >= 0.9 * pool, f"RSS fell by {freed >> 20} MiB of a {pool >> 20} MiB pool"
    with pytest.raises(ValueError, match="sleeping"):
        sleepy.generate("hello", _greedy(), use_tqdm=False)
    sleepy.wake_up()
    assert not sleepy.is_sleeping()
    assert sleepy.llm_engine.client.core.executor.model is model  # level 1 kept them
    assert _tokens(sleepy) == before


def test_level2_drops_and_reloads_weights_in_tag_order(sleepy):
    before = _tokens(sleepy)
    executor = sleepy.llm_engine.client.core.executor
    with torch.no_grad():  # weights a trainer changed: level 2 wake reloads the directory's
        for p in executor.model.parameters():
            p.zero_()
    pool = _touch_kv_pool(sleepy)
    rss = _rss()
    sleepy.sleep(level=2)
    assert executor.worker.model is None and executor.worker.runner is None
    assert rss - _rss() >= 0.9 * pool
    with pytest.raises(ValueError, match="weights before the KV cache"):
        sleepy.wake_up(tags=["kv_cache"])
    sleepy.wake_up(tags=["weights"])
    assert sleepy.is_sleeping() and executor.worker.model is not None
    assert executor.worker.runner is None  # no KV cache yet
    sleepy.wake_up(tags=["kv_cache"])
    assert not sleepy.is_sleeping()
    assert _tokens(sleepy) == before


def test_sleep_errors(sleepy, llama_dir):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        sleepy.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        sleepy.wake_up(tags=["optimizer"])
    sleepy.sleep(level=1)
    with pytest.raises(ValueError, match="already sleeping"):
        sleepy.sleep(level=1)
    sleepy.wake_up(tags=["weights"])
    sleepy.wake_up(tags=["weights"])  # already awake: nothing to do
    assert sleepy.is_sleeping()
    sleepy.wake_up(tags=["kv_cache"])
    # Refused while a request is unfinished (vLLM needs an idle engine).
    engine = sleepy.llm_engine
    engine.add_request("busy", {"prompt_token_ids": PROMPT}, _greedy())
    with pytest.raises(ValueError, match="unfinished"):
        sleepy.sleep(level=1)
    engine.abort_request(["busy"])
    while engine.has_unfinished_requests():
        engine.step()
    sleepy.sleep(level=1)
    sleepy.wake_up()
    assert len(_tokens(sleepy)) == MAX_TOKENS

    plain = cpu_llm(llama_dir)
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            plain.sleep()
    finally:
        plain.shutdown()


def _generate_in_thread(llm, max_tokens: int):
    result: dict = {}

    def run() -> None:
        out = llm.generate({"prompt_token_ids": PROMPT}, _greedy(max_tokens), use_tqdm=False)
        result["output"] = out[0].outputs[0]

    thread = threading.Thread(target=run)
    thread.start()
    # a few steps in: the engine core holds the request and it has decoded (waiting a
    # fixed time instead lost the race on a loaded machine, before the core had it)
    core = llm.llm_engine.client.core
    deadline = time.monotonic() + 30
    while not any(r.num_output_tokens >= 2 for r in list(core.scheduler.requests.values())):
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.001)
    return thread, result


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_generation_modes(sleepy, mode):
    max_tokens = 200
    full = list(sleepy.generate({"prompt_token_ids": PROMPT}, _greedy(max_tokens),
                                use_tqdm=False)[0].outputs[0].token_ids)
    thread, result = _generate_in_thread(sleepy, max_tokens)
    sleepy.pause_generation(mode=mode)
    assert sleepy.is_paused()
    if mode == "abort":
        thread.join(10)
        assert result["output"].finish_reason == "abort"
        assert list(result["output"].token_ids) == full[:len(result["output"].token_ids)]
        assert len(result["output"].token_ids) < max_tokens
    elif mode == "wait":  # returned once the request had run to completion
        thread.join(10)
        assert list(result["output"].token_ids) == full
    else:  # held where it was: no token while paused
        time.sleep(0.05)
        core = sleepy.llm_engine.client.core
        held = [r.num_output_tokens for r in core.scheduler.requests.values()]
        time.sleep(0.2)
        assert [r.num_output_tokens for r in core.scheduler.requests.values()] == held
        assert held and held[0] < max_tokens and thread.is_alive()
    with pytest.raises(RuntimeError, match="paused"):  # this thread would wait forever
        sleepy.generate("hi", _greedy(), use_tqdm=False)
    sleepy.resume_generation()
    thread.join(30)
    assert not thread.is_alive()
    if mode == "keep":
        assert list(result["output"].token_ids) == full
    assert _tokens(sleepy) == full[:MAX_TOKENS]


def test_tensor_parallel_ranks_sleep_and_wake(llama_dir):
    llm = cpu_llm(llama_dir, enable_sleep_mode=True, tensor_parallel_size=2)
    try:
        before = _tokens(llm)
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm) == before
        llm.sleep(level=2)
        assert llm.is_sleeping()
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        assert _tokens(llm) == before
    finally:
        llm.shutdown()


def test_hybrid_kv_cache_groups_and_draft_model_survive_sleep(model_dir_factory):
    """Sliding-window + full layers (two KV cache groups over one pool) and a draft model
    (its own KV cache on the same block ids): both caches come back mapped onto the
    layers as before, and a level-2 wake reloads the draft model too."""
    hybrid = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}
    path = model_dir_factory("qwen2", num_hidden_layers=4, **hybrid, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    draft = model_dir_factory("qwen2", num_hidden_layers=2, seed=1, **hybrid,
                              layer_types=["sliding_attention", "full_attention"])
    llm = cpu_llm(path, enable_sleep_mode=True, block_size=4, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    try:
        executor = llm.llm_engine.client.core.executor
        assert executor.kv_cache_layout.num_groups == 2
        prompt = [5, 6, 7, 8, 9, 10, 11] * 5
        before = _tokens(llm, prompt)
        for level in (1, 2):
            llm.sleep(level=level)
            assert executor.proposer is None or not executor.proposer.kv_caches
            llm.wake_up()
            assert executor.proposer.kv_caches and executor.runner.kv_caches
            assert _tokens(llm, prompt) == before
    finally:
        llm.shutdown()
