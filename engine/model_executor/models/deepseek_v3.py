"""DeepSeek-V3 (and V2-style configs): multi-head latent attention and grouped-routing MoE.

Attention (MLA). Each token's keys and values come from one compressed latent
``c = norm(W_dkv x)`` of ``kv_lora_rank`` (L) dims plus one rotated key part ``k_pe`` of
``qk_rope_head_dim`` (R) dims shared by all heads; only ``[c, k_pe]`` is cached (L + R
values per token and layer, against ``2 * heads * head_dim`` for MHA). The key and value
up-projections (``kv_b_proj``: per head ``W_uk [nope, L]`` and ``W_uv [v, L]``) are
absorbed: a head's query becomes ``[q_nope W_uk, q_pe]`` so it scores the cached entries
directly, the attention output stays in latent space (``[T, H, L]``) and ``W_uv`` maps it
to the head's values before ``o_proj``. Scores equal the expanded form's
``q_nope . k_nope + q_pe . k_pe``. With ``rope_interleave`` the checkpoint's rotary dims
are interleaved pairs; they are de-interleaved before the (NeoX-style) rotation, which
leaves every dot product as transformers computes it.

Feed-forward: the first ``first_k_dense_replace`` layers are dense MLPs; the rest are MoE
blocks with sigmoid scores, grouped top-k over ``n_group`` groups (``topk_group`` kept),
an ``e_score_correction_bias`` for the choice, ``routed_scaling_factor`` on the weights,
and ``n_shared_experts`` shared experts.

Tensor parallel: heads split across ranks (q / kv_b column parallel, o_proj row parallel);
the latent projection and the cache entries are replicated (every head reads them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.fused_moe import RouterConfig
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    tp_rank_size,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding, yarn_mscale
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.llama import (
    STACKED_PARAMS,
    DecoderOptions,
    LlamaForCausalLM,
    LlamaMLP,
)
from engine.model_executor.models.moe_block import SparseMoeBlock, expert_name_mapper

# Only gate/up fuse (MLA's projections keep their checkpoint names).
MLA_STACKED_PARAMS = tuple(p for p in STACKED_PARAMS if p.target == ".gate_up_proj.")


def mla_softmax_scale(hf_config: Any) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's mscale squared for a stretched context."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                     None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_mscale(params["factor"], mscale_all_dim)
            scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        ctx: ModelInitContext,
        opts: DecoderOptions,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        c = hf_config
        rank, size = tp_rank_size(ctx.tp)
        if c.num_attention_heads % size:
            raise ValueError(f"{c.num_attention_heads} attention heads are not divisible by "
                             f"tensor_parallel_size={size}")
        self.num_heads = c.num_attention_heads // size  # this rank's
        self.num_kv_heads = 1  # one latent entry per token
        self.nope, self.rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = c.v_head_dim, c.kv_lora_rank
        self.interleaved = bool(getattr(c, "rope_interleave", False))
        qk_head = self.nope + self.rope
        bias = bool(getattr(c, "attention_bias", False))
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        norm = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, self.q_lora_rank, bias=bias, **common,
                                             quant_method=ctx.linear_method(f"{prefix}.q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, c.rms_norm_eps, **norm)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, c.num_attention_heads * qk_head, bias=False, tp=ctx.tp,
                **common, quant_method=ctx.linear_method(f"{prefix}.q_b_proj"))
        else:
            self.q_proj = ColumnParallelLinear(
                c.hidden_size, c.num_attention_heads * qk_head, bias=False, tp=ctx.tp, **common,
                quant_method=ctx.linear_method(f"{prefix}.q_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            c.hidden_size, self.kv_lora_rank + self.rope, bias=bias, **common,
            quant_method=ctx.linear_method(f"{prefix}.kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, c.rms_norm_eps, **norm)
        # Loaded, then absorbed into w_uk / w_uv (process_weights_after_loading).
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, c.num_attention_heads * (self.nope + self.v_head_dim),
            bias=False, tp=ctx.tp, **common,
            quant_method=ctx.linear_method(f"{prefix}.kv_b_proj"))
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * self.v_head_dim, c.hidden_size, bias=bias, tp=ctx.tp,
            **common, quant_method=ctx.linear_method(f"{prefix}.o_proj"))
        self.rotary_emb = rotary_emb
        self.dtype = ctx.dtype
        self.attn = Attention(
            self.num_heads, self.kv_lora_rank + self.rope, mla_softmax_scale(c), 1, layer_idx,
            ctx.attn_backend, kv_lora_rank=self.kv_lora_rank,
            cache_index=layer_idx - ctx.stage_layers(c.num_hidden_layers).start,
        )

    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into the absorbed per-head ``w_uk [H, nope, L]`` and
        ``w_uv [H, v, L]`` (then drop it: nothing multiplies by it as a whole)."""
        layer = self.kv_b_proj
        weight = layer.weight if hasattr(layer, "weight") else None
        if weight is None or weight.dim() != 2:
            raise ValueError("MLA needs an unquantized kv_b_proj to absorb it into the "
                             "attention (a quantized kv_b_proj is not supported)")
        per_head = weight.detach().to(self.dtype).view(self.num_heads, self.nope + self.v_head_dim,
                                                       self.kv_lora_rank)
        self.register_buffer("w_uk", per_head[:, : self.nope].contiguous(), persistent=False)
        self.register_buffer("w_uv", per_head[:, self.nope :].contiguous(), persistent=False)
        del self.kv_b_proj

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """``(x0, x1), (x2, x3) ...`` pairs -> evens then odds, per head."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope],
                                                             dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        if self.interleaved:
            q_pe, k_pe = self._deinterleave(q_pe), self._deinterleave(k_pe)
        q_pe = self.rotary_emb.apply(q_pe.reshape(tokens, -1).contiguous(), rope)
        k_pe = self.rotary_emb.apply(k_pe.contiguous(), rope)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)
        query = torch.cat((q_latent, q_pe.view(tokens, self.num_heads, self.rope)), dim=-1)
        entry = torch.cat((latent, k_pe.view(tokens, self.rope)), dim=-1)
        out = self.attn(query.reshape(tokens, -1), entry, None)  # [T, H, L]
        values = torch.einsum("thl,hvl->thv", out, self.w_uv)
        return self.o_proj(values.reshape(tokens, self.num_heads * self.v_head_dim))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    attention_cls = DeepseekV3Attention
    stacked_params = MLA_STACKED_PARAMS

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(head_size=hf_config.qk_rope_head_dim)

    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        prefix = f"model.layers.{layer_idx}.mlp"
        experts = getattr(hf_config, "n_routed_experts", None)
        if not experts or layer_idx < getattr(hf_config, "first_k_dense_replace", 0) or (
                layer_idx % getattr(hf_config, "moe_layer_freq", 1)):
            return "mlp", LlamaMLP(hf_config, ctx, opts, prefix)
        scoring = getattr(hf_config, "scoring_func", "sigmoid")
        router = RouterConfig(
            experts, hf_config.num_experts_per_tok, scoring=scoring,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
            num_groups=getattr(hf_config, "n_group", None) or 1,
            topk_groups=getattr(hf_config, "topk_group", None) or 1,
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        )
        shared = getattr(hf_config, "n_shared_experts", 0) or 0
        inter = hf_config.moe_intermediate_size
        make_shared = (lambda: LlamaMLP(hf_config, ctx, opts, f"{prefix}.shared_experts",
                                        inter * shared, reduce_results=False)) if shared else None
        return "mlp", SparseMoeBlock(
            hf_config, ctx, router, inter, shared_expert=make_shared,
            shared_expert_name="shared_experts",
            correction_bias=getattr(hf_config, "topk_method", "noaux_tc") == "noaux_tc",
            router_dtype=torch.float32,
        )

    def load_name_mapper(self):
        return expert_name_mapper

    def kv_cache_spec(self) -> ModelKVSpec:
        c = self.config
        windows = tuple(None for _ in self.stage_layers)
        return ModelKVSpec(self.num_layers, 1, c.kv_lora_rank + c.qk_rope_head_dim, windows,
                           mla=True)
