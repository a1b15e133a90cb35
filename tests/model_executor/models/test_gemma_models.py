"""Gemma, Gemma 2 and Gemma 3 (text) against transformers (float32, greedy).

Tiny random models (tests/helpers/hf_models.py) with every norm weight perturbed away
from HF's zero init, so ``x * (1 + w)`` is exercised: Gemma 2 and 3 have three layers,
sliding (window 8) and full ones, with soft-caps small enough to bite (attention 5,
final 3); Gemma 3 has a local and a global RoPE (linear factor 2) and q/k norms. Prompts
are longer than the window and generation runs further past it.

The reference is transformers' own cached generation (``generate`` with its per-step
logits), so each engine token is compared with what transformers decodes one token at a
time (its sliding-window cache included). A divergence is tolerated only at a verified
near-tie, and the sampled tokens' logprobs must match up to it."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _prompts
from tests.helpers.hf_reference import (
    assert_matches_reference,
    hf_generate_with_logprobs,
    load_hf_model,
    sampled_logprobs,
)

MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 96,
          "max_model_len": 128, "block_size": 8}
PROMPT_LENGTHS = [3, 19, 30]  # the window is 8
WINDOWS = {"gemma": (None, None), "gemma2": (8, None, 8), "gemma3": (8, 8, None)}


def perturbed_model_dir(model_dir_factory, tmp_path_factory, variant: str) -> Path:
    """``variant``'s model with N(0, 0.3) added to every norm weight (HF initializes
    Gemma's to zero and Cohere's to one, which would hide how a norm uses its weight)."""
    src = model_dir_factory(variant)
    dst = tmp_path_factory.mktemp(f"{variant}-norms")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = load_hf_model(dst)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def greedy(logprobs: int | None = 1, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens,
                          logprobs=logprobs)


def assert_matches_transformers(hf, prompt: list[int], out, tie: float = 1e-3) -> None:
    """The engine's tokens equal transformers' up to a verified near-tie (top-2 within
    ``tie`` in its step distribution); the sampled tokens' logprobs equal until then."""
    want, ref = hf_generate_with_logprobs(hf, prompt, len(out.token_ids))
    assert_matches_reference(list(out.token_ids), sampled_logprobs(out), want, ref, tie)


@torch.inference_mode()
def last_logprobs(path: Path, prompt: list[int], **config_overrides) -> torch.Tensor:
    hf = load_hf_model_with(path, **config_overrides)
    return hf(torch.tensor([prompt])).logits[0, -1].double().log_softmax(-1)


def load_hf_model_with(path: Path, **config_overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                **config_overrides).eval()


@pytest.fixture(scope="module")
def gemma_dir(model_dir_factory, tmp_path_factory):
    dirs: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in dirs:
            dirs[variant] = perturbed_model_dir(model_dir_factory, tmp_path_factory, variant)
        return dirs[variant]

    return get


@pytest.mark.parametrize("variant", ["gemma", "gemma2", "gemma3"])
def test_gemma_matches_transformers(gemma_dir, variant):
    path = gemma_dir(variant)
    hf = load_hf_model(path)
    prompts = _prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    with LLM(str(path), **ENGINE) as llm:
        model = llm.llm_engine.client.core.executor.worker.model
        assert model.kv_cache_spec().sliding_windows == WINDOWS[variant]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out.outputs[0])


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_the_comparison_sees_window_and_soft_caps(gemma_dir, variant):
    """The matches above pin the window and the caps down: on the 30-token prompt,
    transformers with a window of 7 or 9 or without the caps scores differently. Gemma 3
    is the exception for the attention cap, which transformers reads but never applies
    (and the engine ignores too)."""
    path = gemma_dir(variant)
    prompt = _prompts(load_hf_model(path).config.vocab_size, PROMPT_LENGTHS)[-1]
    base = last_logprobs(path, prompt)

    def moved(**overrides) -> float:
        return float((last_logprobs(path, prompt, **overrides) - base).abs().max())

    assert moved(sliding_window=7) > 1e-3 and moved(sliding_window=9) > 1e-3
    assert moved(final_logit_softcapping=None) > 1e-3
    if variant == "gemma2":
        assert moved(attn_logit_softcapping=None) > 1e-3
    else:
        assert moved(attn_logit_softcapping=None) == 0.0


def check_prefix_cache_chunked_prefill_and_preemption(path: Path, num_blocks: int = 17
                                                      ) -> None:
    """A shared three-block prefix, a 16-token step budget (prompts are prefilled in
    chunks, across the window) and a pool too small for the batch (requests are preempted
    and recomputed; ``num_blocks``: the smallest pool one sequence fits, every KV cache
    group's table counting): outputs still equal transformers'."""
    hf = load_hf_model(path)
    prefix = _prompts(hf.config.vocab_size, [24], seed=3)[0]
    tails = _prompts(hf.config.vocab_size, [6, 9, 12, 14], seed=4)
    prompts = [prefix + t for t in tails]
    engine = {**ENGINE, "num_gpu_blocks_override": num_blocks, "max_model_len": 64,
              "max_num_batched_tokens": 16,
              "enable_chunked_prefill": True, "enable_prefix_caching": True}
    with LLM(str(path), **engine) as llm:
        core = llm.llm_engine.client.core
        first = llm.generate({"prompt_token_ids": prompts[0]}, greedy(), use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(),
                            use_tqdm=False)
        preemptions = core.scheduler.num_preemptions_total
    assert preemptions > 0
    assert max(o.num_cached_tokens for o in rest) >= 16, [o.num_cached_tokens for o in rest]
    for prompt, out in zip(prompts, first + rest):
        assert_matches_transformers(hf, prompt, out.outputs[0])


@pytest.mark.parametrize(("variant", "num_blocks"), [("gemma", 9), ("gemma2", 17),
                                                     ("gemma3", 17)])
def test_prefix_cache_chunked_prefill_and_preemption(gemma_dir, variant, num_blocks):
    check_prefix_cache_chunked_prefill_and_preemption(gemma_dir(variant), num_blocks)


@pytest.mark.parametrize(("variant", "parallel"),
                         [("gemma3", {"tensor_parallel_size": 2}),
                          pytest.param("gemma2", {"pipeline_parallel_size": 2},
                                       marks=pytest.mark.slow)],
                         ids=["gemma3-tp2", "gemma2-pp2"])
def test_gemma_parallel_matches_transformers(gemma_dir, variant, parallel):
    """Two ranks: heads (with their q/k norms) and MLP columns split (TP), or the layers
    split with the residual stream handed between stages (PP)."""
    path = gemma_dir(variant)
    hf = load_hf_model(path)
    prompts = _prompts(hf.config.vocab_size, [3, 30], seed=1)
    with LLM(str(path), **ENGINE, **parallel) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out.outputs[0])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 "
                           "(ci/test.sh sets it)")
def test_gemma2_on_the_triton_backend_matches_transformers(gemma_dir):
    """Soft-capped scores and a sliding window through the Triton attention kernels
    (interpreted on CPU), a 16-token budget chunking the 19-token prompt."""
    path = gemma_dir("gemma2")
    hf = load_hf_model(path)
    prompt = _prompts(hf.config.vocab_size, [19], seed=2)[0]
    engine = {**ENGINE, "attention_backend": "triton", "max_num_batched_tokens": 16,
              "enable_chunked_prefill": True}
    with LLM(str(path), **engine) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=6),
                           use_tqdm=False)[0]
    assert_matches_transformers(hf, prompt, out.outputs[0])
