"""The engine core in its own process, driven through SyncMPClient.

One core process serves the whole module (each start imports torch and loads the model);
the last test shuts it down and checks nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from engine import EngineArgs, SamplingParams
from engine.core.engine_io import EngineCoreRequest
from engine.core.errors import EngineStartupError
from engine.frontend.llm_engine import LLMEngine
from engine.core.mp_client import SyncMPClient
from engine.core.request import FinishReason
from engine.entrypoints.llm import LLM

MODEL_KWARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 128}


@pytest.fixture(scope="module")
def config(llama_dir):
    return EngineArgs(model=str(llama_dir), **MODEL_KWARGS).create_engine_config()


@pytest.fixture(scope="module")
def reference_llm(llama_dir):
    return LLM(str(llama_dir), **MODEL_KWARGS)


@pytest.fixture(scope="module")
def mp_engine(config):
    engine = LLMEngine(config, client=SyncMPClient(config))
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, prompts, params) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[f"r{i}"] for i in range(len(prompts))]


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie nobody will run again)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _live_core_children() -> set[int]:
    """Running (not zombie) core processes whose parent is this process."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if (
            fields[0] != "Z"
            and int(fields[1]) == os.getpid()
            and "engine.core.core_proc" in cmdline
        ):
            found.add(int(entry))
    return found


def test_greedy_outputs_equal_inprocess_llm(mp_engine, reference_llm):
    prompts = [
        "hello world",
        "the quick brown fox",
        [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = _run(mp_engine, prompts, params)
    reference = reference_llm.generate(prompts, params, use_tqdm=False)
    for mine, ref in zip(got, reference):
        assert mine.outputs[0].token_ids == ref.outputs[0].token_ids
        assert mine.outputs[0].text == ref.outputs[0].text
        assert mine.outputs[0].finish_reason == "length"


def test_seeded_sampling_and_n_match_inprocess(mp_engine, reference_llm):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    got = _run(mp_engine, ["sampling prompt"], params)[0]
    ref = reference_llm.generate(["sampling prompt"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]


def test_stats_and_utilities(mp_engine):
    client: SyncMPClient = mp_engine.client
    prompt = list(range(60, 100))  # 2 full blocks of 16 (no prefix shared with other tests)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    before = client.get_stats()
    _run(mp_engine, [prompt], params)
    _run(mp_engine, [prompt], params)
    stats = client.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_kv_blocks == client.num_kv_blocks > 0
    # Two lookups of the 40-token prompt; the second finds both full blocks computed.
    assert stats.prefix_cache_queries_total - before.prefix_cache_queries_total == 80
    assert stats.prefix_cache_hits_total - before.prefix_cache_hits_total == 32
    assert client.reset_prefix_cache() is True
    with pytest.raises(RuntimeError, match="unknown utility 'no_such_call'"):
        client.call_utility("no_such_call")


def test_get_output_with_nothing_in_flight_returns_at_once(mp_engine):
    start = time.monotonic()
    assert mp_engine.client.get_output().outputs == []
    assert time.monotonic() - start < 0.5


def test_abort_frees_blocks(mp_engine):
    client: SyncMPClient = mp_engine.client
    mp_engine.add_request("long", "abort me", SamplingParams(max_tokens=100, ignore_eos=True))
    outputs = []
    while not outputs:
        outputs = mp_engine.step()
    assert client.get_stats().num_running == 1
    mp_engine.abort_request(["long"])
    stats = client.get_stats()  # answered after the abort: same input queue, in order
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert not mp_engine.has_unfinished_requests()


def test_request_the_core_rejects_is_finished_not_fatal(mp_engine):
    client: SyncMPClient = mp_engine.client
    # Bypasses the processor's checks: the scheduler itself refuses a too-long prompt.
    client.add_request(EngineCoreRequest("huge", list(range(5, 205)), SamplingParams()))
    # Skip stale outputs of an earlier, aborted request that were already on their way.
    output = None
    while output is None:
        output = next((o for o in client.get_output().outputs if o.request_id == "huge"), None)
    assert output.finish_reason == int(FinishReason.ABORT) and output.new_token_ids == []
    assert client.get_stats().num_running == 0  # and the core is still serving


def test_shutdown_leaves_no_process(mp_engine):
    client: SyncMPClient = mp_engine.client
    pid, run_dir = client.proc.pid, client.proc.run_dir
    mp_engine.shutdown()
    assert client.proc.process.poll() is not None
    assert _wait_gone(pid)
    assert not run_dir.exists()
    mp_engine.shutdown()  # idempotent


def test_bad_model_dir_fails_fast_with_child_error(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    config = EngineArgs(
        model=str(broken), **MODEL_KWARGS
    ).create_engine_config()  # config.json is fine
    before = _live_core_children()
    start = time.monotonic()
    with pytest.raises(
        EngineStartupError, match="engine core failed to start: SafetensorError: .*header"
    ):
        SyncMPClient(config)
    assert time.monotonic() - start < 120  # fails on the child's error, not a timeout
    assert _live_core_children() == before


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from engine import EngineArgs
    from engine.core.mp_client import SyncMPClient
    config = EngineArgs(model=sys.argv[1], device="cpu", dtype="float32", max_model_len=128).create_engine_config()
    client = SyncMPClient(config)
    print(client.proc.pid, client.proc.run_dir, flush=True)
    if sys.argv[2] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without shutdown(); the finalizer must stop the core
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphan_when_parent_forgets_or_dies(llama_dir, how):
    result = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(llama_dir), how],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.stdout.strip(), result.stderr[-2000:]
    child_pid, run_dir = result.stdout.split()
    assert _wait_gone(int(child_pid), timeout_s=15.0), f"core {child_pid} outlived its parent"
    assert not os.path.exists(run_dir)  # the finalizer, or the orphaned core, removed it
