"""The Gemma family: Gemma (1), Gemma 2 and Gemma 3 (text only), as transformers runs them.

What sets them apart from Llama (and which member has it):

- RMSNorm ``x / rms(x) * (1 + w)`` in float32 (:class:`GemmaRMSNorm`), all three;
- the embedding scaled by ``sqrt(hidden_size)`` (rounded to the embedding's dtype), all;
- a GeLU (tanh) gated MLP (``hidden_act`` in Gemma, ``hidden_activation`` in 2 and 3);
- attention scale ``query_pre_attn_scalar ** -0.5`` (2, 3; Gemma's is ``head_dim ** -0.5``);
- "sandwich" norms: the attention and MLP outputs are normalized again before the
  residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``; the MLP's
  input norm is ``pre_feedforward_layernorm``) (2, 3);
- sliding-window attention on the layers ``layer_types`` marks ``sliding_attention``
  (2, 3). HF's window of W lets a query see the W keys ending at itself (mask
  ``kv > q - W``), the engine's convention too, so the window passes unchanged;
- tanh soft-capping of the attention scores (``attn_logit_softcapping``, Gemma 2 only:
  transformers' Gemma 3 reads the setting but never applies it) and of the final logits
  (``final_logit_softcapping``, 2 and 3);
- per-head q/k norms (Gemma norms) before RoPE, and two RoPE settings, one for the
  sliding layers and one for the full ones (``rope_parameters`` keyed by layer type) (3).

Tensor and pipeline parallelism and weight loading are Llama's (the checkpoint names are
the same): this module reuses :class:`LlamaForCausalLM`'s loading and stage bookkeeping
and builds its own layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import MergedLinear, RowParallelLinear
from engine.model_executor.layers.norm import GemmaRMSNorm, residual_norm
from engine.model_executor.layers.rotary import (
    RopeInputs,
    RopeScaling,
    RotaryEmbedding,
    rope_scaling_from_config,
)
from engine.model_executor.models.interface import IntermediateTensors, ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    PPMissingLayer,
    config_head_size,
)

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class GemmaOptions:
    """The switches that tell the Gemma generations apart."""

    hidden_act: str
    attn_scale: float
    sandwich_norms: bool = False  # Gemma 2/3's post-attention and pre/post-MLP norms
    qk_norm: bool = False  # Gemma 3
    attn_soft_cap: float | None = None  # Gemma 2
    final_soft_cap: float | None = None  # Gemma 2/3
    layer_types: tuple[str, ...] = ()  # per layer; empty: all full attention
    sliding_window: int | None = None

    def window(self, layer_idx: int) -> int | None:
        if self.layer_types and self.layer_types[layer_idx] == SLIDING:
            return self.sliding_window
        return None

    def layer_type(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else FULL

    def decoder_options(self, hf_config: Any) -> DecoderOptions:
        """The Llama attention switches these options amount to."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            head_size=config_head_size(hf_config), qkv_bias=bias, o_proj_bias=bias,
            qk_norm=self.qk_norm, attn_scale=self.attn_scale, attn_soft_cap=self.attn_soft_cap,
            sliding_windows=tuple(self.window(i) for i in range(hf_config.num_hidden_layers)),
        )


def layer_types_of(hf_config: Any) -> tuple[str, ...]:
    types = tuple(getattr(hf_config, "layer_types", None) or ())
    if types and len(types) != hf_config.num_hidden_layers:
        raise ValueError(f"config gives {len(types)} layer types for "
                         f"{hf_config.num_hidden_layers} layers")
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    if SLIDING in types and not getattr(hf_config, "sliding_window", None):
        raise ValueError("config marks sliding-window layers but gives no sliding_window")
    return types


def rope_scaling_for(hf_config: Any, layer_type: str | None = None) -> RopeScaling:
    """RoPE settings of ``layer_type``'s layers (a per-type ``rope_parameters`` dict, as
    Gemma 3's config holds it) or of every layer.

    With per-type parameters the engine's context limit is ``max_position_embeddings``
    itself (a linear factor there stretches the trained positions, not the limit), so the
    table covers exactly that many positions."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is None or not isinstance(params.get(layer_type), dict):
        return rope_scaling_from_config(hf_config)
    scaling = rope_scaling_from_config(_WithRopeParameters(hf_config, params[layer_type]))
    if scaling.rope_type == "linear":
        scaling = dataclasses.replace(scaling, max_position_embeddings=math.ceil(
            scaling.max_position_embeddings / scaling.factor))
    return scaling


class _WithRopeParameters:
    """``hf_config`` seen with one layer type's ``rope_parameters``."""

    def __init__(self, hf_config: Any, rope_parameters: dict[str, Any]) -> None:
        self._config = hf_config
        self.rope_parameters = rope_parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class GemmaMLP(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, hidden_act: str, prefix: str):
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.gate_up_proj = MergedLinear(
            hidden, {0: inter, 1: inter}, bias=False, **common, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.gate_proj", f"{prefix}.up_proj"),
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=False, **common, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.down_proj"),
        )
        self.act_fn = get_act_and_mul(hidden_act, ctx.fused_ops, ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, soft-cap and zero-centred q/k norms."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: GemmaOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(hf_config, ctx, opts.decoder_options(hf_config), layer_idx,
                         rotary_emb)

    @staticmethod
    def make_head_norm(head_size: int, eps: float, ctx: ModelInitContext) -> nn.Module:
        return GemmaRMSNorm(head_size, eps, dtype=ctx.dtype, device=ctx.device)


class GemmaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with ``sandwich_norms`` each output is normalized
    again before its residual add. The residual stream travels beside the sub-layer
    output (``norm(x, residual)`` adds them), so every add is transformers' own."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: GemmaOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(hf_config, ctx, opts, layer_idx, rotary_emb)
        self.mlp = GemmaMLP(hf_config, ctx, opts.hidden_act, f"model.layers.{layer_idx}.mlp")
        norm = {"dtype": ctx.dtype, "device": ctx.device}
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, **norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, **norm)
        self.sandwich = opts.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **norm)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **norm)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(rope, hidden)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GemmaModel(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: GemmaOptions,
                 rope_per_layer_type: bool) -> None:
        super().__init__()
        common = {"dtype": ctx.dtype, "device": ctx.device}
        self.is_first_stage, self.is_last_stage = ctx.is_first_stage, ctx.is_last_stage
        self.embed_tokens: nn.Module = PPMissingLayer()
        self.normalizer = 1.0
        if self.is_first_stage:
            self.embed_tokens = VocabEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, **ctx.matrix_dtypes,
                device=ctx.device, fused_ops=ctx.fused_ops, tp=ctx.tp,
            )
            # HF scales by sqrt(hidden) cast to the embedding's dtype (sqrt(3072) -> 55.5
            # in bf16).
            self.normalizer = float(torch.tensor(hf_config.hidden_size**0.5,
                                                 dtype=self.embed_tokens.weight.dtype))
        head_size = config_head_size(hf_config)
        # One rotary table per layer type (Gemma 3: the local and the global base), else
        # one for all.
        self.rope_keys = [opts.layer_type(i) if rope_per_layer_type else "all"
                          for i in range(hf_config.num_hidden_layers)]
        self.rotary = nn.ModuleDict({
            key: RotaryEmbedding(head_size, rope_scaling_for(
                hf_config, key if rope_per_layer_type else None), **common,
                fused_ops=ctx.fused_ops)
            for key in sorted(set(self.rope_keys))
        })
        self.stage_layers = ctx.stage_layers(hf_config.num_hidden_layers)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, ctx, opts, i, self.rotary[self.rope_keys[i]])
            if i in self.stage_layers else PPMissingLayer()
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm: nn.Module = PPMissingLayer()
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **common)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings (what the first layer sees)."""
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | IntermediateTensors:
        """``inputs_embeds``: the first stage's input rows, already scaled (as
        :meth:`embed` returns them; Gemma 3's vision-language model puts its image rows
        among the *scaled* text rows, as transformers does), so they are not scaled
        again."""
        if self.is_first_stage:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        ropes = {t: rotary.prepare(positions) for t, rotary in self.rotary.items()}
        for i in self.stage_layers:
            hidden, residual = self.layers[i](ropes[self.rope_keys[i]], hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, hidden if residual is None else residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (1); the base of Gemma 2 and 3 (override ``gemma_options``).

    Loading, pipeline-stage bookkeeping and the KV spec are Llama's; ``self.opts`` is a
    Llama :class:`DecoderOptions` carrying the per-layer windows that the KV spec reads."""

    supports_pipeline_parallel = True
    rope_per_layer_type = False  # Gemma 3: one rotary table per layer type

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        nn.Module.__init__(self)
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional (encoder) Gemma configs are not supported")
        self.config = hf_config
        self.gemma_opts = self.gemma_options(hf_config)
        num_layers = hf_config.num_hidden_layers
        self.opts = DecoderOptions(
            head_size=config_head_size(hf_config),
            sliding_windows=tuple(self.gemma_opts.window(i) for i in range(num_layers)),
        )
        self.vocab_size = hf_config.vocab_size
        self.head_size = self.opts.head_size
        self.activation_dtype = ctx.dtype
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.model = GemmaModel(hf_config, ctx, self.gemma_opts, self.rope_per_layer_type)
        self.stage_layers = self.model.stage_layers
        self.num_layers = len(self.stage_layers)
        first = self.model.layers[self.stage_layers.start]
        self.num_kv_heads = first.self_attn.num_kv_heads
        self.init_lm_head(hf_config, ctx, tie_by_default=True)

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        act = hf_config.hidden_act
        # GemmaConfig's own fix-up: the legacy "gelu" of the releases meant the tanh form.
        return GemmaOptions(
            hidden_act="gelu_pytorch_tanh" if act == "gelu" else act,
            attn_scale=config_head_size(hf_config) ** -0.5,
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings (``forward``'s ``inputs_embeds``, which it does
        not scale again)."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.gemma_opts.final_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        return GemmaOptions(
            hidden_act=hf_config.hidden_activation,
            attn_scale=hf_config.query_pre_attn_scalar**-0.5,
            sandwich_norms=True,
            attn_soft_cap=getattr(hf_config, "attn_logit_softcapping", None),
            final_soft_cap=getattr(hf_config, "final_logit_softcapping", None),
            layer_types=layer_types_of(hf_config),
            sliding_window=getattr(hf_config, "sliding_window", None),
        )


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3's text decoder (``Gemma3TextConfig``, model_type ``gemma3_text``)."""

    rope_per_layer_type = True

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        # transformers' Gemma3Attention keeps attn_logit_softcapping but never passes it
        # to the attention function: scores are not capped, here neither.
        return dataclasses.replace(
            Gemma2ForCausalLM.gemma_options(hf_config), qk_norm=True, attn_soft_cap=None,
        )
