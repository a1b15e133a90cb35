"""Mixture-of-experts layers: the router and the experts, on the platform's fused-MoE kernel.

Routing (:func:`select_experts`) is device-neutral torch on the router logits:

- ``softmax`` scoring (Mixtral, Qwen-MoE): softmax over all experts in float32, top-k,
  optionally renormalized over the chosen k;
- ``sigmoid`` scoring with DeepSeek-V3's grouped top-k: the experts fall in ``num_groups``
  groups; a group's score is the sum of its two best (bias-corrected) expert scores; only
  experts of the ``topk_groups`` best groups may be chosen; the choice uses the scores
  plus ``e_score_correction_bias``, the weights are the uncorrected scores, renormalized,
  times ``routed_scaling_factor``.

The experts' weights are stacked per layer (``w13 [E, 2I, H]``: each expert's gate rows
then up rows; ``w2 [E, H, I]``) so one kernel call runs them all. Checkpoint tensors
(``experts.{e}.gate_proj`` / ``w1`` ...) load into their expert's slice; a model whose
checkpoint stacks a layer's experts in one tensor hands it over in this layout through
:meth:`FusedMoE.load_stacked`. With ``bias`` the experts also have ``w13_bias [E, 2I]``
and ``w2_bias [E, H]`` (GPT-OSS; the down bias is added once, by the first rank, when the
partial sums are all-reduced). Ungated experts (``gated=False``; Nemotron-H:
``down(act(up x))``, ``activation`` "relu2") have ``w13 [E, I, H]``, the up rows alone:
checkpoint ``up_proj`` / ``w3`` loads into it, a gate projection is refused, and only a
kernel that declares ``supports_ungated`` is chosen.

Parallelism, over the tensor-parallel group:

- tensor parallel (default): every rank holds every expert with ``1/tp`` of its
  intermediate features; the partial sums are all-reduced (by the caller, together with a
  shared expert's);
- expert parallel (``--enable-expert-parallel``): rank ``r`` holds experts
  ``[r E/P, (r+1) E/P)`` whole (only those are read from the checkpoint). Each rank takes
  ``1/P`` of the step's tokens, sends every (token, choice) pair to the rank that owns the
  chosen expert (all-to-all), computes what it received, sends the results back
  (all-to-all), combines its tokens' choices, and all-gathers the tokens. With data
  parallelism the EP group is every replica's TP ranks (EP = DP x TP, ``ep``): the
  replicas hold different tokens, so each TP group splits its own tokens as above and the
  all-to-alls run over the whole EP group (engine.core.dp_lockstep keeps the replicas'
  steps matched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from engine.core.interfaces import Communicator, FusedMoEKernel, MoELayerSpec
from engine.core.interfaces.moe import UNGATED_ACTIVATIONS
from engine.model_executor.layers.linear import copy_checked, divide, tp_rank_size
from engine.model_executor.lazy_tensor import materialize, split_part


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE layer picks ``top_k`` experts per token."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True
    num_groups: int = 1  # DeepSeek's n_group (1: no grouping)
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring {self.scoring!r} is not supported (softmax, sigmoid)")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, {self.num_experts}] experts")
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into "
                             f"{self.num_groups} groups")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in [1, {self.num_groups}]")


def select_experts(
    router_logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, k]`` float32 weights, ``[T, k]`` int64 expert ids)."""
    logits = router_logits.float()
    if config.scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        tokens = choice.shape[0]
        grouped = choice.view(tokens, config.num_groups, -1)
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(config.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1),
                                    float("-inf"))
    ids = choice.topk(config.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids


def select_moe_kernel(spec: MoELayerSpec, kernels: list[type[FusedMoEKernel]]) -> FusedMoEKernel:
    """The first of the platform's fused-MoE kernels that accepts ``spec``."""
    reasons = []
    for kernel_cls in kernels:
        why = kernel_cls.can_implement(spec)
        if why is None and spec.has_bias and not getattr(kernel_cls, "supports_expert_bias",
                                                         False):
            why = "it has no expert biases"
        if why is None and not spec.gated and not getattr(kernel_cls, "supports_ungated",
                                                          False):
            why = "it has no ungated experts (gated MLP experts only)"
        if why is None:
            return kernel_cls()
        reasons.append(f"{kernel_cls.name}: {why}")
    if not kernels:
        raise ValueError("this platform offers no fused-MoE kernel, so MoE models cannot run")
    raise ValueError("no fused-MoE kernel accepts this layer: " + "; ".join(reasons))


class ExpertLoad:
    """Tokens routed to each expert (global ids), summed over steps until taken."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)

    def observe(self, expert_ids: torch.Tensor) -> None:
        self.counts += torch.bincount(expert_ids.flatten(), minlength=self.counts.numel())

    def take(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts


class FusedMoE(nn.Module):
    """The routed experts of one layer (the router's logits come from the caller)."""

    def __init__(
        self,
        router: RouterConfig,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: list[type[FusedMoEKernel]],
        tp: Communicator | None = None,
        expert_parallel: bool = False,
        ep: Communicator | None = None,
        activation: str = "silu",
        bias: bool = False,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.router = router
        self.activation = activation
        self.gated = gated
        if not gated and activation not in UNGATED_ACTIVATIONS:
            raise ValueError(f"ungated experts' activation {activation!r} is not supported "
                             f"(supported: {', '.join(UNGATED_ACTIVATIONS)})")
        self.hidden_size = hidden_size
        rank, size = tp_rank_size(tp)
        self.comm = tp if size > 1 else None
        # The ranks the experts are spread over: ``ep`` when they span data-parallel
        # replicas (EP = DP x TP), else the TP group.
        ep = ep if ep is not None else tp
        ep_rank, ep_size = tp_rank_size(ep)
        self.ep_comm = ep if expert_parallel and ep_size > 1 else None
        self.expert_parallel = self.ep_comm is not None
        if self.expert_parallel:
            self.num_local_experts = divide(router.num_experts, ep_size,
                                            "the number of experts")
            self.first_expert = ep_rank * self.num_local_experts
            self.intermediate_part = (0, 1)
        else:
            self.num_local_experts = router.num_experts
            self.first_expert = 0
            self.intermediate_part = (rank, size)
        local_inter = divide(intermediate_size, self.intermediate_part[1],
                             "the experts' intermediate features")
        self.intermediate_size = local_inter
        e = self.num_local_experts
        rows13 = 2 * local_inter if gated else local_inter  # gate + up rows, or up alone
        self.w13 = nn.Parameter(torch.empty(e, rows13, hidden_size, dtype=dtype,
                                            device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, local_inter, dtype=dtype,
                                           device=device), requires_grad=False)
        local = range(self.first_expert, self.first_expert + e)
        self.w13.weight_loader = self._load_expert
        self.w13.shard_ids = tuple((part, g) for g in local
                                   for part in (("w1", "w3") if gated else ("w3",)))
        self.w2.weight_loader = self._load_expert
        self.w2.shard_ids = tuple(("w2", g) for g in local)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, rows13, dtype=dtype,
                                                     device=device), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hidden_size, dtype=dtype, device=device),
                                        requires_grad=False)
        # The down bias once over partial sums: only the first rank of a sharded layer.
        self.adds_down_bias = self.expert_parallel or rank == 0
        self.kernel = select_moe_kernel(
            MoELayerSpec(e, hidden_size, local_inter, router.top_k, dtype, torch.device(device),
                         activation, has_bias=bias, gated=gated), kernels)
        self.load = ExpertLoad(router.num_experts, torch.device(device))

    @property
    def outputs_partial_sums(self) -> bool:
        """True: the output must still be all-reduced over the TP group (experts sharded
        by their intermediate features); False: it is complete on every rank."""
        return self.comm is not None and not self.expert_parallel

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local_experts

    def _load_expert(self, param: torch.Tensor, loaded: Any, shard_id: Any) -> None:
        """Checkpoint tensor ``shard_id = (part, expert)``: ``w1`` (gate) / ``w3`` (up)
        ``[I, H]`` or ``w2`` ``[H, I]`` of global expert ``expert``. Another rank's
        expert is skipped unread."""
        part, expert = shard_id
        if not 0 <= expert < self.router.num_experts:
            raise ValueError(f"expert {expert} is outside the {self.router.num_experts} experts")
        if not self.owns(expert):
            return
        local = expert - self.first_expert
        inter = self.intermediate_size
        index, parts = self.intermediate_part
        if part == "w2":
            copy_checked(param[local], materialize(split_part(loaded, 1, index, parts)),
                         f"expert {expert} w2")
            return
        if part not in ("w1", "w3"):
            raise ValueError(f"expert weights have parts w1, w2, w3, not {part!r}")
        if not self.gated:
            if part == "w1":
                raise ValueError(f"expert {expert}: ungated experts have no gate projection "
                                 "(w1 / gate_proj)")
            rows = param[local]
        else:
            rows = param[local, :inter] if part == "w1" else param[local, inter:]
        copy_checked(rows, materialize(split_part(loaded, 0, index, parts)),
                     f"expert {expert} {part}")

    def load_stacked(self, name: str, loaded: Any) -> None:
        """A checkpoint tensor holding every expert of the layer, already in this layer's
        layout with the whole intermediate size: ``w13 [E, 2I, H]`` (gate rows, then up
        rows; ungated: ``[E, I, H]``, up rows only), ``w2 [E, H, I]``, ``w13_bias [E, 2I]``
        (ungated ``[E, I]``), ``w2_bias [E, H]``. This rank's experts and intermediate part
        are copied."""
        param = getattr(self, name, None) if name in ("w13", "w2", "w13_bias",
                                                      "w2_bias") else None
        if param is None:
            raise ValueError(f"the experts have no stacked parameter {name!r}")
        experts = self.router.num_experts
        if loaded.shape[0] != experts:
            raise ValueError(f"{name}: {loaded.shape[0]} experts, the layer has {experts}")
        mine = materialize(loaded.narrow(0, self.first_expert, self.num_local_experts))
        index, parts = self.intermediate_part
        if name in ("w13", "w13_bias") and not self.gated:
            mine = split_part(mine, 1, index, parts)
        elif name in ("w13", "w13_bias"):
            gate, up = mine.chunk(2, dim=1)
            mine = torch.cat((split_part(gate, 1, index, parts),
                              split_part(up, 1, index, parts)), dim=1)
        elif name == "w2":
            mine = split_part(mine, 2, index, parts)
        copy_checked(param, mine, f"experts {name}")

    def process_weights_after_loading(self) -> None:
        """The experts' weights in the kernel's layout (the loader calls this once, after
        any parent module derived them, e.g. GPT-OSS's MXFP4 experts)."""
        w13, w2 = self.kernel.prepare_weights(self.w13.data, self.w2.data)
        self.w13.data, self.w2.data = w13, w2  # the parameters (and their loaders) stay

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        with record_function("moe.select_experts"):
            weights, ids = select_experts(router_logits, self.router, correction_bias)
        return self.forward_routed(hidden, weights, ids)

    def forward_routed(self, hidden: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """The experts for routing the caller chose: ``weights [T, k]`` float32, ``ids
        [T, k]`` global expert ids."""
        self.load.observe(ids)
        if self.expert_parallel:
            return self._forward_expert_parallel(hidden, weights, ids)
        with record_function("moe.experts"):
            return self._apply(hidden, weights, ids)

    def _apply(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
               ) -> torch.Tensor:
        # keywords only where the layer needs them (kernels without the feature were
        # refused at selection and may not take them)
        extra: dict[str, Any] = {} if self.gated else {"gated": False}
        if self.w13_bias is not None:
            extra["w13_bias"] = self.w13_bias
            extra["w2_bias"] = self.w2_bias if self.adds_down_bias else None
        return self.kernel.apply(hidden, self.w13, self.w2, weights, ids, self.activation,
                                 **extra)

    def _forward_expert_parallel(self, hidden: torch.Tensor, weights: torch.Tensor,
                                 ids: torch.Tensor) -> torch.Tensor:
        """Dispatch (token, choice) pairs to their experts' ranks and combine them back
        (the module docstring's steps). The TP ranks of a replica hold the same tokens:
        each dispatches its share; across replicas every EP rank dispatches its own."""
        comm, ep = self.comm, self.ep_comm
        tp_size, tp_rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        size = ep.world_size
        num_tokens, top_k = ids.shape
        chunk = -(-num_tokens // tp_size)
        start = min(tp_rank * chunk, num_tokens)
        end = min((tp_rank + 1) * chunk, num_tokens)
        mine = end - start
        token = torch.arange(mine, device=hidden.device).repeat_interleave(top_k)
        expert = ids[start:end].flatten()
        dest = expert // self.num_local_experts
        order = torch.argsort(dest, stable=True)
        token, expert, dest = token[order], expert[order], dest[order]
        send_counts = torch.bincount(dest, minlength=size)
        with record_function("moe.all_to_all"):
            recv_counts = ep.all_to_all(send_counts, [1] * size, [1] * size)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            meta = torch.stack((expert.double(), weights[start:end].flatten()[order].double()),
                               1)
            rows = ep.all_to_all(hidden[start:end][token], send, recv)
            their_meta = ep.all_to_all(meta, send, recv)
        local_ids = (their_meta[:, 0].long() - self.first_expert).unsqueeze(1)
        with record_function("moe.experts"):
            done = self._apply(rows, their_meta[:, 1:2].float(), local_ids)
        with record_function("moe.all_to_all"):
            back = ep.all_to_all(done, recv, send)
        combined = hidden.new_zeros((chunk, hidden.shape[1]))
        combined.index_add_(0, token, back.to(hidden.dtype))
        if comm is None:
            return combined[:num_tokens]
        with record_function("moe.all_gather"):
            return comm.all_gather(combined, dim=0)[:num_tokens]

    def take_expert_load(self) -> torch.Tensor:
        return self.load.take()

    def extra_repr(self) -> str:
        mode = "expert parallel" if self.expert_parallel else "tensor parallel"
        return (f"experts={self.router.num_experts} (local {self.num_local_experts}, {mode}), "
                f"top_k={self.router.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}"
                + ("" if self.gated else f", ungated {self.activation}"))
