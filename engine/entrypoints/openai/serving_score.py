"""``POST /score`` (and ``/v1/score``) and ``/rerank`` (``/v1/rerank``: Jina's shape,
``/v2/rerank``: Cohere's; one handler).

A pair is scored the way ``LLM.score`` scores it offline: a classifier reads
``(text_1, text_2)`` as one cross-encoder input (one label: the sigmoid of its logit), an
embedder embeds every distinct text once and takes the cosine similarity of the two
embeddings. Rerank scores ``(query, document)`` pairs and returns them best first.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import UsageInfo, random_id
from engine.entrypoints.openai.protocol_pooling import (
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankResultDocument,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from engine.entrypoints.openai.serving_pooling import OpenAIServingPooling, PoolingJob, usage

ScoreRequestLike = ScoreRequest | RerankRequest


class OpenAIServingScore(OpenAIServingPooling):
    """Every pooling route: embeddings, pooling, classify (inherited), score, rerank."""

    async def create_score(self, request: ScoreRequest, receive: Callable) -> JSONResponse:
        await self.start(request, "/score")
        left = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        right = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: give "
                              "one text_1, or as many as text_2", "text_2")
        request_id = random_id("score")
        labels = [("text_1" if isinstance(request.text_1, str) else f"text_1[{i}]",
                   "text_2" if isinstance(request.text_2, str) else f"text_2[{i}]")
                  for i in range(len(right))]
        scores, tokens = await self.score_pairs(request_id, left, right, labels, request,
                                                receive)
        response = ScoreResponse(
            id=request_id, model=self.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)], usage=tokens)
        return JSONResponse(response.model_dump(mode="json"))

    async def create_rerank(self, request: RerankRequest, receive: Callable) -> JSONResponse:
        await self.start(request, "/rerank")
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        request_id = random_id("rerank")
        labels = [("query", f"documents[{i}]") for i in range(len(documents))]
        scores, tokens = await self.score_pairs(request_id, [request.query] * len(documents),
                                                documents, labels, request, receive)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable on ties
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(
            index=i, relevance_score=scores[i],
            document=RerankResultDocument(text=documents[i]) if request.return_documents
            else None) for i in order]
        response = RerankResponse(id=request_id, model=self.model_name,
                                  usage=RerankUsage(total_tokens=tokens.total_tokens),
                                  results=results)
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    # -- scoring --------------------------------------------------------------------------
    async def score_pairs(self, request_id: str, left: list[str], right: list[str],
                          labels: list[tuple[str, str]], request: ScoreRequestLike,
                          receive: Callable) -> tuple[list[float], UsageInfo]:
        """The score of each ``(left[i], right[i])`` pair and the tokens it took;
        ``labels`` name each pair's two request fields for error messages."""
        self.check_pooling("scoring")
        assert self.info is not None
        if "score" in self.info.tasks:
            return await self._cross_encode(request_id, left, right, labels, request, receive)
        self.check_task("embed", "scoring")
        if request.use_activation is not None:
            raise bad_request("use_activation applies to cross-encoders; an embedding model "
                              "scores by cosine similarity", "use_activation")
        return await self._cosine(request_id, left, right, labels, request, receive)

    async def _cross_encode(self, request_id: str, left: list[str], right: list[str],
                            labels: list[tuple[str, str]], request: ScoreRequestLike,
                            receive: Callable) -> tuple[list[float], UsageInfo]:
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     use_activation=request.use_activation)
        jobs = [PoolingJob(a, "score", params, where[1], text_pair=b)
                for a, b, where in zip(left, right, labels)]
        outputs = await self.encode_all(request_id, jobs, request.priority, receive)
        width = outputs[0].outputs.data.numel()
        if width != 1:
            raise bad_request(f"scoring needs a classifier with one label; this one has "
                              f"{width} (use /classify)", "model")
        return [float(o.outputs.data.reshape(())) for o in outputs], usage(outputs)

    async def _cosine(self, request_id: str, left: list[str], right: list[str],
                      labels: list[tuple[str, str]], request: ScoreRequestLike,
                      receive: Callable) -> tuple[list[float], UsageInfo]:
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens)
        where: dict[str, str] = {}  # each distinct text, embedded once, and its first field
        for (a, b), (where_a, where_b) in zip(zip(left, right), labels):
            where.setdefault(a, where_a)
            where.setdefault(b, where_b)
        jobs = [PoolingJob(text, "embed", params, field) for text, field in where.items()]
        outputs = await self.encode_all(request_id, jobs, request.priority, receive)
        by_text = {text: o.outputs.data.double() for text, o in zip(where, outputs)}
        scores = []
        for a, b in zip(left, right):
            x, y = by_text[a], by_text[b]
            scores.append(float((x @ y) / (x.norm() * y.norm()).clamp_min(1e-12)))
        return scores, usage(outputs)
