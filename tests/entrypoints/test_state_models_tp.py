"""Tensor parallelism (two ranks, real worker processes) for the state-space and
linear-attention families: greedy float32 tokens and logprobs equal transformers' (near-ties
tolerated) for prompts longer than a 16-token prefill chunk, batched with chunked prefill;
each rank's state per request is its share (heads, channels, groups), which the memory
accounting reports; a config whose heads or groups do not split over the ranks is a
clear error naming the numbers.

Mamba-2 (vLLM's rule): heads split over the ranks, and the B / C groups too, or, with
fewer groups than ranks, each group replicated on ``tp / n_groups`` ranks (the gated norm
then sums a group's squares over the ranks that hold it). Mamba-1: channels split,
``x_proj`` all-reduced. Gated DeltaNet: key heads split, each with its value heads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.entrypoints.test_qwen3_next import _perturb_norms
from tests.helpers.hf_reference import cpu_llm
from tests.helpers.state_models import (
    check_against,
    generate_greedy,
    reference_for,
    slots_all_free,
)

TP = 2


def _arch(variant: str) -> dict[str, Any]:
    from tests.helpers.hf_models import ARCH_CONFIGS

    return ARCH_CONFIGS[variant]


def _run_tp(model_dir, reference) -> list[dict[str, Any]]:
    """The engine with two ranks on ``reference``'s prompts (chunked prefill, decodes and
    prefill chunks in one step), checked against it; each rank's ``kv_cache_info()``."""
    with cpu_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=3,
                 tensor_parallel_size=TP) as llm:
        core = llm.llm_engine.client.core
        outs = generate_greedy(llm, reference[0])
        assert slots_all_free(core)
        infos = core.executor.collective_rpc("kv_cache_info")
    check_against(outs, reference)
    assert len(infos) == TP and all(i == infos[0] for i in infos)  # same shapes per rank
    return infos


def _mamba2_state_bytes(heads: int, head_dim: int, groups: int, d_state: int, d_conv: int,
                        layers: int) -> int:
    """One rank's float32 state of ``layers`` Mamba-2 mixers holding ``heads`` heads and
    ``groups`` groups: conv window over x, B, C plus the SSM state."""
    conv_dim = heads * head_dim + 2 * groups * d_state
    return (conv_dim * (d_conv - 1) + heads * head_dim * d_state) * 4 * layers


def _model(model_dir_factory, variant: str, **overrides: Any):
    """A model directory of its own (seed 7: not shared with the TP=1 tests, which
    perturb some checkpoints in place) with random norm weights and dt_bias."""
    model_dir = model_dir_factory(variant, seed=7, **overrides)
    _perturb_norms(model_dir)
    return model_dir


# -- cheap: two families, the replicated-group and the DeltaNet paths ----------------------

