"""Falcon-H1, Nemotron-H and Granite 4.0-H with routed experts (attention + Mamba-2 hybrids) end to end against
transformers' torch path: greedy float32 equal (near-ties tolerated) for prompts longer
than a prefill chunk, batched with chunked prefill so prefills and decodes mix in a step;
KV caches only for the attention layers, a state per Mamba-2 layer."""

from __future__ import annotations

import pytest

from tests.helpers.state_models import reference_for, run_chunked

# variant, config overrides, (KV cache layers, state layers)
CASES = {
    "falcon_h1": ("falcon_h1", {}, (3, 3)),
    # The mixer's output only gated (no RMSNorm), the norm after the gate.
    "falcon_h1-gate-only": ("falcon_h1", {"mamba_rms_norm": False}, (3, 3)),
    "falcon_h1-gate-then-norm": ("falcon_h1", {"mamba_norm_before_gate": False}, (3, 3)),
    "nemotron_h": ("nemotron_h", {}, (1, 2)),
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
    runner, _ = run_chunked(model_dir, reference_for(model_dir, 3, (37, 6, 23, 19)))
    assert (len(runner.kv_caches), len(runner.state_caches)) == (kv_layers, state_layers)


def test_nemotron_h_block_types_and_refusals():
    """Old and new spellings of the block types; MoE blocks refused with a reason."""
    from types import SimpleNamespace

    from engine.model_executor.models.nemotron_h import block_kinds

    assert block_kinds(SimpleNamespace(hybrid_override_pattern="M*-")) == \
        block_kinds(SimpleNamespace(layers_block_type=["mamba", "attention", "mlp"])) == \
        ["mamba", "attention", "mlp"]
    with pytest.raises(ValueError, match="mixture-of-experts"):
        block_kinds(SimpleNamespace(layers_block_type=["linear_attention", "moe"]))
    with pytest.raises(ValueError, match="unknown block types"):
        block_kinds(SimpleNamespace(layers_block_type=["linear_attention", "conv"]))
