"""`engine proxy` (engine.kv_transfer.proxy) against fake prefill / decode servers.

Everything goes over real sockets: the fake backends and the proxy itself are uvicorn
servers in threads (one subprocess test runs the real ``engine proxy`` command). The fake
backends record each request they get (body and headers), so the tests can check exactly
what each hop was sent. Behaviour is picked per request by the standard ``user`` field:
``prefill-400`` / ``prefill-500`` make the prefill backend fail, ``no-kv`` makes it return
no kv_transfer_params, ``decode-400`` makes the decode backend fail, ``gate`` makes a
decode stream wait after its first chunk until the test has seen that chunk, ``hang`` makes
it wait until the connection goes away.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.cli import main as cli_main
from engine.kv_transfer.proxy import build_proxy_app, prefill_kv_transfer_params

MODEL = "fake-model"
API_KEY = "sk-proxy-test"
STREAM_TOKENS = [f"tok{i}" for i in range(5)]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- servers
class ThreadServer:
    """A uvicorn server in a daemon thread on a socket bound up front (no port race)."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no start"
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "server did not stop"
        self.sock.close()


@contextmanager
def serving(app: FastAPI) -> Iterator[ThreadServer]:
    server = ThreadServer(app).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def dead_url() -> Iterator[str]:
    """A URL whose port is bound but not listening: connecting is refused at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@contextmanager
def proxy_over(prefill: list[str], decode: list[str]) -> Iterator[ThreadServer]:
    """A proxy server for one test; its httpx client must be closed once it stops."""
    app = build_proxy_app(prefill, decode)
    with serving(app) as server:
        yield server
    assert app.state.proxy.client is None, "lifespan shutdown did not close the client"


# --------------------------------------------------------------------------- backends
@dataclass
class Backend:
    """One fake engine server, prefill or decode, recording what it is sent."""

    name: str
    role: str
    port_hint: int
    received: list[dict[str, Any]] = field(default_factory=list)
    healthy: bool = True
    gate: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)
    url: str = ""

    def kv_params(self, request_id: str | None) -> dict[str, Any]:
        """What a producer's kv connector would return (vLLM's shape plus extras)."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": f"engine-{self.name}", "remote_block_ids": [3, 1, 4],
                "remote_host": "10.0.0.7", "remote_port": self.port_hint, "tp_size": 1,
                "request_id": request_id}

    def reset(self) -> None:
        self.received.clear()
        self.events.clear()
        self.gate.clear()
        self.healthy = True


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "error": {
        "message": message, "type": "BadRequestError" if status < 500 else
        "InternalServerError", "param": "prompt", "code": status}}, status_code=status)


