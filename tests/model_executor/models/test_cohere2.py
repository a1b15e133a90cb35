"""Cohere2 against transformers (float32, greedy): a tiny three-layer model, sliding
(window 8, interleaved RoPE) / full (no positional encoding) / sliding, parallel
attention + MLP blocks, bias-free LayerNorms (weights perturbed from HF's ones), a tied
head and ``logit_scale`` 0.5. Prompts are longer than the window; the reference is
transformers' cached generation (see test_gemma_models)."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.entrypoints.test_llm_equivalence import _prompts
from tests.helpers.hf_reference import load_hf_model
from tests.model_executor.models.test_gemma_models import (
    ENGINE,
    PROMPT_LENGTHS,
    assert_matches_transformers,
    check_prefix_cache_chunked_prefill_and_preemption,
    greedy,
    last_logprobs,
    perturbed_model_dir,
)


@pytest.fixture(scope="module")
def cohere2_dir(model_dir_factory, tmp_path_factory):
    return perturbed_model_dir(model_dir_factory, tmp_path_factory, "cohere2")


def test_cohere2_matches_transformers(cohere2_dir):
    hf = load_hf_model(cohere2_dir)
    prompts = _prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    with LLM(str(cohere2_dir), **ENGINE) as llm:
        model = llm.llm_engine.client.core.executor.worker.model
        assert model.kv_cache_spec().sliding_windows == (8, None, 8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out.outputs[0])


def test_the_comparison_sees_window_and_positions(cohere2_dir):
    """On the 30-token prompt transformers scores differently with a window of 7 or 9,
    and with the full layer made sliding (RoPE on it too): the match above pins the
    window and the full layer's lack of positions down."""
    prompt = _prompts(load_hf_model(cohere2_dir).config.vocab_size, PROMPT_LENGTHS)[-1]
    base = last_logprobs(cohere2_dir, prompt)

    def moved(**overrides) -> float:
        return float((last_logprobs(cohere2_dir, prompt, **overrides) - base).abs().max())

    assert moved(sliding_window=7) > 1e-3 and moved(sliding_window=9) > 1e-3
    assert moved(sliding_window=64, layer_types=["sliding_attention"] * 3) > 1e-3


def test_prefix_cache_chunked_prefill_and_preemption(cohere2_dir):
    check_prefix_cache_chunked_prefill_and_preemption(cohere2_dir)


@pytest.mark.parametrize("parallel", [
    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
    {"pipeline_parallel_size": 2},
], ids=["tp2", "pp2"])
def test_cohere2_parallel_matches_transformers(cohere2_dir, parallel):
    """Two ranks: heads and MLP columns split (TP), or layers split with the tied head on
    the stage without the embedding (PP)."""
    hf = load_hf_model(cohere2_dir)
    prompts = _prompts(hf.config.vocab_size, [3, 30], seed=1)
    with LLM(str(cohere2_dir), **ENGINE, **parallel) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out.outputs[0])
