"""Driving a group of worker ranks over ZeroMQ: the part the mp and Ray executors share.

The executor binds one PUSH socket per rank (the step's bytes are encoded once and sent
to each), one PULL for results and one PULL for heartbeats, all TCP so that ranks on other
machines (Ray) reach it like local ones. While it waits for a result it watches every
rank: a process that exited, a rank whose heartbeats stopped for
``ENGINE_WORKER_HEARTBEAT_TIMEOUT_S`` (default 5), or a step past
``ENGINE_EXECUTE_TIMEOUT_S`` (default 600) raises :class:`WorkerFailedError` naming the
rank, and every rank is then stopped: no hang, no stray process.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from abc import abstractmethod
from collections import deque
from typing import Any

import zmq

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.core.scheduler.output import ModelRunnerOutput
from engine.distributed.parallel_state import ParallelLayout
from engine.model_executor import worker_proc as wire
from engine.model_executor.executor import (
    Executor,
    StepFuture,
    WorkerFailedError,
    clamp_num_blocks,
)
from engine.model_executor.step_codec import decode_output, encode_step

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_ENV = "ENGINE_WORKER_HEARTBEAT_TIMEOUT_S"
EXECUTE_TIMEOUT_ENV = "ENGINE_EXECUTE_TIMEOUT_S"
LOAD_TIMEOUT_ENV = "ENGINE_WORKER_LOAD_TIMEOUT_S"
_POLL_MS = 100


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


class WorkerGroupExecutor(Executor):
    """One worker per rank, started by a subclass (:meth:`_launch`)."""

    def __init__(self, config: EngineConfig, platform: Platform, host: str) -> None:
        self.config = config
        self.platform = platform
        parallel = config.parallel
        self.layout = ParallelLayout(parallel.tensor_parallel_size,
                                     parallel.pipeline_parallel_size,
                                     enable_expert_parallel=parallel.enable_expert_parallel)
        self.world_size = self.layout.world_size
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.max_concurrent_batches = parallel.pipeline_parallel_size
        self.heartbeat_timeout_s = _env_seconds(HEARTBEAT_TIMEOUT_ENV, 5.0)
        self.execute_timeout_s = _env_seconds(EXECUTE_TIMEOUT_ENV, 600.0)
        self.load_timeout_s = _env_seconds(LOAD_TIMEOUT_ENV, 1800.0)
        self._closed = False
        self._failure: str | None = None
        self._pending: deque[float] = deque()  # send times of steps not answered yet
        self._ctx = zmq.Context(io_threads=1)
        self._inputs = []
        for _ in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind_to_random_port(f"tcp://{host}")
            self._inputs.append(sock)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind_to_random_port(f"tcp://{host}")
        self._heartbeats = self._ctx.socket(zmq.PULL)
        self._heartbeats.setsockopt(zmq.LINGER, 0)
        self._heartbeats.bind_to_random_port(f"tcp://{host}")
        # Heartbeats count once every rank is loaded: loading (reading a checkpoint can
        # hold the GIL for long) is bounded by the load timeout and process liveness.
        self._last_beat: list[float | None] = [None] * self.world_size
        self._beats_checked = False
        # Whatever outlives a forgotten executor (its processes, its sockets) is released
        # by a finalizer that holds only these handles, at GC or at interpreter exit.
        self._handles = _Handles(self._ctx, [*self._inputs, self._results, self._heartbeats])
        self._finalizer = weakref.finalize(self, self._handles.release)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _address(self, sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def worker_spec(self, rank: int, init_method: str, local_rank: int, local_world_size: int,
                    parent_pid: int | None) -> wire.WorkerSpec:
        return wire.WorkerSpec(
            config_json=self.config.model_dump_json(),
            rank=rank,
            tensor_parallel_size=self.layout.tensor_parallel_size,
            pipeline_parallel_size=self.layout.pipeline_parallel_size,
            distributed_init_method=init_method,
            input_address=self._address(self._inputs[rank]),
            result_address=self._address(self._results),
            heartbeat_address=self._address(self._heartbeats),
            local_rank=local_rank,
            local_world_size=local_world_size,
            parent_pid=parent_pid,
        )

    # -- subclass hooks ---------------------------------------------------------------------
    @abstractmethod
    def _launch(self) -> None:
        """Start one worker per rank (each connecting to this executor's sockets)."""

    def _dead_rank(self, exclude: int | None = None) -> tuple[int, str] | None:
        """A rank whose process has ended, and how (None: all alive); ranks killed by a
        signal or failing first (the likely cause), ``exclude`` never."""
        ended = [(rank, how, bad) for rank, how, bad in self._ended_ranks() if rank != exclude]
        if not ended:
            return None
        rank, how, _ = sorted(ended, key=lambda e: (not e[2], e[0]))[0]
        return rank, how

    @abstractmethod
    def _ended_ranks(self) -> list[tuple[int, str, bool]]:
        """``(rank, how it ended, abnormally)`` of every rank whose process has ended."""

    def _on_release(self, stop: Any) -> None:
        """Register ``stop(graceful)`` (a closure over the workers' handles, not over the
        executor): it makes sure no worker process is left, after QUIT was sent
        (``graceful`` False: a rank failed, the others are stuck in collectives: do not
        wait for them)."""
        self._handles.stops.append(stop)

    # -- start ------------------------------------------------------------------------------
    def _start(self) -> None:
        self._launch()
        ready: dict[int, wire.WorkerReady] = {}
        deadline = time.monotonic() + self.load_timeout_s
        while len(ready) < self.world_size:
            tag, payload = self._receive(deadline, "loading the model")
            if tag == wire.READY:
                info = wire.ready_decoder.decode(payload)
                ready[info.rank] = info
            else:
                raise WorkerFailedError(f"unexpected message {tag!r} while the workers load")
        self._last_beat = [time.monotonic()] * self.world_size
        self._beats_checked = True
        capacity = min(info.kv_block_capacity for info in ready.values())
        block_bytes = max(info.kv_block_bytes for info in ready.values())
        # Every rank holds the same layers' groups (pipeline stages run one group).
        self.kv_cache_layout = ready[0].kv_cache_layout
        self.num_blocks = clamp_num_blocks(self.config, capacity, block_bytes,
                                           self.kv_cache_layout)
        self.vocab_size = ready[0].vocab_size
        self.rank_weights_bytes = [ready[r].weights_bytes for r in range(self.world_size)]
        self.worker_pids = [ready[r].pid for r in range(self.world_size)]
        # The engine's max_model_len (resolved here with --max-model-len auto).
        self.collective_rpc("initialize_cache", self.num_blocks,
                            self.config.scheduler.max_model_len)
        logger.info("%d workers (tp %d x pp %d) ready: %d KV blocks, weights per rank %s MiB",
                    self.world_size, self.layout.tensor_parallel_size,
                    self.layout.pipeline_parallel_size, self.num_blocks,
                    [round(b / 2**20, 1) for b in self.rank_weights_bytes])

    # -- calls ------------------------------------------------------------------------------
    def _broadcast(self, frames: list[bytes]) -> None:
        self._raise_if_failed()
        for sock in self._inputs:
            sock.send_multipart(frames, copy=False)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank; the results in rank order. Only
        between steps (results and outputs share one socket)."""
        if self._pending:
            raise RuntimeError("collective_rpc while steps are in flight")
        self._broadcast([wire.CALL, wire.encoder.encode(wire.WorkerCall(method, list(args)))])
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.execute_timeout_s
        while len(results) < self.world_size:
            tag, payload = self._receive(deadline, f"running {method}")
            if tag != wire.RESULT:
                raise WorkerFailedError(f"unexpected message {tag!r} answering {method}")
            reply = wire.reply_decoder.decode(payload)
            results[reply.rank] = reply.result
        return [results[r] for r in range(self.world_size)]

    def execute_model(self, scheduler_output, grammar_bitmask=None, non_block=False):
        self._broadcast([wire.EXECUTE, *encode_step(scheduler_output, grammar_bitmask)])
        self._pending.append(time.monotonic())
        future = StepFuture(self._next_output)
        return future if non_block else future.result()

    def _next_output(self) -> ModelRunnerOutput:
        """The oldest unanswered step's output (the output rank answers in order)."""
        deadline = self._pending[0] + self.execute_timeout_s
        tag, payload = self._receive(deadline, "running a step")
        if tag != wire.OUTPUT:
            raise WorkerFailedError(f"unexpected message {tag!r} instead of a step output")
        self._pending.popleft()
        return decode_output(payload)

    def runtime_info(self) -> dict[str, Any]:
        info = self.collective_rpc("runtime_info")
        return {
            **info[self.output_rank],
            "weights_mib": round(sum(self.rank_weights_bytes) / 2**20, 1),
            "parallel": {
                "tensor_parallel_size": self.layout.tensor_parallel_size,
                "pipeline_parallel_size": self.layout.pipeline_parallel_size,
                "executor": self.backend_name,
                "weights_mib_per_rank": [round(b / 2**20, 2) for b in self.rank_weights_bytes],
            },
        }

    # -- watching the ranks -----------------------------------------------------------------
    def _receive(self, deadline: float, doing: str) -> tuple[bytes, memoryview]:
        """The next result message, watching the workers while waiting."""
        self._raise_if_failed()
        while True:
            if self._results.poll(_POLL_MS):
                frames = self._results.recv_multipart(copy=False)
                tag = bytes(frames[0].buffer)
                if tag == wire.FAILED:
                    reply = wire.reply_decoder.decode(frames[1].buffer)
                    self._fail(self._failure_cause(
                        reply.rank, f"worker rank {reply.rank} failed: {reply.error}"))
                return tag, frames[1].buffer if len(frames) > 1 else memoryview(b"")
            self.check_health()
            if time.monotonic() > deadline:
                self._fail(f"the workers did not answer within the deadline while {doing} "
                           f"({EXECUTE_TIMEOUT_ENV} / {LOAD_TIMEOUT_ENV})")

    def check_health(self) -> None:
        self._raise_if_failed()
        now = time.monotonic()
        while True:
            try:
                frames = self._heartbeats.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            rank = int.from_bytes(frames[1], "little")
            if 0 <= rank < self.world_size:
                self._last_beat[rank] = now
        dead = self._dead_rank()
        if dead is not None:
            self._fail(f"worker rank {dead[0]} {dead[1]}")
        for rank, beat in enumerate(self._last_beat):
            if self._beats_checked and now - beat > self.heartbeat_timeout_s:
                self._fail(f"worker rank {rank} sent no heartbeat for {now - beat:.1f} s "
                           f"({HEARTBEAT_TIMEOUT_ENV}={self.heartbeat_timeout_s:g}): it is "
                           "stopped or hung")

    def _failure_cause(self, reporter: int, error: str) -> str:
        """A rank's error, led by another rank that died if one did: a collective fails on
        the survivors when a peer dies, and the dead peer is the cause worth naming."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            dead = self._dead_rank(exclude=reporter)
            if dead is not None:
                return f"worker rank {dead[0]} {dead[1]} (then {error})"
            time.sleep(0.05)
        return error

    def _fail(self, why: str) -> None:
        logger.error("%s; stopping every worker", why)
        self._failure = why
        self.shutdown(graceful=False)
        raise WorkerFailedError(why)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        if self._closed:
            raise WorkerFailedError("the executor is shut down")

    # -- stop -------------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._handles.graceful = graceful
        self._finalizer()


class _Handles:
    """The sockets and worker-stopping closures of one executor."""

    def __init__(self, ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
        self.ctx = ctx
        self.sockets = sockets
        self.inputs = sockets[:-2]
        self.stops: list[Any] = []
        self.released = False
        self.graceful = True

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for sock in self.inputs:
            try:
                sock.send_multipart([wire.QUIT], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        try:
            for stop in self.stops:
                stop(self.graceful)
        finally:
            for sock in self.sockets:
                sock.close(linger=0)
            self.ctx.term()