def _completion(backend: Backend, chat: bool, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                               "finish_reason": "length", "logprobs": None} if chat else
                              {"index": 0, "text": text, "finish_reason": "length",
                               "logprobs": None})
    return {"id": f"{backend.name}-1", "object": "chat.completion" if chat else
            "text_completion", "created": 1, "model": MODEL, "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _chunk(backend: Backend, chat: bool, text: str) -> str:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
              else {"index": 0, "text": text, "finish_reason": None, "logprobs": None})
    payload = {"id": f"{backend.name}-s", "object": "chat.completion.chunk" if chat else
               "text_completion", "created": 1, "model": MODEL, "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n"


def make_backend_app(backend: Backend) -> FastAPI:
    app = FastAPI()

    async def generate(request: Request, chat: bool):
        body = await request.json()
        backend.received.append({"path": request.url.path, "body": body,
                                 "headers": dict(request.headers)})
        mode = body.get("user")
        if backend.role == "prefill":
            if mode == "prefill-400":
                return _error(400, "bad prompt from prefill")
            if mode == "prefill-500":
                return _error(500, "prefill exploded")
            answer = _completion(backend, chat, "x")
            if mode != "no-kv":
                answer["kv_transfer_params"] = backend.kv_params(
                    request.headers.get("x-request-id"))
            return answer
        if mode == "decode-400":
            return _error(400, "bad input at decode")
        if not body.get("stream"):
            return _completion(backend, chat, f"from {backend.name}")

        async def events():
            try:
                for i, token in enumerate(STREAM_TOKENS):
                    yield _chunk(backend, chat, token)
                    if i == 0 and mode == "gate":
                        for _ in range(500):  # 5 s at most
                            if backend.gate.is_set():
                                break
                            await asyncio.sleep(0.01)
                        backend.events.append(f"gate released={backend.gate.is_set()}")
                    elif i == 0 and mode == "hang":
                        while True:
                            await asyncio.sleep(0.01)
                    else:
                        await asyncio.sleep(0.005)
                yield "data: [DONE]\n\n"
            finally:
                backend.events.append("stream closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        backend.received.append({"path": "/v1/models", "body": None,
                                 "headers": dict(request.headers)})
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                            "owned_by": backend.name}]}

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if backend.healthy else 503)

    return app


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    made = {name: Backend(name, role, 5600 + i) for i, (name, role) in enumerate(
        [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")])}
    servers = [ThreadServer(make_backend_app(b)).start() for b in made.values()]
    for backend, server in zip(made.values(), servers):
        backend.url = server.url
    yield made
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_backends(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


@pytest.fixture(scope="module")
def proxy(backends: dict[str, Backend]) -> Iterator[ThreadServer]:
    b = backends
    with proxy_over([b["p0"].url, b["p1"].url], [b["d0"].url, b["d1"].url]) as server:
        yield server


def only_request(backends: dict[str, Backend], role: str) -> tuple[Backend, dict[str, Any]]:
    """The one backend of ``role`` that got a request in this test, and that request."""
    hit = [(b, r) for b in backends.values() if b.role == role for r in b.received]
    assert len(hit) == 1, f"expected one {role} request, got {len(hit)}"
    return hit[0]


def openai_client(server: ThreadServer, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0,
                         timeout=10)


# --------------------------------------------------------------------------- the two hops
def test_completion_two_hops_via_openai_client(proxy, backends):
    result = openai_client(proxy).completions.create(
        model=MODEL, prompt="hello there", max_tokens=7, temperature=0.0, n=1)
    prefill_backend, prefill = only_request(backends, "prefill")
    decode_backend, decode = only_request(backends, "decode")
    assert result.choices[0].text == f"from {decode_backend.name}"

    sent = prefill["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert "stream_options" not in sent
    assert sent["kv_transfer_params"] == prefill_kv_transfer_params()
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["prompt"] == "hello there" and sent["n"] == 1 and sent["temperature"] == 0.0

    request_id = prefill["headers"]["x-request-id"]
    assert request_id.startswith("proxy-")
    assert decode["headers"]["x-request-id"] == request_id
    # The decoder gets the original body plus exactly what the producer returned.
    assert decode["body"]["max_tokens"] == 7 and decode["body"]["prompt"] == "hello there"
    assert decode["body"]["kv_transfer_params"] == prefill_backend.kv_params(request_id)


def test_streaming_via_openai_client(proxy, backends):
    stream = openai_client(proxy).completions.create(
        model=MODEL, prompt="stream me", max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    texts = [chunk.choices[0].text for chunk in stream]
    assert texts == STREAM_TOKENS

    prefill_backend, prefill = only_request(backends, "prefill")
    _, decode = only_request(backends, "decode")
    assert prefill["body"]["stream"] is False and prefill["body"]["max_tokens"] == 1
    assert "stream_options" not in prefill["body"]
    assert decode["body"]["stream"] is True and decode["body"]["max_tokens"] == 5
    assert decode["body"]["stream_options"] == {"include_usage": True}
    assert decode["body"]["kv_transfer_params"] == prefill_backend.kv_params(
        prefill["headers"]["x-request-id"])


def test_chat_limits_max_completion_tokens_and_streams(proxy, backends):
    client = openai_client(proxy)
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=9)
    assert answer.choices[0].message.content.startswith("from d")
    _, prefill = only_request(backends, "prefill")
    _, decode = only_request(backends, "decode")
    assert prefill["path"] == decode["path"] == "/v1/chat/completions"
    assert prefill["body"]["max_completion_tokens"] == 1
    assert prefill["body"]["max_tokens"] == 1
    assert decode["body"]["max_completion_tokens"] == 9 and "max_tokens" not in decode["body"]
    assert decode["body"]["messages"] == messages

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            stream=True)
    assert [c.choices[0].delta.content for c in stream] == STREAM_TOKENS


def test_round_robin_over_two_prefill_and_two_decode(proxy, backends):
    order: list[tuple[str, str]] = []
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(4):
            answer = client.post("/v1/completions",
                                 json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 3})
            assert answer.status_code == 200
            prefill_name = next(b.name for b in backends.values() if b.role == "prefill"
                                and any(r["body"]["prompt"] == f"p{i}" for r in b.received))
            order.append((prefill_name, answer.json()["choices"][0]["text"][5:]))
    prefills = [p for p, _ in order]
    decodes = [d for _, d in order]
    assert prefills[0] != prefills[1] and prefills[:2] == prefills[2:], prefills
    assert decodes[0] != decodes[1] and decodes[:2] == decodes[2:], decodes
    assert sorted(prefills) == ["p0", "p0", "p1", "p1"]
    assert sorted(decodes) == ["d0", "d0", "d1", "d1"]


def test_stream_is_relayed_chunk_by_chunk_in_order_with_done(proxy, backends):
    """The decode backend holds its stream after the first chunk until the test has
    received that chunk: a proxy that buffered would make the backend time out."""
    lines: list[str] = []
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, "user": "gate"}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"].startswith("proxy-")
        for line in resp.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 1:
                for backend in backends.values():
                    backend.gate.set()
    decode_backend, _ = only_request(backends, "decode")
    assert "gate released=True" in decode_backend.events
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[len("data: "):])["choices"][0]["text"] for line in lines[:-1]]
    assert texts == STREAM_TOKENS


