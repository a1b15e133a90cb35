"""The pooling routes of the app (``--runner pooling``), vLLM/OpenAI-compatible.

``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score`` + ``/v1/score`` and
``/rerank`` + ``/v1/rerank`` + ``/v2/rerank``. A generating engine answers them too,
with a 400 saying the model does not support the task (they are left out of its OpenAPI
document); a pooling engine answers the completion routes with a 400 the same way
(``OpenAIServingPooling.generation_refused``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.entrypoints.openai.openapi import error_responses, json_body
from engine.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_score import OpenAIServingScore

POOLING_ERRORS = (400, 401, 404, 413, 422, 500, 503)
# paths, request body, response body, handler (an OpenAIServingScore method), the task
# in words (for the 400 of a generating engine)
_ROUTES: tuple[tuple[tuple[str, ...], type[BaseModel], type[BaseModel], str, str], ...] = (
    (("/v1/embeddings",), EmbeddingRequest, EmbeddingResponse, "create_embedding",
     "embeddings"),
    (("/pooling",), PoolingRequest, PoolingResponse, "create_pooling", "pooling"),
    (("/classify",), ClassificationRequest, ClassificationResponse, "create_classify",
     "classification"),
    (("/score", "/v1/score"), ScoreRequest, ScoreResponse, "create_score", "scoring"),
    (("/rerank", "/v1/rerank", "/v2/rerank"), RerankRequest, RerankResponse,
     "create_rerank", "reranking"),
)
POOLING_REQUEST_MODELS: tuple[type[BaseModel], ...] = tuple(route[1] for route in _ROUTES)

Guard = Callable[[Awaitable[Any]], Awaitable[Any]]


def add_pooling_routes(app: FastAPI, serving: OpenAIServingScore, max_depth: int,
                       guard: Guard) -> None:
    """Register every pooling route (documented only when the engine pools)."""
    documented = serving.info is not None
    for paths, request_model, response_model, handler, what in _ROUTES:
        endpoint = _endpoint(serving, request_model, getattr(serving, handler), what,
                             max_depth, guard)
        for path in paths:
            app.add_api_route(path, endpoint, methods=["POST"], name=handler,
                              openapi_extra=json_body(request_model),
                              response_model=response_model,
                              responses=error_responses(*POOLING_ERRORS),
                              include_in_schema=documented)


def _endpoint(serving: OpenAIServingScore, model: type[BaseModel],
              handler: Callable[[Any, Callable], Awaitable[Response]], what: str,
              max_depth: int, guard: Guard) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(raw_request: Request) -> Response:
        serving.check_pooling(what)  # a generating engine: its 400 before the body
        request = await parse_body(raw_request, model, max_depth)
        return await guard(handler(request, raw_request.receive))

    return endpoint
