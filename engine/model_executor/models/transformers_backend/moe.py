"""transformers 5's fused expert modules on the platform's fused-MoE kernel.

transformers 5 stores a MoE layer's experts as one module with 3-D parameters
(``gate_up_proj [E, 2I, H]`` -- gate rows then up rows -- and ``down_proj [E, H, I]``),
called as ``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])`` by the
model's own router (classes decorated with ``use_experts_implementation``). Such a module
is replaced by :class:`EngineExperts`, an engine :class:`FusedMoE` (the same ``w13`` /
``w2`` stacking, tensor- and expert-parallel sharding, expert-load counts) that takes the
router's choice as given and runs the platform kernel. The routing stays transformers'.

Checkpoints name experts either per expert (``experts.{e}.gate_proj.weight`` / ``w1`` ...,
the legacy layout save_pretrained writes back) or fused (``experts.gate_up_proj``); both
load (:func:`expert_name_mapper`, :func:`split_fused_experts`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import FusedMoE, RouterConfig
from engine.model_executor.lazy_tensor import materialize

logger = logging.getLogger(__name__)
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                          r"\.weight$")
_PART = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2",
         "w2": "w2"}


def _is_fused_experts(module: nn.Module) -> bool:
    params = module._parameters
    return (getattr(module, "has_gate", None) is not None and "gate_up_proj" in params
            and "down_proj" in params)


def _activation(module: nn.Module, config: Any) -> str:
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu")
    return {"swish": "silu"}.get(act, act)


class EngineExperts(FusedMoE):
    """A transformers experts module's forward on the engine's fused-MoE kernel."""

    def __init__(self, hf_experts: nn.Module, name: str, config: Any, ctx: Any) -> None:
        num_experts, two_inter, hidden = hf_experts.gate_up_proj.shape
        top_k = int(getattr(config, "num_experts_per_tok", None)
                    or getattr(config, "top_k", None) or getattr(config, "moe_topk", 1))
        if isinstance(top_k, (list, tuple)):
            top_k = int(top_k[0])
        super().__init__(RouterConfig(num_experts, min(top_k, num_experts)), hidden,
                         two_inter // 2, dtype=ctx.dtype, device=ctx.device,
                         kernels=ctx.moe_kernels, tp=ctx.tp,
                         expert_parallel=ctx.expert_parallel, ep=ctx.ep,
                         activation=_activation(hf_experts, config))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        weights, ids = top_k_weights.float(), top_k_index.long()
        self.load.observe(ids)
        if self.expert_parallel:
            return self._forward_expert_parallel(hidden, weights, ids)
        out = self.kernel.apply(hidden, self.w13, self.w2, weights, ids, self.activation)
        if self.outputs_partial_sums:
            out = self.comm.all_reduce(out)
        return out.to(hidden.dtype)


def _unsupported_layout(module: nn.Module) -> str | None:
    """Why the fused-MoE kernel cannot take ``module``'s experts (None: it can)."""
    for flag, ok in (("has_bias", False), ("is_transposed", False),
                     ("is_concatenated", True), ("has_post_expert_norm", False),
                     ("has_gate", True)):
        if bool(getattr(module, flag, ok)) != ok:
            return f"{flag}={not ok}"
    if type(module)._apply_gate is not _default_apply_gate():
        return "a custom gate"
    return None


def _default_apply_gate() -> Any:
    from transformers.integrations.moe import _default_apply_gate as default

    return default


def replace_experts(model: nn.Module, ctx: Any) -> int:
    """Swap every fused transformers experts module of ``model`` whose layout the
    fused-MoE kernel takes for an EngineExperts; others keep transformers' code."""
    config = model.text_config
    replaced = 0
    for name, module in list(model.named_modules()):
        if not _is_fused_experts(module):
            continue
        why = _unsupported_layout(module)
        if why is not None:
            logger.info("%s: experts with %s stay on transformers' experts code", name, why)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, EngineExperts(module, name, config, ctx))
        replaced += 1
    return replaced


def expert_name_mapper(model: nn.Module) -> Any:
    """``experts.{e}.gate_proj.weight`` -> ``(experts.w13, ("w1", e))`` and the like."""
    params = {n for n, _ in model.named_parameters()}

    def mapper(name: str) -> tuple[str, Any] | None:
        m = _EXPERT_NAME.match(name)
        if m is None:
            return None
        prefix, expert, part = m.group(1), int(m.group(2)), _PART[m.group(3)]
        target = f"{prefix}.{'w2' if part == 'w2' else 'w13'}"
        if target not in params:
            return None
        return target, (part, expert)

    return mapper


def split_fused_experts(model: nn.Module, name: str, tensor: Any
                        ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """A fused checkpoint tensor (``experts.gate_up_proj`` / ``experts.down_proj``) as
    per-expert tensors under their legacy names (None: ``name`` is no such tensor)."""
    for suffix, parts in ((".gate_up_proj", ("gate_proj", "up_proj")),
                          (".down_proj", ("down_proj",))):
        base = name.removesuffix(".weight")
        if not base.endswith(suffix):
            continue
        prefix = base[: -len(suffix)]
        experts = _get(model, prefix)
        if not isinstance(experts, EngineExperts):
            return None
        full = materialize(tensor)
        return _per_expert(prefix, parts, full)
    return None


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _per_expert(prefix: str, parts: tuple[str, ...], full: torch.Tensor
                ) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(full.shape[0]):
        chunks = full[e].chunk(len(parts), dim=0)
        for part, chunk in zip(parts, chunks):
            yield f"{prefix}.{e}.{part}.weight", chunk
