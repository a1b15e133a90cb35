"""Executors: how the engine core reaches the model's ranks.

The engine core makes one call per step, ``execute_model(scheduler_output)``, and gets
the sampled tokens back; it never knows how many processes hold the model. Three kinds,
chosen by :func:`make_executor` with vLLM's ``distributed_executor_backend`` names:

- ``uni``: the one rank lives in the engine core's process (world size 1);
- ``mp``: one local process per rank (:mod:`.multiproc_executor`);
- ``ray``: one Ray actor per rank, on any node of a Ray cluster (:mod:`.ray_executor`).

With pipeline stages the core keeps up to ``max_concurrent_batches`` steps in flight
(``execute_model(..., non_block=True)`` returns a :class:`StepFuture`), so every stage
has a micro-batch to work on.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.model_executor.worker import Worker

logger = logging.getLogger(__name__)

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


class StepFuture:
    """The output of a step already sent to the workers."""

    def __init__(self, wait: Any) -> None:
        self._wait = wait
        self._value: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._value is None:
            self._value = self._wait()
        return self._value


class StepThread:
    """The worker's own thread under async scheduling: calls run on it in the order sent.

    A step's output is handed over when the step sent after it starts its forward, not
    when the step ends. Both threads run Python under one interpreter lock: handed over
    at the end, the caller's update, output processing and next scheduling would contend
    for the lock with the next step's input preparation (which then took 3x as long); an
    output handed over as the forward starts lets the caller's Python run while the
    forward computes with the lock released. Without a next step sent, it is handed over
    at once."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._lock = threading.Lock()
        self._steps_waiting = 0  # sent, not started
        self._held: tuple[Future, ModelRunnerOutput] | None = None

    def submit_step(self, worker: Worker, scheduler_output: SchedulerOutput,
                    grammar_bitmask: torch.Tensor | None) -> Future:
        done: Future = Future()
        with self._lock:
            self._steps_waiting += 1
        self._pool.submit(self._run_step, worker, scheduler_output, grammar_bitmask, done)
        return done

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the thread, after the steps sent before it."""
        return self._pool.submit(self._run_call, fn, args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _run_call(self, fn: Any, args: tuple) -> Any:
        self._hand_over()
        return fn(*args)

    def _run_step(self, worker: Worker, scheduler_output: SchedulerOutput,
                  grammar_bitmask: torch.Tensor | None, done: Future) -> None:
        with self._lock:
            self._steps_waiting -= 1
        runner = worker.runner  # None only while the worker sleeps (level 2)
        if runner is not None:
            runner.on_forward_start = self._hand_over
        try:
            output = worker.execute_model(scheduler_output, grammar_bitmask)
        except BaseException as exc:  # noqa: BLE001 - the caller's result() raises it
            self._hand_over()
            done.set_exception(exc)
            return
        finally:
            if runner is not None:
                runner.on_forward_start = None
        self._hand_over()  # the step ran no forward
        with self._lock:
            if self._steps_waiting:  # the next step hands this one over
                self._held = (done, output)
                return
        done.set_result(output)

    def _hand_over(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[0].set_result(held[1])


class Executor(ABC):
    """What the engine core asks of whoever runs the model."""

    config: EngineConfig
    num_blocks: int
    vocab_size: int
    # The model's KV cache groups (the scheduler keeps one block table per group).
    kv_cache_layout: KVCacheLayout
    max_concurrent_batches: int = 1

    @abstractmethod
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: torch.Tensor | None = None,
        non_block: bool = False,
    ) -> ModelRunnerOutput | StepFuture: ...

    @abstractmethod
    def runtime_info(self) -> dict[str, Any]: ...

    def check_health(self) -> None:
        """Raise :class:`WorkerFailedError` when a rank is dead or unresponsive."""

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache (and, level 2, its weights): ``Worker.sleep``."""
        self.collective_rpc("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every rank brings back ``tags`` (None: weights and KV cache)."""
        self.collective_rpc("wake_up", tags)

    def update_weights(self, method: str, *args: Any) -> None:
        """Every rank runs the weight update ``Worker.method(*args)``
        (engine.model_executor.weight_update); the first rank's refusal is raised here: a
        ValueError for bad input (a wrong path, name or shape), else a RuntimeError."""
        self.checked_rpc(method, *args)

    def checked_rpc(self, method: str, *args: Any) -> None:
        """``Worker.method(*args)`` on every rank, for methods that return their error
        as a value (``{"error": ..., "type": ...}`` or None): the first rank's error is
        raised (ValueError for bad input, else RuntimeError)."""
        for rank, result in enumerate(self.collective_rpc(method, *args)):
            if result:
                error = ValueError if result.get("type", "ValueError") == "ValueError" \
                    else RuntimeError
                where = f"rank {rank}: " if self.config.parallel.world_size > 1 else ""
                raise error(where + result["error"])

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank; the results in rank order."""

    def shutdown(self) -> None:
        """Stop the workers and free their ports and memory (idempotent)."""


class WorkerFailedError(RuntimeError):
    """A rank died or stopped answering; the engine cannot continue."""


def blocks_per_sequence(config: EngineConfig, layout: KVCacheLayout | None = None,
                        max_model_len: int | None = None) -> int:
    """Blocks one sequence of ``max_model_len`` tokens (None: the config's) holds at
    most, over every KV cache group (a windowed group holds only its window and one
    step's tokens)."""
    cache, sched = config.cache, config.scheduler
    length = sched.max_model_len if max_model_len is None else max_model_len
    full = -(-length // cache.block_size)
    if layout is None:
        return full
    step = sched.max_num_batched_tokens
    return sum(full if not g.is_windowed else min(full, g.max_blocks_held(cache.block_size, step))
               for g in layout.groups)


def largest_fitting_len(config: EngineConfig, capacity: int,
                        layout: KVCacheLayout | None = None, limit: int | None = None) -> int:
    """The largest max_model_len (at most ``limit``, None: the config's) whose one
    sequence fits ``capacity`` blocks (one of them the null block); 0 when none does."""
    hi = config.scheduler.max_model_len if limit is None else limit
    lo = 0
    while lo < hi:  # blocks_per_sequence grows with the length
        mid = (lo + hi + 1) // 2
        if blocks_per_sequence(config, layout, mid) + 1 <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _set_max_model_len(config: EngineConfig, length: int) -> None:
    config.scheduler.max_model_len = length
    config.model.max_model_len = length


def clamp_num_blocks(config: EngineConfig, capacity: int, block_bytes: int,
                     layout: KVCacheLayout | None = None) -> int:
    """The engine's KV block count from the smallest rank capacity: never more than every
    seat at full length could use, and refused when one sequence would not fit (naming
    the largest max_model_len that would). With ``--max-model-len auto`` the config's
    max_model_len (the model's limit until now) becomes the largest length that fits."""
    cache, sched = config.cache, config.scheduler
    if cache.max_model_len_auto:
        fitting = largest_fitting_len(config, capacity, layout)
        if fitting >= 2 and fitting < sched.max_model_len:
            logger.info("max_model_len auto: %d tokens (the KV cache holds %d blocks; the "
                        "model allows %d)", fitting, capacity, sched.max_model_len)
            _set_max_model_len(config, fitting)
    blocks_per_seq = blocks_per_sequence(config, layout)
    num_blocks = min(capacity, blocks_per_seq * sched.max_num_seqs + 1)
    if num_blocks < blocks_per_seq + 1:
        fitting = largest_fitting_len(config, num_blocks, layout)
        hint = (f"use max_model_len <= {fitting}" if fitting >= 2 else
                "no max_model_len fits")
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({block_bytes} bytes each), fewer than one sequence of max_model_len="
            f"{sched.max_model_len} needs ({blocks_per_seq + 1}); raise the KV cache "
            "size (--kv-cache-memory, cpu_kvcache_space_gib / ENGINE_CPU_KVCACHE_SPACE, "
            f"gpu_memory_utilization) or {hint}"
        )
    log_kv_cache_size(config, int(num_blocks), block_bytes, layout)
    return int(num_blocks)


def log_kv_cache_size(config: EngineConfig, num_blocks: int, block_bytes: int,
                      layout: KVCacheLayout | None = None) -> None:
    """vLLM's start-up lines: the KV cache's size in tokens and how many requests of
    max_model_len tokens it holds at once."""
    cache, sched = config.cache, config.scheduler
    usable = num_blocks - 1  # block 0 is the null block
    per_seq = blocks_per_sequence(config, layout)
    logger.info("KV cache size: %d tokens (%d blocks of %d tokens, %.1f MiB per rank)",
                usable * cache.block_size, num_blocks, cache.block_size,
                num_blocks * block_bytes / 2**20)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", sched.max_model_len,
                usable / max(1, per_seq))


def _join_replicas(config: EngineConfig, platform: Platform) -> Any:
    """The parallel state of a one-rank replica whose experts span the replicas."""
    from engine.distributed.parallel_state import (
        ParallelLayout,
        init_parallel_state,
        rendezvous,
    )

    return init_parallel_state(platform.communicator_cls(),
                               ParallelLayout.of_rank(config.parallel),
                               **rendezvous(config.parallel, None))


class UniProcExecutor(Executor):
    """The whole model in the engine core's process."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        # Async scheduling: the worker lives on its own thread (built, loaded and called
        # there only: a platform's per-thread setup, e.g. the CPU's OpenMP team and its
        # pinning, then serves every step), so the caller schedules while a step runs.
        self._step_thread: StepThread | None = (
            StepThread() if config.scheduler.async_scheduling else None)
        if config.parallel.data_parallel_size > 1:
            # One replica of several on this machine: its own device / share of the CPUs
            # (on the thread that runs the model: device selection is per thread).
            self._on_worker_thread(platform.bind_worker, *config.parallel.node_share(0))
        # Experts shared with the other data-parallel replicas: this one rank joins their
        # world (engine.distributed.dp_lockstep); else it is a world of its own.
        parallel = (self._on_worker_thread(_join_replicas, config, platform)
                    if config.parallel.dp_lockstep else None)
        self.worker = self._on_worker_thread(Worker, config, platform, parallel)
        capacity = self._on_worker_thread(self.worker.load)
        self.kv_cache_layout = self.worker.kv_cache_layout
        self.num_blocks = clamp_num_blocks(config, capacity, self.worker.kv_block_bytes(),
                                           self.kv_cache_layout)
        self._on_worker_thread(self.worker.initialize_cache, self.num_blocks)
        self.vocab_size = self.worker.model.vocab_size

    # The single rank's parts, for tools and tests that inspect them.
    @property
    def runner(self):
        return self.worker.runner

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def proposer(self):
        return self.worker.proposer

    @property
    def weights_bytes(self) -> int:
        return self.worker.weights_bytes

    def execute_model(self, scheduler_output, grammar_bitmask=None, non_block=False):
        """``non_block`` (async scheduling): the step runs on the worker's thread while
        the caller schedules the next one; steps run in the order sent."""
        if self._step_thread is None:
            output = self.worker.execute_model(scheduler_output, grammar_bitmask)
            return StepFuture(lambda: output) if non_block else output
        future = self._step_thread.submit_step(self.worker, scheduler_output, grammar_bitmask)
        return StepFuture(future.result) if non_block else future.result()

    def _on_worker_thread(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` where the worker runs (after the steps sent before it)."""
        if self._step_thread is None:
            return fn(*args)
        return self._step_thread.call(fn, *args)

    def runtime_info(self) -> dict[str, Any]:
        return self._on_worker_thread(self.worker.runtime_info)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self._on_worker_thread(getattr(self.worker, method), *args)]

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown()
            self._step_thread = None
        self.worker.shutdown()


def resolve_executor_backend(config: EngineConfig) -> str:
    """``uni`` for one rank; otherwise the configured backend (default ``mp``)."""
    parallel = config.parallel
    backend = parallel.distributed_executor_backend
    if parallel.world_size == 1 and backend in (None, "uni"):
        return "uni"
    if backend == "uni":
        raise ValueError(f"distributed_executor_backend 'uni' runs one rank; the world size "
                         f"is {parallel.world_size} (use mp or ray)")
    return backend or "mp"


def make_executor(config: EngineConfig, platform: Platform) -> Executor:
    backend = resolve_executor_backend(config)
    if backend == "uni":
        return UniProcExecutor(config, platform)
    if config.kv_transfer is not None:
        raise ValueError("KV connectors (--kv-transfer-config) run on one rank for now: "
                         "use tensor_parallel_size=1 and pipeline_parallel_size=1")
    if config.speculative is not None and config.parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative decoding cannot be combined with pipeline parallelism "
                         "yet (the last stage drafts, the first embeds); tensor parallelism "
                         "works")
    if backend == "mp":
        from engine.model_executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, platform)
    from engine.model_executor.ray_executor import RayExecutor

    return RayExecutor(config, platform)
