"""Attention + Mamba-2 hybrids (Bamba; Granite 4.0-H dense, with and without RoPE) end to
end against transformers' torch path, and their KV cache: blocks only for the attention
layer, states for the Mamba-2 layers."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from tests.helpers.hf_reference import cpu_llm
from tests.helpers.state_models import reference_for, run_chunked


@pytest.fixture(scope="module")
def bamba_dir(model_dir_factory):
    return model_dir_factory("bamba", max_position_embeddings=4608)


@pytest.mark.parametrize("variant", ["bamba", "granitemoehybrid", "granitemoehybrid-rope"])
def test_hybrid_matches_transformers_with_chunked_prefill(model_dir_factory, variant):
    if variant == "bamba":
        model_dir = model_dir_factory("bamba", max_position_embeddings=4608)
    elif variant == "granitemoehybrid":
        model_dir = model_dir_factory("granitemoehybrid")
    else:
        model_dir = model_dir_factory("granitemoehybrid", position_embedding_type="rope")
    runner, _ = run_chunked(model_dir, reference_for(model_dir, 1))
    assert len(runner.kv_caches) == 1 and len(runner.state_caches) == 3


def test_long_request_holds_blocks_for_the_attention_layer_only(bamba_dir):
    """4,096 prompt tokens: one KV cache tensor (1 attention layer of 4), the request's
    blocks cover its tokens once, and a block costs one layer's K and V."""
    prompt = [random.Random(2).randrange(5, 300) for _ in range(4096)]
    with cpu_llm(bamba_dir, max_model_len=4200, max_num_seqs=2,
                 max_num_batched_tokens=2048) as llm:
        core = llm.llm_engine.client.core
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        kv = core.scheduler.kv_cache_manager
        block_size = kv.block_size
        assert kv.group_usage() == [{"kind": "full", "held": 0,
                                     "peak": -(-(4096 + 1) // block_size)}]
        runner = core.executor.runner
        assert len(runner.kv_caches) == 1
        cfg = runner.model.config
        head = cfg.hidden_size // cfg.num_attention_heads
        info = core.executor.worker.kv_cache_info()
        assert info["num_layers"] == 1 and info["num_state_layers"] == 3
        assert info["block_bytes"] == 2 * block_size * cfg.num_key_value_heads * head * 4
        cache = runner.kv_caches[0]
        assert cache.numel() * cache.element_size() == info["block_bytes"] * kv.num_blocks
