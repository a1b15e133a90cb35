"""Overload and deadlines on a real `engine serve`: with --max-num-seqs 2
--max-num-waiting 1 a fourth concurrent generation request gets a 429 (Retry-After, an
OpenAI-style RateLimitError body) while the admitted ones succeed; a request whose
x-request-timeout passes is aborted in the engine core (a 408, or an error event in its
stream) and its KV blocks are freed at once."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.entrypoints.openai.serving_base import request_timeout_s

SERVED_NAME = "tiny"
MAX_LEN = 4096
# Thousands of tokens: each request runs for seconds even on this tiny model.
SLOW = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 16,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama_dir(model_dir_factory):
    """The conftest's tiny model, with room for long generations."""
    return model_dir_factory("llama-gqa", max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", str(MAX_LEN), "--max-num-seqs", "2",
                        "--max-num-waiting", "1")


def _gauges(http: httpx.Client) -> dict[str, float]:
    found = {}
    for line in http.get("/metrics").text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"engine:{name}{{"):
                found[name] = float(line.split()[-1])
    return found


def _wait_gauges(http: httpx.Client, timeout_s: float, **expected) -> float:
    """Poll /metrics until every gauge matches (a callable tests the value); the wait."""
    start = time.monotonic()
    while True:
        gauges = _gauges(http)
        if all(check(gauges[name]) if callable(check) else gauges[name] == check
               for name, check in expected.items()):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, gauges
        time.sleep(0.02)


def _stream(url: str, max_tokens: int) -> tuple[int, list[str]]:
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**SLOW, "max_tokens": max_tokens, "stream": True}) as response:
        return response.status_code, [line for line in response.iter_lines() if line]


def _assert_rate_limited(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    body = response.json()
    assert body["object"] == "error"
    error = body["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert "max_num_waiting" in error["message"] and error["param"] is None


def test_queue_cap_answers_429(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with ThreadPoolExecutor(3) as pool, httpx.Client(base_url=server.url, timeout=30) as http:
        admitted = [pool.submit(_stream, server.url, 600 + 100 * i) for i in range(3)]
        _wait_gauges(http, 10, num_requests_running=2, num_requests_waiting=1)

        _assert_rate_limited(http.post("/v1/completions", json={**SLOW, "max_tokens": 4}))
        _assert_rate_limited(http.post("/v1/chat/completions", json={
            "model": SERVED_NAME, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}))
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=4)
        assert http.get("/health").status_code == 200  # only generation is capped

        for future in admitted:  # the admitted requests all finish normally
            status, lines = future.result(timeout=60)
            assert status == 200 and lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == \
                "length"
        response = http.post("/v1/completions", json={**SLOW, "max_tokens": 4})  # room again
        assert response.status_code == 200, response.text


def test_deadline_aborts_and_frees_kv(server):
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=30) as http:
        timed = {"x-request-timeout": "0.5"}
        start = time.monotonic()
        pending = pool.submit(http.post, "/v1/completions", json=SLOW, headers=timed)
        _wait_gauges(http, 5, num_requests_running=1, kv_cache_usage_perc=lambda v: v > 0)
        response = pending.result(timeout=10)
        answered = time.monotonic() - start
        assert response.status_code == 408, response.text
        error = response.json()["error"]
        assert error["code"] == 408 and "deadline of 0.5 s" in error["message"]
        freed = _wait_gauges(http, 2, num_requests_running=0, num_requests_waiting=0,
                             kv_cache_usage_perc=0.0)
        print(f"deadline 0.5 s: 408 after {answered:.2f} s, KV free {freed:.2f} s later")
        assert 0.5 <= answered < 2.0

        with http.stream("POST", "/v1/completions", json={**SLOW, "stream": True},
                         headers={"x-request-timeout": "0.3"}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == 408
        assert "error" not in lines[0]  # tokens streamed before the deadline
        _wait_gauges(http, 2, num_requests_running=0, kv_cache_usage_perc=0.0)

        bad = http.post("/v1/completions", json=SLOW, headers={"x-request-timeout": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"


def test_request_timeout_header_and_default():
    assert request_timeout_s([], None) is None
    assert request_timeout_s([], 30.0) == 30.0
    assert request_timeout_s([(b"x-request-timeout", b" 2.5 ")], 30.0) == 2.5
    for bad in (b"0", b"-1", b"inf", b"nan", b"soon"):
        with pytest.raises(Exception, match="x-request-timeout"):
            request_timeout_s([(b"x-request-timeout", bad)], None)
