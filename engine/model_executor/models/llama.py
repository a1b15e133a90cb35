"""The Llama decoder family: Llama, Mistral, Qwen2 (and, via qwen3.py, Qwen3).

These architectures share one decoder layer; what differs is a handful of switches
read from the HF config into :class:`DecoderOptions` by each class's
``decoder_options``: biases on the projections, per-head q/k RMSNorm, the head size,
and which layers use a sliding window.

Parameter layout: q/k/v are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``
(one GEMM each); ``load_weights`` fuses HF checkpoint tensors at load time.

Tensor parallel: q/k/v and gate/up are column parallel, o_proj and down_proj row parallel
(one all-reduce after attention, one after the MLP), the embedding and LM head vocab
parallel. Pipeline parallel: a stage builds its layer range (the other indices hold
:class:`PPMissingLayer`, so parameter names stay the checkpoint's), the first stage the
embedding, the last the final norm and the LM head (a tied head then loads the
embedding's tensor itself).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from engine.model_executor.layers.norm import RMSNorm, residual_norm
from engine.model_executor.layers.rotary import (
    RopeInputs,
    RotaryEmbedding,
    rope_scaling_from_config,
)
from engine.model_executor.models.interface import (
    IntermediateTensors,
    ModelInitContext,
    ModelKVSpec,
)
from engine.model_executor.weight_utils import StackedParam, load_named_weights

STACKED_PARAMS = (
    StackedParam(".qkv_proj.", ".q_proj.", "q"),
    StackedParam(".qkv_proj.", ".k_proj.", "k"),
    StackedParam(".qkv_proj.", ".v_proj.", "v"),
    StackedParam(".gate_up_proj.", ".gate_proj.", 0),
    StackedParam(".gate_up_proj.", ".up_proj.", 1),
)
SKIPPED_TENSORS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class DecoderOptions:
    """The config switches that tell the family members apart."""

    head_size: int
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty: all full attention
    attn_scale: float | None = None  # softmax scale; None: head_size ** -0.5
    attn_soft_cap: float | None = None  # attention logit soft-capping (Gemma 2)

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_windows[layer_idx] if self.sliding_windows else None


def config_head_size(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def layer_type_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` (Qwen2/Qwen3 style configs)."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    if window is None or not getattr(hf_config, "use_sliding_window", False):
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first = getattr(hf_config, "max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(num_layers))
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


class LlamaMLP(nn.Module):
    """Gated MLP; ``intermediate_size`` overrides the config's (a MoE layer's shared
    expert), ``reduce_results`` False leaves the TP all-reduce to the caller."""

    def __init__(
        self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions, prefix: str,
        intermediate_size: int | None = None, reduce_results: bool = True,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        inter = intermediate_size or hf_config.intermediate_size
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.gate_up_proj = MergedLinear(
            hidden, {0: inter, 1: inter}, bias=opts.mlp_bias, **common, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.gate_proj", f"{prefix}.up_proj"),
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=opts.mlp_bias, **common, tp=ctx.tp,
            reduce_results=reduce_results,
            quant_method=ctx.linear_method(f"{prefix}.down_proj"),
        )
        self.act_fn = get_act_and_mul(hf_config.hidden_act, ctx.fused_ops, ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        ctx: ModelInitContext,
        opts: DecoderOptions,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        cache_index: int | None = None,
    ) -> None:
        """``cache_index``: this layer's KV cache among the model's attention layers (None:
        its layer index within the stage; hybrids with state layers count only attention
        layers)."""
        super().__init__()
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_size = opts.head_size
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVLinear(
            hf_config.hidden_size,
            self.head_size,
            num_heads,
            num_kv_heads,
            bias=opts.qkv_bias,
            **common,
            tp=ctx.tp,
            quant_method=ctx.linear_method(*(f"{prefix}.{p}_proj" for p in "qkv")),
        )
        # This rank's heads (all of them on one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            num_heads * self.head_size, hf_config.hidden_size, bias=opts.o_proj_bias,
            **common, tp=ctx.tp, quant_method=ctx.linear_method(f"{prefix}.o_proj"),
        )
        if opts.qk_norm:
            self.q_norm = self.make_head_norm(self.head_size, hf_config.rms_norm_eps, ctx)
            self.k_norm = self.make_head_norm(self.head_size, hf_config.rms_norm_eps, ctx)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            opts.attn_scale or self.head_size**-0.5,
            self.num_kv_heads,
            layer_idx,
            ctx.attn_backend,
            sliding_window=opts.window(layer_idx),
            logits_soft_cap=opts.attn_soft_cap,
            cache_index=(layer_idx - ctx.stage_layers(hf_config.num_hidden_layers).start
                         if cache_index is None else cache_index),
            **self.extra_attention_args(ctx),
        )

    @staticmethod
    def make_head_norm(head_size: int, eps: float, ctx: ModelInitContext) -> nn.Module:
        """The per-head q/k norm (``opts.qk_norm``); family members override it."""
        return RMSNorm(head_size, eps, dtype=ctx.dtype, device=ctx.device,
                       fused_ops=ctx.fused_ops)

    def extra_attention_args(self, ctx: ModelInitContext) -> dict[str, Any]:
        """More keywords for this layer's :class:`Attention` (e.g. sinks)."""
        return {}

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        shape = x.shape
        return norm(x.reshape(shape[0], -1, self.head_size)).view(shape)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.shard_sizes["q"], self.qkv_proj.shard_sizes["k"]
        if self.q_norm is None:  # q and k heads side by side: one rotary pass for both
            qk = self.rotary_emb.apply(qkv[:, : q_size + kv_size], rope)
            q, k = qk.split([q_size, kv_size], dim=-1)
            v = qkv[:, q_size + kv_size :]
        else:
            q, k, v = self.qkv_proj.split(qkv)
            q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
            q, k = self.rotary_emb.apply(q, rope), self.rotary_emb.apply(k, rope)
        return self.o_proj(self.attn(q, k, v))


