"""The MoE router against transformers' routers, and the CPU fused-MoE kernel against a
float64 per-(token, choice) reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core.interfaces import MoELayerSpec
from engine.model_executor.layers.fused_moe import RouterConfig, select_experts
from engine.plugins.cpu.fused_moe import CPUFusedMoE


def _reference_moe(hidden, w13, w2, weights, ids):
    """float64, one (token, choice) at a time."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(hidden)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e] @ hidden[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_moe_matches_float64(dtype):
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 9, 24, 20, 8, 2
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / 4).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / 4).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[ids == 5] = 6  # expert 5 receives nothing ...
    ids[:, 1] = torch.where(ids[:, 0] == 6, 3, ids[:, 1])  # ... and no token picks 6 twice
    ids[2] = -1  # a token served entirely by other ranks
    ids[4, 1] = -1
    weights = torch.rand(tokens, top_k)
    kernel = CPUFusedMoE()
    assert CPUFusedMoE.can_implement(MoELayerSpec(experts, hidden, inter, top_k, dtype,
                                                  torch.device("cpu"))) is None
    got = kernel.apply(x, w13, w2, weights, ids)
    want = _reference_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert torch.count_nonzero(got[2]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_moe_on_packed_experts_matches_float64(dtype):
    """Experts repacked once for the C GEMM (shapes it takes): the same results, the
    weights really in the panel layout, a bias still added once."""
    from engine.plugins.cpu.native import load_kernels

    if load_kernels() is None:
        pytest.skip("no native CPU kernels (no C compiler)")
    torch.manual_seed(1)
    tokens, hidden, inter, experts, top_k = 11, 32, 24, 4, 2
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / 4).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / 4).to(dtype)
    b2 = torch.randn(experts, hidden).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[3] = -1
    weights = torch.rand(tokens, top_k)
    kernel = CPUFusedMoE()
    p13, p2 = kernel.prepare_weights(w13.clone(), w2.clone())
    assert p13.shape == w13.shape and not torch.equal(p13, w13)  # panel order
    got = kernel.apply(x, p13, p2, weights, ids, w2_bias=b2)
    want = _reference_moe(x, w13, w2, weights, ids)
    want += (weights.double()[..., None] * b2.double()[ids.clamp(min=0)]
             * (ids >= 0)[..., None]).sum(1)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert torch.count_nonzero(got[3]) == 0
    # A shape the packed GEMM does not take keeps the plain weights and torch's GEMMs.
    odd = torch.randn(experts, 2 * 10, hidden).to(dtype)
    plain = CPUFusedMoE()
    assert plain.prepare_weights(odd, torch.randn(experts, hidden, 10).to(dtype))[0] is odd


def _hf_config(**kwargs):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=16, **kwargs)


def test_grouped_sigmoid_routing_matches_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = _hf_config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(1)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(std=0.1)
    hidden = torch.randn(11, 16)
    _, want_w, want_ids = router(hidden)
    logits = hidden @ router.weight.t()
    cfg = RouterConfig(16, 4, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                       routed_scaling_factor=2.5)
    got_w, got_ids = select_experts(logits, cfg, router.e_score_correction_bias)
    order_w, order_g = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing_matches_qwen_moe(renormalize):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=renormalize)
    router = Qwen2MoeTopKRouter(config)
    torch.manual_seed(2)
    router.weight.data.normal_()
    hidden = torch.randn(7, 16)
    logits, want_w, want_ids = router(hidden)
    got_w, got_ids = select_experts(logits, RouterConfig(8, 2, renormalize=renormalize))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float())


def test_router_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="groups"):
        RouterConfig(10, 2, num_groups=4)
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="scoring"):
        RouterConfig(4, 2, scoring="relu")
