"""Mamba-1 (pure state-space) and Jamba (attention + Mamba-1 + MoE) end to end against
transformers' torch path (no mamba_ssm / causal_conv1d kernels on CPU).

Greedy float32 tokens and logprobs equal transformers' (near-ties tolerated) for prompts
longer than a 16-token prefill chunk, batched so that decodes and prefill chunks share
steps (the mixer's split path is checked to have run); the state caches' bytes per request
equal the config's formula, d_inner * (d_conv - 1) + d_inner * d_state per Mamba layer.
"""

from __future__ import annotations

import random

import pytest

from engine.model_executor.layers import mamba1
from tests.entrypoints.test_mamba2 import _check, _generate, _hf_greedy, _slots_all_free
from tests.helpers.hf_reference import cpu_llm, load_hf_model

MAX_TOKENS = 10


def _reference(model_dir, seed: int):
    hf = load_hf_model(model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, hf.config.vocab_size) for _ in range(n)]
               for n in (41, 5, 26, 18)]
    return prompts, [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def _count_mixed_steps(monkeypatch) -> list[int]:
    """Counts the mixer calls on steps that mix decodes with prefill chunks."""
    mixed = [0]
    real = mamba1.by_parts

    def spy(md, *args):
        mixed[0] += bool(md.parts)
        return real(md, *args)

    monkeypatch.setattr(mamba1, "by_parts", spy)
    return mixed


def _state_bytes(d_inner: int, d_conv: int, d_state: int, layers: int) -> int:
    return (d_inner * (d_conv - 1) + d_inner * d_state) * 4 * layers  # float32


def _allocated_state_bytes(runner) -> int:
    return sum(t[0].numel() * t.element_size() for layer in runner.state_caches for t in layer)


def _run(model_dir, reference, monkeypatch):
    mixed = _count_mixed_steps(monkeypatch)
    with cpu_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=3) as llm:
        core = llm.llm_engine.client.core
        outs = _generate(llm, reference[0])
        assert _slots_all_free(core)
        assert mixed[0] > 0
        runner = core.executor.runner
        info = core.executor.worker.kv_cache_info()
        assert info["state_bytes_per_request"] == _allocated_state_bytes(runner)
    _check(outs, reference)
    return runner, info


def test_mamba1_matches_transformers_with_chunked_prefill(model_dir_factory, monkeypatch):
    model_dir = model_dir_factory("mamba1")
    runner, info = _run(model_dir, _reference(model_dir, 0), monkeypatch)
    cfg = runner.model.config
    assert runner.kv_caches == [] and info["num_state_layers"] == cfg.num_hidden_layers
    assert runner.model.lm_head.tied  # MambaConfig ties by default; this one says so
    assert info["state_bytes_per_request"] == _state_bytes(
        cfg.intermediate_size, cfg.conv_kernel, cfg.state_size, cfg.num_hidden_layers)


def test_jamba_matches_transformers_with_chunked_prefill(model_dir_factory, monkeypatch):
    model_dir = model_dir_factory("jamba")
    runner, info = _run(model_dir, _reference(model_dir, 1), monkeypatch)
    cfg = runner.model.config
    kinds = cfg.layers_block_type
    assert kinds == ["mamba", "attention", "mamba", "attention"]
    assert len(runner.kv_caches) == info["num_layers"] == 2  # attention layers only
    assert info["num_state_layers"] == 2
    assert info["state_bytes_per_request"] == _state_bytes(
        cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_conv, cfg.mamba_d_state, 2)
    moe = [type(layer.feed_forward).__name__ for layer in runner.model.model.layers]
    assert moe == ["SparseMoeBlock", "LlamaMLP", "LlamaMLP", "SparseMoeBlock"]


@pytest.mark.parametrize("variant", ["mamba1", "jamba"])
def test_tensor_parallel_is_refused(model_dir_factory, variant):
    with pytest.raises(Exception, match="ForCausalLM does not support tensor parallelism"):
        cpu_llm(model_dir_factory(variant), tensor_parallel_size=2)