class PreNormDecoderLayer(nn.Module):
    """The pre-norm residual block of every decoder built on Llama's: ``input_layernorm``,
    the token mixer (:meth:`mix`: attention here; Mamba in hybrids), the second norm
    (``post_norm_name``), then the feed-forward block (``mlp_name``). The norms add the
    residual as they normalize (:class:`RMSNorm` with a residual)."""

    mlp_name = "mlp"
    post_norm_name = "post_attention_layernorm"

    def mix(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.self_attn(rope, hidden)

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.mix(rope, hidden)
        hidden, residual = getattr(self, self.post_norm_name)(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        hf_config: Any,
        ctx: ModelInitContext,
        opts: DecoderOptions,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        make_mlp: Any = None,
        make_attention: Any = None,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        common = {"dtype": ctx.dtype, "device": ctx.device}
        self.self_attn = (make_attention or LlamaAttention)(hf_config, ctx, opts, layer_idx,
                                                           rotary_emb)
        # The feed-forward block under its checkpoint name ("mlp", Mixtral's
        # "block_sparse_moe"): a dense MLP or a mixture of experts.
        make_mlp = make_mlp or LlamaForCausalLM.make_mlp
        self.mlp_name, mlp = make_mlp(hf_config, ctx, opts, layer_idx)
        self.add_module(self.mlp_name, mlp)
        common = {**common, "fused_ops": ctx.fused_ops}
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, **common)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, **common)


