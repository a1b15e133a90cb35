"""Tensor and pipeline parallelism end to end: worker processes per rank (mp and Ray
executors, and through ``engine serve``) against the same engine in one process.

The reference is the single-process engine with the same scheduler settings (prefix
caching, a small token budget that chunks every prefill, a KV pool too small for the
whole batch so requests are preempted). Greedy token ids must be equal; a divergence is
accepted only at a verified near-tie (the reference's top-2 logprobs at that position
within ``TIE``), after which the sequences are not compared. Sampled-token logprobs
agree to ``LOGPROB_ATOL`` (float32 reductions run in another order across ranks).

Worker start-up costs seconds on a small CPU machine, so the engines are built once per
module (:class:`_Engines`) and reused by the equivalence, weight-memory and failure
tests; every engine is shut down at module end and its worker processes must be gone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.model_executor.executor import WorkerFailedError
from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, child_pids
from tests.helpers.equivalence import LOGPROB_ATOL, TIE, assert_outputs_equivalent, top2

MAX_TOKENS = 10
REAP_TIMEOUT_S = 3.0

# One setting for every engine of the module, reference and parallel alike: blocks of 8
# tokens, prompts chunked (16 tokens a step, at most 12 per request), and 9 usable KV
# blocks for requests of up to 6 blocks each, 4 seats: the batch cannot all fit.
ENGINE_KWARGS = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 48,
    "block_size": 8,
    "enable_prefix_caching": True,
    "max_num_batched_tokens": 16,
    "long_prefill_token_threshold": 12,
    "max_num_seqs": 4,
    "num_gpu_blocks_override": 10,
}

# (variant, tp, pp): Llama GQA with 2 KV heads (one per tp rank) and with 1 KV head
# (replicated at tp=2, tied embeddings), Qwen3 (q/k norms, head_dim 24), Mistral.
CASES = [
    ("llama-gqa", 2, 1),
    ("llama-mqa-tied", 2, 1),
    ("qwen3", 1, 2),
    ("mistral", 2, 2),
]


def _case_id(case) -> str:
    variant, tp, pp = case
    return f"{variant}-tp{tp}-pp{pp}"


def _vocab_size(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def _prompts(vocab_size: int) -> list[list[int]]:
    """Five prompts; the first and third share a 24-token (3-block) prefix."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab_size) for _ in range(n)]

    shared = tokens(24)
    return [shared + tokens(5), tokens(3), shared + tokens(9), tokens(17), tokens(33)]


def _params(max_tokens: int = MAX_TOKENS, logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_pids_gone(pids: list[int], timeout: float = REAP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in pids if not _pid_gone(p)]
    assert not alive, f"worker processes still alive {timeout} s after shutdown: {alive}"


# -- engines, built once per module ----------------------------------------------------------
class _Engines:
    """``get(variant, tp, pp)``: an LLM with ENGINE_KWARGS, built on first use and kept;
    ``reference(variant)``: the single-process outputs of the module's prompts."""

    def __init__(self, model_dir_factory) -> None:
        self._factory = model_dir_factory
        self._llms: dict[tuple, LLM] = {}
        self._pids: list[int] = []
        self._references: dict[str, list] = {}

    def path(self, variant: str) -> Path:
        return self._factory(variant)

    def prompts(self, variant: str) -> list[list[int]]:
        return _prompts(_vocab_size(self.path(variant)))

    def get(self, variant: str, tp: int = 1, pp: int = 1) -> LLM:
        key = (variant, tp, pp)
        if key not in self._llms:
            kwargs = dict(ENGINE_KWARGS)
            if tp * pp > 1:
                kwargs.update(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                              distributed_executor_backend="mp")
            llm = LLM(str(self.path(variant)), **kwargs)
            self._llms[key] = llm
            self._pids += getattr(executor_of(llm), "worker_pids", [])
        return self._llms[key]

    def pop(self, variant: str, tp: int, pp: int) -> LLM:
        """The engine, no longer shared (for a test that breaks it)."""
        llm = self.get(variant, tp, pp)
        del self._llms[(variant, tp, pp)]
        return llm

    def run(self, llm: LLM, variant: str):
        prompts = self.prompts(variant)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], _params(),
                            use_tqdm=False)

    def reference(self, variant: str):
        if variant not in self._references:
            llm = self.get(variant)
            self._references[variant] = self.run(llm, variant)
            assert llm.llm_engine.client.core.scheduler.num_preemptions_total > 0
        return self._references[variant]

    def close(self) -> None:
        while self._llms:
            _, llm = self._llms.popitem()
            llm.shutdown()
        _assert_pids_gone(self._pids)


def executor_of(llm: LLM):
    return llm.llm_engine.client.core.executor


