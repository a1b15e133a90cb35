"""Norm, gated activation, linear (plain, merged, custom method) and embedding layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.model_executor.layers.activation import SiluAndMul, get_act_and_mul
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.linear import MergedLinear, QKVLinear, ReplicatedLinear
from engine.model_executor.layers.norm import RMSNorm

GEN = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_llama(dtype):
    ref = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    norm = RMSNorm(32, 1e-5, dtype=dtype, device="cpu")
    weight = randn(32, dtype=dtype)
    ref.weight.data.copy_(weight)
    norm.weight.data.copy_(weight)
    x, residual = randn(5, 32, dtype=dtype), randn(5, 32, dtype=dtype)
    torch.testing.assert_close(norm(x), ref(x), atol=0, rtol=0)
    normed, summed = norm(x, residual)
    torch.testing.assert_close(summed, residual + x, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref(residual + x), atol=0, rtol=0)


def test_silu_and_mul():
    x = randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
    gelu = get_act_and_mul("gelu_pytorch_tanh")
    torch.testing.assert_close(gelu(x), F.gelu(x[:, :5], approximate="tanh") * x[:, 5:])
    with pytest.raises(ValueError, match="relu6"):
        get_act_and_mul("relu6")


def test_merged_linear_loads_shards_and_splits():
    layer = QKVLinear(8, 4, 3, 1, bias=True, dtype=torch.float32, device="cpu")
    parts = {s: (randn(n, 8), randn(n)) for s, n in (("q", 12), ("k", 4), ("v", 4))}
    for shard, (w, b) in parts.items():
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    assert layer.weight.shard_ids == ("q", "k", "v")
    x = randn(2, 8)
    for got, (w, b) in zip(layer.split(layer(x)), parts.values()):
        torch.testing.assert_close(got, F.linear(x, w, b))
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, randn(5, 8), "k")
    with pytest.raises(ValueError, match="shards"):
        layer.weight.weight_loader(layer.weight, randn(4, 8), "o")


def test_linear_casts_checkpoint_dtype():
    layer = ReplicatedLinear(3, 2, bias=False, dtype=torch.bfloat16, device="cpu")
    w = randn(2, 3)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer.weight.float(), w.to(torch.bfloat16).float())


class TransposedMethod:
    """A stand-in quantized format: stores W^T and applies it through a matmul."""

    def create_weights(self, layer, in_features, out_features, params_dtype):
        layer.weight_t = torch.nn.Parameter(
            torch.empty(in_features, out_features, dtype=params_dtype), requires_grad=False
        )

    def apply(self, layer, x, bias=None):
        y = x @ layer.weight_t
        return y if bias is None else y + bias


def test_linear_method_seam():
    layer = ReplicatedLinear(
        4, 3, bias=True, dtype=torch.float32, device="cpu", quant_method=TransposedMethod()
    )
    w, b = randn(3, 4), randn(3)
    layer.weight_t.data.copy_(w.t())
    layer.bias.data.copy_(b)
    x = randn(2, 4)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_merged_linear_gate_up():
    layer = MergedLinear(6, {0: 5, 1: 5}, bias=False, dtype=torch.float32, device="cpu")
    gate, up = randn(5, 6), randn(5, 6)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    torch.testing.assert_close(layer.weight, torch.cat([gate, up]))


def test_embedding_and_tied_head():
    emb = VocabEmbedding(10, 4, dtype=torch.bfloat16, device="cpu")
    emb.weight.data.copy_(randn(10, 4))
    ids = torch.tensor([3, 0, 9])
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    head = LMHead(10, 4, dtype=torch.bfloat16, device="cpu")
    head.tie_to(emb)
    assert head.weight is emb.weight
    h = randn(2, 4, dtype=torch.bfloat16)
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (2, 10)
    torch.testing.assert_close(logits, F.linear(h, emb.weight).float())
    with pytest.raises(ValueError, match="tie"):
        LMHead(11, 4, dtype=torch.float32, device="cpu").tie_to(emb)
