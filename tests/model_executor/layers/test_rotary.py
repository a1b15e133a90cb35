"""RoPE tables and rotation against transformers' own rope functions and Llama layer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.model_executor.layers.rotary import (
    RotaryEmbedding,
    compute_inv_freq,
    rope_scaling_from_config,
)

HEAD = 32
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
}


def config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD * 2,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_inv_freq_matches_transformers(kind):
    cfg = config(ROPES[kind])
    expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    assert attention_factor == 1.0
    got = compute_inv_freq(rope_scaling_from_config(cfg), HEAD)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_llama_within_context(kind, dtype):
    cfg = config(ROPES[kind])
    rope = RotaryEmbedding(HEAD, rope_scaling_from_config(cfg), dtype=dtype, device="cpu")
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255, 17])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3 * HEAD, generator=gen).to(dtype)
    k = torch.randn(len(positions), 1 * HEAD, generator=gen).to(dtype)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, -1, 3, HEAD).transpose(1, 2), k.view(1, -1, 1, HEAD).transpose(1, 2), cos, sin
    )
    q_got, k_got = rope(positions, q, k)
    torch.testing.assert_close(q_got, q_ref.transpose(1, 2).reshape(q.shape), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_got, k_ref.transpose(1, 2).reshape(k.shape), atol=1e-6, rtol=0)


def test_dynamic_ntk_beyond_context_matches_token_by_token_transformers():
    """Position p uses the base transformers computes when p is the newest token."""
    cfg = config(ROPES["dynamic"])
    scaling = rope_scaling_from_config(cfg)
    assert scaling.max_positions == 512
    table = compute_inv_freq(scaling, HEAD)  # [512, HEAD/2]
    base, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu")
    torch.testing.assert_close(table[:256], base.expand(256, -1), atol=0, rtol=0)
    for p in (256, 300, 511):
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=p + 1)
        torch.testing.assert_close(table[p], expected, atol=0, rtol=1e-6)
    rope = RotaryEmbedding(HEAD, scaling, dtype=torch.float32, device="cpu")
    hf = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HEAD)
    for p in (300, 400):  # growing, as in generation
        cos, sin = hf(x, torch.arange(p + 1)[None])
        got_cos, got_sin = rope.cos_sin_cache[p].chunk(2)
        torch.testing.assert_close(got_cos, cos[0, -1, : HEAD // 2], atol=1e-6, rtol=0)
        torch.testing.assert_close(got_sin, sin[0, -1, : HEAD // 2], atol=1e-6, rtol=0)


def test_table_covers_scaled_context():
    assert rope_scaling_from_config(config(ROPES["linear"])).max_positions == 1024
    assert rope_scaling_from_config(config(ROPES["llama3"])).max_positions == 256
    assert rope_scaling_from_config(config(ROPES["default"])).max_positions == 256


def test_legacy_rope_scaling_fields_are_read():
    legacy = SimpleNamespace(  # a v4-style config: rope_theta + rope_scaling
        max_position_embeddings=100,
        rope_theta=1234.0,
        rope_scaling={"type": "linear", "factor": 3.0},
    )
    scaling = rope_scaling_from_config(legacy)
    assert (scaling.rope_type, scaling.theta, scaling.factor) == ("linear", 1234.0, 3.0)


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}, "not supported"),
        ({"rope_type": "linear", "rope_theta": 1e4}, "factor"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial"),
    ],
)
def test_unsupported_rope_is_a_clear_error(rope, match):
    cfg = SimpleNamespace(max_position_embeddings=64, rope_parameters=rope)
    with pytest.raises(ValueError, match=match):
        rope_scaling_from_config(cfg)


@pytest.mark.parametrize("mscale", [None, 1.0, 0.707])
def test_yarn_frequencies_and_attention_factor_match_transformers(mscale):
    """DeepSeek-V3's YaRN: transformers' inverse frequencies and cos/sin scale."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0, "beta_fast": 32,
              "beta_slow": 1, "original_max_position_embeddings": 4096}
    if mscale is not None:
        params.update(mscale=mscale, mscale_all_dim=1.0)
    config = DeepseekV3Config(rope_parameters=params, max_position_embeddings=163840)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = rope_scaling_from_config(config)
    torch.testing.assert_close(compute_inv_freq(scaling, config.head_dim), want)
    assert scaling.attention_factor == pytest.approx(factor)
    assert scaling.max_positions == 163840
