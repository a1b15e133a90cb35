"""The FastAPI app: routes, API-key and body-size middleware, error handlers, lifespan.

``build_app(engine, settings)`` wires an :class:`AsyncLLM` into a FastAPI app;
``run_server`` serves it with uvicorn. Request bodies are parsed by the routes (not by
FastAPI: ``request_body.parse_body``) so that every failure has an OpenAI-style body:
invalid JSON, nesting deeper than ``max_request_json_depth``, numbers that are not finite
and validation failures are 400s naming the field, an oversized body is a 413, an unknown
model a 404, a dead engine a 503, and anything unexpected a logged 500. /openapi.json
documents every route's request body and responses (``openapi``).

An engine started with ``--runner pooling`` serves the pooling routes (``pooling_routes``:
/v1/embeddings, /pooling, /classify, /score, /rerank) and answers the completion routes
with a 400; a generating engine answers the pooling routes with a 400. /v1/responses (OpenAI's
Responses API, ``serving_responses``) runs through the chat pipeline.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting connections, in-flight requests may
finish for ``timeout_graceful_shutdown`` seconds, then they are aborted in the engine (so
each response still ends properly, with finish_reason "abort"); the lifespan exit then
stops the engine-core process.

Engine-core death: the lifespan's watcher (``serving_base.watch_engine``) fails the
in-flight requests at once (/health is a 503), then starts a fresh core if
``--restart-engine-core`` allows, else stops the server: ``run_server`` returns 1 and
``engine serve`` exits with it, so a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import engine as engine_pkg
from engine.core.errors import EngineDeadError
from engine.core.sampling_defaults import load_sampling_defaults
from engine.entrypoints.openai.errors import APIError, engine_dead, error_body
from engine.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from engine.entrypoints.openai.openapi import (
    GENERATION_ERRORS,
    METRICS_RESPONSES,
    TOKENIZE_ERRORS,
    OpenAPILimits,
    error_responses,
    install_openapi,
    json_body,
    streaming_ok,
)
from engine.entrypoints.openai.pooling_routes import POOLING_REQUEST_MODELS, add_pooling_routes
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from engine.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from engine.entrypoints.openai.request_body import (  # noqa: F401 - re-exported
    DEFAULT_MAX_JSON_DEPTH,
    json_nesting_depth,
    load_json_body,
    parse_body,
    validation_error,
)
from engine.entrypoints.openai.rl_routes import (
    SleepingMiddleware,
    add_rl_routes,
    add_weight_update_routes,
)
from engine.entrypoints.openai.serving_base import (
    GenerationLimitsMiddleware,
    ServerSettings,
    ServerState,
    to_api_error,
    watch_engine,
)
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_lora import (
    LORA_REQUEST_MODELS,
    ServedLoRAs,
    add_lora_routes,
)
from engine.entrypoints.openai.serving_responses import OpenAIServingResponses
from engine.entrypoints.openai.serving_score import OpenAIServingScore
from engine.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from engine.structured_output.reasoning import get_reasoning_parser
from engine.structured_output.tool_calls import get_tool_parser

logger = logging.getLogger("engine.server")

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


# -- app ----------------------------------------------------------------------------------
def build_app(engine: Any, settings: ServerSettings | None = None, *,
              shutdown_engine: bool = True) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an AsyncLLM). With ``shutdown_engine``
    the app's lifespan exit shuts the engine (and its core process) down."""
    settings = settings or ServerSettings()
    get_tool_parser(settings.tool_call_parser)  # an unknown parser: ValueError naming it
    if settings.reasoning_parser is not None:
        get_reasoning_parser(settings.reasoning_parser)  # likewise
    model_name = settings.served_model_name or engine.model_name
    lora_config = getattr(engine.config, "lora", None)
    metrics = ServerMetrics(model_name,
                            max_loras=lora_config.max_loras if lora_config is not None else 0)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-tokenize")
    model_config = engine.config.model
    defaults = load_sampling_defaults(model_config.model, model_config.generation_config)
    if note := defaults.describe():
        logger.info("%s (requests that set a field override it)", note)
    state = ServerState(engine, settings, metrics, pool, sampling_defaults=defaults)
    # The names a request's `model` may give besides the base model (--lora-modules, and
    # /v1/load_lora_adapter with --allow-runtime-lora-updating).
    loras = state.loras = ServedLoRAs(engine, model_name, settings.lora_modules)
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    responses = OpenAIServingResponses(chat, settings.max_stored_responses)
    tokenization = OpenAIServingTokenization(state)
    pooling = OpenAIServingScore(state)
    generates = pooling.info is None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("Serving model %r at http://%s:%d (OpenAI API under /v1)", model_name,
                    settings.host, settings.port)
        if settings.lora_modules:  # `engine serve` loaded them already: a no-op then
            await loras.load_all_missing()
        watcher = asyncio.create_task(watch_engine(state), name="engine-core-watcher")
        try:
            yield
        finally:
            state.shutting_down = True
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            logger.info("Shutting down: stopping the engine")
            pool.shutdown(wait=False, cancel_futures=True)
            if shutdown_engine:
                engine.shutdown()

    app = FastAPI(title="engine OpenAI-compatible server", version=engine_pkg.__version__,
                  lifespan=lifespan)
    app.state.server_state = state
    # add_middleware wraps: the last added runs first, so the API key is checked before
    # any body is read, and only then does a request take a generation slot.
    app.add_middleware(SleepingMiddleware, engine=engine)  # innermost: after the API key
    app.add_middleware(GenerationLimitsMiddleware, state=state)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    _add_error_handlers(app)

    max_depth = settings.max_request_json_depth

    @app.get("/health", response_model=HealthResponse, responses=error_responses(503))
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as exc:
            return engine_dead(exc).response()
        return JSONResponse(HealthResponse().model_dump(mode="json"))

    @app.get("/ping", response_model=HealthResponse, responses=error_responses(503))
    async def ping() -> Response:
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=engine_pkg.__version__)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def prometheus_metrics() -> Response:
        await metrics.refresh(engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, root=engine.config.model.model,
                         max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 500))
    async def list_models() -> JSONResponse:
        cards = [model_card(), *loras.model_cards(engine.max_model_len)]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses=error_responses(401, 404, 422, 500))
    async def retrieve_model(model_id: str) -> JSONResponse:
        lora = completions.check_model(model_id)
        card = model_card() if lora is None else loras.model_card(lora, engine.max_model_len)
        return JSONResponse(card.model_dump(mode="json"))

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
              responses={**streaming_ok(CompletionResponse, CompletionStreamResponse),
                         **error_responses(*GENERATION_ERRORS)}, include_in_schema=generates)
    async def create_completion(raw_request: Request) -> Response:
        if not generates:
            raise pooling.generation_refused()
        request = await parse_body(raw_request, CompletionRequest, max_depth)
        return await _guard(completions.create_completion(request, raw_request.receive))

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
              responses={**streaming_ok(ChatCompletionResponse, ChatCompletionStreamResponse),
                         **error_responses(*GENERATION_ERRORS)}, include_in_schema=generates)
    async def create_chat_completion(raw_request: Request) -> Response:
        if not generates:
            raise pooling.generation_refused()
        request = await parse_body(raw_request, ChatCompletionRequest, max_depth)
        return await _guard(chat.create_chat_completion(request, raw_request.receive))

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest),
              responses={**streaming_ok(ResponseObject, ResponseStreamEvent),
                         **error_responses(*GENERATION_ERRORS)}, include_in_schema=generates)
    async def create_response(raw_request: Request) -> Response:
        if not generates:
            raise pooling.generation_refused()
        request = await parse_body(raw_request, ResponsesRequest, max_depth)
        return await _guard(responses.create_response(request, raw_request.receive))

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject,
             responses=error_responses(400, 401, 404, 500), include_in_schema=generates)
    async def retrieve_response(response_id: str) -> JSONResponse:
        if not generates:
            raise pooling.generation_refused()
        return JSONResponse(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse,
                responses=error_responses(400, 401, 404, 500), include_in_schema=generates)
    async def delete_response(response_id: str) -> JSONResponse:
        if not generates:
            raise pooling.generation_refused()
        return JSONResponse(responses.delete(response_id))

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest),
              response_model=TokenizeResponse, responses=error_responses(*TOKENIZE_ERRORS))
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest, max_depth)
        response = await _guard(tokenization.tokenize_request(request))
        return JSONResponse(response.model_dump(mode="json"))

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest),
              response_model=DetokenizeResponse, responses=error_responses(*TOKENIZE_ERRORS))
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest, max_depth)
        response = await _guard(tokenization.detokenize_request(request))
        return JSONResponse(response.model_dump(mode="json"))

    add_pooling_routes(app, pooling, max_depth, _guard)
    add_rl_routes(app, engine, _guard)
    if settings.allow_runtime_lora_updating:
        add_lora_routes(app, loras, max_depth, _guard)
    if getattr(engine.config.model, "enable_weight_updates", False):
        add_weight_update_routes(app, engine, _guard)
    extra_models = () if generates else POOLING_REQUEST_MODELS
    if settings.allow_runtime_lora_updating:
        extra_models = (*extra_models, *LORA_REQUEST_MODELS)
    install_openapi(app, OpenAPILimits.of(engine, settings), OPEN_PATHS, extra_models)
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
               access_log: bool = True, timeout_graceful_shutdown: int = 10,
               sockets: list[Any] | None = None) -> int:
    """Serve until SIGINT / SIGTERM (or until the engine core dies for good); the engine
    is shut down on the way out. Returns the exit code: 0, or 1 after core death.
    ``sockets``: listening sockets to accept on instead of binding host:port (the
    ``--api-server-count`` launcher's shared one)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On shutdown, let requests run for the grace period, then abort them in the
        engine so that every response still ends properly (streams with a final chunk
        and [DONE]) instead of being cut off."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            state.shutting_down = True  # a core that exits on the same Ctrl-C stays down
            super().handle_exit(sig, frame)

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
    server = GracefulServer(config)
    state: ServerState = app.state.server_state

    def stop_after_core_death() -> None:
        state.shutting_down = True
        server.should_exit = True
        # Should the orderly shutdown hang, still exit (non-zero) for the supervisor.
        limit = timeout_graceful_shutdown + _BACKSTOP_S + _HARD_EXIT_S
        timer = threading.Timer(limit, _hard_exit, (state.exit_code or 1, limit))
        timer.daemon = True
        timer.start()

    state.stop_server = stop_after_core_death
    server.run(sockets=sockets)
    return state.exit_code


_HARD_EXIT_S = 10


def _hard_exit(code: int, after_s: float) -> None:
    logger.error("The server did not stop within %.0f s of the engine core's death; "
                 "exiting now (code %d)", after_s, code)
    logging.shutdown()
    os._exit(code)
