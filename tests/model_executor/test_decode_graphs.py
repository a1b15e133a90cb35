"""Decode steps through forward graphs (model_executor.decode_graphs) against eager steps.

The reference is the same engine with ``enforce_eager=True``: the graphs replay the very
kernels the eager forward calls, so tokens and logprobs must be identical, bit for bit,
whatever the batch sizes the run goes through. (Both paths are checked against
transformers by tests/entrypoints/test_llm_equivalence.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.plugins.cpu import kernel_build, native
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


VARIANTS = [
    ("llama-gqa", {}),
    ("llama-mqa-tied", {}),
    ("qwen2", {}),
    ("mistral-sw", {}),
    ("qwen3", {"head_dim": 32}),  # per-head q/k norms (head size 24 has no C attention)
]


def narrow_weights_level() -> str:
    """The best ISA level this CPU runs without bf16 dot products: where ``--dtype auto``
    keeps a bf16 checkpoint's weights and computes in float32."""
    return [lv.name for lv in kernel_build.runnable_levels() if not lv.bf16_dot][-1]


@pytest.mark.parametrize(
    "variant,overrides,mode",
    [(v, o, "bf16") for v, o in VARIANTS]
    + [(v, o, "bf16-weights-f32-activations") for v, o in VARIANTS]
    + [("llama-gqa", {}, "f32")],
)
def test_graph_replays_equal_eager_steps_as_the_batch_shrinks(model_dir_factory, prompts,
                                                              variant, overrides, mode,
                                                              monkeypatch):
    """Every dtype mode captures: bf16 throughout, float32 throughout, and a bf16
    checkpoint computed in float32 (``--dtype auto`` on a CPU without bf16 dot products,
    forced here through $ENGINE_CPU_ISA)."""
    if mode == "bf16-weights-f32-activations":
        monkeypatch.setenv(kernel_build.ISA_ENV, narrow_weights_level())
        path, kwargs = model_dir_factory(variant, dtype=torch.bfloat16, **overrides), {
            "dtype": "auto"}
    else:
        path = model_dir_factory(variant, **overrides)
        kwargs = {"dtype": "bfloat16" if mode == "bf16" else "float32"}
    if native.load_kernels() is None:
        pytest.fail("forward graphs need the plugin's C kernels, which could not be built")
    max_tokens = [3, 9, 5, 14, 1]  # requests finish at different steps: sizes 4, 3, 2, 1
    graphs = cpu_llm(path, **kwargs)
    eager = cpu_llm(path, enforce_eager=True, **kwargs)
    if mode == "bf16-weights-f32-activations":
        model = _runner(graphs).model
        assert model.lm_head.weight.dtype == torch.bfloat16
        assert model.model.norm.weight.dtype == torch.float32
        assert _runner(graphs).kv_caches[0].dtype == torch.bfloat16
    assert _run(graphs, prompts, max_tokens) == _run(eager, prompts, max_tokens)
    decode_graphs = _runner(graphs).decode_graphs
    assert decode_graphs.captured_sizes == [1, 2, 3, 4]
    assert _runner(eager).decode_graphs is None
    # A second run replays the graphs captured by the first.
    assert _run(graphs, prompts[::-1], max_tokens) == _run(eager, prompts[::-1], max_tokens)


def test_a_forward_with_torch_ops_runs_eagerly(llama_dir, prompts, caplog, monkeypatch):
    """Linears through oneDNN (a torch op, $ENGINE_CPU_GEMM=onednn): capture is refused,
    with a log line, and the steps run eagerly with the same results."""
    monkeypatch.setenv("ENGINE_CPU_GEMM", "onednn")
    graphs = cpu_llm(llama_dir)
    with caplog.at_level("INFO", logger="engine.model_executor.decode_graphs"):
        got = _run(graphs, prompts, [4] * len(prompts))
    assert got == _run(cpu_llm(llama_dir, enforce_eager=True), prompts, [4] * len(prompts))
    decode_graphs = _runner(graphs).decode_graphs
    assert decode_graphs.captured_sizes == []
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
