"""Mamba-1 (pure state-space) and Jamba (attention + Mamba-1 + MoE) end to end against
transformers' torch path (no mamba_ssm / causal_conv1d kernels on CPU).

Greedy float32 tokens and logprobs equal transformers' (near-ties tolerated) for prompts
longer than a 16-token prefill chunk, batched so that decodes and prefill chunks share
steps (the mixer's split path is checked to have run); the state caches' bytes per request
equal the config's formula, d_inner * (d_conv - 1) + d_inner * d_state per Mamba layer.
"""

from __future__ import annotations


from tests.helpers.state_models import reference_for, run_chunked


def _state_bytes(d_inner: int, d_conv: int, d_state: int, layers: int) -> int:
    return (d_inner * (d_conv - 1) + d_inner * d_state) * 4 * layers  # float32


def test_mamba1_matches_transformers_with_chunked_prefill(model_dir_factory, monkeypatch):
    model_dir = model_dir_factory("mamba1")
    runner, info = run_chunked(model_dir, reference_for(model_dir, 0), monkeypatch)
    cfg = runner.model.config
    assert runner.kv_caches == [] and info["num_state_layers"] == cfg.num_hidden_layers
    assert runner.model.lm_head.tied  # MambaConfig ties by default; this one says so
    assert info["state_bytes_per_request"] == _state_bytes(
        cfg.intermediate_size, cfg.conv_kernel, cfg.state_size, cfg.num_hidden_layers)


def test_jamba_matches_transformers_with_chunked_prefill(model_dir_factory, monkeypatch):
    model_dir = model_dir_factory("jamba")
    runner, info = run_chunked(model_dir, reference_for(model_dir, 1), monkeypatch)
    cfg = runner.model.config
    kinds = cfg.layers_block_type
    assert kinds == ["mamba", "attention", "mamba", "attention"]
    assert len(runner.kv_caches) == info["num_layers"] == 2  # attention layers only
    assert info["num_state_layers"] == 2
    assert info["state_bytes_per_request"] == _state_bytes(
        cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_conv, cfg.mamba_d_state, 2)
    moe = [type(layer.feed_forward).__name__ for layer in runner.model.model.layers]
    assert moe == ["SparseMoeBlock", "LlamaMLP", "LlamaMLP", "SparseMoeBlock"]


