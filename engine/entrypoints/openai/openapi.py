"""The OpenAPI document the server serves at /openapi.json.

The routes parse their bodies themselves (``request_body.parse_body``: OpenAI-style 400s,
depth and finiteness checks before any model sees the data), so FastAPI is told about the
request models only for the document: each POST's ``requestBody`` references its model's
schema (``openapi_extra``), and the request models' schemas are added to the components.
Responses name their models, errors the ErrorResponse. What depends on the model and the
server's flags (max_tokens up to max_model_len and --max-tokens-limit, n up to
max_num_seqs, logprobs up to --max-logprobs, token ids below the vocabulary size, the
bearer scheme when an API key is set) is written in when the document is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.entrypoints.openai.metrics import CONTENT_TYPE
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.serving_base import ServerSettings

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
    DetokenizeRequest)

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: not JSON, nested too deeply, a number that is not finite, a "
         "field of the wrong type or out of range (`param` names the field), a prompt too "
         "long for the model, or a constraint that cannot be compiled",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "Unknown model",
    408: "The request passed its deadline (x-request-timeout / --request-timeout)",
    413: "The request body is over the server's size limit",
    422: "Not sent by this server (validation failures are 400s); listed for generators",
    429: "Overloaded: too many requests running or waiting; retry after Retry-After seconds",
    500: "Internal server error",
    503: "The engine is not running",
}
GENERATION_ERRORS = (400, 401, 404, 408, 413, 422, 429, 500, 503)
TOKENIZE_ERRORS = (400, 401, 404, 413, 422, 500)
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "Prometheus text format",
    "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
            for status in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def streaming_ok(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
    return {200: {
        "model": model,
        "description": f"A {model.__name__}; with `stream: true`, server-sent events instead",
        # The schema of one event (OpenAPI 3.1 has no itemSchema; 3.2 reads it the same way).
        "content": {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {
                "type": "string",
                "description": f"A {chunk.__name__} as JSON (an error once the stream has "
                               "started: an ErrorResponse), and last the text `[DONE]`",
                "contentMediaType": "application/json",
            }},
        }}},
    }}


@dataclass(frozen=True)
class OpenAPILimits:
    """The bounds a request field has on this server (not in the models: they depend on
    the model and the server's flags), written into the served schema."""

    max_tokens: int  # the most a request may ask to generate
    max_logprobs: int
    max_num_seqs: int  # the largest n
    vocab_size: int | None  # token ids are below it
    api_key: bool  # the routes outside the open paths need a bearer token
    priorities: bool  # the scheduler orders by priority (else a priority is a 400)

    @classmethod
    def of(cls, engine: Any, settings: ServerSettings) -> OpenAPILimits:
        max_tokens = engine.max_model_len - 1  # a prompt has at least one token
        if settings.max_tokens_limit is not None:
            max_tokens = min(max_tokens, settings.max_tokens_limit)
        processor = getattr(engine, "processor", None)
        return cls(max_tokens=max(max_tokens, 1), max_logprobs=settings.max_logprobs,
                   max_num_seqs=engine.config.scheduler.max_num_seqs,
                   vocab_size=getattr(processor, "vocab_size", None),
                   api_key=bool(settings.api_key),
                   priorities=engine.config.scheduler.policy == "priority")


def openapi_document(app: FastAPI, limits: OpenAPILimits,
                     open_paths: frozenset[str] = frozenset(),
                     extra_models: tuple[type[BaseModel], ...] = ()) -> dict[str, Any]:
    """FastAPI's document plus the request models' schemas (``extra_models``: those of
    routes beyond the generation ones, e.g. the pooling routes) and this server's bounds."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description=app.description)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    models = (*REQUEST_MODELS, *extra_models)
    _, defs = models_json_schema([(model, "validation") for model in models],
                                 ref_template="#/components/schemas/{model}")
    for name, schema in defs.get("$defs", {}).items():
        if schemas.get(name, schema) != schema:
            raise RuntimeError(f"two different schemas are named {name}")
        schemas[name] = _keys_by_pattern(schema)

    def bound(model: str, field: str, **keywords: Any) -> None:
        """Set ``keywords`` on the integer branch(es) of one field's schema."""
        prop = schemas[model]["properties"][field]
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == "integer":
                branch.update(keywords)

    for model in ("CompletionRequest", "ChatCompletionRequest"):
        bound(model, "max_tokens", maximum=limits.max_tokens)
        bound(model, "min_tokens", maximum=limits.max_tokens)  # and at most max_tokens
        bound(model, "n", maximum=limits.max_num_seqs)
        bound(model, "prompt_logprobs", maximum=limits.max_logprobs)
        if not limits.priorities:
            bound(model, "priority", minimum=0, maximum=0)
    bound("ChatCompletionRequest", "max_completion_tokens", maximum=limits.max_tokens)
    bound("ResponsesRequest", "max_output_tokens", maximum=limits.max_tokens)
    bound("CompletionRequest", "logprobs", maximum=limits.max_logprobs)
    bound("ChatCompletionRequest", "top_logprobs", maximum=limits.max_logprobs)
    if limits.vocab_size is not None:
        token_fields = {"CompletionRequest": ("prompt", "stop_token_ids", "allowed_token_ids"),
                        "ChatCompletionRequest": ("stop_token_ids", "allowed_token_ids"),
                        "DetokenizeRequest": ("tokens",)}
        for model, fields in token_fields.items():
            for field in fields:
                _bound_integers(schemas[model]["properties"][field],
                                maximum=limits.vocab_size - 1)
    if limits.api_key:
        document["components"]["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer"}}
        for path, operations in document["paths"].items():
            if path not in open_paths:
                for operation in operations.values():
                    operation["security"] = [{"bearerAuth": []}]
    return document


def _keys_by_pattern(schema: Any) -> Any:
    """Pydantic writes a dict whose keys have a pattern (logit_bias) as patternProperties,
    which leaves other keys unconstrained; the server rejects them, so say so: the pattern
    becomes propertyNames and its value schema additionalProperties."""
    if isinstance(schema, list):
        return [_keys_by_pattern(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _keys_by_pattern(value) for key, value in schema.items()}
    patterns = schema.get("patternProperties")
    if (isinstance(patterns, dict) and len(patterns) == 1 and "properties" not in schema
            and "additionalProperties" not in schema):
        ((pattern, values),) = patterns.items()
        del schema["patternProperties"]
        schema["propertyNames"] = {"pattern": pattern}
        schema["additionalProperties"] = values
    return schema


def _bound_integers(schema: Any, **keywords: Any) -> None:
    """Set ``keywords`` on every integer schema inside ``schema`` (token-id lists)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema.update(keywords)
        for value in schema.values():
            _bound_integers(value, **keywords)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value, **keywords)


def install_openapi(app: FastAPI, limits: OpenAPILimits, open_paths: frozenset[str],
                    extra_models: tuple[type[BaseModel], ...] = ()) -> None:
    """Serve ``openapi_document`` (built on first use) as the app's /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, limits, open_paths, extra_models)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