@pytest.fixture(scope="module")
def engines(model_dir_factory):
    pool = _Engines(model_dir_factory)
    yield pool
    pool.close()


# -- 1. greedy equivalence under prefix caching, chunked prefill and preemption ---------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_parallel_greedy_matches_single_process(engines, case):
    variant, tp, pp = case
    reference = engines.reference(variant)
    llm = engines.get(variant, tp, pp)
    executor = executor_of(llm)
    assert len(executor.worker_pids) == tp * pp
    assert len(set(executor.worker_pids)) == tp * pp and os.getpid() not in executor.worker_pids
    core = llm.llm_engine.client.core
    preempted_before = core.scheduler.num_preemptions_total
    outputs = engines.run(llm, variant)
    assert_outputs_equivalent(reference, outputs)
    # The settings did what they are for, in the parallel run itself: prompt 2 found
    # prompt 0's first block(s) cached, and the small pool preempted requests.
    assert outputs[2].num_cached_tokens >= ENGINE_KWARGS["block_size"], (
        [o.num_cached_tokens for o in outputs])
    assert core.scheduler.num_preemptions_total > preempted_before
    # Tensor-parallel decode steps replayed forward graphs on every rank (their all-reduces
    # recorded as graph calls); pipeline stages hand off between forwards: eager.
    graph_sizes = [info["forward_graph_sizes"] for info in executor.collective_rpc(
        "runtime_info")]
    if pp == 1:
        assert all(graph_sizes) and len(set(map(tuple, graph_sizes))) == 1, graph_sizes
    else:
        assert not any(graph_sizes), graph_sizes


# -- 2. each rank holds its share of the weights ---------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_weights_per_rank_are_a_share_of_the_whole(engines, case):
    variant, tp, pp = case
    total = executor_of(engines.get(variant)).runtime_info()["weights_mib"]
    info = executor_of(engines.get(variant, tp, pp)).runtime_info()["parallel"]
    assert (info["tensor_parallel_size"], info["pipeline_parallel_size"], info["executor"]) == (
        tp, pp, "mp")
    per_rank = info["weights_mib_per_rank"]
    assert len(per_rank) == tp * pp
    share = 1.0 / (tp * pp)
    # Norms, the rotary cache and a single KV head (num_kv_heads 1 < tp) are replicated.
    for rank, mib in enumerate(per_rank):
        assert 0.8 * share <= mib / total <= 1.3 * share, (rank, per_rank, total)
    if tp == 2 and pp == 1:
        assert all(0.4 <= mib / total <= 0.65 for mib in per_rank), (per_rank, total)
    # Together the ranks hold about the whole model once (not tp or pp copies).
    assert 0.95 <= sum(per_rank) / total <= 1.25, (per_rank, total)