def test_mamba2_one_group_replicated_on_both_ranks(model_dir_factory):
    """n_groups=1 < tp: both ranks hold the one B / C group, each half of the heads; the
    gated norm's one group spans both ranks."""
    model_dir = _model(model_dir_factory, "mamba2", n_groups=1)
    infos = _run_tp(model_dir, reference_for(model_dir, 0, (41, 5, 26, 18)))
    cfg = SimpleNamespace(**_arch("mamba2"))
    assert infos[0]["state_bytes_per_request"] == _mamba2_state_bytes(
        cfg.num_heads // TP, cfg.head_dim, 1, cfg.state_size, cfg.conv_kernel, 2)


def test_qwen3_next_key_heads_split(model_dir_factory):
    """Gated DeltaNet (2 key heads, 4 value heads: one key head and its two value heads
    per rank), gated attention (each query head with its gate) and the MoE."""
    model_dir = _model(model_dir_factory, "qwen3_next")
    infos = _run_tp(model_dir, reference_for(model_dir, 0))
    cfg = SimpleNamespace(**_arch("qwen3_next"))
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim // TP
    value_heads = cfg.linear_num_value_heads // TP
    conv_dim = 2 * key_dim + value_heads * cfg.linear_value_head_dim
    per_layer = (conv_dim * (cfg.linear_conv_kernel_dim - 1)
                 + value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim) * 4
    assert infos[0]["state_bytes_per_request"] == per_layer * 3
    assert infos[0]["num_layers"] == 1  # the one full-attention layer


# -- the other families (each a few seconds of worker processes) ----------------------------

SLOW_CASES = {
    # 8 heads, 2 groups: one group and four heads per rank; state exactly halved.
    "mamba2": ("mamba2", {}),
    "mamba1": ("mamba1", {}),
    "jamba": ("jamba", {}),
    "bamba": ("bamba", {}),
    "granitemoehybrid": ("granitemoehybrid", {}),
    "granitemoehybrid-moe": ("granitemoehybrid", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "position_embedding_type": "rope"}),
    # muP vector per rank block, the norm before the gate over the rank's groups ...
    "falcon_h1": ("falcon_h1", {}),
    # ... and over one group spread on both ranks.
    "falcon_h1-one-group": ("falcon_h1", {"mamba_n_groups": 1}),
    "falcon_h1-gate-only": ("falcon_h1", {"mamba_rms_norm": False}),
    "nemotron_h": ("nemotron_h", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_family_matches_transformers_with_two_ranks(model_dir_factory, case):
    variant, overrides = SLOW_CASES[case]
    model_dir = _model(model_dir_factory, variant, **overrides)
    infos = _run_tp(model_dir, reference_for(model_dir, 3, (37, 6, 23, 19)))
    if case == "mamba2":
        cfg = SimpleNamespace(**_arch("mamba2"))
        whole = _mamba2_state_bytes(cfg.num_heads, cfg.head_dim, cfg.n_groups,
                                    cfg.state_size, cfg.conv_kernel, 2)
        assert infos[0]["state_bytes_per_request"] * TP == whole
    if case == "mamba1":  # d_inner 128 of hidden 64: 64 channels per rank
        assert infos[0]["state_bytes_per_request"] == (64 * 3 + 64 * 16) * 4 * 2


# -- configs that do not split --------------------------------------------------------------

class _FakeTP:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _ctx(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(tp=_FakeTP(0, world_size), dtype=torch.float32,
                           device=torch.device("cpu"),
                           matrix_dtypes={"dtype": torch.float32,
                                          "weight_dtype": torch.float32},
                           linear_method=lambda *prefixes: None)


def test_configs_that_do_not_split_name_the_numbers():
    from engine.model_executor.layers.gated_deltanet import (
        GatedDeltaNetDims,
        GatedDeltaNetMixer,
    )
    from engine.model_executor.layers.mamba1 import Mamba1Dims, Mamba1Mixer
    from engine.model_executor.layers.mamba2 import Mamba2Dims, Mamba2Mixer, group_part

    def mamba2(heads: int, groups: int) -> Mamba2Dims:
        return Mamba2Dims(hidden_size=32, num_heads=heads, head_dim=8, n_groups=groups,
                          d_state=8, d_conv=4, intermediate_size=heads * 8, use_bias=False,
                          use_conv_bias=True, chunk_size=16, norm_eps=1e-5)

    with pytest.raises(ValueError, match=r"num_heads \(3\) is not divisible by "
                                         r"tensor_parallel_size=2"):
        Mamba2Mixer(mamba2(3, 1), _ctx(2), "m", 0)
    with pytest.raises(ValueError, match=r"n_groups \(3\) and tensor_parallel_size=2"):
        Mamba2Mixer(mamba2(6, 3), _ctx(2), "m", 0)
    with pytest.raises(ValueError, match=r"n_groups \(2\) and tensor_parallel_size=3"):
        Mamba2Mixer(mamba2(6, 2), _ctx(3), "m", 0)
    # Fewer groups than ranks, dividing them: replicated like GQA's key/value heads.
    assert [group_part(2, _FakeTP(r, 4)) for r in range(4)] == [(0, 2), (0, 2), (1, 2),
                                                                 (1, 2)]
    assert [group_part(4, _FakeTP(r, 2)) for r in range(2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match=r"intermediate_size \(6\) is not divisible by "
                                         r"tensor_parallel_size=4"):
        Mamba1Mixer(Mamba1Dims(hidden_size=8, intermediate_size=6, d_state=4, d_conv=4,
                               dt_rank=2, use_bias=False, use_conv_bias=True), _ctx(4), "m", 0)
    with pytest.raises(ValueError, match=r"num_k_heads \(3\) is not divisible by "
                                         r"tensor_parallel_size=2"):
        GatedDeltaNetMixer(GatedDeltaNetDims(hidden_size=32, num_k_heads=3, num_v_heads=6,
                                             head_k_dim=8, head_v_dim=8, conv_kernel=4,
                                             norm_eps=1e-6), _ctx(2), "m", 0)


def test_conv_channels_are_cut_per_segment():
    """A depthwise conv over [x | B | C] keeps the rank's part of each segment; one
    segment on one rank is the checkpoint tensor unchanged."""
    from engine.model_executor.layers.mamba2 import _Conv1dWeights, segment_loader

    conv = _Conv1dWeights(6, 4, True, torch.float32, torch.device("cpu"),
                          segments=[(2, (1, 2)), (4, (1, 2))])
    weight = torch.arange(24, dtype=torch.float32).view(6, 1, 4)
    conv.weight.weight_loader(conv.weight, weight)
    assert torch.equal(conv.weight, weight[[1, 4, 5]])  # rank 1's channel of each segment
    rows = torch.empty(3)
    segment_loader([(3, (0, 1))])(rows, torch.tensor([1.0, 2.0, 3.0]))
    assert rows.tolist() == [1.0, 2.0, 3.0]
