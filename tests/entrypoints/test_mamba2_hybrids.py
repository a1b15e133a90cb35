"""Falcon-H1, Nemotron-H (dense and with mixture-of-experts blocks) and Granite 4.0-H with
routed experts (attention + Mamba-2 hybrids) end to end against transformers' torch path:
greedy float32 equal (near-ties tolerated) for prompts longer than a prefill chunk, batched
with chunked prefill so prefills and decodes mix in a step; KV caches only for the
attention layers, a state per Mamba-2 layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.state_models import reference_for, run_chunked

# Nemotron-H with MoE blocks ("E": 8 ungated relu^2 experts, top 2, sigmoid router with a
# correction bias, plus a shared expert) beside Mamba-2, attention and the dense MLP.
NEMOTRON_H_MOE = {
    "hybrid_override_pattern": "ME*EM-", "num_hidden_layers": 6, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48}

# variant, config overrides, (KV cache layers, state layers)
CASES = {
    "falcon_h1": ("falcon_h1", {}, (3, 3)),
    # The mixer's output only gated (no RMSNorm), the norm after the gate.
    "falcon_h1-gate-only": ("falcon_h1", {"mamba_rms_norm": False}, (3, 3)),
    "falcon_h1-gate-then-norm": ("falcon_h1", {"mamba_norm_before_gate": False}, (3, 3)),
    "nemotron_h": ("nemotron_h", {}, (1, 2)),
    # DeepSeek-V3 grouped top-k (4 groups of 2, the best 2 groups), renormalized, scaled.
    "nemotron_h-moe-grouped": ("nemotron_h", {
        **NEMOTRON_H_MOE, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5}, (1, 2)),
    # Experts in a 24-wide latent space (fc1 / fc2 latent projections, with biases), one
    # group, weights not renormalized.
    "nemotron_h-moe-latent": ("nemotron_h", {
        **NEMOTRON_H_MOE, "moe_latent_size": 24, "mlp_bias": True, "norm_topk_prob": False,
        "routed_scaling_factor": 1.5}, (1, 2)),
    # Routed experts (4, top 2) beside the shared MLP; RoPE (the dense form without RoPE
    # is tested with Bamba).
    "granitemoehybrid-moe": ("granitemoehybrid", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "position_embedding_type": "rope"}, (1, 3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_matches_transformers_with_chunked_prefill(model_dir_factory, case):
    variant, overrides, (kv_layers, state_layers) = CASES[case]
    model_dir = model_dir_factory(variant, **overrides)
    if "n_routed_experts" in overrides:
        _randomize_correction_bias(model_dir)
    runner, _ = run_chunked(model_dir, reference_for(model_dir, 3, (37, 6, 23, 19)))
    assert (len(runner.kv_caches), len(runner.state_caches)) == (kv_layers, state_layers)


def _randomize_correction_bias(model_dir: Path) -> None:
    """transformers initializes ``e_score_correction_bias`` to zeros: give the saved
    checkpoint a bias large enough to change which experts are chosen (both the
    reference and the engine load it from there)."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(7)
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(path)
        names = sorted(n for n in tensors if n.endswith("gate.e_score_correction_bias"))
        for name in names:
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.3
        if names:
            save_file(tensors, path, metadata={"format": "pt"})


def test_nemotron_h_block_types_and_refusals():
    """Old and new spellings of the block types, MoE blocks included."""
    from types import SimpleNamespace

    from engine.model_executor.models.nemotron_h import block_kinds

    assert block_kinds(SimpleNamespace(hybrid_override_pattern="M*-E")) == \
        block_kinds(SimpleNamespace(layers_block_type=["mamba", "attention", "mlp", "moe"])) \
        == ["mamba", "attention", "mlp", "moe"]
    with pytest.raises(ValueError, match="unknown block types"):
        block_kinds(SimpleNamespace(layers_block_type=["linear_attention", "conv"]))


def test_nemotron_h_moe_refusals():
    """MoE blocks refuse tensor parallelism and quantized experts with a reason."""
    from types import SimpleNamespace

    from engine.model_executor.models.nemotron_h import NemotronHMoE

    config = SimpleNamespace(mlp_hidden_act="relu2")
    with pytest.raises(ValueError, match="tensor parallelism"):
        NemotronHMoE(config, SimpleNamespace(tp=object()), "model.layers.1.mixer")
    plan = SimpleNamespace(method=SimpleNamespace(experts_method=lambda: None),
                           describe=lambda: "mxfp4")
    ctx = SimpleNamespace(tp=None, quantization=plan, linear_method=lambda *names: None)
    with pytest.raises(ValueError, match=r"quantized experts \(mxfp4\)"):
        NemotronHMoE(config, ctx, "model.layers.1.mixer")


def test_nemotron_h_moe_loads_stacked_experts(model_dir_factory, tmp_path):
    """A checkpoint with each layer's experts stacked (transformers' in-memory
    ``experts.up_proj [E, I, H]`` / ``experts.down_proj [E, H, I]``) runs like the
    per-expert one."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, overrides, _ = CASES["nemotron_h-moe-grouped"]
    source = model_dir_factory("nemotron_h", **overrides)
    _randomize_correction_bias(source)
    reference = reference_for(source, 5, (21, 9))
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(source, stacked_dir)
    for path in sorted(stacked_dir.glob("*.safetensors")):
        tensors, stacked = load_file(path), {}
        for name in sorted(tensors):
            stem, sep, rest = name.partition(".experts.")
            if sep and rest.split(".")[0].isdigit():
                expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
                stacked.setdefault(f"{stem}.experts.{proj}", {})[expert] = tensors.pop(name)
        assert stacked
        for name, experts in stacked.items():
            tensors[name] = torch.stack([experts[e] for e in sorted(experts)])
        save_file(tensors, path, metadata={"format": "pt"})
    run_chunked(stacked_dir, reference)
