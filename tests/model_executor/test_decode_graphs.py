"""Decode steps through forward graphs (model_executor.decode_graphs) against eager steps.

The reference is the same engine with ``enforce_eager=True``: the graphs replay the very
kernels the eager forward calls, so tokens and logprobs must be identical, bit for bit,
whatever the batch sizes the run goes through. (Both paths are checked against
transformers by tests/entrypoints/test_llm_equivalence.py.)
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.plugins.cpu import native
from tests.helpers.hf_reference import cpu_llm


def _runner(llm):
    return llm.llm_engine.client.core.executor.runner


def _run(llm, prompts, max_tokens):
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=2)
        for n in max_tokens
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()}
                                        for d in o.outputs[0].logprobs])
        for o in outs
    ]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(5, 250) for _ in range(n)] for n in (1, 9, 16, 30, 47)]


@pytest.mark.parametrize(
    "variant,overrides",
    [
        ("llama-gqa", {}),
        ("llama-mqa-tied", {}),
        ("qwen2", {}),
        ("mistral-sw", {}),
        ("qwen3", {"head_dim": 32}),  # per-head q/k norms (head size 24 has no C attention)
    ],
)
def test_graph_replays_equal_eager_steps_as_the_batch_shrinks(model_dir_factory, prompts,
                                                              variant, overrides):
    if native.load_kernels() is None or not native.load_kernels().has_bf16_gemm:
        pytest.skip("bf16 forwards are captured where the C GEMM runs")
    path = model_dir_factory(variant, **overrides)
    max_tokens = [3, 9, 5, 14, 1]  # requests finish at different steps: sizes 4, 3, 2, 1
    graphs = cpu_llm(path, dtype="bfloat16")
    eager = cpu_llm(path, dtype="bfloat16", enforce_eager=True)
    assert _run(graphs, prompts, max_tokens) == _run(eager, prompts, max_tokens)
    decode_graphs = _runner(graphs).decode_graphs
    assert decode_graphs.captured_sizes == [1, 2, 3, 4]
    assert _runner(eager).decode_graphs is None
    # A second run replays the graphs captured by the first.
    assert _run(graphs, prompts[::-1], max_tokens) == _run(eager, prompts[::-1], max_tokens)


def test_a_forward_with_torch_ops_runs_eagerly(llama_dir, prompts, caplog):
    """float32 linears go through oneDNN (a torch op): capture is refused, with a log line,
    and the steps run eagerly with the same results."""
    graphs = cpu_llm(llama_dir)
    with caplog.at_level("INFO", logger="engine.model_executor.decode_graphs"):
        got = _run(graphs, prompts, [4] * len(prompts))
    assert got == _run(cpu_llm(llama_dir, enforce_eager=True), prompts, [4] * len(prompts))
    decode_graphs = _runner(graphs).decode_graphs
    assert decode_graphs is None or decode_graphs.captured_sizes == []
    if decode_graphs is not None:
        assert "run eagerly" in caplog.text and "torch op" in caplog.text


def test_graphs_are_refused_for_a_batch_size_once(llama_dir, prompts, monkeypatch):
    """A size whose capture failed is not captured again: later steps of that size go
    straight to the eager forward."""
    from engine.core.interfaces import GraphCaptureError

    llm = cpu_llm(llama_dir, dtype="bfloat16")
    decode_graphs = _runner(llm).decode_graphs
    if decode_graphs is None:
        pytest.skip("no forward graphs on this machine")
    attempts = []

    def refuse(forward):
        attempts.append(1)
        raise GraphCaptureError("refused for the test")

    monkeypatch.setattr(decode_graphs.capturer, "capture", refuse)
    want = _run(cpu_llm(llama_dir, dtype="bfloat16", enforce_eager=True), prompts[:1], [6])
    assert _run(llm, prompts[:1], [6]) == want
    assert len(attempts) == 1 and decode_graphs.captured_sizes == []
