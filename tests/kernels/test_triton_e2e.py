"""The Triton attention backend end to end, on the CPU platform with interpreted kernels.

The whole engine (scheduler, KV cache manager, model runner) runs a small random model
with ``attention_backend="triton"`` under ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py)
and must reproduce the CPU backend's greedy tokens exactly. The batch mixes prompt lengths
under a small token budget, so prefill chunks (continuing from cached keys) and decodes
share steps. Kernel launch counters prove the Triton kernels ran in every layer of every
step: an equal output from a silent fallback would not count.

The interpreter is slow: keep models tiny and ``MAX_TOKENS`` small.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine import LLM, SamplingParams
from engine.core.engine_args import ATTENTION_BACKEND_ENV
from engine.kernels import stats
from engine.kernels.triton_backend import NUM_KV_SPLITS_ENV, TritonAttentionBackend

PROMPT_LENGTHS = (3, 11, 37)
MAX_TOKENS = 5
NUM_LAYERS = 2  # tests/helpers/hf_models.py builds every variant with two layers
ENGINE_KWARGS = {  # a 16-token budget chunks the 37-token prompt over three steps
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": 64,
    "max_num_batched_tokens": 16,
    "block_size": 8,
}


@dataclass
class StepLog:
    """What the Triton backend planned for each engine step."""

    query_lens: list[list[int]] = field(default_factory=list)
    seq_lens: list[list[int]] = field(default_factory=list)
    num_kv_splits: list[int] = field(default_factory=list)

    def has_mixed_step(self) -> bool:
        """A step holding a decode (1 new token) next to a multi-token prefill chunk."""
        return any(1 in q and max(q) > 1 for q in self.query_lens)

    def has_continued_prefill(self) -> bool:
        """A multi-token chunk that attends to keys cached by an earlier step."""
        return any(
            q > 1 and s > q
            for qs, ss in zip(self.query_lens, self.seq_lens)
            for q, s in zip(qs, ss)
        )


@pytest.fixture
def step_log(monkeypatch: pytest.MonkeyPatch) -> StepLog:
    log = StepLog()
    original = TritonAttentionBackend.build_metadata

    def recording(self, batch):
        metadata = original(self, batch)
        qsl = batch.query_start_loc.tolist()
        log.query_lens.append([b - a for a, b in itertools.pairwise(qsl)])
        log.seq_lens.append(batch.seq_lens.tolist())
        log.num_kv_splits.append(metadata.num_kv_splits)
        return metadata

    monkeypatch.setattr(TritonAttentionBackend, "build_metadata", recording)
    return log


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(n)]} for n in PROMPT_LENGTHS
    ]


def _generate(path: Path, **kwargs) -> list[list[int]]:
    # min_tokens = max_tokens: every request decodes the same number of steps.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    llm = LLM(str(path), **ENGINE_KWARGS, **kwargs)
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture(scope="module")
def cpu_tokens(model_dir_factory):
    """``variant -> greedy tokens`` of the CPU attention backend (computed once each)."""
    cache: dict[str, list[list[int]]] = {}

    def get(variant: str) -> list[list[int]]:
        if variant not in cache:
            cache[variant] = _generate(model_dir_factory(variant), attention_backend="cpu")
        return cache[variant]

    return get


def _launched(before: dict[str, int]) -> dict[str, int]:
    after = stats.launches.snapshot()
    return {name: after[name] - before[name] for name in after}


def test_triton_matches_cpu_backend_in_mixed_chunked_steps(llama_dir, cpu_tokens, step_log):
    expected = cpu_tokens("llama-gqa")
    before = stats.launches.snapshot()
    got = _generate(llama_dir, attention_backend="triton")
    launched = _launched(before)

    assert got == expected
    assert step_log.has_mixed_step() and step_log.has_continued_prefill(), step_log
    per_layer_step = NUM_LAYERS * len(step_log.query_lens)
    assert launched == {
        "reshape_and_cache": per_layer_step,
        "unified_attention": per_layer_step,
        "split_kv_attention": 0,
        "split_kv_reduce": 0,
    }


def test_env_selected_backend_with_forced_split_kv(
    llama_dir, cpu_tokens, step_log, monkeypatch: pytest.MonkeyPatch
):
    expected = cpu_tokens("llama-gqa")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    monkeypatch.setenv(NUM_KV_SPLITS_ENV, "3")
    before = stats.launches.snapshot()
    got = _generate(llama_dir)  # no attention_backend argument: the env var picks it
    launched = _launched(before)

    assert got == expected
    assert step_log.num_kv_splits and set(step_log.num_kv_splits) == {3}
    assert step_log.has_mixed_step()
    per_layer_step = NUM_LAYERS * len(step_log.query_lens)
    assert launched == {
        "reshape_and_cache": per_layer_step,
        "unified_attention": 0,
        "split_kv_attention": per_layer_step,
        "split_kv_reduce": per_layer_step,
    }


@pytest.mark.parametrize(
    "variant",
    [
        "qwen3",  # GQA 4:2, head_dim 24 (not a power of two), q/k norms
        pytest.param("llama-headdim48", marks=pytest.mark.slow),  # MQA 2:1, head_dim 48
        pytest.param("mistral-sw", marks=pytest.mark.slow),  # sliding window 12 < prompts
    ],
)
def test_triton_matches_cpu_backend_per_architecture(model_dir_factory, cpu_tokens, variant):
    expected = cpu_tokens(variant)
    before = stats.launches.snapshot()
    got = _generate(model_dir_factory(variant), attention_backend="triton")
    launched = _launched(before)

    assert got == expected
    assert launched["unified_attention"] > 0
    assert launched["unified_attention"] == launched["reshape_and_cache"]


def test_triton_verifies_speculative_drafts_as_decode_rows(llama_dir, step_log, monkeypatch):
    """A verification step (each request's token plus its drafts) runs on the Triton
    backend as one decode row per token; greedy output equals the CPU backend's without
    speculation."""
    from engine.model_executor.input_batch import InputBatch

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(prompts, **kwargs):
        llm = LLM(str(llama_dir), **ENGINE_KWARGS, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.get_spec_decoding_stats()

    # Prompts that hold their own continuation, so prompt lookup has something to propose.
    seeds = [[7, 8, 9, 10] * 3, [11, 12, 13] * 3]
    first, _ = run(seeds, attention_backend="cpu")
    prompts = [seed + cont + seed for seed, cont in zip(seeds, first)]
    want, _ = run(prompts, attention_backend="cpu")
    flattened: list[int] = []
    as_decode_rows = InputBatch.as_decode_rows

    def recording(self, step):
        rows = as_decode_rows(self, step)
        flattened.append(len(rows.input_ids))
        return rows

    monkeypatch.setattr(InputBatch, "as_decode_rows", recording)
    step_log.query_lens.clear()
    got, stats = run(prompts, attention_backend="triton", speculative_config=spec)
    assert got == want
    assert stats.num_draft_tokens > 0 and flattened
    # Each verification reached the backend as that many one-token rows.
    for rows in flattened:
        assert [1] * rows in step_log.query_lens
