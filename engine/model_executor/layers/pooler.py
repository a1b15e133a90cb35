"""Pooling: one result per request from the hidden states of its whole prompt.

A pooling model's ``forward`` returns the final hidden states ``[T, H]`` of the step's
flat token batch, like a generating model; its ``pooler`` (this module's :class:`Pooler`)
then turns each pooled request's tokens -- always its whole prompt, scheduled in one
step -- into that request's result:

1. select tokens by the pooling type: the first (CLS), the mean over all (MEAN), the
   last (LAST; causal decoders), or every token (ALL; reward and token ``encode``);
2. per task: ``embed`` runs the sentence-transformers Dense modules, cuts ``dimensions``
   (Matryoshka) and L2-normalizes; ``classify`` / ``score`` run the model's
   classification head and the activation (softmax over labels, sigmoid of a single
   logit); ``reward`` runs the head on every selected token without activation;
   ``encode`` returns the selected hidden states as they are.

Results are float32 on the host side of the wire (the runner moves them). The bulk work
is batched over the step's requests; only the per-request options loop in Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.pooling_params import PoolingParams


class PoolingType(str, enum.Enum):
    CLS = "CLS"
    MEAN = "MEAN"
    LAST = "LAST"
    ALL = "ALL"


@dataclass
class PoolingBatch:
    """The requests one step pools, in the step's batch order.

    Request ``i``'s prompt is ``hidden[starts[i] : starts[i] + lens[i]]``."""

    starts: np.ndarray  # int64 [N]
    lens: np.ndarray  # int64 [N]
    params: list[PoolingParams]  # resolved (task, normalize, activation set)

    @property
    def num_reqs(self) -> int:
        return len(self.params)


def pool_hidden(hidden: torch.Tensor, batch: PoolingBatch, pooling: PoolingType
                ) -> torch.Tensor | list[torch.Tensor]:
    """``[N, H]`` pooled rows (CLS / MEAN / LAST, float32 for MEAN) or, for ALL, one
    ``[len_i, H]`` tensor per request."""
    device = hidden.device
    starts = torch.from_numpy(batch.starts).to(device)
    lens = torch.from_numpy(batch.lens).to(device)
    if pooling is PoolingType.CLS:
        return hidden.index_select(0, starts)
    if pooling is PoolingType.LAST:
        return hidden.index_select(0, starts + lens - 1)
    if pooling is PoolingType.MEAN:
        segment = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        rows = torch.from_numpy(np.repeat(batch.starts, batch.lens)
                                + _offsets(batch.lens)).to(device)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, segment, hidden.index_select(0, rows).float())
        return sums / lens.unsqueeze(1).float()
    return [hidden[s : s + n] for s, n in zip(batch.starts.tolist(), batch.lens.tolist())]


def _offsets(lens: np.ndarray) -> np.ndarray:
    """``0 .. len_i - 1`` for every request, concatenated."""
    total = int(lens.sum())
    firsts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(total, dtype=np.int64) - firsts


class Pooler(nn.Module):
    """A model's pooling step (see the module docstring).

    ``pooling``: the token selection for embed / classify / score; ``reward_pooling``
    and ``encode`` select every token unless given. ``head``: the classification head
    (``[N, H] -> [N, num_labels]``; None: the model cannot classify). ``dense``: the
    sentence-transformers Dense modules an embedding passes through after pooling."""

    def __init__(self, pooling: PoolingType, *, head: nn.Module | None = None,
                 dense: nn.Module | None = None,
                 reward_pooling: PoolingType = PoolingType.ALL) -> None:
        super().__init__()
        self.pooling = PoolingType(pooling)
        self.reward_pooling = PoolingType(reward_pooling)
        self.head = head
        self.dense = dense

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        tasks = ("embed", "encode")
        return tasks + (("classify", "score", "reward") if self.head is not None else ())

    def forward(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * batch.num_reqs
        by_task: dict[str, list[int]] = {}
        for i, params in enumerate(batch.params):
            by_task.setdefault(params.task, []).append(i)
        for task, idx in by_task.items():
            if task not in self.supported_tasks:
                raise ValueError(f"this model cannot run pooling task {task!r}")
            sub = _subset(batch, idx)
            results = getattr(self, f"_{task}")(hidden, sub)
            for i, result in zip(idx, results):
                out[i] = result.float()
        return out  # type: ignore[return-value]

    # -- tasks ------------------------------------------------------------------------------
    def _embed(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        pooled = pool_hidden(hidden, batch, self.pooling)
        if self.dense is not None:
            pooled = self.dense(pooled.to(hidden.dtype))
        pooled = pooled.float()
        results = []
        for row, params in zip(pooled, batch.params):
            if params.dimensions is not None:
                row = row[: params.dimensions]
            if params.normalize:
                row = F.normalize(row, p=2, dim=-1)
            results.append(row)
        return results

    def _classify(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        pooled = pool_hidden(hidden, batch, self.pooling)
        logits = self.head(pooled.to(hidden.dtype)).float()
        results = []
        for row, params in zip(logits, batch.params):
            if params.activation:
                row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
            results.append(row)
        return results

    _score = _classify

    def _reward(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        pooled = pool_hidden(hidden, batch, self.reward_pooling)
        if isinstance(pooled, list):
            return [self.head(rows).float() for rows in pooled]
        return list(self.head(pooled.to(hidden.dtype)).float())

    def _encode(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        pooled = pool_hidden(hidden, batch, PoolingType.ALL)
        return list(pooled)


def _subset(batch: PoolingBatch, idx: list[int]) -> PoolingBatch:
    if len(idx) == batch.num_reqs:
        return batch
    take = np.asarray(idx, dtype=np.int64)
    return PoolingBatch(batch.starts[take], batch.lens[take], [batch.params[i] for i in idx])


# -- building a model's pooler ---------------------------------------------------------------
_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}


def make_pooler(ctx, default_pooling: PoolingType, head: nn.Module | None = None,
                reward_pooling: PoolingType = PoolingType.ALL) -> Pooler:
    """The pooler of a model built with ``ctx`` (a ModelInitContext): the pooling type
    of its pooler config (sentence-transformers' 1_Pooling) or ``default_pooling``, its
    Dense modules loaded from the checkpoint directory, and the model's ``head``."""
    config = ctx.pooler_config
    pooling = default_pooling
    dense = None
    if config is not None:
        if config.pooling_type is not None:
            pooling = PoolingType(config.pooling_type)
        if config.dense_modules:
            dense = nn.Sequential(*(_load_dense(ctx, where) for where in config.dense_modules))
    return Pooler(pooling, head=head, dense=dense, reward_pooling=reward_pooling)


def _load_dense(ctx, where: str) -> nn.Module:
    """A sentence-transformers Dense module (``linear`` + activation) from its folder."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(ctx.model_dir) / where
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"sentence-transformers Dense module {folder}: {exc}") from exc
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in _ST_ACTIVATIONS:
        raise ValueError(f"{folder}: activation {activation} is not supported "
                         f"({', '.join(sorted(_ST_ACTIVATIONS))})")
    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{folder} has no model.safetensors (only safetensors Dense "
                         "modules are supported)")
    state = load_file(str(weights_file))
    linear = nn.Linear(int(config["in_features"]), int(config["out_features"]),
                       bias=bool(config.get("bias", True)), device=ctx.device,
                       dtype=ctx.dtype)
    linear.weight.copy_(state["linear.weight"])
    if linear.bias is not None:
        linear.bias.copy_(state["linear.bias"])
    return nn.Sequential(linear, _ST_ACTIVATIONS[activation]())