# -- 3. a worker dies mid-generation ---------------------------------------------------------
def test_killed_worker_fails_fast_and_leaves_no_process(engines):
    llm = engines.pop("llama-gqa", 2, 1)  # broken by this test: not shared afterwards
    pids = list(executor_of(llm).worker_pids)
    rng = random.Random(1)
    vocab = _vocab_size(engines.path("llama-gqa"))
    # Far more work than the kill needs to land in (hundreds of steps, seconds).
    prompts = [{"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(4)]}
               for _ in range(100)]
    result: dict[str, object] = {}

    def generate() -> None:
        try:
            llm.generate(prompts, _params(max_tokens=40, logprobs=0), use_tqdm=False)
            result["returned"] = True
        except BaseException as exc:  # noqa: BLE001 - checked below
            result["error"] = exc
        result["at"] = time.monotonic()

    scheduler = llm.llm_engine.client.core.scheduler
    preempted_before = scheduler.num_preemptions_total
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while scheduler.num_preemptions_total == preempted_before and time.monotonic() < deadline:
        time.sleep(0.02)  # until it is well into the batch (the pool preempts)
    assert thread.is_alive(), f"generation ended before the kill: {result}"
    killed_at = time.monotonic()
    os.kill(pids[-1], signal.SIGKILL)
    thread.join(5.0)
    assert not thread.is_alive(), "generate still running 5 s after a worker was killed"
    error = result.get("error")
    assert isinstance(error, WorkerFailedError), result
    assert result["at"] - killed_at < 5.0
    assert "worker rank" in str(error), error
    _assert_pids_gone(pids)

    # The engine stays failed: a new call raises at once instead of waiting forever.
    second: dict[str, object] = {}

    def again() -> None:
        try:
            llm.generate("The quick brown fox", _params(max_tokens=4), use_tqdm=False)
            second["returned"] = True
        except BaseException as exc:  # noqa: BLE001
            second["error"] = exc

    retry = threading.Thread(target=again, daemon=True)
    retry.start()
    retry.join(5.0)
    assert not retry.is_alive(), "a generate call after a worker failure hangs"
    assert isinstance(second.get("error"), WorkerFailedError), second
    llm.shutdown()  # still fine to call


# -- 4. the Ray executor on a real local Ray head --------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _import_ray_or_skip():
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("ENGINE_CI") == "1":
            pytest.fail(f"ray must be installed in CI (ENGINE_CI=1): {exc}")
        pytest.skip(f"ray is not installed: {exc}")
    return ray


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


class _RayHead:
    """``ray start --head --block`` in its own session and temp dir (so that stopping it
    touches no other Ray instance on this machine, unlike ``ray stop``)."""

    STARTUP_TIMEOUT_S = 60.0

    def __init__(self) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Short: Ray's unix sockets live under it (108-byte path limit).
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.log_path = Path(self.temp_dir) / "head.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the head runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             "--port", str(self.port), "--num-cpus", "4", "--include-dashboard", "false",
             "--disable-usage-stats", "--temp-dir", self.temp_dir],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
        while "will now block" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray head not up after {self.STARTUP_TIMEOUT_S} s:\n"
                                   f"{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # --block stops the head's processes on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        # Whatever of this head outlived it (workers name its temp dir on their command
        # line): only ours, found by the unique directory.
        deadline = time.monotonic() + 10
        while (left := _processes_mentioning(self.temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not left, f"ray processes outlived the head: {left}"


def test_ray_executor_matches_single_process(engines, monkeypatch, request):
    ray = _import_ray_or_skip()
    if ray.is_initialized():
        pytest.skip("this process is already connected to another Ray cluster")
    head = _RayHead()

    def stop_head() -> None:
        if ray.is_initialized():
            ray.shutdown()  # the driver first: it would outlive its cluster otherwise
        head.stop()

    request.addfinalizer(stop_head)
    reference = engines.reference("llama-gqa")  # built while the head starts
    head.wait_ready()
    monkeypatch.setenv("RAY_ADDRESS", head.address)
    with LLM(str(engines.path("llama-gqa")), tensor_parallel_size=2,
             distributed_executor_backend="ray", **ENGINE_KWARGS) as llm:
        executor = executor_of(llm)
        pids = list(executor.worker_pids)
        assert len(pids) == 2 and os.getpid() not in pids
        assert executor.runtime_info()["parallel"]["executor"] == "ray"
        outputs = engines.run(llm, "llama-gqa")
        assert_outputs_equivalent(reference, outputs)
        assert llm.llm_engine.client.core.scheduler.num_preemptions_total > 0
    _assert_pids_gone(pids, timeout=10.0)


# -- 5. through `engine serve --tensor-parallel-size 2` -------------------------------------
def test_serve_with_tensor_parallel_matches_offline(engines, tmp_path):
    path = engines.path("llama-gqa")
    prompts = engines.prompts("llama-gqa")[1:4]  # 3, 33 and 17 tokens
    offline = engines.get("llama-gqa").generate(
        [{"prompt_token_ids": p} for p in prompts], _params(max_tokens=8), use_tqdm=False)
    server = ServerProcess(path, tmp_path / "server.log", ["--tensor-parallel-size", "2"])
    workers: list[int] = []
    try:
        server.wait_ready()
        workers = child_pids(server.core_pid, "engine.model_executor.worker_proc")
        assert len(workers) == 2, (workers, server.log())
        body = {"model": SERVED_NAME, "prompt": prompts, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 2}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == len(prompts)
        for i, (choice, ref) in enumerate(zip(choices, offline)):
            want = ref.outputs[0]
            want_tokens = [want.logprobs[j][t].decoded_token for j, t in enumerate(want.token_ids)]
            got_tokens = choice["logprobs"]["tokens"]
            got_lps = choice["logprobs"]["token_logprobs"]
            assert len(got_tokens) == len(got_lps) == 8
            for j, (w, g) in enumerate(zip(want_tokens, got_tokens)):
                if w != g:  # compared as the strings the server reports per token
                    top = top2(want.logprobs[j])
                    gap = top[0][1] - top[1][1]
                    top_text = [want.logprobs[j][t].decoded_token for t, _ in top]
                    assert gap < TIE and g in top_text, (
                        f"prompt {i} diverged at output {j}: served {g!r}, offline {w!r}, "
                        f"offline top-2 {top} (gap {gap:.2e})")
                    break
                lw = want.logprobs[j][want.token_ids[j]].logprob
                assert abs(got_lps[j] - lw) <= LOGPROB_ATOL, (i, j, got_lps[j], lw)
            else:
                assert choice["text"] == want.text
                assert choice["finish_reason"] == "length"
    finally:
        server.stop()
        server.assert_no_orphans()
    _assert_pids_gone(workers, timeout=10.0)
    log = server.log()
    assert "Traceback" not in log, log
