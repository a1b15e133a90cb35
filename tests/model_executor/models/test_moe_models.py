"""Mixture-of-experts models against transformers, and their parallel runs against one
process: Mixtral (8 experts, top-2), Qwen2-MoE (with a sigmoid-gated shared expert),
Qwen3-MoE (a dense layer beside a MoE one), DeepSeek-V3 (MLA, grouped sigmoid routing with
a correction bias and a shared expert). Reference: transformers' greedy generation in
float32, one prompt at a time; a divergence only at a verified near-tie."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _hf_greedy, _prompts, assert_greedy_equivalent
from tests.helpers.equivalence import assert_outputs_equivalent
from tests.helpers.hf_reference import hf_logprobs, load_hf_model

MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 96,
          "max_model_len": 128, "block_size": 8}
MOE_VARIANTS = ["mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"]


def _greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                          logprobs=logprobs)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_greedy_and_logprobs_match_transformers(model_dir_factory, variant):
    path = model_dir_factory(variant)
    hf = load_hf_model(path)
    prompts = _prompts(hf.config.vocab_size, [1, 6, 19])
    with LLM(str(path), **ENGINE) as llm:
        for prompt in prompts:
            out = llm.generate({"prompt_token_ids": prompt}, _greedy(logprobs=1),
                               use_tqdm=False)[0].outputs[0]
            want = _hf_greedy(hf, prompt, MAX_TOKENS)
            assert_greedy_equivalent(hf, prompt, list(out.token_ids), want)
            if list(out.token_ids) == want:  # logprobs of the sampled tokens, as HF scores them
                ref = hf_logprobs(hf, prompt + want)[len(prompt) - 1 : -1]
                got = torch.tensor([out.logprobs[j][t].logprob
                                    for j, t in enumerate(out.token_ids)])
                expected = ref.gather(1, torch.tensor(want)[:, None]).squeeze(1)
                torch.testing.assert_close(got, expected.float(), atol=2e-4, rtol=0)


PARALLEL_CASES = [
    ("mixtral", {"tensor_parallel_size": 2}),
    ("mixtral", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen2-moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3-moe", {"pipeline_parallel_size": 2}),
    ("deepseek-v3", {"tensor_parallel_size": 2}),
    ("deepseek-v3", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
]


@pytest.mark.parametrize(("variant", "parallel"), PARALLEL_CASES,
                         ids=[f"{v}-{'-'.join(f'{k}{x}' for k, x in p.items())}"
                              for v, p in PARALLEL_CASES])
def test_moe_parallel_matches_one_process(model_dir_factory, variant, parallel):
    path = model_dir_factory(variant)
    prompts = [{"prompt_token_ids": p} for p in _prompts(200, [3, 9, 17, 30], seed=1)]
    params = _greedy(logprobs=2)
    with LLM(str(path), **ENGINE) as ref:
        want = ref.generate(prompts, params, use_tqdm=False)
        total = ref.llm_engine.client.core.executor.weights_bytes
    with LLM(str(path), **ENGINE, **parallel) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        per_rank = llm.llm_engine.client.core.executor.rank_weights_bytes
    assert_outputs_equivalent(want, got)
    if "tensor_parallel_size" in parallel:  # sharded or placed, each rank holds a part
        assert all(0.3 * total < b < 0.8 * total for b in per_rank), (per_rank, total)


def test_expert_load_counts_every_routed_choice(model_dir_factory):
    """The per-expert counts the engine reports add up to tokens x top-k x MoE layers."""
    path = model_dir_factory("qwen3-moe")  # layer 0 dense, layer 1 MoE (top-2 of 8)
    prompt = list(range(5, 15))
    with LLM(str(path), **ENGINE) as llm:
        core = llm.llm_engine.client.core
        core.get_stats()  # drop what loading did
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        load = core.get_stats().expert_load
    forwarded = len(prompt) + 3  # the last sampled token is never forwarded
    assert load is not None and len(load) == 8
    assert sum(load) == forwarded * 2 * 1


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_mla_cache_holds_one_latent_entry_per_token_and_prefix_caching_works(
        model_dir_factory, backend):
    """DeepSeek-V3's cache costs (kv_lora_rank + qk_rope_head_dim) x dtype bytes per token
    and layer (read from the allocated tensors), and a prefix-cache hit gives the same
    tokens as computing the prompt afresh, on the CPU and the Triton (interpreted) MLA
    kernels."""
    path = model_dir_factory("deepseek-v3")
    hf = load_hf_model(path)
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    prefix = list(range(7, 7 + 24))
    prompts = [{"prompt_token_ids": prefix + [40 + i, 50 + i]} for i in range(2)]
    params = _greedy(logprobs=2)
    engine = {**ENGINE, "attention_backend": backend}
    with LLM(str(path), **engine, enable_prefix_caching=False) as fresh:
        want = fresh.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), **engine) as llm:
        executor = llm.llm_engine.client.core.executor
        caches = executor.runner.kv_caches
        assert len(caches) == hf.config.num_hidden_layers
        blocks = executor.num_blocks
        for cache in caches:
            per_token = cache.numel() * cache.element_size() / (blocks * ENGINE["block_size"])
            assert per_token == latent * torch.float32.itemsize
        assert executor.worker.kv_block_bytes() == (
            hf.config.num_hidden_layers * ENGINE["block_size"] * latent * 4)
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        second = llm.generate(prompts[1:], params, use_tqdm=False)
        assert second[0].num_cached_tokens >= 16  # two full blocks of the shared prefix
    assert_outputs_equivalent(want, first + second)
