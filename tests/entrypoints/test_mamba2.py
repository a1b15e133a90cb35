"""Mamba-2 (a pure state-space model) end to end against transformers' torch path.

Greedy float32 tokens and their logprobs equal transformers' (near-ties tolerated) for
prompts longer than a prefill chunk, batched with chunked prefill (chunks continue from
the state slots; prefill and decode mix in a step) and under preemption (recompute from
scratch); the state caches' bytes per request equal the config's formula; what cannot
keep a per-request state right is refused or turned off clearly.
"""

from __future__ import annotations

import pytest

from tests.helpers.hf_reference import cpu_llm
from tests.helpers.state_models import (
    allocated_state_bytes,
    check_against,
    generate_greedy,
    reference_for,
    slots_all_free,
)


@pytest.fixture(scope="module")
def mamba2_dir(model_dir_factory):
    return model_dir_factory("mamba2")


@pytest.fixture(scope="module")
def reference(mamba2_dir):
    """Prompts (a few longer than a 16-token chunk) and transformers' greedy outputs."""
    return reference_for(mamba2_dir, 0, (45, 3, 23, 17, 31))


def test_mamba2_matches_transformers_with_chunked_prefill(mamba2_dir, reference):
    with cpu_llm(mamba2_dir, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        core = llm.llm_engine.client.core
        outs = generate_greedy(llm, reference[0])
        assert slots_all_free(core)
        assert not core.scheduler.kv_cache_manager.enable_caching  # refused for state models
        runner = core.executor.runner
        assert runner.decode_graphs is None and runner.kv_caches == []  # eager, no KV layers
        # Memory: the allocated state tensors per request equal the config's formula.
        cfg = runner.model.config
        inner = cfg.expand * cfg.hidden_size
        conv_dim = inner + 2 * cfg.n_groups * cfg.state_size
        per_layer = (conv_dim * (cfg.conv_kernel - 1)
                     + cfg.num_heads * cfg.head_dim * cfg.state_size) * 4  # float32
        allocated = allocated_state_bytes(runner)
        assert allocated == per_layer * cfg.num_hidden_layers
        assert all(t.shape[0] == 4 + 1 for layer in runner.state_caches for t in layer)
        info = core.executor.worker.kv_cache_info()
        assert info["state_bytes_per_request"] == allocated
        assert info["num_state_layers"] == cfg.num_hidden_layers
    check_against(outs, reference)


def test_mamba2_preemption_recomputes_the_state(mamba2_dir, reference):
    with cpu_llm(mamba2_dir, max_num_batched_tokens=16, max_num_seqs=3,
                 num_gpu_blocks_override=12, block_size=8, max_model_len=80) as llm:
        core = llm.llm_engine.client.core
        outs = generate_greedy(llm, reference[0])
        assert core.scheduler.num_preemptions_total > 0
        assert slots_all_free(core)
    check_against(outs, reference)


def test_mamba2_one_request_at_a_time_and_sleep_mode(mamba2_dir, reference):
    """A slot reused by the next request starts from zeros, not the previous state; sleep
    frees the state caches with the KV cache and waking allocates them again."""
    with cpu_llm(mamba2_dir, max_num_seqs=1, enable_sleep_mode=True) as llm:
        runner = llm.llm_engine.client.core.executor.runner
        outs = generate_greedy(llm, reference[0][:2])
        llm.sleep(level=1)
        assert runner.state_caches == []
        llm.wake_up()
        assert len(runner.state_caches) == runner.model.config.num_hidden_layers
        outs += generate_greedy(llm, reference[0][2:3])
    check_against(outs, (None, reference[1][:3]))


def test_mamba2_refuses_speculative_decoding(mamba2_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3}
    with pytest.raises(Exception, match="state rolled back"):
        cpu_llm(mamba2_dir, speculative_config=spec)

