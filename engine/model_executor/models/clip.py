"""The CLIP vision tower as LLaVA uses it: the hidden states of one chosen layer (or
several, concatenated), not the pooled output.

transformers' ``CLIPVisionModel``: patch embedding (a stride-``patch`` Conv2d without
bias) behind a learned class token, learned position embeddings, ``pre_layrnorm``, then
pre-norm encoder layers (``x + attn(ln1(x))``, ``x + fc2(act(fc1(ln2(x))))``).
``hidden_states[0]`` is the embedding after ``pre_layrnorm`` and ``hidden_states[i]`` the
output of layer ``i``; ``post_layernorm`` applies only to the pooled CLS row, which no
vision-language model reads, so it is not built. Layers past the deepest selected one
are not built either (vLLM does the same): their checkpoint tensors are skipped.

The patch embedding runs as one GEMM over each flattened ``C x P x P`` patch (the
checkpoint's conv kernel is flattened at load). Attention is non-causal within each
image (one segment per image of :func:`encoder_attention_context`) through the
platform's encoder attention kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.model_executor.layers.vision import encoder_attention_context, patch_rows
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.bert import Activation
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.weight_utils import StackedParam, load_named_weights

CLIP_STACKED = (
    StackedParam(".self_attn.qkv_proj.", ".self_attn.q_proj.", "q"),
    StackedParam(".self_attn.qkv_proj.", ".self_attn.k_proj.", "k"),
    StackedParam(".self_attn.qkv_proj.", ".self_attn.v_proj.", "v"),
)
# Checkpoint tensors of the tower no feature layer needs (or saved buffers).
_UNUSED = ("post_layernorm.", "embeddings.position_ids")


def resolve_feature_layers(feature_layer: int | Sequence[int], num_layers: int) -> list[int]:
    """LLaVA's ``vision_feature_layer`` (an index into ``hidden_states``, which has
    ``num_layers + 1`` entries; negative from the end; or a list of them) as
    non-negative indices, in the given order."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    if not layers:
        raise ValueError("vision_feature_layer is an empty list")
    out = []
    for layer in layers:
        index = int(layer) + (num_layers + 1 if int(layer) < 0 else 0)
        if not 0 <= index <= num_layers:
            raise ValueError(f"vision_feature_layer {layer} is out of range for a tower of "
                             f"{num_layers} layers")
        out.append(index)
    return out


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.patch, self.image_size = patch, config.image_size
        self.channels = getattr(config, "num_channels", 3)
        self.num_patches = (config.image_size // patch) ** 2
        self.class_embedding = nn.Parameter(torch.empty(dim, dtype=ctx.dtype, device=ctx.device),
                                            requires_grad=False)
        self.patch_embedding = ReplicatedLinear(self.channels * patch * patch, dim, bias=False,
                                                **ctx.matrix_dtypes, device=ctx.device)
        self.position_embedding = nn.Embedding(self.num_patches + 1, dim, dtype=ctx.dtype,
                                               device=ctx.device)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, 1 + patches, dim]`` (class token first)."""
        n = pixels.shape[0]
        patches = patch_rows(pixels, self.channels, self.image_size, self.patch, "CLIP")
        embeds = self.patch_embedding(patches).reshape(n, self.num_patches, -1)
        cls = self.class_embedding.to(embeds.dtype).expand(n, 1, -1)
        return torch.cat([cls, embeds], dim=1) + self.position_embedding.weight.to(embeds.dtype)


class CLIPAttention(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        dim, heads = config.hidden_size, config.num_attention_heads
        if dim % heads:
            raise ValueError(f"CLIP hidden_size {dim} is not a multiple of {heads} heads")
        head_size = dim // heads
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.qkv_proj = QKVLinear(dim, head_size, heads, heads, bias=True, **common)
        local = self.qkv_proj.num_heads
        self.attn = Attention(local, head_size, head_size**-0.5, local, layer_idx,
                              ctx.attn_backend, causal=False)
        self.out_proj = RowParallelLinear(dim, dim, bias=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.out_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True,
                                        **common)
        self.act = Activation(config.hidden_act)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True,
                                     **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        common = {"dtype": ctx.dtype, "device": ctx.device}
        self.self_attn = CLIPAttention(config, ctx, layer_idx)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, **common)
        self.mlp = CLIPMLP(config, ctx)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, ctx, i) for i in range(num_layers))


class CLIPVisionTower(nn.Module):
    """``forward(pixels [N, C, S, S]) -> [N, 1 + patches, dim * len(feature_layers)]``:
    the selected hidden states, concatenated on the last axis in the given order."""

    def __init__(self, config: Any, ctx: ModelInitContext,
                 feature_layer: int | Sequence[int]) -> None:
        super().__init__()
        model_type = getattr(config, "model_type", "clip_vision_model")
        if model_type not in ("clip_vision_model", "clip"):
            raise ValueError(f"vision tower model_type {model_type!r} is not supported here "
                             "(only CLIP: 'clip_vision_model')")
        self.ctx = ctx
        self.feature_layers = resolve_feature_layers(feature_layer, config.num_hidden_layers)
        self.num_built = max(self.feature_layers)
        self.hidden_size = config.hidden_size
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.embeddings = CLIPVisionEmbeddings(config, ctx)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                         dtype=ctx.dtype, device=ctx.device)
        self.encoder = CLIPEncoder(config, ctx, self.num_built)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(device=self.ctx.device, dtype=self.ctx.dtype)
        n = pixels.shape[0]
        x = self.pre_layrnorm(self.embeddings(pixels))  # [N, L, dim]
        length = x.shape[1]
        x = x.reshape(n * length, -1)
        states = {0: x}
        with encoder_attention_context(self.ctx.attn_backend, [length] * n, self.ctx.device):
            for i, layer in enumerate(self.encoder.layers, start=1):
                x = layer(x)
                if i in self.feature_layers:
                    states[i] = x
        selected = [states[i] for i in self.feature_layers]
        out = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return out.reshape(n, length, -1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower-relative names as transformers 5 saves them (``embeddings.*``,
        ``encoder.layers.{i}.*``) or under ``vision_model.`` (the older CLIPVisionModel).
        Tensors of unbuilt layers and of ``post_layernorm`` are skipped."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("vision_model.")
                if name.startswith(_UNUSED):
                    continue
                if (name.startswith("encoder.layers.")
                        and int(name.split(".", 3)[2]) >= self.num_built):
                    continue
                if name == "embeddings.patch_embedding.weight":
                    tensor = materialize(tensor)
                    tensor = tensor.reshape(tensor.shape[0], -1)
                yield name, tensor

        return load_named_weights(self, renamed(), stacked=CLIP_STACKED)
