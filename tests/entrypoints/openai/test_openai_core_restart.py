"""A SIGKILLed engine core of a real `engine serve`: the in-flight stream gets an error
event, /health turns 503, then the server process exits with code 1 (vLLM's behaviour,
so a supervisor restarts it); with --restart-engine-core 1 a fresh core serves again
(/health 200, requests succeed) and a second kill makes the server exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import _alive, child_pids

SERVED_NAME = "tiny"
MAX_LEN = 4096
# Thousands of tokens: the stream surely still runs when the core is killed a few ms
# after its first chunk arrived.
LONG = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 16,
        "temperature": 0, "ignore_eos": True, "stream": True}
ARGS = ("--max-model-len", str(MAX_LEN))
EXIT_WITHIN_S = 8.0


@pytest.fixture(scope="module")
def llama_dir(model_dir_factory):
    """The conftest's tiny model, with room for long generations."""
    return model_dir_factory("llama-gqa", max_position_embeddings=MAX_LEN)


def _kill_during_stream(server, http: httpx.Client) -> dict[str, float]:
    """Start a stream, SIGKILL the core after its first chunk; the stream must end with
    an error event and [DONE]. Returns the timeline (seconds after the kill)."""
    timeline: dict[str, float] = {}
    with http.stream("POST", "/v1/completions", json=LONG) as stream:
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        assert "error" not in json.loads(next(lines)[len("data: "):])
        os.kill(server.core_pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                if http.get("/health", timeout=2).status_code == 503:
                    timeline["503"] = time.monotonic() - killed
                    break
            except httpx.TransportError:  # already gone: fine only for the exit case
                timeline["503"] = time.monotonic() - killed
                break
            assert time.monotonic() - killed < 5, "/health stayed 200 after the kill"
            time.sleep(0.02)
        rest = list(lines)
        timeline["stream_error"] = time.monotonic() - killed
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert "error" in rest[-2], (rest[-3:], server.log())
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "engine" in error["message"].lower(), error
    timeline["_killed"] = killed
    return timeline


def _wait_exit(server, killed: float) -> float:
    try:
        code = server.proc.wait(EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still up {EXIT_WITHIN_S} s after the core died:\n"
                             f"{server.log()}") from None
    assert code == 1, f"exit code {code}:\n{server.log()}"
    return time.monotonic() - killed


def test_core_death_exits_nonzero(start_server):
    server = start_server(*ARGS)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        timeline = _kill_during_stream(server, http)
    timeline["exit"] = _wait_exit(server, timeline.pop("_killed"))
    print("core death timeline (s after SIGKILL):", timeline)
    log = server.log()
    assert "stopping the server with exit code 1" in log, log
    assert timeline["503"] < 1.0 and timeline["exit"] < EXIT_WITHIN_S


def test_restart_engine_core_once(start_server):
    server = start_server(*ARGS, "--restart-engine-core", "1")
    first_core = server.core_pid
    with httpx.Client(base_url=server.url, timeout=30) as http:
        timeline = _kill_during_stream(server, http)
        killed = timeline.pop("_killed")
        while http.get("/health").status_code != 200:
            assert time.monotonic() - killed < 60, f"no restart:\n{server.log()}"
            time.sleep(0.05)
        timeline["restarted"] = time.monotonic() - killed
        cores = [pid for pid in child_pids(server.proc.pid, "engine.core.core_proc")
                 if _alive(pid)]
        assert len(cores) == 1 and cores[0] != first_core, cores
        server.core_pid = cores[0]  # the fixture checks it is gone at the end
        response = http.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert "restart 1 of 1" in server.log()

        second = _kill_during_stream(server, http)  # no restarts left: the server exits
        timeline["second_exit"] = _wait_exit(server, second.pop("_killed"))
    print("restart timeline (s after SIGKILL):", timeline, "second kill:", second)
    assert "all 1 restart(s) are used" in server.log()
