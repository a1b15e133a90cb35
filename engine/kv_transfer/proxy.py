"""An OpenAI-compatible router for disaggregated prefill/decode (vLLM's disagg proxy).

Each ``POST /v1/completions`` or ``/v1/chat/completions`` runs in two hops:

1. **Prefill.** The next prefill server (round-robin) gets the client's body with
   ``max_tokens=1``, ``stream=False`` and ``kv_transfer_params`` asking it to keep the KV
   cache for a remote decoder (``do_remote_decode``). Its JSON answer carries the
   producer's ``kv_transfer_params`` (block ids, host, port ...).
2. **Decode.** The next decode server (round-robin) gets the *original* body plus those
   ``kv_transfer_params``, pulls the KV cache instead of recomputing it, and generates; its
   answer (JSON, or an SSE stream relayed chunk by chunk) goes back to the client as is.

The proxy never parses more of a body than it must: it forwards whatever JSON the
servers send, so fields it does not know about (new ``kv_transfer_params`` keys, vLLM
extras) pass through untouched. Error policy: a prefill server that cannot be reached or
answers 5xx is the proxy's problem (502, OpenAI-style body); a 4xx is the client's (passed
through as is, so bad input reads the same as from a single server).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# Non-streaming answers arrive in one piece after the whole generation: be generous.
READ_TIMEOUT_S = 3600.0
HEALTH_TIMEOUT_S = 5.0
REQUEST_ID_HEADER = "X-Request-Id"
# Client headers worth forwarding; hop-by-hop and length headers must not be copied.
FORWARDED_HEADERS = ("authorization",)

_NON_STREAM_TIMEOUT = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
# A stream may sit idle between tokens for as long as the decoder likes.
_STREAM_TIMEOUT = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
_HEALTH_TIMEOUT = httpx.Timeout(HEALTH_TIMEOUT_S, connect=min(CONNECT_TIMEOUT_S,
                                                              HEALTH_TIMEOUT_S))


def prefill_kv_transfer_params() -> dict[str, Any]:
    """What the prefill server is told: compute the prompt's KV, keep it for a remote
    decoder (vLLM's shape; the remote_* fields are the decoder's to fill, hence null)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


class RoundRobin:
    """Cycles over a fixed list of server URLs. The proxy runs on one event loop, so
    ``next()`` needs no lock."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls: tuple[str, ...] = tuple(urls)
        if not self.urls:
            raise ValueError("RoundRobin needs at least one URL")
        self._cycle = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._cycle)


def normalize_urls(urls: Iterable[str], role: str) -> list[str]:
    """Validate ``http(s)://host:port`` base URLs and drop trailing slashes, so that
    joining with ``/v1/...`` never yields ``//v1``. A typo fails at startup, not on the
    first request."""
    result = []
    for raw in urls:
        url = raw.strip().rstrip("/")
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"{role} URL {raw!r} is not an http(s)://host[:port] URL")
        result.append(url)
    if not result:
        raise ValueError(f"at least one {role} URL is needed")
    return result


def error_response(status: int, message: str, error_type: str,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error in the engine server's OpenAI-style shape, which the ``openai`` client
    parses into its exception types."""
    body = {"object": "error",
            "error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def bad_gateway(message: str, request_id: str) -> JSONResponse:
    return error_response(502, message, "BadGatewayError", {REQUEST_ID_HEADER: request_id})


def build_prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The client's body turned into a prefill-only request: one token (the prompt's KV is
    the point, not the text), no stream (the proxy needs the whole JSON for its
    ``kv_transfer_params``). ``n`` is kept: the producer must hold KV for each sample."""
    prefill = copy.deepcopy(dict(body))
    prefill["max_tokens"] = 1
    if chat and "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1  # it takes precedence over max_tokens
    prefill["stream"] = False
    prefill.pop("stream_options", None)  # only valid with stream=true
    prefill["kv_transfer_params"] = prefill_kv_transfer_params()
    return prefill


def build_decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The client's original body plus the producer's ``kv_transfer_params``. Without any
    (a prefill server with no KV connector) the decoder simply prefills itself."""
    decode = dict(body)
    decode.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        decode["kv_transfer_params"] = kv_transfer_params
    return decode


def forwarded_headers(request: Request, request_id: str) -> dict[str, str]:
    """Headers for both hops: the client's credentials plus the shared request id, so
    both servers' logs can be matched up."""
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS
               if name in request.headers}
    headers[REQUEST_ID_HEADER] = request_id
    return headers


def new_request_id() -> str:
    return f"proxy-{uuid.uuid4().hex}"


