"""A server whose engine-core process is killed: /health turns 503 at once, in-flight
requests end with errors (a stream gets an error event, then [DONE]), new requests get a
503 promptly, and SIGTERM still stops the server. Its own server: the core stays dead
(--keep-alive-on-engine-death; by default the server exits, see test_openai_core_restart)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

SERVED_NAME = "tiny"
LONG = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 240,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--keep-alive-on-engine-death")


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("engine:num_requests_running{"):
            return float(line.split()[-1])
    raise AssertionError("no running gauge")


def test_killed_core_fails_requests_fast(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=30)
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert "error" not in json.loads(next(lines)[len("data: "):])
            pending = pool.submit(lambda: client.completions.create(
                extra_body={"ignore_eos": True},
                **{k: v for k, v in LONG.items() if k != "ignore_eos"}))
            deadline = time.monotonic() + 10
            while _running(server.url) < 2:  # both requests are in the core
                assert time.monotonic() < deadline and not pending.done()
                time.sleep(0.02)

            os.kill(server.core_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)
            assert time.monotonic() - killed < 5
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "engine" in error["message"].lower()

        with pytest.raises(openai.APIStatusError) as info:
            pending.result(timeout=10)
        assert info.value.status_code == 503

        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["type"] == "ServiceUnavailableError"
        for path, body in (
            ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 2, "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]}),
        ):
            start = time.monotonic()
            response = http.post(path, json=body)
            assert response.status_code == 503, response.text
            assert time.monotonic() - start < 2
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert 'engine:engine_healthy{model_name="tiny"} 0.0' in metrics.text
