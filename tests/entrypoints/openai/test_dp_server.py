"""`engine serve --data-parallel-size 2`: two engine cores behind one server.

Completions equal one core's (the offline engine's greedy text), /metrics has a series per
core (``engine="0"``, ``engine="1"``), and killing one core: its in-flight request ends with
an error within seconds; with ``--data-parallel-on-rank-failure continue`` the other core
keeps serving (and new requests avoid the dead one), by default the server exits (code 1).
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4", "Once upon a time"]
LONG = {"model": SERVED_NAME, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
        "stream": True}
ERROR_WITHIN_S = 5.0
EXIT_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    """(continue server, exit server), started together; stopped at module end."""
    started = []
    for policy in ("continue", "exit"):
        log = tmp_path_factory.mktemp("dp-server") / "server.log"
        started.append(ServerProcess(llama_dir, log, ["--data-parallel-size", "2",
                                                      "--data-parallel-on-rank-failure",
                                                      policy], num_cores=2))
    try:
        for server in started:
            server.wait_ready()
        yield tuple(started)
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def reference(llama_dir):
    """One core's greedy completions (the offline engine, the server's options)."""
    from engine import LLM, SamplingParams

    with LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256,
             cpu_kvcache_space_gib=0.05) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def _complete(url: str, prompt: str) -> str:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _metric(text: str, name: str, engine: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for engine {engine}")


def _start_streams(url: str, count: int):
    """``count`` long streaming completions, each past its first token; (client, streams).
    Their prompts are new to the server (no prefix affinity pulls them to one rank), so
    the least-loaded rule spreads them over the ranks."""
    http = httpx.Client(base_url=url, timeout=60)
    streams = []
    for i in range(count):
        prompt = f"Stream {i} {time.monotonic_ns()}: a long story"
        stream = http.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt})
        response = stream.__enter__()
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        assert "error" not in json.loads(next(lines)[len("data: "):])
        streams.append((stream, lines))
    return http, streams


def _ends_in_error(lines) -> bool:
    rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    return any("error" in json.loads(line[len("data: "):]) for line in rest[:-1])


def assert_killing_a_rank_fails_only_its_stream(url: str, kill) -> None:
    """Two streams (one on each rank, least loaded), ``kill()`` one rank's core: exactly
    one stream ends in an error event, within ERROR_WITHIN_S; the server stays healthy and
    completes new requests as one core would."""
    http, streams = _start_streams(url, 2)
    kill()
    killed = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        errored = list(pool.map(lambda s: (_ends_in_error(s[1]), time.monotonic() - killed),
                                streams))
    for stream, _ in streams:
        stream.__exit__(None, None, None)
    http.close()
    assert sorted(e for e, _ in errored) == [False, True], errored
    assert next(t for e, t in errored if e) < ERROR_WITHIN_S
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_completions_equal_one_core_and_metrics_per_engine(servers, reference):
    server = servers[0]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
    assert texts == reference
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for engine in ("0", "1"):
        assert _metric(metrics, "engine:engine_healthy", engine) == 1.0
        assert _metric(metrics, "engine:prompt_tokens_computed_total", engine) > 0
    assert 'engine:prompt_tokens_total{model_name="tiny"}' in metrics  # front end's, as before


def test_continue_fails_only_the_dead_ranks_requests(servers, reference):
    server = servers[0]
    victim = server.core_pids[1]
    assert_killing_a_rank_fails_only_its_stream(
        server.url, lambda: os.kill(victim, signal.SIGKILL))
    # The server keeps serving on the live core, for any number of new requests.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: _complete(server.url, p), PROMPTS)) == reference
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    healthy = [_metric(metrics, "engine:engine_healthy", e) for e in ("0", "1")]
    assert sorted(healthy) == [0.0, 1.0]


def test_exit_policy_stops_the_server(servers):
    server = servers[1]
    http, streams = _start_streams(server.url, 2)
    os.kill(server.core_pids[0], signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = server.proc.wait(EXIT_WITHIN_S)
    finally:
        for stream, _ in streams:
            try:
                stream.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        http.close()
    assert code == 1, server.log()
    assert time.monotonic() - killed < EXIT_WITHIN_S
    assert "data-parallel rank" in server.log()
