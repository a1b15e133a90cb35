"""The offline pooling API of :class:`engine.LLM`: embed, classify, score, reward, encode.

Shaped like vLLM's (an engine built with ``runner="pooling"``): every call takes one
prompt or a list, optional :class:`PoolingParams` (one for all or one per prompt) and
``truncate_prompt_tokens``, and returns outputs in input order. ``score`` pairs texts:
one ``data_1`` against each of ``data_2``, or ``data_1[i]`` against ``data_2[i]``; a
classifier scores each pair as a cross-encoder (one label: the sigmoid of its logit), an
embedder by the cosine similarity of the two embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.core.pooling_params import PoolingParams

PoolingPrompt = str | list[int] | dict[str, Any]


class PoolingAPI:
    """Mixed into :class:`engine.LLM` (which provides ``llm_engine`` and
    ``_submit_and_run``)."""

    llm_engine: Any

    def embed(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              prompt_name: str | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``prompt_name``: a sentence-transformers prompt of
        the model, e.g. "query"; None: its default prompt)."""
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens,
                             use_tqdm, prompt_name=prompt_name)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (softmax; one label: sigmoid)."""
        outputs = self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens,
                             use_tqdm)
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
               ) -> list[PoolingRequestOutput]:
        """The reward head's raw output for every token of each prompt."""
        return self._pool(prompts, pooling_params, "reward", truncate_prompt_tokens, use_tqdm)

    def encode(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The raw pooled tensor of any task (default ``encode``: every token's hidden
        state)."""
        task = pooling_task or _single_task(pooling_params) or "encode"
        return self._pool(prompts, pooling_params, task, truncate_prompt_tokens, use_tqdm)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
              ) -> list[ScoringRequestOutput]:
        """Relevance of each ``(data_1, data_2)`` pair (see the module docstring)."""
        left, right = _score_pairs(data_1, data_2)
        info = self._pooling_info()
        if "score" in info.tasks:
            pairs = [{"text": a, "text_pair": b} for a, b in zip(left, right)]
            outputs = self._pool(pairs, pooling_params, "score", truncate_prompt_tokens,
                                 use_tqdm)
            scores = []
            for out in outputs:
                if out.outputs.data.numel() != 1:
                    raise ValueError("score needs a classifier with one label; this one has "
                                     f"{out.outputs.data.numel()} (use classify)")
                scores.append(float(out.outputs.data.reshape(())))
            return [ScoringRequestOutput(o.request_id, ScoringOutput(s), o.prompt_token_ids)
                    for o, s in zip(outputs, scores)]
        if "embed" not in info.tasks:
            raise ValueError(f"this model ({info.config.task} pooler) cannot score")
        if pooling_params is not None:
            raise ValueError("an embedding model scores by cosine similarity: pooling_params "
                             "do not apply")
        unique = list(dict.fromkeys([*left, *right]))
        embedded = self._pool(unique, None, "embed", truncate_prompt_tokens, use_tqdm)
        by_text = {text: out for text, out in zip(unique, embedded)}
        results = []
        for a, b in zip(left, right):
            x, y = by_text[a].outputs.data.double(), by_text[b].outputs.data.double()
            cosine = float((x @ y) / (x.norm() * y.norm()).clamp_min(1e-12))
            results.append(ScoringRequestOutput(
                by_text[b].request_id, ScoringOutput(cosine),
                by_text[a].prompt_token_ids + by_text[b].prompt_token_ids))
        return results

    # -- internals ------------------------------------------------------------------------
    def _pooling_info(self) -> Any:
        pooling = self.llm_engine.processor.pooling
        if pooling is None:
            raise ValueError("this is a generating engine; pooling calls (embed, classify, "
                             "score, reward, encode) need LLM(..., runner='pooling')")
        return pooling.info

    def _pool(self, prompts: Any, pooling_params: Any, task: str,
              truncate_prompt_tokens: int | None, use_tqdm: bool,
              prompt_name: str | None = None) -> list[PoolingRequestOutput]:
        self._pooling_info()
        prompt_list = as_prompt_list(prompts)
        params_list = _broadcast(pooling_params, len(prompt_list))
        if truncate_prompt_tokens is not None:
            params_list = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]

        def submit(i: int, request_id: str) -> None:
            prompt, pair = prompt_list[i], None
            if isinstance(prompt, dict) and "text_pair" in prompt:
                prompt, pair = prompt["text"], prompt["text_pair"]
            self.llm_engine.add_pooling_request(request_id, prompt, params_list[i], task,
                                                text_pair=pair, prompt_name=prompt_name)

        return self._submit_and_run(submit, len(prompt_list), use_tqdm)


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids, a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, a dict or a list of "
                     f"those, not {type(prompts).__name__}")


def _broadcast(params: PoolingParams | Sequence[PoolingParams] | None, n: int
               ) -> list[PoolingParams]:
    if params is None:
        return [PoolingParams()] * n
    if isinstance(params, PoolingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} pooling params for {n} prompts")
    for p in params:
        if not isinstance(p, PoolingParams):
            raise ValueError(f"pooling params must be PoolingParams, not {type(p).__name__}")
    return params


def _single_task(params: Any) -> str | None:
    if isinstance(params, PoolingParams):
        return params.task
    return None


def _score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]
                 ) -> tuple[list[str], list[str]]:
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if not left or not right:
        raise ValueError("score needs at least one text on each side")
    for text in (*left, *right):
        if not isinstance(text, str):
            raise ValueError(f"score takes texts, not {type(text).__name__}")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"score pairs data_1 ({len(left)} texts) with data_2 "
                         f"({len(right)}): give one data_1 or as many as data_2")
    return left, right