def test_client_disconnect_closes_the_decode_stream(proxy, backends):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, "user": "hang"}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as resp:
        first = next(line for line in resp.iter_lines() if line)
        assert first.startswith("data: ")
    decode_backend, _ = only_request(backends, "decode")
    deadline = time.monotonic() + 5
    while "stream closed" not in decode_backend.events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "stream closed" in decode_backend.events


def test_no_kv_transfer_params_from_prefill_means_plain_decode(proxy, backends):
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        answer = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 3, "user": "no-kv"})
    assert answer.status_code == 200
    _, decode = only_request(backends, "decode")
    assert "kv_transfer_params" not in decode["body"]
    assert decode["body"]["max_tokens"] == 3


# --------------------------------------------------------------------------- errors
def test_prefill_down_is_a_502_openai_error(backends):
    with dead_url() as dead, proxy_over([dead], [backends["d0"].url]) as server:
        answer = httpx.post(server.url + "/v1/completions",
                            json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert answer.status_code == 502
        error = answer.json()["error"]
        assert error["code"] == 502 and error["type"] == "BadGatewayError"
        assert dead in error["message"]
        with pytest.raises(openai.APIStatusError) as excinfo:
            openai_client(server).completions.create(model=MODEL, prompt="x")
        assert excinfo.value.status_code == 502
    assert backends["d0"].received == []


def test_prefill_500_is_a_502_naming_the_cause(proxy, backends):
    answer = httpx.post(proxy.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "x", "user": "prefill-500"},
                        timeout=10)
    assert answer.status_code == 502
    assert "prefill exploded" in answer.json()["error"]["message"]
    assert all(not b.received for b in backends.values() if b.role == "decode")


def test_prefill_400_passes_through(proxy, backends):
    answer = httpx.post(proxy.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "x", "user": "prefill-400"},
                        timeout=10)
    assert answer.status_code == 400
    assert answer.content == _error(400, "bad prompt from prefill").body  # byte for byte
    with pytest.raises(openai.BadRequestError, match="bad prompt from prefill"):
        openai_client(proxy).completions.create(model=MODEL, prompt="x", user="prefill-400")
    assert all(not b.received for b in backends.values() if b.role == "decode")


