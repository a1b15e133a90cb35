"""The RL-loop routes of `engine serve`: /sleep, /wake_up, /is_sleeping (503 for model
routes while asleep) and /pause + /resume with vLLM's modes abort / wait / keep, against
a real server process driven over HTTP."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

SERVED_NAME = "tiny"
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(start_server):
    # Eager steps and a long context, so a streamed request is still running when the
    # test pauses it.
    return start_server("--enable-sleep-mode", "--enforce-eager", "--max-model-len", "512",
                        "--num-threads", "1")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _body(max_tokens: int = 16, **extra) -> dict:
    return {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **extra}


def _complete(http) -> str:
    response = http.post("/v1/completions", json=_body())
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class _Stream(threading.Thread):
    """A streaming completion read in the background: its chunks and finish reason."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c, \
                c.stream("POST", "/v1/completions",
                         json=_body(MAX_TOKENS, stream=True)) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.texts.append(choice["text"])
                self.started.set()
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]


def _start_stream(server) -> _Stream:
    stream = _Stream(server.url)
    stream.start()
    assert stream.started.wait(30)
    return stream


def test_sleep_wake_and_503_while_asleep(http):
    before = _complete(http)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    bad = http.post("/sleep", params={"level": 3})
    assert bad.status_code == 400 and "level must be 1 or 2" in bad.json()["error"]["message"]

    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = http.post("/v1/completions", json=_body())
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "wake_up" in error["message"]
    again = http.post("/sleep", params={"level": 1})
    assert again.status_code == 400 and "already sleeping" in again.json()["error"]["message"]
    assert http.get("/health").status_code == 200  # alive, only asleep
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(http) == before

    assert http.post("/sleep", params={"level": 2}).status_code == 200
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/v1/completions", json=_body()).status_code == 503
    assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(http) == before


def test_pause_abort(server, http):
    stream = _start_stream(server)
    assert http.post("/pause", params={"mode": "abort"}).status_code == 200
    stream.join(30)
    assert stream.finish_reason == "abort" and len(stream.texts) < MAX_TOKENS
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert _complete(http)


def test_pause_wait_lets_the_request_finish(server, http):
    stream = _start_stream(server)
    assert http.post("/pause", params={"mode": "wait"}).status_code == 200
    stream.join(5)  # /pause returned after the request completed
    assert stream.finish_reason == "length"
    assert "".join(stream.texts)
    assert http.post("/resume").status_code == 200


def test_pause_keep_holds_then_resumes(server, http):
    stream = _start_stream(server)
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    time.sleep(0.2)
    held = len(stream.texts)
    # a new request waits for /resume; sleeping is refused while a request is held
    late = _Stream(server.url)
    late.start()
    time.sleep(0.5)
    assert len(stream.texts) == held and stream.is_alive() and not late.started.is_set()
    busy = http.post("/sleep", params={"level": 1})
    assert busy.status_code == 400 and "unfinished" in busy.json()["error"]["message"]
    assert http.post("/resume").status_code == 200
    stream.join(60)
    late.join(60)
    assert stream.finish_reason == "length" and late.finish_reason == "length"
    assert len(stream.texts) > held
