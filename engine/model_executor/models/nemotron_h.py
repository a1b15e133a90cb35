"""Nemotron-H (transformers' ``NemotronHForCausalLM``): a stack of single-mixer blocks,
RMSNorm -> mixer -> + residual, the mixer per ``layers_block_type`` (the older
``hybrid_override_pattern``): Mamba-2 ("M"), attention without positional encoding
("*"), a squared-ReLU MLP ("-") or a mixture of experts ("E", Nemotron-H v2 / 3).

Mixture-of-experts blocks (transformers' ``NemotronHMoE``): DeepSeek-V3's router (sigmoid
scores, ``e_score_correction_bias`` for the choice, grouped top-k over ``n_group`` groups
keeping ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``; the router in
float32) over ``n_routed_experts`` ungated experts (``down(relu(up x) ** 2)``: the
fused-MoE layer's ``gated=False``), plus one squared-ReLU shared expert of
``moe_shared_expert_intermediate_size`` on the block's input. With ``moe_latent_size``
the routed experts work in a latent space: ``fc1_latent_proj`` before them,
``fc2_latent_proj`` after (the router still reads the full hidden state). Refused: an
``mlp_hidden_act`` other than relu2 (for the dense, shared and routed MLPs alike),
quantized experts, and tensor parallelism in MoE blocks.

Checkpoint names: ``backbone.embeddings`` / ``backbone.layers.{i}.mixer`` /
``backbone.norm_f`` become Llama's ``model.embed_tokens`` / ``model.layers.{i}.mixer`` /
``model.norm``. Tensor parallelism runs the Mamba-2 and attention blocks (MoE blocks
refuse it, above); pipeline parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import RouterConfig
from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    dt_limit_of,
    ssm_cache_dtype,
)
from engine.model_executor.layers.norm import RMSNorm, residual_norm
from engine.model_executor.layers.rotary import RopeInputs
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.granitemoehybrid import NoRotary
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    STACKED_PARAMS,
    DecoderOptions,
    LlamaAttention,
)
from engine.model_executor.models.mamba2_hybrid import ConfigView, Mamba2HybridForCausalLM
from engine.model_executor.models.moe_block import SparseMoeBlock, expert_name_mapper

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
# Each spelling of a block kind (pattern characters, older and newer names) -> ours.
_KINDS = {"M": MAMBA, "mamba": MAMBA, "linear_attention": MAMBA,
          "*": ATTENTION, "attention": ATTENTION, "full_attention": ATTENTION,
          "-": MLP, "mlp": MLP, "E": MOE, "moe": MOE}


def block_kinds(hf_config: Any) -> list[str]:
    """Each block's mixer kind (``MAMBA``, ``ATTENTION``, ``MLP`` or ``MOE``)."""
    kinds = (getattr(hf_config, "layers_block_type", None)
             or list(getattr(hf_config, "hybrid_override_pattern", "")))
    unknown = sorted({kind for kind in kinds if kind not in _KINDS})
    if unknown or not kinds:
        raise ValueError(f"NemotronHForCausalLM: unknown block types {unknown or kinds}")
    return [_KINDS[kind] for kind in kinds]