def passthrough(upstream: httpx.Response, request_id: str) -> Response:
    """An upstream answer (already read) returned unchanged: status, body, content type."""
    return Response(content=upstream.content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type"),
                    headers={REQUEST_ID_HEADER: request_id})


class _EarlyResponse(Exception):
    """Raised by a hop to end the request with ``response`` (an error) right away."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass
class ProxyState:
    """Per-app routing state: the server pools and the one shared connection pool."""

    prefill: RoundRobin
    decode: RoundRobin
    client: httpx.AsyncClient | None = None

    def http(self) -> httpx.AsyncClient:
        """The shared client; made lazily too, for ASGI use without a lifespan."""
        if self.client is None or self.client.is_closed:
            self.client = new_http_client()
        return self.client

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def new_http_client() -> httpx.AsyncClient:
    """One pool for all servers. No connection cap: each stream holds a connection for its
    whole life, and httpx's default of 100 would quietly queue request 101."""
    return httpx.AsyncClient(
        timeout=_NON_STREAM_TIMEOUT,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
    )


async def run_prefill(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], request_id: str) -> Any:
    """Hop 1: returns the producer's ``kv_transfer_params`` (``None`` when it sent none);
    raises ``_EarlyResponse`` with a 502 (unreachable, 5xx, not JSON) or the server's own
    4xx."""
    target = url + path
    try:
        upstream = await client.post(target, json=body, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("%s: prefill server %s failed: %r", request_id, url, exc)
        raise _EarlyResponse(bad_gateway(
            f"prefill server {url} failed: {type(exc).__name__}: {exc}", request_id)) from exc
    status = upstream.status_code
    if 400 <= status < 500:
        raise _EarlyResponse(passthrough(upstream, request_id))
    if not 200 <= status < 300:
        logger.warning("%s: prefill server %s answered %d", request_id, url, status)
        raise _EarlyResponse(bad_gateway(
            f"prefill server {url} answered {status}: {_upstream_message(upstream)}",
            request_id))
    try:
        answer = upstream.json()
    except ValueError as exc:
        raise _EarlyResponse(bad_gateway(
            f"prefill server {url} answered {status} with a body that is not JSON",
            request_id)) from exc
    return answer.get("kv_transfer_params") if isinstance(answer, dict) else None


def _upstream_message(upstream: httpx.Response) -> str:
    """The error message inside an upstream's error body, else its text (shortened)."""
    try:
        message = upstream.json()["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return upstream.text[:500]


async def run_decode(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any],
                     headers: dict[str, str], request_id: str) -> Response:
    """Hop 2 without streaming: the decode server's answer, status code included."""
    try:
        upstream = await client.post(url + path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("%s: decode server %s failed: %r", request_id, url, exc)
        return bad_gateway(f"decode server {url} failed: {type(exc).__name__}: {exc}",
                           request_id)
    return passthrough(upstream, request_id)


async def run_decode_stream(client: httpx.AsyncClient, url: str, path: str,
                            body: dict[str, Any], headers: dict[str, str],
                            request_id: str) -> Response:
    """Hop 2 streaming: wait only for the decode server's status line, then relay its
    bytes as they come. A non-200 (its 4xx/5xx JSON error) is read and passed through
    with its status, since no stream has started yet."""
    request = client.build_request("POST", url + path, json=body, headers=headers,
                                   timeout=_STREAM_TIMEOUT)
    try:
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        logger.warning("%s: decode server %s failed: %r", request_id, url, exc)
        return bad_gateway(f"decode server {url} failed: {type(exc).__name__}: {exc}",
                           request_id)
    if upstream.status_code != 200:
        try:
            await upstream.aread()
        except httpx.HTTPError as exc:
            return bad_gateway(f"decode server {url} failed: {type(exc).__name__}: {exc}",
                               request_id)
        finally:
            await upstream.aclose()
        return passthrough(upstream, request_id)
    return StreamingResponse(
        relay_stream(upstream, url, request_id),
        media_type=upstream.headers.get("content-type", "text/event-stream"),
        headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"},
        background=BackgroundTask(upstream.aclose),
    )


async def relay_stream(upstream: httpx.Response, url: str,
                       request_id: str) -> AsyncIterator[bytes]:
    """Yield the decode server's chunks unchanged. Should it die mid-stream, end the
    stream the way the engine's own server does (an error event, then ``[DONE]``), since
    the 200 is already sent. Closing ``upstream`` (also when the client goes away and this
    generator is cancelled) drops the connection, which makes the decoder abort the
    request instead of generating for nobody."""
    try:
        async for chunk in upstream.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("%s: decode stream from %s broke: %r", request_id, url, exc)
        error = {"object": "error", "error": {
            "message": f"decode server {url} failed mid-stream: {type(exc).__name__}: {exc}",
            "type": "BadGatewayError", "param": None, "code": 502}}
        yield f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled task must still close it
            await upstream.aclose()


async def parse_json_body(request: Request) -> dict[str, Any]:
    """The client's JSON object; anything else is a 400 (the servers would say the same,
    but the proxy needs the object to rewrite it)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _EarlyResponse(error_response(
            400, f"request body is not valid JSON: {exc}", "BadRequestError")) from exc
    if not isinstance(body, dict):
        raise _EarlyResponse(error_response(
            400, "request body must be a JSON object", "BadRequestError"))
    return body


async def route_generation(state: ProxyState, request: Request, path: str) -> Response:
    """Prefill on one server, decode on another, answer with the decoder's response."""
    request_id = new_request_id()
    try:
        body = await parse_json_body(request)
        headers = forwarded_headers(request, request_id)
        client = state.http()
        prefill_url = state.prefill.next()
        kv_params = await run_prefill(
            client, prefill_url, path,
            build_prefill_body(body, chat=path.endswith("/chat/completions")),
            headers, request_id)
    except _EarlyResponse as early:
        early.response.headers.setdefault(REQUEST_ID_HEADER, request_id)
        return early.response
    # Picked only now, so that failed prefills do not skew the decoders' rotation.
    decode_url = state.decode.next()
    logger.debug("%s: %s prefill=%s decode=%s kv_transfer_params=%s", request_id, path,
                 prefill_url, decode_url, "yes" if kv_params is not None else "none")
    decode_body = build_decode_body(body, kv_params)
    run = run_decode_stream if body.get("stream") is True else run_decode
    return await run(client, decode_url, path, decode_body, headers, request_id)


async def check_health(client: httpx.AsyncClient, role: str, url: str) -> dict[str, Any]:
    """One server's ``/health``: ``{"role", "url", "healthy", "reason"}``."""
    try:
        answer = await client.get(url + "/health", timeout=_HEALTH_TIMEOUT)
    except httpx.HTTPError as exc:
        return {"role": role, "url": url, "healthy": False,
                "reason": f"{type(exc).__name__}: {exc}"}
    healthy = answer.status_code == 200
    return {"role": role, "url": url, "healthy": healthy,
            "reason": None if healthy else f"HTTP {answer.status_code}"}


def build_proxy_app(prefill_urls: Iterable[str], decode_urls: Iterable[str]) -> FastAPI:
    """The proxy's FastAPI app over the given prefill and decode base URLs
    (``http://host:port``). Raises ``ValueError`` for an empty list or a malformed URL."""
    state = ProxyState(prefill=RoundRobin(normalize_urls(prefill_urls, "prefill")),
                       decode=RoundRobin(normalize_urls(decode_urls, "decode")))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.http()
        try:
            yield
        finally:
            await state.aclose()  # no leaked sockets on Ctrl-C / SIGTERM

    app = FastAPI(title="engine disaggregated prefill/decode proxy", lifespan=lifespan)
    app.state.proxy = state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route_generation(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route_generation(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The decoders serve the client's generations, so they name the model."""
        request_id = new_request_id()
        url = state.decode.urls[0]
        try:
            upstream = await state.http().get(url + "/v1/models",
                                              headers=forwarded_headers(request, request_id))
        except httpx.HTTPError as exc:
            return bad_gateway(f"decode server {url} failed: {type(exc).__name__}: {exc}",
                               request_id)
        return passthrough(upstream, request_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 only when every server is healthy: a request needs one of each kind, and
        round-robin would send some requests to a dead one."""
        client = state.http()
        checks = await asyncio.gather(
            *(check_health(client, "prefill", url) for url in dict.fromkeys(state.prefill.urls)),
            *(check_health(client, "decode", url) for url in dict.fromkeys(state.decode.urls)))
        unhealthy = [c for c in checks if not c["healthy"]]
        if unhealthy:
            names = ", ".join(f"{c['role']} {c['url']} ({c['reason']})" for c in unhealthy)
            return JSONResponse({"status": "unhealthy", "message": f"unhealthy: {names}",
                                 "unhealthy": unhealthy, "servers": checks},
                                status_code=503)
        return JSONResponse({"status": "healthy", "servers": checks})

    return app


__all__ = [
    "RoundRobin",
    "build_decode_body",
    "build_prefill_body",
    "build_proxy_app",
    "prefill_kv_transfer_params",
]
