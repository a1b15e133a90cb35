"""The FastAPI app: routes, API-key and body-size middleware, error handlers, lifespan.

``build_app(engine, settings)`` wires an :class:`AsyncLLM` into a FastAPI app;
``run_server`` serves it with uvicorn. Request bodies are parsed here (not by FastAPI)
so that every failure has an OpenAI-style body: invalid JSON and validation failures are
400s naming the field, an oversized body is a 413, an unknown model a 404, a dead engine
a 503, and anything unexpected a logged 500.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting connections, in-flight requests may
finish for ``timeout_graceful_shutdown`` seconds, then they are aborted in the engine (so
each response still ends properly, with finish_reason "abort"); the lifespan exit then
stops the engine-core process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import engine as engine_pkg
from engine.core.errors import EngineDeadError
from engine.core.sampling_defaults import load_sampling_defaults
from engine.entrypoints.openai.errors import APIError, bad_request, engine_dead, error_body
from engine.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from engine.entrypoints.openai.serving_base import ServerSettings, ServerState, to_api_error
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from engine.structured_output.tool_calls import get_tool_parser

logger = logging.getLogger("engine.server")

M = TypeVar("M", bound=BaseModel)

# Routes that stay open when an API key is set (probes and scrapers carry no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


# -- middleware ---------------------------------------------------------------------------
class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every route but the open ones."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'")
        await error.response()(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over the limit: at once from Content-Length, or as soon as
    a streamed (chunked) body grows past it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server's limit of "
                             f"{self.max_bytes} bytes")


# -- request parsing ----------------------------------------------------------------------
async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``; 400 with the offending field otherwise."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: list[Any]) -> APIError:
    def where(error: Any) -> str:
        return ".".join(str(part) for part in error.get("loc", ())) or "body"

    details = "; ".join(f"{where(e)}: {e.get('msg', 'invalid')}" for e in errors[:5])
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = str(first_loc[0]) if first_loc else None
    if param == "body" and len(first_loc) > 1:  # FastAPI's own locations start with "body"
        param = str(first_loc[1])
    return bad_request(f"Invalid request: {details}", param)


# -- app ----------------------------------------------------------------------------------
def build_app(engine: Any, settings: ServerSettings | None = None, *,
              shutdown_engine: bool = True) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an AsyncLLM). With ``shutdown_engine``
    the app's lifespan exit shuts the engine (and its core process) down."""
    settings = settings or ServerSettings()
    get_tool_parser(settings.tool_call_parser)  # an unknown parser: ValueError naming it
    model_name = settings.served_model_name or engine.model_name
    metrics = ServerMetrics(model_name)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-tokenize")
    model_config = engine.config.model
    defaults = load_sampling_defaults(model_config.model, model_config.generation_config)
    if note := defaults.describe():
        logger.info("%s (requests that set a field override it)", note)
    state = ServerState(engine, settings, metrics, pool, sampling_defaults=defaults)
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    tokenization = OpenAIServingTokenization(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("Serving model %r at http://%s:%d (OpenAI API under /v1)", model_name,
                    settings.host, settings.port)
        try:
            yield
        finally:
            logger.info("Shutting down: stopping the engine")
            pool.shutdown(wait=False, cancel_futures=True)
            if shutdown_engine:
                engine.shutdown()

    app = FastAPI(title="engine OpenAI-compatible server", version=engine_pkg.__version__,
                  lifespan=lifespan)
    app.state.server_state = state
    # add_middleware wraps: the last added runs first, so the API key is checked before
    # any body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as exc:
            return engine_dead(exc).response()
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": engine_pkg.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await metrics.refresh(engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, root=engine.config.model.model,
                         max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        completions.check_model(model_id)
        return JSONResponse(model_card().model_dump(mode="json"))

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await _guard(completions.create_completion(request, raw_request.receive))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await _guard(chat.create_chat_completion(request, raw_request.receive))

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        response = await _guard(tokenization.tokenize_request(request))
        return JSONResponse(response.model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        response = await _guard(tokenization.detokenize_request(request))
        return JSONResponse(response.model_dump(mode="json"))

    return app


async def _guard(work: Any) -> Any:
    """Await a handler; map whatever it raises to an APIError (unexpected ones are logged
    as 500s by ``to_api_error``)."""
    try:
        return await work
    except APIError:
        raise
    except Exception as exc:
        raise to_api_error(exc) from exc


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"Internal server error: {type(exc).__name__}"),
                            status_code=500)


# -- running ------------------------------------------------------------------------------
_BACKSTOP_S = 5  # after the grace period and the aborts, uvicorn cancels what is left


def run_server(engine: Any, settings: ServerSettings, *, log_level: str = "info",
               access_log: bool = True, timeout_graceful_shutdown: int = 10) -> None:
    """Serve until SIGINT / SIGTERM; the engine is shut down on the way out."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On shutdown, let requests run for the grace period, then abort them in the
        engine so that every response still ends properly (streams with a final chunk
        and [DONE]) instead of being cut off."""

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(timeout_graceful_shutdown,
                                    lambda: loop.create_task(_abort_all()))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    async def _abort_all() -> None:
        count = await app.state.server_state.abort_in_flight()
        if count:
            logger.info("Grace period over: aborted %d in-flight request(s)", count)

    app = build_app(engine, settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level,
        access_log=access_log, lifespan="on",
        timeout_graceful_shutdown=timeout_graceful_shutdown + _BACKSTOP_S,
    )
    GracefulServer(config).run()
