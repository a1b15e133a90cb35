"""``LLM(data_parallel_size=2, data_parallel_backend="ray")`` on a real two-node Ray cluster
started by the test (``ray start --head`` in its own session and temp dir, plus a second
raylet, ``ray start --address``, as the other "node"): each rank's launcher is a Ray
actor whose core connects back over tcp; the ranks land on both nodes, greedy outputs
equal one core's, and every Ray process the test started is gone afterwards. Without Ray the test skips, except
in CI (``ENGINE_CI=1``), where it fails."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine import LLM
from tests.entrypoints.test_data_parallel import (  # noqa: F401 - dp1_outputs: a fixture
    OPTIONS,
    assert_two_ranks_equal_one,
    dp1_outputs,
)
from tests.model_executor.test_parallel_executor import (
    _assert_pids_gone,
    _import_ray_or_skip,
    _RayHead,
)


def test_ray_dp2_equals_dp1(llama_dir, dp1_outputs, monkeypatch, request):  # noqa: F811
    ray = _import_ray_or_skip()
    if ray.is_initialized():
        pytest.skip("this process is already connected to another Ray cluster")
    head = _RayHead()
    node_b: list[subprocess.Popen] = []

    def stop_cluster() -> None:
        if ray.is_initialized():
            ray.shutdown()  # the driver first: it would outlive its cluster otherwise
        for proc in node_b:
            proc.terminate()  # --block stops the raylet's processes on SIGTERM
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        head.stop()  # also kills (and reports) whatever named its temp dir

    request.addfinalizer(stop_cluster)
    head.wait_ready()
    node_b.append(subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--address", head.address,
         "--block", "--num-cpus", "1", "--disable-usage-stats", "--temp-dir", head.temp_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    monkeypatch.setenv("RAY_ADDRESS", head.address)
    ray.init(address=head.address)  # the engine joins this connection
    deadline = time.monotonic() + 60
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        assert time.monotonic() < deadline, f"the second raylet never joined: {ray.nodes()}"
        time.sleep(0.2)
    with LLM(str(llama_dir), data_parallel_size=2, data_parallel_backend="ray",
             **OPTIONS) as llm:
        client, _ = assert_two_ranks_equal_one(llm, dp1_outputs)
        cores = list(client.pids)
        [group] = ray.util.placement_group_table().values()
        assert len(set(group["bundles_to_node_id"].values())) == 2, group  # both nodes
    _assert_pids_gone(cores, timeout=15.0)  # the launchers stopped their cores
