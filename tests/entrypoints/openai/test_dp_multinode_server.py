"""Multi-node data parallelism with two "nodes" on this machine over 127.0.0.1.

The head runs ``-dp 2 --data-parallel-size-local 1`` (rank 0 and the API server) and a
``--headless`` node runs rank 1, registering at the head's rpc port. Completions equal
one core's, both ranks serve (``engine="0"`` and ``engine="1"`` series), killing the
remote core is noticed within seconds (``continue``: only its request fails), the
launcher then exits, and the head's shutdown leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.conftest import ServerProcess, _alive, _free_port, child_pids
from tests.entrypoints.openai.test_dp_server import (
    PROMPTS,
    _complete,
    _metric,
    assert_killing_a_rank_fails_only_its_stream,
    reference,  # noqa: F401 - the fixture
)


def _headless(model_dir, log_path, rpc_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine.cli", "serve", str(model_dir), "--headless",
           "-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)]
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def two_nodes(llama_dir, tmp_path_factory):
    """(head server, headless launcher process, its log path)."""
    logs = tmp_path_factory.mktemp("dp-nodes")
    rpc_port = _free_port()
    head = ServerProcess(llama_dir, logs / "head.log", [
        "-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
        "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
        "--data-parallel-on-rank-failure", "continue"], num_cores=1)
    node = _headless(llama_dir, logs / "node.log", rpc_port)
    try:
        head.wait_ready()
        yield head, node, logs / "node.log"
    finally:
        head.stop()
        try:
            node.wait(15)  # the head's Goodbye (or silence) stops the launcher
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()
                pytest.fail("the headless launcher outlived the head")


def test_two_nodes_serve_like_one_core(two_nodes, reference):  # noqa: F811
    head, _node, _ = two_nodes
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(head.url, p), PROMPTS))
    assert texts == reference
    metrics = httpx.get(head.url + "/metrics", timeout=10).text
    for engine in ("0", "1"):
        assert _metric(metrics, "engine:engine_healthy", engine) == 1.0
        assert _metric(metrics, "engine:prompt_tokens_computed_total", engine) > 0


def test_remote_core_death_is_noticed(two_nodes, reference):  # noqa: F811
    head, node, node_log = two_nodes
    [remote_core] = child_pids(node.pid, "engine.core.core_proc")
    assert_killing_a_rank_fails_only_its_stream(
        head.url, lambda: os.kill(remote_core, signal.SIGKILL))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: _complete(head.url, p), PROMPTS)) == reference
    assert node.wait(10) == 1, node_log.read_text()  # its only rank is gone
    assert not _alive(remote_core)
