"""Qwen3-Next (gated DeltaNet + gated full attention + MoE with a shared expert) end to
end against transformers' torch path (no flash-linear-attention / causal_conv1d here).

Greedy float32 tokens and logprobs equal transformers' (near-ties tolerated) for prompts
longer than a 16-token prefill chunk, batched so that decodes and prefill chunks share
steps (the mixer's split path is checked to have run), with every state slot free once
the requests finish (the Mamba-1 / Jamba test's run); KV caches exist for the one
full-attention layer only; the state bytes per request equal the config's formula,
conv_dim * (kernel - 1) in the model dtype plus Hv * head_k_dim * head_v_dim in float32
per DeltaNet layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model_executor.models.bamba import BambaForCausalLM
from engine.model_executor.models.qwen3_next import Qwen3NextForCausalLM, layer_kinds
from tests.helpers.state_models import reference_for, run_chunked


def _perturb_norms(model_dir) -> None:
    """Random norm weights and dt_bias (transformers initializes them to 0, 1 and 1), so
    the zero-centred norms, the gated norm and the decay's bias are all exercised."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(("norm.weight", "dt_bias")):
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def _state_bytes(cfg) -> int:
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    conv = conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4  # model dtype: float32 here
    return (conv + recurrent * 4) * cfg.layer_types.count("linear_attention")


def test_qwen3_next_matches_transformers_with_chunked_prefill(model_dir_factory,
                                                              monkeypatch):
    model_dir = model_dir_factory("qwen3_next")
    _perturb_norms(model_dir)
    runner, info = run_chunked(model_dir, reference_for(model_dir, 0), monkeypatch)
    cfg = runner.model.config
    assert len(runner.kv_caches) == info["num_layers"] == 1  # the full-attention layer
    assert info["num_state_layers"] == 3
    assert info["state_bytes_per_request"] == _state_bytes(cfg)
    kinds = [type(layer.mlp).__name__ for layer in runner.model.model.layers]
    assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock", "SparseMoeBlock"]


def test_mtp_weights_are_skipped(monkeypatch):
    """A checkpoint's multi-token-prediction tensors (``mtp.*``) never reach the loader."""
    seen: list[str] = []
    monkeypatch.setattr(BambaForCausalLM, "load_weights",
                        lambda self, weights: seen.extend(n for n, _ in weights) or set(seen))
    model = Qwen3NextForCausalLM.__new__(Qwen3NextForCausalLM)
    model.load_weights([("mtp.fc.weight", torch.zeros(1)), ("model.norm.weight", torch.zeros(1))])
    assert seen == ["model.norm.weight"]


def test_unknown_layer_types_are_refused():
    kinds = ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="unsupported layer types"):
        layer_kinds(SimpleNamespace(layer_types=kinds, num_hidden_layers=4))
    with pytest.raises(ValueError, match="3 layer_types for 4 layers"):
        layer_kinds(SimpleNamespace(layer_types=kinds[:3], num_hidden_layers=4))


