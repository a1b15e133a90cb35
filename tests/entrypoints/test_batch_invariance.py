"""Batch-invariant mode on the CPU platform: a request's tokens and logprobs are bitwise
equal alone and in any batch (1..64 requests, at any place among them, prefills mixed
with decodes), whatever the prefill chunk size, with and without speculative decoding,
at every ISA level this CPU runs (engine.core.batch_invariance).

The reference is the engine's own run of the request alone: the property is equality
across batch compositions, and each run's numbers are checked against transformers
elsewhere (test_llm_equivalence). A long prompt makes decode attention split its keys
outside the mode (2 threads, one KV head), so the splits' absence is exercised too.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.plugins.cpu import kernel_build

LEVELS = [level.name for level in kernel_build.runnable_levels()]
MAX_TOKENS = 12
# The request under test: long enough for decode key splits (>= 512 keys), repetitive
# so that n-gram speculation proposes (and verifies) tokens for it.
_rng = random.Random(0)
_PATTERN = [_rng.randrange(10, 380) for _ in range(9)]
TARGET = (_PATTERN * 70)[:600]
OTHERS = [[_rng.randrange(10, 380) for _ in range(_rng.randrange(3, 60))] for _ in range(63)]


@pytest.fixture(scope="module")
def model_dir(model_dir_factory):
    # a tied LM head runs the plain-layout GEMM; one KV head makes decode splits likely
    return model_dir_factory("llama-mqa-tied", dtype=torch.bfloat16,
                             max_position_embeddings=1024)


def _target_run(llm: LLM, others: list[list[int]], place: int) -> list:
    """The target's (token, top-5 logprobs) per step, generated at ``place`` among
    ``others``."""
    prompts = [{"prompt_token_ids": p} for p in others]
    prompts.insert(place, {"prompt_token_ids": TARGET})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            logprobs=5)
    out = llm.generate(prompts, params, use_tqdm=False)[place].outputs[0]
    return [(token, sorted((k, v.logprob) for k, v in step.items()))
            for token, step in zip(out.token_ids, out.logprobs)]


def _assert_invariant(llm: LLM, reference: list, sizes=(1, 7, 63)) -> None:
    for n in sizes:
        for place in sorted({0, n // 2, n}):
            got = _target_run(llm, OTHERS[:n], place)
            assert got == reference, f"batch of {n + 1}, target at {place}: logprobs moved"


def _engine(path, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 64)  # chunked prefill, mixed steps
    kwargs.setdefault("enable_prefix_caching", False)  # every run computes the prompt
    return LLM(str(path), device="cpu", max_model_len=1024, batch_invariant=True, **kwargs)


@pytest.mark.parametrize("level", LEVELS)
def test_logprobs_are_bitwise_equal_in_any_batch_at_every_isa_level(model_dir, level,
                                                                     monkeypatch):
    """bf16 weights: vdpbf16ps GEMMs on AVX512-BF16 (AMX off in the mode), float32
    arithmetic on bf16 weights below it; chunked prefill with a 64-token budget."""
    monkeypatch.setenv("ENGINE_CPU_ISA", level)
    with _engine(model_dir) as llm:
        info = llm.llm_engine.client.core.executor.runtime_info()
        assert info["isa_level"] == level
        assert "F.linear" not in info["gemm_kernels"], info["gemm_kernels"]
        _assert_invariant(llm, _target_run(llm, [], 0))


def test_float32_weights_are_batch_invariant(model_dir_factory):
    """The float32 GEMM paths (one row: a second accumulator chain outside the mode);
    with prefix caching, later runs read the target's cached prompt blocks."""
    path = model_dir_factory("llama-mqa-tied", max_position_embeddings=1024)
    with _engine(path, dtype="float32", enable_prefix_caching=True) as llm:
        _assert_invariant(llm, _target_run(llm, [], 0), sizes=(1, 63))


def test_chunk_sizes_and_speculative_decoding_keep_the_logprobs(model_dir):
    """Prefill in one chunk vs 16-token chunks, plain decoding vs n-gram speculation
    (verification rows scored in one forward): the same bits."""
    with _engine(model_dir, max_num_batched_tokens=1024) as llm:
        reference = _target_run(llm, [], 0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with _engine(model_dir, max_num_batched_tokens=16, speculative_config=spec) as llm:
        _assert_invariant(llm, reference, sizes=(0, 7))
        stats = llm.llm_engine.client.core.executor.runtime_info()["speculative"]
        assert stats["method"] == "ngram"


def test_the_switch_reaches_the_worker_from_the_environment(model_dir, monkeypatch):
    monkeypatch.setenv("ENGINE_BATCH_INVARIANT", "1")
    with LLM(str(model_dir), device="cpu", max_model_len=256) as llm:
        assert llm.llm_engine.config.model.batch_invariant


def test_mixture_of_experts_is_batch_invariant(model_dir_factory):
    """Experts see a different number of tokens in every batch: their GEMMs too must
    reduce a row the same way at any row count."""
    path = model_dir_factory("mixtral", dtype=torch.bfloat16, max_position_embeddings=1024)
    with _engine(path) as llm:
        _assert_invariant(llm, _target_run(llm, [], 0), sizes=(1, 63))


def test_seeded_sampling_is_batch_invariant(model_dir):
    """Random sampling with a per-request seed (top-k / top-p filtered): the same tokens
    and logprobs alone and among 63 other requests, seeded or not."""
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                            max_tokens=MAX_TOKENS, logprobs=2)

    def run(llm: LLM, n: int) -> list:
        prompts = [{"prompt_token_ids": p} for p in OTHERS[:n]] + [{"prompt_token_ids": TARGET}]
        others = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
        out = llm.generate(prompts, [others] * n + [params], use_tqdm=False)[-1].outputs[0]
        return [(t, sorted((k, v.logprob) for k, v in step.items()))
                for t, step in zip(out.token_ids, out.logprobs)]

    with _engine(model_dir) as llm:
        reference = run(llm, 0)
        assert run(llm, 63) == reference


def test_quantized_models_are_refused_clearly():
    """Quantized GEMMs change schedule with the row count: the mode refuses them at
    start-up rather than promise what it cannot keep."""
    from tests.quantization.refs import FIXTURES

    with pytest.raises(Exception, match="batch-invariant mode covers unquantized"):
        LLM(str(FIXTURES / "awq-gemm-g64"), device="cpu", max_model_len=128,
            batch_invariant=True)


@pytest.mark.parametrize("width", [384, 151936])
def test_torch_cpu_row_reductions_do_not_depend_on_the_batch(width):
    """What the mode keeps from torch on the CPU (the sampler's softmax / log-softmax,
    GemmaRMSNorm's F.rms_norm): a row's result alone equals it among 64 rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, width, generator=gen) * 4
    full = (torch.log_softmax(x, -1), x.softmax(-1),
            torch.nn.functional.rms_norm(x, (width,), None, 1e-6))
    for row in (0, 31, 63):
        one = x[row : row + 1]
        alone = (torch.log_softmax(one, -1), one.softmax(-1),
                 torch.nn.functional.rms_norm(one, (width,), None, 1e-6))
        for a, f in zip(alone, full):
            assert torch.equal(a[0], f[row])