class PPMissingLayer(nn.Module):
    """The place of a module another pipeline stage holds (no parameters)."""


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 make_mlp: Any = None, make_attention: Any = None, make_layer: Any = None,
                 make_rotary: Any = None) -> None:
        super().__init__()
        common = {"dtype": ctx.dtype, "device": ctx.device}
        fused = {"fused_ops": ctx.fused_ops}
        self.is_first_stage, self.is_last_stage = ctx.is_first_stage, ctx.is_last_stage
        self.embed_tokens: nn.Module = PPMissingLayer()
        if self.is_first_stage:
            self.embed_tokens = VocabEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, **ctx.matrix_dtypes,
                device=ctx.device, **fused, tp=ctx.tp,
            )
        rotary_emb = make_rotary(hf_config, ctx, opts) if make_rotary else RotaryEmbedding(
            opts.head_size, rope_scaling_from_config(hf_config), **common, **fused
        )
        self.rotary_emb = rotary_emb  # shared by every layer
        self.stage_layers = ctx.stage_layers(hf_config.num_hidden_layers)
        make_layer = make_layer or LlamaDecoderLayer
        self.layers = nn.ModuleList(
            make_layer(hf_config, ctx, opts, i, rotary_emb, make_mlp, make_attention)
            if i in self.stage_layers else PPMissingLayer()
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm: nn.Module = PPMissingLayer()
        if self.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **common, **fused)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``inputs_embeds``: the first stage's input rows when the caller embedded the
        tokens itself (a vision-language model's text with image embeddings merged)."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary_emb.prepare(positions)  # once per forward, for every layer
        for i in self.stage_layers:
            hidden, residual = self.layers[i](rope, hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, hidden if residual is None else residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama; also the base of the other family members (override ``decoder_options``)."""

    supports_pipeline_parallel = True
    attention_cls: Any = None  # None: LlamaAttention (MLA models name theirs)
    decoder_layer_cls: Any = None  # None: LlamaDecoderLayer (same constructor signature)
    make_rotary: Any = None  # None: RotaryEmbedding; else (hf_config, ctx, opts) -> rotary
    stacked_params: tuple[StackedParam, ...] = STACKED_PARAMS

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        self.config = hf_config
        self.opts = self.decoder_options(hf_config)
        windows = self.opts.sliding_windows
        if windows and len(windows) != hf_config.num_hidden_layers:
            raise ValueError(
                f"config gives {len(windows)} layer types for {hf_config.num_hidden_layers} layers"
            )
        self.vocab_size = hf_config.vocab_size
        self.head_size = self.opts.head_size
        self.activation_dtype = ctx.dtype  # what a pipeline stage hands the next
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.model = LlamaModel(hf_config, ctx, self.opts, self.make_mlp, self.attention_cls,
                                self.decoder_layer_cls, self.make_rotary)
        self.stage_layers = self.model.stage_layers
        self.num_layers, self.num_kv_heads = self.kv_layout()
        self.init_lm_head(hf_config, ctx)

    def kv_layout(self) -> tuple[int, int]:
        """This rank's KV cache layers and its KV heads per layer (hybrids whose other
        layers keep a state count their attention layers only)."""
        first = self.model.layers[self.stage_layers.start]
        return len(self.stage_layers), first.self_attn.num_kv_heads

    def init_lm_head(self, hf_config: Any, ctx: ModelInitContext,
                     tie_by_default: bool = False) -> None:
        """``lm_head`` on the last stage (tied to the embedding when the config says so,
        ``tie_by_default`` when it is silent); a tied head on a stage without the
        embedding loads the embedding's tensor itself (``head_reads_embedding``)."""
        self.lm_head: nn.Module = PPMissingLayer()
        self.head_reads_embedding = False
        if ctx.is_last_stage:
            self.lm_head = LMHead(
                hf_config.vocab_size, hf_config.hidden_size, **ctx.matrix_dtypes,
                device=ctx.device, tp=ctx.tp,
            )
            if getattr(hf_config, "tie_word_embeddings", tie_by_default):
                if ctx.is_first_stage:
                    self.lm_head.tie_to(self.model.embed_tokens)
                else:
                    self.head_reads_embedding = True

    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        """Layer ``layer_idx``'s feed-forward block and its checkpoint name (MoE members
        of the family override this)."""
        return "mlp", LlamaMLP(hf_config, ctx, opts, f"model.layers.{layer_idx}.mlp")

    def load_name_mapper(self):
        """Checkpoint names that carry a shard id themselves (MoE experts); None here."""
        return

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            qkv_bias=bias,
            o_proj_bias=bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is None:  # family members whose model takes no inputs_embeds
            return self.model(input_ids, positions, intermediate)
        return self.model(input_ids, positions, intermediate, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer would see (``forward``'s
        ``inputs_embeds`` when a vision-language model merges image rows into them)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        windows = self.opts.sliding_windows or (None,) * self.config.num_hidden_layers
        mine = tuple(windows[i] for i in self.stage_layers)
        return ModelKVSpec(self.num_layers, self.num_kv_heads, self.head_size, mine)

    def _other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) not in self.stage_layers
        if name.startswith("model.embed_tokens."):
            return not (self.model.is_first_stage or self.head_reads_embedding)
        if name.startswith(("model.norm.", "lm_head.")):
            return not self.model.is_last_stage
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; an absent ``lm_head.weight`` ties the head to the
        embedding. Tensors of other pipeline stages are skipped unread."""
        head = self.lm_head if isinstance(self.lm_head, LMHead) else None
        tied = head is not None and (head.tied or self.head_reads_embedding)
        has_embedding = isinstance(self.model.embed_tokens, VocabEmbedding)

        def mine() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if self._other_stage(name):
                    continue
                if name == "model.embed_tokens.weight" and self.head_reads_embedding:
                    yield "lm_head.weight", tensor
                    if not has_embedding:
                        continue
                yield name, tensor

        loaded = load_named_weights(
            self,
            mine(),
            stacked=self.stacked_params,
            skip_substrings=SKIPPED_TENSORS,
            ignore={"lm_head.weight"} if tied and not self.head_reads_embedding else (),
            optional=() if tied or head is None else {"lm_head.weight"},
            name_mapper=self.load_name_mapper(),
        )
        if head is not None and not tied and "lm_head.weight" not in loaded:
            if not has_embedding:
                raise ValueError("checkpoint lacks lm_head.weight (a pipeline stage without "
                                 "the embedding cannot tie its head to it)")
            if "model.embed_tokens.weight" not in loaded:
                raise ValueError("checkpoint lacks both lm_head.weight and the embedding")
            head.tie_to(self.model.embed_tokens)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window on every layer."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        window = getattr(hf_config, "sliding_window", None)
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            sliding_windows=(window,) * hf_config.num_hidden_layers,
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases and per-layer sliding windows (``use_sliding_window``)."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            qkv_bias=True,
            sliding_windows=layer_type_windows(hf_config),
        )
