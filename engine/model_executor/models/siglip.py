"""The SigLIP vision tower as vision-language models use it: the last hidden state after
``post_layernorm``, one row per patch (Gemma 3 pools and projects these itself).

transformers' ``SiglipVisionModel``: patch embedding (a stride-``patch`` Conv2d *with*
bias), learned position embeddings, no class token and no pre-norm, then pre-norm encoder
layers (``x + attn(ln1(x))``, ``x + fc2(act(fc1(ln2(x))))``, ``gelu_pytorch_tanh``) and
``post_layernorm``. The attention-pooling ``head`` (``vision_use_head``) produces the
pooled output no vision-language model reads, so it is not built and its checkpoint
tensors are skipped.

The encoder layers are CLIP's (:class:`~engine.model_executor.models.clip.CLIPEncoderLayer`:
the same structure and tensor names). The patch embedding runs as one GEMM over each
flattened ``C x P x P`` patch (the conv kernel is flattened at load); attention is
non-causal within each image (one segment per image of
:func:`encoder_attention_context`) through the platform's encoder attention kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.vision import encoder_attention_context, patch_rows
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.clip import CLIP_STACKED, CLIPEncoder
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.weight_utils import load_named_weights

# Checkpoint tensors of the tower that are not built (the pooling head) or saved buffers.
_UNUSED = ("head.", "embeddings.position_ids")


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.patch, self.image_size = patch, config.image_size
        self.channels = getattr(config, "num_channels", 3)
        self.num_patches = (config.image_size // patch) ** 2
        self.patch_embedding = ReplicatedLinear(self.channels * patch * patch, dim, bias=True,
                                                **ctx.matrix_dtypes, device=ctx.device)
        self.position_embedding = nn.Embedding(self.num_patches, dim, dtype=ctx.dtype,
                                               device=ctx.device)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, patches, dim]`` (row-major patches)."""
        n = pixels.shape[0]
        patches = patch_rows(pixels, self.channels, self.image_size, self.patch, "SigLIP")
        embeds = self.patch_embedding(patches).reshape(n, self.num_patches, -1)
        return embeds + self.position_embedding.weight.to(embeds.dtype)


class SiglipVisionTower(nn.Module):
    """``forward(pixels [N, C, S, S]) -> [N, patches, dim]``: ``last_hidden_state``."""

    def __init__(self, config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        model_type = getattr(config, "model_type", "siglip_vision_model")
        if model_type not in ("siglip_vision_model", "siglip"):
            raise ValueError(f"vision tower model_type {model_type!r} is not supported here "
                             "(only SigLIP: 'siglip_vision_model')")
        self.ctx = ctx
        self.hidden_size = config.hidden_size
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.embeddings = SiglipVisionEmbeddings(config, ctx)
        self.encoder = CLIPEncoder(config, ctx, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                           dtype=ctx.dtype, device=ctx.device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(device=self.ctx.device, dtype=self.ctx.dtype)
        n = pixels.shape[0]
        x = self.embeddings(pixels)  # [N, L, dim]
        length = x.shape[1]
        x = x.reshape(n * length, -1)
        with encoder_attention_context(self.ctx.attn_backend, [length] * n, self.ctx.device):
            for layer in self.encoder.layers:
                x = layer(x)
        return self.post_layernorm(x).reshape(n, length, -1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower-relative names as transformers 5 saves them (``embeddings.*``,
        ``encoder.layers.{i}.*``, ``post_layernorm.*``) or under ``vision_model.`` (the
        original checkpoints). The pooling head's tensors are skipped."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("vision_model.")
                if name.startswith(_UNUSED):
                    continue
                if name == "embeddings.patch_embedding.weight":
                    tensor = materialize(tensor)
                    tensor = tensor.reshape(tensor.shape[0], -1)
                yield name, tensor

        return load_named_weights(self, renamed(), stacked=CLIP_STACKED)