def test_decode_error_status_is_preserved_streaming_or_not(proxy, backends):
    for stream in (False, True):
        answer = httpx.post(proxy.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "stream": stream, "user": "decode-400"}, timeout=10)
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "bad input at decode"


def test_decode_down_is_a_502(backends):
    with dead_url() as dead, proxy_over([backends["p0"].url], [dead]) as server:
        for stream in (False, True):
            answer = httpx.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "x", "stream": stream}, timeout=10)
            assert answer.status_code == 502 and dead in answer.json()["error"]["message"]


def test_body_that_is_not_a_json_object_is_a_400(proxy, backends):
    for raw in (b"{not json", b"[1, 2]"):
        answer = httpx.post(proxy.url + "/v1/completions", content=raw,
                            headers={"content-type": "application/json"}, timeout=10)
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "BadRequestError"
    assert all(not b.received for b in backends.values())


# --------------------------------------------------------------------------- other routes
def test_authorization_is_forwarded_to_both_hops_and_models(proxy, backends):
    client = openai_client(proxy)
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    _, prefill = only_request(backends, "prefill")
    _, decode = only_request(backends, "decode")
    assert prefill["headers"]["authorization"] == f"Bearer {API_KEY}"
    assert decode["headers"]["authorization"] == f"Bearer {API_KEY}"

    for _ in range(2):  # always the first decode server, whatever the rotation
        models = client.models.list()
        assert [m.owned_by for m in models.data] == ["d0"]
    assert backends["d0"].received[-1]["headers"]["authorization"] == f"Bearer {API_KEY}"


def test_health(proxy, backends):
    answer = httpx.get(proxy.url + "/health", timeout=10)
    assert answer.status_code == 200 and answer.json()["status"] == "healthy"

    backends["d1"].healthy = False
    answer = httpx.get(proxy.url + "/health", timeout=10)
    assert answer.status_code == 503
    assert [(u["role"], u["url"]) for u in answer.json()["unhealthy"]] == [
        ("decode", backends["d1"].url)]

    with dead_url() as dead, proxy_over([backends["p0"].url, dead],
                                        [backends["d0"].url]) as server:
        answer = httpx.get(server.url + "/health", timeout=10)
        assert answer.status_code == 503
        body = answer.json()
        assert [(u["role"], u["url"]) for u in body["unhealthy"]] == [("prefill", dead)]
        assert dead in body["message"]


def test_build_proxy_app_rejects_bad_urls():
    with pytest.raises(ValueError, match="at least one prefill"):
        build_proxy_app([], ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="decode URL"):
        build_proxy_app(["http://127.0.0.1:1"], ["127.0.0.1:2"])


# --------------------------------------------------------------------------- the command
def test_cli_registration_and_usage_errors():
    runner = CliRunner()
    assert "proxy" in runner.invoke(cli_main, ["--help"]).output
    result = runner.invoke(cli_main, ["proxy", "--help"])
    assert result.exit_code == 0 and "--prefill" in result.output
    assert runner.invoke(cli_main, ["proxy", "--prefill", "http://a:1"]).exit_code == 2
    result = runner.invoke(cli_main, ["proxy", "--prefill", "ftp://a:1", "--decode",
                                      "http://b:2"])
    assert result.exit_code == 2 and "prefill URL" in result.output


def test_engine_proxy_command_serves_and_exits_cleanly(backends):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "proxy", "--prefill", backends["p0"].url,
         "--decode", backends["d0"].url, "--port", str(port), "--log-level", "warning"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            assert child.poll() is None, child.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "engine proxy did not come up"
            time.sleep(0.05)
        answer = httpx.post(url + "/v1/completions",
                            json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=10)
        assert answer.json()["choices"][0]["text"] == "from d0"
        child.send_signal(signal.SIGINT)
        output, _ = child.communicate(timeout=10)
        assert child.returncode == 0, output
        assert "Traceback" not in output, output
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
