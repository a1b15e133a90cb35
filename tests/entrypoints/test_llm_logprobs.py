"""Prompt and sampled-token logprobs equal transformers' float32 ``log_softmax``.

For every scored position the reference is the float64 ``log_softmax`` of transformers'
float32 logits over the same tokens. Checked per position: the scored token's logprob
(within 1e-4) and rank, and the top-k ids with ranks 1..k (ids must agree exactly unless
the k-th and (k+1)-th reference values are a near-tie).
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.core.outputs import Logprob
from tests.helpers.hf_models import SAMPLE_TEXT
from tests.helpers.hf_reference import cpu_llm, hf_logprobs, load_hf_model

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(llama_dir):
    return load_hf_model(llama_dir)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return cpu_llm(llama_dir)


@pytest.fixture(scope="module")
def chunked_llm(llama_dir):
    """A token budget of 8: any longer prompt is prefilled over several steps."""
    return cpu_llm(llama_dir, max_num_batched_tokens=8, enable_chunked_prefill=True)


def _rank_bounds(ref_row: torch.Tensor, value: float) -> tuple[int, int]:
    """The ranks ``value`` may have in ``ref_row`` given the tolerance (ties either way)."""
    return 1 + int((ref_row > value + TOL).sum()), int((ref_row > value - TOL).sum())


def assert_position(entry: dict[int, Logprob], ref_row: torch.Tensor, token: int, k: int) -> None:
    """One position's logprobs dict against the reference row."""
    want = float(ref_row[token])
    assert abs(entry[token].logprob - want) < TOL, (token, entry[token].logprob, want)
    lo, hi = _rank_bounds(ref_row, want)
    assert lo <= entry[token].rank <= hi, (token, entry[token].rank, lo, hi)
    k = ref_row.numel() if k == -1 else k
    top = {tid: lp for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k}
    assert sorted(lp.rank for lp in top.values()) == list(range(1, k + 1))
    assert set(entry) == set(top) | {token}  # nothing else is reported
    ref_sorted = ref_row.sort(descending=True).values
    for tid, lp in top.items():
        assert abs(lp.logprob - float(ref_row[tid])) < TOL, (tid, lp.logprob, float(ref_row[tid]))
        assert abs(float(ref_sorted[lp.rank - 1]) - lp.logprob) < TOL, (tid, lp.rank)
    if 0 < k < ref_row.numel() and float(ref_sorted[k - 1] - ref_sorted[k]) > TOL:
        assert set(top) == set(ref_row.topk(k).indices.tolist())


def _prompt(llm, num_tokens: int) -> list[int]:
    ids = llm.get_tokenizer().encode(SAMPLE_TEXT)
    assert len(ids) >= num_tokens
    return list(ids[:num_tokens])


def _assert_prompt_logprobs(hf, prompt: list[int], prompt_logprobs, k: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    ref = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        assert_position(prompt_logprobs[p], ref[p - 1], prompt[p], k)


@pytest.mark.parametrize("k", [0, 5, -1])
def test_prompt_logprobs_match_transformers(llm, hf, k):
    prompt = _prompt(llm, 21)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    _assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, k)


def test_one_token_prompt_has_only_the_none_entry(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=1)
    out = llm.generate({"prompt_token_ids": [7]}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert len(out.outputs[0].logprobs) == 2


def test_chunked_prompt_logprobs_are_assembled_across_chunks(chunked_llm, hf):
    prompt = _prompt(chunked_llm, 45)  # 6 chunks under a budget of 8 tokens
    assert chunked_llm.llm_engine.config.scheduler.max_num_batched_tokens < len(prompt)
    # Warm the prefix cache first: prompt logprobs must still score every prompt token.
    chunked_llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4)
    out = chunked_llm.generate(prompt, params, use_tqdm=False)[0]
    _assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 4)


def test_prompt_logprobs_reported_once_with_n_samples(llm, hf):
    prompt = _prompt(llm, 18)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 2)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=-1),
        SamplingParams(temperature=1.0, seed=11, max_tokens=8, min_tokens=8, logprobs=5),
        # Logprobs are of the raw model distribution, before temperature / top-k.
        SamplingParams(temperature=0.6, top_k=4, seed=5, max_tokens=8, min_tokens=8, logprobs=2),
    ],
    ids=["greedy", "chosen-only", "whole-vocab", "random", "temperature-top-k"],
)
def test_sampled_logprobs_match_transformers(llm, hf, params):
    prompt = _prompt(llm, 12)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    assert len(tokens) == len(out.logprobs) == params.max_tokens
    ref = hf_logprobs(hf, prompt + tokens)
    for j, (token, entry) in enumerate(zip(tokens, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert_position(entry, row, token, params.logprobs)
        if params.temperature == 0.0:
            assert entry[token].rank == 1 or float(row.max() - row[token]) < TOL
    chosen = sum(entry[t].logprob for t, entry in zip(tokens, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(chosen, abs=1e-4)


def test_prompt_logprobs_survive_preemption_mid_prefill(llama_dir, hf):
    """A long prompt-logprobs request is preempted while still prefilling (a decoding
    request needs its blocks) and recomputed later; each prompt token is reported once."""
    llm = cpu_llm(llama_dir, num_gpu_blocks_override=12, block_size=8, max_model_len=80,
                  max_num_batched_tokens=16)
    tokens = llm.get_tokenizer().encode(SAMPLE_TEXT * 2)
    decoding, prompt = list(tokens[:40]), list(tokens[40:110])
    outputs = llm.generate(
        [decoding, prompt],
        [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)],
        use_tqdm=False,
    )
    assert llm.llm_engine.client.core.scheduler.num_preemptions_total > 0
    _assert_prompt_logprobs(hf, prompt, outputs[1].prompt_logprobs, 2)
