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


def assert_two_ranks_equal_one(llm, dp1_outputs) -> tuple[SyncDPClient, list[int]]:
    """Two core processes whose greedy outputs are one core's, both having run prompts;
    returns the client and each rank's computed prompt tokens."""
    client = llm.llm_engine.client
    assert isinstance(client, SyncDPClient)
    assert len(set(client.pids)) == 2
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == dp1_outputs
    computed = [stats.prompt_tokens_computed_total for stats in client.get_engine_stats()]
    assert all(n > 0 for n in computed), computed  # both ranks ran prompts
    return client, computed


def test_dp2_equals_dp1_and_both_ranks_serve(llama_dir, dp1_outputs):
    with LLM(str(llama_dir), data_parallel_size=2, **OPTIONS) as llm:
        client, computed = assert_two_ranks_equal_one(llm, dp1_outputs)
        assert llm.llm_engine.client.get_stats().prompt_tokens_computed_total == sum(computed)
        assert llm.reset_prefix_cache() is True  # a utility on every rank
        assert not client.router.owner  # every request finished and left the count


def test_options_refused_by_name(llama_dir):
    with pytest.raises(ValueError, match="run on other nodes.*--data-parallel-address"):
        LLM(str(llama_dir), data_parallel_size=2, data_parallel_size_local=1, **OPTIONS)
    with pytest.raises(ValueError, match="ray places every rank itself"):
        LLM(str(llama_dir), data_parallel_size=2, data_parallel_backend="ray",
            data_parallel_size_local=1, **OPTIONS)
    lockstep = {"data_parallel_size": 2, "enable_expert_parallel": True, **OPTIONS}
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        LLM(str(llama_dir), pipeline_parallel_size=2, **lockstep)
    with pytest.raises(ValueError, match="a dead rank takes its experts"):
        LLM(str(llama_dir), data_parallel_on_rank_failure="continue", **lockstep)
    with pytest.raises(ValueError, match="async_scheduling with data parallelism"):
        LLM(str(llama_dir), async_scheduling=True, **lockstep)


# -- MoE: experts spread over the ranks (EP = DP x TP), the ranks in lockstep -----------

MOE_OPTIONS = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 96,
               "max_model_len": 128, "block_size": 8}
LOCKSTEP_CASES = [("mixtral", {}), ("deepseek-v3", {}),
                  ("mixtral", {"tensor_parallel_size": 2})]


@pytest.mark.parametrize(("variant", "extra"), LOCKSTEP_CASES,
                         ids=["mixtral-dp2", "deepseek-v3-dp2", "mixtral-dp2-tp2"])
def test_moe_dp_with_expert_parallel_equals_one_process(model_dir_factory, variant, extra):
    """Attention data parallel, experts expert parallel across every rank's workers:
    greedy outputs equal one process; a request alone on one rank still completes (the
    other rank runs dummy steps so each all-to-all finds it)."""
    from tests.entrypoints.test_llm_equivalence import _prompts
    from tests.helpers.equivalence import assert_outputs_equivalent

    path = str(model_dir_factory(variant))
    prompts = [{"prompt_token_ids": p} for p in _prompts(200, [3, 9, 17, 30, 5], seed=1)]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=2)
    with LLM(path, **MOE_OPTIONS) as ref:
        want = ref.generate(prompts, params, use_tqdm=False)
    with LLM(path, data_parallel_size=2, enable_expert_parallel=True, **extra,
             **MOE_OPTIONS) as llm:
        client = llm.llm_engine.client
        assert_outputs_equivalent(want, llm.generate(prompts, params, use_tqdm=False))
        alone = llm.generate(prompts[:1], params, use_tqdm=False)
        assert_outputs_equivalent(want[:1], alone)
        per_rank = client.get_engine_stats()
    ep_size = 2 * extra.get("tensor_parallel_size", 1)
    assert [s.moe_expert_parallel_size for s in per_rank] == [ep_size, ep_size]
    assert all(s.prompt_tokens_computed_total > 0 for s in per_rank)  # both ranks served
    assert all(s.dp_lockstep_waves_total >= 1 for s in per_rank)
    # The lone request ran on one rank; the other stepped along with nothing of its own.
    assert sum(s.dp_dummy_steps_total for s in per_rank) >= params.max_tokens - 1
