"""GPT-2 (``GPT2LMHeadModel``) for the engine: an architecture the core does not ship.

Pre-norm decoder: learned absolute position embeddings added to the token embeddings,
LayerNorm (with bias) before attention and MLP, a fused ``c_attn`` projection to q/k/v,
GELU (``gelu_new``: the tanh approximation) and an LM head tied to the token embedding.

Checkpoint names are HF's (``transformer.h.{i}.attn.c_attn.weight`` ...), so the module
tree mirrors them. HF stores GPT-2's projections as ``Conv1D`` with weights ``[in, out]``;
the engine's linear layers hold ``[out, in]``: :meth:`GPT2LMHeadModel.load_weights`
transposes those four matrices per layer (a quantized checkpoint stores its own
``[out, in]`` tensors and is not transposed). One rank only (no tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.weight_utils import load_named_weights

CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                  ".mlp.c_proj.weight")
# old checkpoints save the causal-mask buffers
SKIPPED = (".attn.bias", ".attn.masked_bias")

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def _linear(ctx: ModelInitContext, in_f: int, out_f: int, prefix: str) -> ReplicatedLinear:
    return ReplicatedLinear(in_f, out_f, bias=True, **ctx.matrix_dtypes, device=ctx.device,
                            quant_method=ctx.linear_method(prefix))


def _layer_norm(size: int, eps: float, ctx: ModelInitContext) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps, dtype=ctx.dtype, device=ctx.device)
    norm.requires_grad_(False)
    return norm


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        hidden = cfg.n_embd
        self.num_heads = cfg.n_head
        self.head_size = hidden // cfg.n_head
        prefix = f"transformer.h.{layer_idx}.attn"
        self.c_attn = _linear(ctx, hidden, 3 * hidden, f"{prefix}.c_attn")
        self.c_proj = _linear(ctx, hidden, hidden, f"{prefix}.c_proj")
        scale = self.head_size ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.head_size, scale, self.num_heads,
                              layer_idx, ctx.attn_backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        prefix = f"transformer.h.{layer_idx}.mlp"
        self.c_fc = _linear(ctx, cfg.n_embd, inner, f"{prefix}.c_fc")
        self.c_proj = _linear(ctx, inner, cfg.n_embd, f"{prefix}.c_proj")
        name = cfg.activation_function
        if name not in _ACTIVATIONS:
            raise ValueError(f"GPT-2 activation_function {name!r} is not supported; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = _layer_norm(cfg.n_embd, eps, ctx)
        self.attn = GPT2Attention(cfg, ctx, layer_idx)
        self.ln_2 = _layer_norm(cfg.n_embd, eps, ctx)
        self.mlp = GPT2MLP(cfg, ctx, layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.n_embd, **common)
        self.wpe = VocabEmbedding(cfg.n_positions, cfg.n_embd, **common)
        self.h = nn.ModuleList(GPT2Block(cfg, ctx, i) for i in range(cfg.n_layer))
        self.ln_f = _layer_norm(cfg.n_embd, cfg.layer_norm_epsilon, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """``cls(hf_config, ctx)``; forward / compute_logits / load_weights / kv_cache_spec."""

    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        if ctx.tp is not None or (ctx.parallel is not None and (
                not ctx.is_first_stage or not ctx.is_last_stage)):
            raise ValueError("the example GPT-2 model runs on one rank only")
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.transformer = GPT2Model(hf_config, ctx)
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.n_embd, **ctx.matrix_dtypes,
                              device=ctx.device)
        # GPT-2 always ties its head to the token embedding
        if getattr(hf_config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.transformer.wte)
        self.head_size = hf_config.n_embd // hf_config.n_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Any = None) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        n = self.config.n_layer
        return ModelKVSpec(n, self.config.n_head, self.head_size, (None,) * n)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(("transformer.", "lm_head.")):
                    name = "transformer." + name  # GPT2Model checkpoints lack the prefix
                param = params.get(name)
                # Conv1D [in, out] -> [out, in] for dense weights; a quantized format's
                # tensors (integer codes, scales) are stored [out, in] already
                if (name.endswith(CONV1D_WEIGHTS) and param is not None
                        and param.is_floating_point()):
                    tensor = materialize(tensor).t().contiguous()
                yield name, tensor

        tied = self.lm_head.tied
        return load_named_weights(
            self, renamed(), skip_substrings=SKIPPED,
            ignore={"lm_head.weight"} if tied else (),
        )
