"""One engine core, two front ends (``endpoints.json``): each gets only its own outputs.

The core is started by hand (as the ``--api-server-count`` launcher does) and two
``LLMEngine``s attach to it (``AttachedCore`` channels); their requests interleave in the
core's batches, yet every step output and utility result reaches only its owner.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine import EngineArgs, SamplingParams
from engine.core.core_endpoints import ClientEndpoint, CoreEndpoints, EndpointsFile, pid_alive
from engine.core.core_proc import CONFIG_FILE
from engine.core.engine_io import EngineCoreOutput, EngineCoreOutputs
from engine.core.mp_client import AttachedCore, SyncMPClient, _child_env
from engine.frontend.llm_engine import LLMEngine

MODEL_KWARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 128}
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3"]


class _FakeSocket:
    """A PUSH socket that records what is sent."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def send_multipart(self, frames, copy=True) -> None:
        self.sent.append(frames)


def test_outputs_split_per_owner() -> None:
    """Unit level: a step touching two clients' requests is split; unknown ids dropped."""
    from engine.core import core_protocol as wire

    outs = [_FakeSocket(), _FakeSocket()]
    endpoints = CoreEndpoints([None, None], outs, lambda: None)
    endpoints.owner.update({"a": 0, "b": 1, "c": 1})
    step = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[1]) for rid in "abcz"],
        finished_requests=["c"], timestamp=1.0)
    endpoints.send_outputs(step)
    got = [[wire.outputs_decoder.decode(frames[1]) for frames in sock.sent] for sock in outs]
    assert [o.request_id for o in got[0][0].outputs] == ["a"]
    assert [o.request_id for o in got[1][0].outputs] == ["b", "c"]
    assert got[1][0].finished_requests == ["c"] and not got[0][0].finished_requests
    assert endpoints.owner == {"a": 0, "b": 1}  # c finished: forgotten
    endpoints.send(wire.READY, wire.ReadyInfo(1, 2, 3))  # READY / DEAD: everyone
    assert [len(sock.sent) for sock in outs] == [2, 2]


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


@pytest.fixture(scope="module")
def attached_engines(llama_dir):
    """Two LLMEngines over one core they did not start."""
    config = EngineArgs(model=str(llama_dir), **MODEL_KWARGS).create_engine_config()
    run_dir = Path(tempfile.mkdtemp(prefix="engine-ep-", dir="/tmp"))
    pairs = [ClientEndpoint(input=f"ipc://{run_dir}/c{i}-in", output=f"ipc://{run_dir}/c{i}-out")
             for i in range(2)]
    (run_dir / CONFIG_FILE).write_text(config.model_dump_json())
    EndpointsFile(clients=pairs).write(run_dir)
    core = subprocess.Popen([sys.executable, "-m", "engine.core.core_proc", "--run-dir",
                             str(run_dir), "--parent-pid", str(os.getpid())],
                            env=_child_env(config))
    engines = []
    try:
        for pair in pairs:
            channel = AttachedCore(pair.input, pair.output, startup_timeout_s=120)
            engines.append(LLMEngine(config, client=SyncMPClient(config, channel=channel)))
        yield core, engines
    finally:
        for engine in engines:
            engine.shutdown()
        core.terminate()
        core.wait(20)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_each_front_end_gets_only_its_outputs(attached_engines) -> None:
    core, (first, second) = attached_engines
    assert first.client.ready.pid == core.pid == second.client.ready.pid
    params = SamplingParams(temperature=0, max_tokens=12)
    for i, prompt in enumerate(PROMPTS):
        first.add_request(f"a{i}", prompt, params)
        second.add_request(f"b{i}", prompt, params)
    finished: list[dict[str, str]] = [{}, {}]
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for index, engine in enumerate((first, second)):
            if engine.has_unfinished_requests():
                for output in engine.step():
                    assert output.request_id[0] == "ab"[index], output.request_id
                    if output.finished:
                        finished[index][output.request_id] = output.outputs[0].text
    assert sorted(finished[0]) == ["a0", "a1", "a2"]
    assert sorted(finished[1]) == ["b0", "b1", "b2"]
    # Same greedy text for the same prompt, whichever front end asked.
    assert [finished[0][f"a{i}"] for i in range(3)] == [finished[1][f"b{i}"] for i in range(3)]
    # A utility result reaches only its caller.
    assert second.client.call_utility("ping", timeout_s=30) is True
    assert not first.client._results
