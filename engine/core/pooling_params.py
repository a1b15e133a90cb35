"""Parameters of one pooling request (embed, classify, score, reward, token encode).

Field names follow vLLM's ``PoolingParams``: ``dimensions`` (Matryoshka truncation of an
embedding, then normalization), ``normalize`` (embeddings), ``activation`` (classify and
score: softmax over the labels, or the sigmoid of a single logit; ``use_activation`` is
its newer spelling), ``truncate_prompt_tokens`` (keep the prompt's last tokens; -1: as
many as the model takes). ``None`` means the model's default, which the front end
resolves (:meth:`PoolingParams.resolved`) before the request reaches the engine core.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify", "score", "reward", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "reward", "encode")


@dataclass
class PoolingParams:
    """How to turn one prompt's hidden states into its result."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    use_activation: bool | None = None  # vLLM >= 0.11's name for ``activation``
    task: str | None = None  # set by LLM.embed/classify/... or the server route

    def __post_init__(self) -> None:
        if self.use_activation is not None:
            if self.activation is not None and self.activation != self.use_activation:
                raise ValueError("activation and use_activation disagree; pass one of them")
            self.activation, self.use_activation = self.use_activation, None
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean or None, not {value!r}")
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, not {self.dimensions!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int)
                                     or (truncate < 1 and truncate != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, "
                             f"not {truncate!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; one of {', '.join(POOLING_TASKS)}")

    def clone(self, **changes: object) -> PoolingParams:
        return dataclasses.replace(self, **changes)

    def resolved(self, task: str, *, normalize: bool, embed_size: int | None,
                 matryoshka: list[int] | None = None, supports_dimensions: bool = True,
                 activation: bool = True) -> PoolingParams:
        """A copy for ``task`` with every default filled in; a ValueError for what the
        task or the model cannot do.

        ``normalize``: the model's embedding default (sentence-transformers' Normalize
        module, else True); ``activation``: its classify / score default. ``embed_size``: the embedding width ``dimensions`` may cut;
        ``matryoshka``: the only widths the model was trained for (None: any)."""
        if task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {task!r}")
        if self.task is not None and self.task != task:
            raise ValueError(f"these pooling params are for task {self.task!r}, not {task!r}")
        if self.dimensions is not None:
            if task != "embed":
                raise ValueError(f"dimensions applies to embeddings, not to task {task!r}")
            if not supports_dimensions:
                raise ValueError("this model does not support matryoshka representation; "
                                 "dimensions cannot be set")
            if embed_size is not None and self.dimensions > embed_size:
                raise ValueError(f"dimensions {self.dimensions} exceeds the model's "
                                 f"embedding size {embed_size}")
            if matryoshka and self.dimensions not in matryoshka:
                raise ValueError(f"dimensions {self.dimensions} is not one of the model's "
                                 f"matryoshka dimensions {sorted(matryoshka)}")
        if self.normalize is not None and task != "embed":
            raise ValueError(f"normalize applies to embeddings, not to task {task!r}")
        if self.activation is not None and task not in ("classify", "score"):
            raise ValueError(f"activation applies to classify and score, not to task {task!r}")
        return dataclasses.replace(
            self,
            task=task,
            normalize=normalize if self.normalize is None and task == "embed" else self.normalize,
            activation=(activation if self.activation is None and task in ("classify", "score")
                        else self.activation),
        )
