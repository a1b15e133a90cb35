"""`engine serve --api-server-count 2`: two API server processes on one port, one core.

Completions equal the offline engine's greedy text; both processes serve requests (their
own Prometheus multiprocess files count them) and ``/metrics`` on either sums them. An API
server killed with SIGKILL: its stream breaks; with ``--api-server-on-failure continue``
the other serves on and the core aborts the dead one's requests (running count back to
0), by default (``exit``) the launcher stops everything with a non-zero code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.mmap_dict import MmapedDict

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, _alive, child_pids

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4", "Once upon a time"]
EXIT_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    """(continue launcher, exit launcher), started together; stopped at module end."""
    started = []
    for policy in ("continue", "exit"):
        log = tmp_path_factory.mktemp("group-server") / "server.log"
        # Eager steps, one thread and a long context: a stream still runs when its
        # server is killed.
        started.append(ServerProcess(llama_dir, log, [
            "--api-server-count", "2", "--api-server-on-failure", policy,
            "--max-model-len", "512", "--enforce-eager", "--num-threads", "1"]))
    try:
        for server in started:
            server.wait_ready()
        yield tuple(started)
    finally:
        for server in started:
            server.stop()


def _api_servers(server: ServerProcess) -> list[int]:
    return child_pids(server.proc.pid, "api_server_group")


def _wait_all_up(server: ServerProcess) -> list[int]:
    """The API server pids, once both answer (each touched its ready file)."""
    pids = _api_servers(server)
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.log().count("Application startup complete") >= 2:
            return pids
        time.sleep(0.2)
    raise AssertionError(server.log())


def _metrics_dir(pid: int) -> Path:
    return Path(psutil.Process(pid).environ()["PROMETHEUS_MULTIPROC_DIR"])


def _served_by(pid: int) -> float:
    """Requests this API server finished (its own multiprocess counter file)."""
    path = _metrics_dir(pid) / f"counter_{pid}.db"
    total = 0.0
    if not path.exists():  # written on the server's first counted request
        return total
    for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
        if json.loads(key)[0] == "engine:request_success":
            total += value
    return total


def _complete(url: str, prompt: str) -> str:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def reference(llama_dir):
    from engine import LLM, SamplingParams

    with LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256,
             cpu_kvcache_space_gib=0.05) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def test_two_servers_share_port_and_metrics(servers, reference) -> None:
    server = servers[0]
    pids = _wait_all_up(server)
    sent = 0
    with ThreadPoolExecutor(8) as pool:
        for _ in range(6):  # until both processes have served (the kernel picks)
            texts = list(pool.map(lambda p: _complete(server.url, p), PROMPTS * 2))
            sent += len(texts)
            assert texts == reference * 2
            if all(_served_by(pid) > 0 for pid in pids):
                break
    assert all(_served_by(pid) > 0 for pid in pids), [_served_by(pid) for pid in pids]
    assert sum(_served_by(pid) for pid in pids) == sent
    # Any server's /metrics: the per-request counter over both processes, the core once.
    assert _metric(server.url, "engine:request_success_total") == sent
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert sum(line.startswith("engine:num_requests_running{") for line in text.splitlines()) == 1


def _stream_on(server: ServerProcess, pids: list[int], victim: int, control: httpx.Client):
    """Open long streams until one is served by ``victim``, pausing the core's scheduling
    (``control``, a client on the other server) right after its first token so that it
    is still in the core; (client, response, line iterator). A stream whose 480 tokens
    all ran before the pause landed (a loaded machine: the pause crosses the other
    server) finishes on the victim: it is drained and another one opened."""
    for attempt in range(16):
        finished_before = _served_by(victim)
        http = httpx.Client(base_url=server.url, timeout=60)
        body = {"model": SERVED_NAME, "prompt": f"Story {attempt} {time.monotonic_ns()}",
                "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
        stream = http.stream("POST", "/v1/completions", json=body)
        response = stream.__enter__()
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        assert control.post("/pause", params={"mode": "keep"}).status_code == 200
        if _owner(pids, _client_port(response)) == victim:
            time.sleep(0.5)  # a request the core finished reaches the victim's counter
            if _served_by(victim) == finished_before:
                return http, response, lines
        assert control.post("/resume").status_code == 200
        for _ in lines:  # not on the victim: let it finish
            pass
        stream.__exit__(None, None, None)
        http.close()
    raise AssertionError("no stream landed on the chosen API server")


def _client_port(response: httpx.Response) -> int:
    stream = response.extensions["network_stream"]
    return stream.get_extra_info("client_addr")[1]


def _owner(pids: list[int], client_port: int) -> int | None:
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == client_port:
                return pid
    return None


def _client_on(server: ServerProcess, pids: list[int], pid: int) -> httpx.Client:
    """A keep-alive client whose connection is served by ``pid``."""
    for _ in range(32):
        http = httpx.Client(base_url=server.url, timeout=60)
        response = http.get("/health")
        if _owner(pids, _client_port(response)) == pid:
            return http
        http.close()
    raise AssertionError("no connection landed on the chosen API server")


def test_continue_after_api_server_death(servers) -> None:
    server = servers[0]
    pids = _wait_all_up(server)
    victim, survivor = pids
    control = _client_on(server, pids, survivor)
    http, _, lines = _stream_on(server, pids, victim, control)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(httpx.HTTPError):
        for _ in lines:
            pass
    http.close()
    deadline = time.monotonic() + 10
    while not re.search(r"front end \d is gone: aborting its 1 ", server.log()):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert control.post("/resume").status_code == 200
    control.close()
    # The survivor serves on, on the same port; the core holds no request.
    for prompt in PROMPTS:
        _complete(server.url, prompt)
    assert _metric(server.url, "engine:num_requests_running") == 0
    assert server.proc.poll() is None


def test_exit_after_api_server_death(servers) -> None:
    server = servers[1]
    pids = _wait_all_up(server)
    cores = child_pids(server.proc.pid, "engine.core.core_proc")
    started = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    code = server.proc.wait(EXIT_WITHIN_S)
    assert code != 0
    assert time.monotonic() - started < EXIT_WITHIN_S
    deadline = time.monotonic() + 10
    while any(map(_alive, [*pids, *cores])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, [*pids, *cores])), "a child outlived the launcher"


def test_core_death_stops_every_server(servers) -> None:
    """As one server does: the surviving API server exits on the core's death, then the
    launcher (no server left) with a non-zero code, within seconds."""
    server = servers[0]
    assert server.proc.poll() is None
    cores = child_pids(server.proc.pid, "engine.core.core_proc")
    started = time.monotonic()
    os.kill(cores[0], signal.SIGKILL)
    assert server.proc.wait(EXIT_WITHIN_S) != 0
    assert time.monotonic() - started < EXIT_WITHIN_S