def nemotron_h_mamba_dims(hf_config: Any) -> Mamba2Dims:
    inter = hf_config.mamba_num_heads * hf_config.mamba_head_dim
    return Mamba2Dims(
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.mamba_num_heads,
        head_dim=hf_config.mamba_head_dim,
        n_groups=hf_config.n_groups,
        d_state=hf_config.ssm_state_size,
        d_conv=hf_config.conv_kernel,
        intermediate_size=inter,
        use_bias=bool(hf_config.use_bias),
        use_conv_bias=bool(hf_config.use_conv_bias),
        chunk_size=hf_config.chunk_size,
        norm_eps=hf_config.layer_norm_epsilon,
        dt_limit=dt_limit_of(hf_config),
        activation=hf_config.mamba_hidden_act,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


class SquaredReluMLP(nn.Module):
    """``down(relu(up(x)) ** 2)`` (``mlp_hidden_act`` "relu2"; no gate)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, prefix: str,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        act = getattr(hf_config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"NemotronHForCausalLM: mlp_hidden_act {act!r} is not supported")
        hidden, inter, bias = (hf_config.hidden_size,
                               intermediate_size or hf_config.intermediate_size,
                               bool(hf_config.mlp_bias))
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.up_proj = ReplicatedLinear(hidden, inter, bias=bias, **common,
                                        quant_method=ctx.linear_method(f"{prefix}.up_proj"))
        self.down_proj = ReplicatedLinear(inter, hidden, bias=bias, **common,
                                          quant_method=ctx.linear_method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHMoE(SparseMoeBlock):
    """Router + ungated routed experts (optionally in a latent space) + the shared
    squared-ReLU expert (the module docstring)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, prefix: str) -> None:
        c = hf_config
        if ctx.tp is not None:
            raise ValueError("NemotronHForCausalLM: mixture-of-experts blocks do not support "
                             "tensor parallelism yet (tensor_parallel_size must be 1)")
        plan = ctx.quantization
        if plan is not None and (
                getattr(plan.method, "experts_method", None) is not None
                or ctx.linear_method(f"{prefix}.experts.0.up_proj") is not None):
            raise ValueError(f"NemotronHForCausalLM: quantized experts ({plan.describe()}) "
                             "are not supported (the ungated fused-MoE experts are dense)")
        act = getattr(c, "mlp_hidden_act", "relu2")
        experts = getattr(c, "n_routed_experts", None) or c.num_local_experts
        router = RouterConfig(
            experts, c.num_experts_per_tok, scoring="sigmoid",
            renormalize=bool(getattr(c, "norm_topk_prob", True)),
            num_groups=getattr(c, "n_group", None) or 1,
            topk_groups=getattr(c, "topk_group", None) or 1,
            routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0)))
        latent = getattr(c, "moe_latent_size", None)
        super().__init__(
            c, ctx, router, c.moe_intermediate_size,
            shared_expert=lambda: SquaredReluMLP(
                c, ctx, f"{prefix}.shared_experts",
                getattr(c, "moe_shared_expert_intermediate_size", None)),
            shared_expert_name="shared_experts", correction_bias=True,
            router_dtype=torch.float32, activation=act, gated=False,
            expert_hidden_size=latent)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            common = {**ctx.matrix_dtypes, "device": ctx.device}
            bias = bool(c.mlp_bias)
            self.fc1_latent_proj = ReplicatedLinear(
                c.hidden_size, latent, bias=bias, **common,
                quant_method=ctx.linear_method(f"{prefix}.fc1_latent_proj"))
            self.fc2_latent_proj = ReplicatedLinear(
                latent, c.hidden_size, bias=bias, **common,
                quant_method=ctx.linear_method(f"{prefix}.fc2_latent_proj"))

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fc1_latent_proj is None:
            return super().routed(hidden)
        bias = self.gate.e_score_correction_bias
        logits = self.gate(hidden.to(self.router_dtype))
        return self.fc2_latent_proj(self.experts(self.fc1_latent_proj(hidden), logits, bias))


class NemotronHBlock(nn.Module):
    """RMSNorm -> one mixer -> + residual (LlamaModel's layer interface)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__()
        kinds = block_kinds(hf_config)
        self.kind = kinds[layer_idx]
        before = kinds[:layer_idx]
        prefix = f"model.layers.{layer_idx}.mixer"
        if self.kind == ATTENTION:
            self.mixer = LlamaAttention(hf_config, ctx, opts, layer_idx, rotary_emb,
                                        cache_index=before.count(ATTENTION))
        elif self.kind == MAMBA:
            self.mixer = Mamba2Mixer(nemotron_h_mamba_dims(hf_config), ctx, prefix,
                                     before.count(MAMBA))
        elif self.kind == MOE:
            self.mixer = NemotronHMoE(hf_config, ctx, prefix)
        else:
            self.mixer = SquaredReluMLP(hf_config, ctx, prefix)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon,
                            dtype=ctx.dtype, device=ctx.device, fused_ops=ctx.fused_ops)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = residual_norm(self.norm, hidden, residual)
        out = self.mixer(rope, hidden) if self.kind == ATTENTION else self.mixer(hidden)
        return out, residual


class NemotronHForCausalLM(Mamba2HybridForCausalLM):
    decoder_layer_cls = NemotronHBlock
    stacked_params = tuple(p for p in STACKED_PARAMS if p.target == ".qkv_proj.")

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        if getattr(hf_config, "sliding_window", None) is not None:
            raise ValueError("NemotronHForCausalLM: sliding-window attention is not supported")
        # LlamaModel's field names: the layer count from the block types, the norms' eps.
        super().__init__(ConfigView(hf_config, num_hidden_layers=len(block_kinds(hf_config)),
                                    rms_norm_eps=hf_config.layer_norm_epsilon), ctx)

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> Any:
        return NoRotary()  # no positional encoding

    def load_name_mapper(self):
        return expert_name_mapper  # experts.{e}.up_proj / down_proj -> experts.w13 / w2

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader under Llama's names (``backbone.`` or ``model.`` prefixed);
        routed experts per expert (``experts.{e}.up_proj.weight``, as checkpoints and
        save_pretrained have them) or stacked (``experts.up_proj [E, I, H]`` /
        ``experts.down_proj [E, H, I]``, transformers' in-memory layout)."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("backbone."):
                    name = "model." + name[len("backbone."):]
                name = (name.replace("model.embeddings.", "model.embed_tokens.")
                        .replace("model.norm_f.", "model.norm."))
                stem, _, proj = name.removesuffix(".weight").rpartition(".experts.")
                if stem.endswith(".mixer") and proj in ("up_proj", "down_proj"):
                    for e in range(tensor.shape[0]):
                        yield (f"{stem}.experts.{e}.{proj}.weight",
                               materialize(tensor.narrow(0, e, 1))[0])
                    continue
                yield name, tensor

        return super().load_weights(renamed())
