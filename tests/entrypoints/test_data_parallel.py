"""Data parallelism offline: ``LLM(data_parallel_size=2)`` runs two engine-core processes
(each a whole replica) behind one front end; greedy outputs equal one core's and both
ranks serve (their own stats say so)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.dp_client import SyncDPClient

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4",
           "Once upon a time", "The quick brown fox", "In a galaxy far away",
           "def fib(n):", "Data parallelism means"]
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 128,
           "cpu_kvcache_space_gib": 0.05, "enforce_eager": True}


@pytest.fixture(scope="module")
def dp1_outputs(llama_dir):
    with LLM(str(llama_dir), **OPTIONS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False)]


def test_dp2_equals_dp1_and_both_ranks_serve(llama_dir, dp1_outputs):
    with LLM(str(llama_dir), data_parallel_size=2, **OPTIONS) as llm:
        client = llm.llm_engine.client
        assert isinstance(client, SyncDPClient)
        assert len(set(client.pids)) == 2
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == dp1_outputs
        per_rank = client.get_engine_stats()
        computed = [stats.prompt_tokens_computed_total for stats in per_rank]
        assert all(n > 0 for n in computed), computed  # both ranks ran prompts
        assert llm.llm_engine.client.get_stats().prompt_tokens_computed_total == sum(computed)
        assert llm.reset_prefix_cache() is True  # a utility on every rank
        assert not client.router.owner  # every request finished and left the count


def test_options_refused_by_name(llama_dir):
    with pytest.raises(ValueError, match="multi-node data parallelism"):
        LLM(str(llama_dir), data_parallel_size=2, data_parallel_size_local=1, **OPTIONS)
    with pytest.raises(ValueError, match="'ray'.*not built yet"):
        LLM(str(llama_dir), data_parallel_size=2, data_parallel_backend="ray", **OPTIONS)
    with pytest.raises(ValueError, match="lockstep coordinator"):
        LLM(str(llama_dir), data_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
