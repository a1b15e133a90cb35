"""With pipeline stages the engine core keeps one micro-batch in flight per stage, and a
worker stopped with SIGSTOP (hung, not dead) is declared failed by its missing heartbeats."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.model_executor.executor import WorkerFailedError


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_stages_keep_two_micro_batches_in_flight(llama_dir):
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32", num_gpu_blocks_override=64) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    # max_num_seqs 3: the six requests form two micro-batches of three.
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2, max_num_seqs=3,
             num_gpu_blocks_override=64) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        core = llm.llm_engine.client.core
        assert core.batch_queue_size == 2
        assert core.max_batches_in_flight == 2
        assert not core.scheduler.in_flight
    assert got == want


def test_a_stopped_worker_is_declared_hung(llama_dir, monkeypatch):
    monkeypatch.setenv("ENGINE_WORKER_HEARTBEAT_TIMEOUT_S", "2.5")
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2,
              num_gpu_blocks_override=64)
    pids = llm.llm_engine.client.core.executor.worker_pids
    failure: dict[str, object] = {}

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4,
                         SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
        except WorkerFailedError as exc:
            failure["error"], failure["at"] = exc, time.monotonic()

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(0.5)
    stopped_at = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    thread.join(timeout=20)
    try:
        assert "error" in failure, "generate did not fail"
        assert failure["at"] - stopped_at < 6.0  # 2.5 s of silence, then the kill
        assert "heartbeat" in str(failure["error"]) or "rank" in str(failure["error"])
        deadline = time.monotonic() + 10
        while not all(map(_gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(_gone, pids)), "a worker process is left"
        with pytest.raises(WorkerFailedError):
            llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
