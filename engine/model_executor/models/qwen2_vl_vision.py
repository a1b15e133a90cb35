"""The vision towers of Qwen2-VL and Qwen2.5-VL, as transformers computes them.

Pixels arrive flattened per patch (``[patches, C * T * P * P]``: the processor's
``pixel_values``), so the Conv3d patch embedding is one GEMM over the flattened patch
(the checkpoint's 5-D kernel is reshaped at load). Patches come block-major: every
``merge x merge`` square of patches is consecutive, which is what the PatchMerger
concatenates into one LLM token.

Each block is pre-norm attention + MLP. q and k are rotated by a 2D RoPE: the first
quarter of the frequencies by the patch's row, the second by its column (in float32,
as transformers). Attention is non-causal within one frame of one image or video (the
segments of :func:`encoder_attention_context`); Qwen2.5-VL's blocks outside
``fullatt_block_indexes`` attend within windows of ``window_size`` pixels instead, over
patches reordered window by window (``get_window_index``) and put back in order after
the merger.

Qwen2-VL: LayerNorm, ``fc1 -> act -> fc2`` MLP, LayerNorm merger. Qwen2.5-VL: RMSNorm,
gated MLP with biases, RMSNorm merger.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.vision import encoder_attention_context
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.bert import Activation
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.weight_utils import StackedParam, load_named_weights

VISION_STACKED = (
    StackedParam(".attn.qkv_proj.", ".attn.q_proj.", "q"),
    StackedParam(".attn.qkv_proj.", ".attn.k_proj.", "k"),
    StackedParam(".attn.qkv_proj.", ".attn.v_proj.", "v"),
    StackedParam(".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
    StackedParam(".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
)


def _norm(size: int, ctx: ModelInitContext, rms: bool) -> nn.Module:
    if rms:
        return RMSNorm(size, 1e-6, dtype=ctx.dtype, device=ctx.device)
    return nn.LayerNorm(size, eps=1e-6, dtype=ctx.dtype, device=ctx.device)


def vision_positions(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """``[patches, 2]`` (row, column) of every patch, block-major over merge squares
    (transformers' ``get_vision_position_ids``)."""
    out = []
    for t, h, w in grids:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
    return np.concatenate(out)


def window_index(grids: list[tuple[int, int, int]], merge: int, window: int
                 ) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's window order of the merged tokens and the windows' patch counts
    (transformers' ``get_vision_window_index``; empty windows dropped)."""
    index, lens, offset = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        ids = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = window - gh % window, window - gw % window
        padded = np.pad(ids, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
        padded = padded.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, window * window)
        counts = (padded >= 0).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat >= 0] + offset)
        lens.extend(int(c) * merge * merge for c in counts if c)
        offset += t * gh * gw
    return np.concatenate(index), lens


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        self.head_size = dim // heads
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.qkv_proj = QKVLinear(dim, self.head_size, heads, heads, bias=True, **common)
        local = self.qkv_proj.num_heads
        self.attn = Attention(local, self.head_size, self.head_size**-0.5, local, layer_idx,
                              ctx.attn_backend, causal=False)
        self.proj = RowParallelLinear(dim, dim, bias=True, **common)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(shape[0], -1, self.head_size).float()
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(dtype).reshape(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        return self.proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class VisionMLP(nn.Module):
    """``fc1 -> act -> fc2`` (Qwen2-VL) or the gated ``gate_up_proj`` (Qwen2.5-VL)."""

    def __init__(self, dim: int, hidden: int, act: str, gated: bool,
                 ctx: ModelInitContext) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.gated = gated
        if gated:
            self.gate_up_proj = MergedLinear(dim, {0: hidden, 1: hidden}, bias=True, **common)
            self.act = get_act_and_mul(act, ctx.fused_ops, ctx.dtype)
            self.down_proj = RowParallelLinear(hidden, dim, bias=True, **common)
        else:
            self.fc1 = ColumnParallelLinear(dim, hidden, bias=True, **common)
            self.act = Activation(act)
            self.fc2 = RowParallelLinear(hidden, dim, bias=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_up_proj(x)))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str, qwen25: bool,
                 ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(dim, ctx, qwen25), _norm(dim, ctx, qwen25)
        self.attn = VisionAttention(dim, heads, ctx, layer_idx)
        self.mlp = VisionMLP(dim, mlp_hidden, act, qwen25, ctx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then ``merge**2`` consecutive patches concatenated through a 2-layer MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool,
                 ctx: ModelInitContext) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.ln_q = _norm(dim, ctx, rms)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.hidden, self.hidden, bias=True, **common),
            nn.GELU(),
            RowParallelLinear(self.hidden, out_dim, bias=True, **common),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Both towers; ``qwen25`` picks Qwen2.5-VL's norms, MLP and windowed attention."""

    def __init__(self, vision_config: Any, ctx: ModelInitContext, qwen25: bool) -> None:
        super().__init__()
        c = vision_config
        self.ctx, self.qwen25 = ctx, qwen25
        self.merge, self.patch_size = c.spatial_merge_size, c.patch_size
        dim = c.hidden_size if qwen25 else c.embed_dim
        out_dim = c.out_hidden_size if qwen25 else c.hidden_size
        mlp_hidden = c.intermediate_size if qwen25 else int(c.embed_dim * c.mlp_ratio)
        self.head_size = dim // c.num_heads
        patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = ReplicatedLinear(patch_dim, dim, bias=False, **ctx.matrix_dtypes,
                                                 device=ctx.device)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, c.num_heads, mlp_hidden, c.hidden_act, qwen25, ctx, i)
            for i in range(c.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen25, ctx)
        self.window = (c.window_size // self.merge // self.patch_size) if qwen25 else None
        self.full_blocks = set(getattr(c, "fullatt_block_indexes", ()) or ()) if qwen25 else None
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = self.head_size // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq.to(ctx.device), persistent=False)

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.from_numpy(positions).to(self.ctx.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head/2]: h then w
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``[sum(t*h*w) // merge**2, out_dim]``: the merged tokens of every item, in order."""
        x = self.patch_embed.proj(pixels.to(device=self.ctx.device, dtype=self.ctx.dtype))
        cos, sin = self._cos_sin(vision_positions(grids, self.merge))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        layer_lens = None
        order = None
        if self.qwen25:
            index, window_lens = window_index(grids, self.merge, self.window)
            unit = self.merge * self.merge
            order = torch.from_numpy(index).to(self.ctx.device)

            def permute(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(-1, unit, *t.shape[1:])[order].reshape(t.shape)

            x, cos, sin = permute(x), permute(cos), permute(sin)
            layer_lens = [frames if i in self.full_blocks else window_lens
                          for i in range(len(self.blocks))]
        with encoder_attention_context(self.ctx.attn_backend, frames, self.ctx.device,
                                       layer_seq_lens=layer_lens):
            for block in self.blocks:
                x = block(x, cos, sin)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower-relative checkpoint names (``blocks.0.attn.qkv.weight``): the fused
        qkv tensor is cut into its q / k / v shards, the Conv3d kernel flattened. Tensors
        may be torch tensors or the loader's lazy ones."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "patch_embed.proj.weight":
                    yield name, materialize(tensor).reshape(tensor.shape[0], -1)
                elif ".attn.qkv." in name:  # narrow: a lazy tensor reads only its rows
                    rows = tensor.shape[0] // 3
                    for i, part in enumerate("qkv"):
                        yield (name.replace(".attn.qkv.", f".attn.{part}_proj."),
                               tensor.narrow(0, i * rows, rows))
                else:
                    yield name, tensor

        return load_named_weights(self, renamed(), stacked=VISION_STACKED)
