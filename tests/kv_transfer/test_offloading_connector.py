"""The KV offloading tier (``--kv-offloading-size``, vLLM's OffloadingConnector): prefix
blocks evicted from a tiny KV cache are stored in a bounded host tier and loaded back on
a revisit (outputs equal, the prompt not recomputed), LRU in the tier, alongside another
connector (MultiConnector), and a preempted request resumes from the tier."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.config import KVTransferConfig
from engine.kv_transfer.offloading import OffloadingConnector, TierIndex

BLOCK = 16
PROMPT_LEN = 64  # 4 blocks
# 12 blocks (11 usable): three prompts of 4 blocks do not fit; the first is evicted.
SMALL_CACHE = {"dtype": "float32", "max_model_len": 128, "block_size": BLOCK,
               "num_gpu_blocks_override": 12, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)] for i in range(5)]


def _one(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _core(llm: LLM):
    return llm.llm_engine.client.core


def _fill_then_revisit(llm: LLM) -> tuple[list[list[int]], list[int], object]:
    """Every prompt once (the first falls out of the KV cache), then the first again;
    the revisit's scheduler stats."""
    firsts = [_one(llm, p) for p in PROMPTS]
    scheduler = _core(llm).scheduler
    scheduler.make_stats()  # reset the interval counters
    again = _one(llm, PROMPTS[0])
    return firsts, again, scheduler.make_stats()


@pytest.fixture(scope="module")
def path(model_dir_factory):
    return model_dir_factory("llama-gqa")


@pytest.fixture(scope="module")
def reference(path):
    """No tier: the revisit recomputes the whole prompt."""
    with LLM(str(path), **SMALL_CACHE) as llm:
        return _fill_then_revisit(llm)


def test_revisit_loads_from_the_tier_and_equals(path, reference):
    firsts_ref, again_ref, stats_ref = reference
    assert again_ref == firsts_ref[0]
    assert stats_ref.prompt_tokens_computed == PROMPT_LEN  # evicted: all recomputed
    with LLM(str(path), kv_offloading_size=0.01, **SMALL_CACHE) as llm:
        connector = _core(llm).kv_connector
        assert isinstance(connector, OffloadingConnector)
        firsts, again, stats = _fill_then_revisit(llm)
        worker = _core(llm).executor.runner.kv_connector
        pool_shape = tuple(worker._pool.shape)
        # Stored and loaded whole blocks of every layer.
        kv = stats.kv_transfer
        assert kv.blocks_sent > 0 and kv.blocks_received == PROMPT_LEN // BLOCK
        assert kv.bytes_received == kv.blocks_received * worker._slot_bytes
    assert firsts == firsts_ref and again == firsts[0]
    assert stats.prompt_tokens_computed < 0.1 * PROMPT_LEN
    assert stats.external_tokens_loaded == PROMPT_LEN - 1
    # 0.01 GiB of blocks of 2 layers x 16 tokens x 2 KV heads x 16 x 2 (K, V) x 4 bytes.
    assert pool_shape[0] == int(0.01 * 2**30) // worker._slot_bytes


def test_tier_is_lru_and_bounded(path, reference):
    index = TierIndex(3)
    slots = [index.store(h) for h in (b"a", b"b", b"c")]
    assert sorted(slots) == [0, 1, 2]
    assert index.store(b"a") is None  # already there: refreshed, not copied again
    assert index.store(b"d") == slots[1]  # b was the least recently used
    assert index.hashes() == [b"c", b"a", b"d"] and len(index) == 3
    index.pin(index.lookup(b"c"))
    assert index.store(b"e") == slots[0]  # c is pinned: a goes
    index.pin(index.lookup(b"d"))
    index.pin(index.lookup(b"e"))
    assert index.store(b"f") is None and index.dropped == 1  # all pinned: not stored
    index.unpin_all()
    assert index.store(b"f") is not None and len(index) == 3

    # End to end: a tier of 4 blocks holds only the last evicted prompt, never more.
    firsts_ref = reference[0]
    config = {"kv_connector": "OffloadingConnector",
              "kv_connector_extra_config": {"num_cpu_blocks": 4}}
    with LLM(str(path), kv_transfer_config=config, **SMALL_CACHE) as llm:
        firsts = [_one(llm, p) for p in PROMPTS]
        tier = _core(llm).kv_connector.index
        assert len(tier) == tier.capacity == 4 and tier.evictions > 0
        assert _core(llm).executor.runner.kv_connector._pool.shape[0] == 4
        scheduler = _core(llm).scheduler
        scheduler.make_stats()
        assert _one(llm, PROMPTS[0]) == firsts[0]  # long gone from the tier: recomputed
        assert scheduler.make_stats().prompt_tokens_computed == PROMPT_LEN
    assert firsts == firsts_ref


def test_multi_connector_with_shared_storage(path, reference, tmp_path):
    """Shared storage as a producer only (it saves, never loads): the revisit's blocks come
    from the offloading tier, the second child of the MultiConnector."""
    firsts_ref = reference[0]
    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    with LLM(str(path), kv_transfer_config=config, kv_offloading_size=0.01,
             **SMALL_CACHE) as llm:
        connector = _core(llm).kv_connector
        assert [c.name for c in connector.connectors] == ["SharedStorageConnector",
                                                          "OffloadingConnector"]
        firsts, again, stats = _fill_then_revisit(llm)
    assert firsts == firsts_ref and again == firsts[0]
    assert stats.prompt_tokens_computed < 0.1 * PROMPT_LEN
    assert len(list((tmp_path / "kv" / "blocks").glob("*.kv"))) >= len(PROMPTS) * 4


def test_offloading_size_config():
    assert KVTransferConfig.with_offloading(None, None) is None
    alone = KVTransferConfig.with_offloading(None, 2)
    assert alone.kv_connector == "OffloadingConnector"
    base = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer")
    multi = KVTransferConfig.with_offloading(base, 1.5)
    assert multi.kv_connector == "MultiConnector" and multi.engine_id == base.engine_id
    children = multi.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "OffloadingConnector"]
    assert children[1]["kv_connector_extra_config"] == {"kv_offloading_size": 1.5}
    with pytest.raises(ValueError, match="must be > 0"):
        KVTransferConfig.with_offloading(None, 0)


def test_preempted_request_resumes_from_the_tier(path):
    """Two requests that outgrow the cache together: one is preempted; its computed
    blocks are evicted into the tier and its resume loads them (less recomputed than
    without the tier), with the same greedy tokens."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]

    def run(**kw):
        with LLM(str(path), **SMALL_CACHE, **kw) as llm:
            scheduler = _core(llm).scheduler
            schedule, computed = scheduler.schedule, []

            def counting_schedule():  # every token the model runs, outputs included
                out = schedule()
                computed.append(out.total_num_scheduled_tokens)
                return out

            scheduler.schedule = counting_schedule
            outs = llm.generate(prompts, long, use_tqdm=False)
            stats = scheduler.make_stats()
            return [list(o.outputs[0].token_ids) for o in outs], stats, sum(computed)

    ref, ref_stats, ref_computed = run()
    outs, stats, computed = run(kv_offloading_size=0.01)
    assert ref_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert outs == ref
    # The victim's evicted blocks (its generated tokens' too) came back from the tier.
    assert stats.external_tokens_loaded >= BLOCK
    assert computed <= ref_computed - stats.external_tokens_loaded + BLOCK
