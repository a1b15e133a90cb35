"""Data parallelism: one front end over ``data_parallel_size`` engine cores.

Each rank is an ordinary core process (:class:`~engine.core.mp_client.CoreProcess`: its
own scheduler, KV cache and TP x PP workers) whose config carries its
``data_parallel_rank``; its workers take their own slots of the machine
(``ParallelConfig.node_share``), and every socket and rendezvous port is private to it
(ipc paths in its own run directory, ZeroMQ and torch.distributed on random free ports).
The ranks start concurrently.

:class:`SyncDPClient` (the offline ``LLMEngine``, here) and
:class:`~engine.core.dp_async_client.AsyncDPClient` (``AsyncLLM``, the server) hold one
per-core client per rank and present the single-core client's surface:

* a new request goes to the rank :class:`~engine.core.dp_router.DPRouter` picks (load,
  prefix affinity); an abort goes to the rank that owns the request;
* step outputs of every rank are merged into one stream;
* utilities run on every live rank and their results are combined (``_COMBINE``); one
  without a data-parallel meaning is refused by name.

A dead rank (its DEAD message or its process gone, noticed within ``POLL_S``) is handled
by ``data_parallel_on_rank_failure``: ``exit`` makes the whole client dead (every request
fails, the server exits as with one core); ``continue`` fails only that rank's in-flight
requests (a :class:`RankDeadError` from ``get_output`` lists them) and routes new ones to
the others, until no rank is left.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import zmq

from engine.core import core_protocol as wire
from engine.core.config import EngineConfig
from engine.core.dp_placement import node_plan
from engine.core.dp_router import DPRouter
from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.core.errors import EngineDeadError, EngineStartupError
from engine.core.mp_client import POLL_S, STARTUP_TIMEOUT_S, CoreUtilities, SyncMPClient

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RankDeadError(EngineDeadError):
    """One data-parallel rank died while the others serve on (``continue``): the error
    of the requests it held (``request_ids``, engine-core request ids)."""

    def __init__(self, message: str, rank: int, request_ids: list[str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.request_ids = request_ids


def _none(results: list[Any]) -> None:
    return None


def _union(results: list[Any]) -> list[Any]:
    return sorted({item for result in results for item in result})


# How a utility runs on N ranks: on every live rank, then this combines the results.
_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "reset_prefix_cache": all,  # True once every rank dropped its cached prefixes
    "sleep": _none,
    "wake_up": _none,
    "is_sleeping": any,  # asleep while any rank still is
    "pause_scheduling": _none,
    "resume_scheduling": _none,
    "abort_all_requests": sum,
    "update_weights": _none,
    "init_weight_update_group": _none,
    "update_weights_from_distributed": _none,
    "add_lora": all,
    "remove_lora": any,
    "list_loras": _union,
    "ping": all,
    "shutdown": all,
}
_REFUSED = {
    "update_weights_from_tensors": "sharing a co-located trainer's tensors with several "
                                   "data-parallel ranks is not built yet (use "
                                   "update_weights from a checkpoint directory, or the "
                                   "distributed weight-update group)",
}


def check_supported(config: EngineConfig, method: str) -> None:
    """ValueError if ``method`` has no data-parallel form and ``config`` runs several
    ranks (checked before the caller prepares the call's arguments)."""
    if config.parallel.data_parallel_size > 1 and method in _REFUSED:
        raise ValueError(f"{method} with data_parallel_size > 1: {_REFUSED[method]}")


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for data-parallel rank ``rank``."""
    parallel = config.parallel.model_copy(update={"data_parallel_rank": rank})
    return config.model_copy(update={"parallel": parallel})


def with_rendezvous_port(config: EngineConfig) -> EngineConfig:
    """``config`` with the port where rank 0 hosts the ranks' store (lockstep ranks:
    engine.distributed.dp_lockstep), a free one when none is set."""
    parallel = config.parallel
    if not parallel.dp_lockstep or parallel.data_parallel_master_port:
        return config
    from engine.model_executor.multiproc_executor import free_port

    port = free_port(parallel.data_parallel_master_ip)
    return config.model_copy(update={"parallel": parallel.model_copy(
        update={"data_parallel_master_port": port})})


def with_head_address(config: EngineConfig) -> EngineConfig:
    """Multi-node: rank 0's rendezvous (lockstep store) is on the head, at the address
    every node reaches it by."""
    from engine.core.dp_remote import head_address

    return config.model_copy(update={"parallel": config.parallel.model_copy(
        update={"data_parallel_master_ip": head_address(config)})})


# A remote rank's channel, given the startup timeout (engine.core.dp_remote): None for a
# rank this process spawns itself.
Attach = Callable[[float], Any]


def start_cores(build: Callable[[EngineConfig, Attach | None], T], config: EngineConfig
                ) -> list[T]:
    """One per-core client per rank, started concurrently (each loads the model); if any
    rank fails, the started ones are shut down and the first failure is raised. Ranks
    of other nodes (``--headless`` nodes, Ray) are attached to, not spawned."""
    size = config.parallel.data_parallel_size
    parallel = config.parallel
    plan = node_plan(size, parallel.data_parallel_size_local,
                     parallel.data_parallel_start_rank, parallel.data_parallel_backend)
    remote = None
    if plan.multi_node:
        config = with_head_address(config)
    config = with_rendezvous_port(config)
    if plan.multi_node:
        from engine.core.dp_remote import RemoteRanks

        remote = RemoteRanks(config, plan)

    def attach(rank: int) -> Attach | None:
        return None if remote is None or rank in plan.local_ranks else (
            lambda timeout_s: remote.attach(rank, timeout_s))

    with ThreadPoolExecutor(size, thread_name_prefix="engine-dp-start") as pool:
        futures = [pool.submit(build, rank_config(config, rank), attach(rank))
                   for rank in range(size)]
        outcomes: list[tuple[T | None, BaseException | None]] = []
        for future in futures:
            try:
                outcomes.append((future.result(), None))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after cleanup
                outcomes.append((None, exc))
    failed = [(rank, exc) for rank, (_, exc) in enumerate(outcomes) if exc is not None]
    if not failed:
        return [client for client, _ in outcomes]  # type: ignore[misc]
    for client, _ in outcomes:
        if client is not None:
            client.shutdown()  # type: ignore[attr-defined]
    if remote is not None:
        remote.close()
    rank, exc = failed[0]
    if isinstance(exc, EngineStartupError):
        raise EngineStartupError(f"data-parallel rank {rank}: {exc}") from exc
    raise exc


class _DPClientBase(ABC):
    """What the sync and async clients share: the router, liveness, utilities' rules."""

    def __init__(self, clients: list[Any], config: EngineConfig) -> None:
        if not clients:
            raise ValueError("a data-parallel client needs at least one core client")
        self.clients = list(clients)
        self.config = config
        self.on_failure = config.parallel.data_parallel_on_rank_failure
        self.lockstep = config.parallel.dp_lockstep
        self.router = DPRouter(len(self.clients), config.cache.block_size)
        self._dead: EngineDeadError | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.clients)

    @property
    def ready(self) -> wire.ReadyInfo:
        """What every rank can do: the smallest KV pool and max_model_len."""
        infos = [client.ready for client in self.clients]
        return wire.ReadyInfo(min(i.num_kv_blocks for i in infos),
                              min(i.max_model_len for i in infos), infos[0].pid)

    @property
    def num_kv_blocks(self) -> int:
        return self.ready.num_kv_blocks

    @property
    def pids(self) -> list[int]:
        return [client.ready.pid for client in self.clients]

    @property
    def dead(self) -> EngineDeadError | None:
        return self._dead

    def live_ranks(self) -> list[int]:
        return self.router.live_ranks()

    def check_alive(self) -> None:
        """Raise EngineDeadError once the client is dead (``exit``: any rank died;
        ``continue``: every rank); a rank found dead here is handled as in get_output."""
        if self._dead is None:
            for rank in self.router.live_ranks():
                try:
                    self.clients[rank].check_alive()
                except EngineDeadError as error:
                    self._rank_failed(rank, error)
        if self._dead is not None:
            raise self._dead

    def exited(self) -> bool:
        """A core process has ended that makes the client dead (see check_alive)."""
        ranks = self.router.live_ranks()
        if self.on_failure == "exit":
            return any(self.clients[r].exited() for r in range(self.num_ranks))
        return all(self.clients[r].exited() for r in ranks)

    def _rank_failed(self, rank: int, error: BaseException) -> None:
        """Take a dead rank out of routing and deliver its error (once)."""
        lost = self.router.mark_dead(rank)
        if lost is None:
            return
        if self.on_failure == "exit" or not self.router.live_ranks():
            reason = ("data_parallel_on_rank_failure is 'exit'" if self.on_failure == "exit"
                      else "no rank is left")
            self._dead = EngineDeadError(f"data-parallel rank {rank} died ({error}); the "
                                         f"engine stops: {reason}")
            logger.error("%s", self._dead)
            self._deliver(self._dead)
            return
        logger.error("data-parallel rank %d died (%s): %d in-flight request(s) fail; ranks "
                     "%s keep serving", rank, error, len(lost), self.router.live_ranks())
        self._deliver(RankDeadError(f"data-parallel rank {rank} died: {error}", rank, lost))

    @abstractmethod
    def _deliver(self, error: EngineDeadError) -> None:
        """Hand ``error`` to whoever reads outputs next."""

    def _wake_others(self, rank: int) -> None:
        """Lockstep ranks (experts shared across them) start a step together: the ones
        that did not get the request stop waiting for input."""
        if not self.lockstep:
            return
        for other in self.live_ranks():
            if other != rank:
                try:
                    self.clients[other].wake()
                except EngineDeadError as error:
                    self._rank_failed(other, error)

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _utility_plan(self, method: str, args: tuple[Any, ...]
                      ) -> tuple[Callable[[list[Any]], Any], list[tuple[int, tuple[Any, ...]]]]:
        """(how to combine the results, [(rank, its args)] over the live ranks)."""
        self._check_usable()
        if method in _REFUSED:
            raise ValueError(f"{method} with data_parallel_size > 1: {_REFUSED[method]}")
        combine = _COMBINE.get(method)
        if combine is None:
            raise ValueError(f"utility {method!r} has no data-parallel rule (known: "
                             f"{', '.join(sorted(_COMBINE))}, get_stats)")
        world = self.config.parallel.world_size
        plan = []
        for rank in self.router.live_ranks():
            rank_args = args
            if method == "init_weight_update_group":
                # Each replica's workers join the trainer's group as their own block of
                # ranks: rank_offset + dp_rank * (tp x pp) + worker rank.
                address, port, rank_offset, world_size = args
                rank_args = (address, port, rank_offset + rank * world, world_size)
            plan.append((rank, rank_args))
        return combine, plan

    def _ranks_or_dead(self) -> list[int]:
        ranks = self.router.live_ranks()
        if not ranks:
            raise self._dead or EngineDeadError("every data-parallel rank has died")
        return ranks

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = EngineDeadError("the engine has been shut down")
        for client in self.clients:
            client.shutdown()


def _merge(outputs: list[EngineCoreOutputs]) -> EngineCoreOutputs:
    if len(outputs) == 1:
        return outputs[0]
    return EngineCoreOutputs(
        outputs=[o for step in outputs for o in step.outputs],
        timestamp=max(step.timestamp for step in outputs),
        finished_requests=[r for step in outputs for r in step.finished_requests],
    )


class SyncDPClient(CoreUtilities, _DPClientBase):
    """``EngineCoreClient`` over N core processes, for ``LLMEngine`` (offline ``LLM``).

    ``get_output`` returns what any rank has produced (merged), waiting on every busy
    rank's socket at once; with nothing in flight it returns an empty step at once.
    """

    def __init__(self, clients: list[SyncMPClient], config: EngineConfig) -> None:
        super().__init__(clients, config)
        self._errors: deque[EngineDeadError] = deque()

    @classmethod
    def start(cls, config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S
              ) -> SyncDPClient:
        return cls(start_cores(lambda c, attach: SyncMPClient(
            c, startup_timeout_s=startup_timeout_s,
            channel=attach(startup_timeout_s) if attach else None), config), config)

    def _deliver(self, error: EngineDeadError) -> None:
        self._errors.append(error)

    def add_request(self, request: EngineCoreRequest) -> None:
        while True:
            self._check_usable()
            self._ranks_or_dead()
            rank = self.router.route(request)
            try:
                self.clients[rank].add_request(request)
                self._wake_others(rank)
                return
            except EngineDeadError as error:
                self.router.forget([request.request_id])
                self._rank_failed(rank, error)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self.router.forget(request_ids).items():
            if self.router.live[rank]:
                try:
                    self.clients[rank].abort_requests(ids)
                except EngineDeadError as error:
                    self._rank_failed(rank, error)

    def get_output(self) -> EngineCoreOutputs:
        self._check_usable()
        while True:
            if self._errors:
                raise self._errors.popleft()
            steps = []
            for rank in self.router.live_ranks():
                for step in self.clients[rank].take_outputs():
                    self.router.on_outputs(rank, step)
                    steps.append(step)
            if steps:
                return _merge(steps)
            busy = [r for r in self.router.live_ranks() if self.router.in_flight[r]]
            if not busy:
                return EngineCoreOutputs(timestamp=time.monotonic())
            self._wait(busy)

    def _wait(self, ranks: list[int]) -> None:
        """Up to POLL_S for a message from any of ``ranks``; a dead rank is handled."""
        poller = zmq.Poller()
        for rank in ranks:
            poller.register(self.clients[rank].output_socket, zmq.POLLIN)
        readable = dict(poller.poll(int(POLL_S * 1000)))
        for rank in ranks:
            client = self.clients[rank]
            try:
                if client.output_socket in readable:
                    client.receive_once()
                else:
                    client.check_alive()
            except EngineDeadError as error:
                self._rank_failed(rank, error)

    # -- utilities --------------------------------------------------------------------------
    def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Start ``method`` on every live rank, then wait for each (so a collective call,
        e.g. a weight broadcast, has every rank in it) and combine the results."""
        combine, plan = self._utility_plan(method, args)
        calls = [(rank, self.clients[rank].send_utility(method, *rank_args))
                 for rank, rank_args in plan]
        return combine([self.clients[rank].wait_utility(call_id, method, timeout_s)
                        for rank, call_id in calls])

    def get_engine_stats(self) -> list[wire.EngineCoreStats | None]:
        """Each rank's stats (None: a dead rank)."""
        self._check_usable()
        return [self.clients[r].get_stats() if self.router.live[r] else None
                for r in range(self.num_ranks)]

    def get_stats(self) -> wire.EngineCoreStats:
        return wire.EngineCoreStats.merge([s for s in self.get_engine_stats() if s is not None])

    def update_weights(self, method: str, *args: Any) -> None:
        self.call_utility(method, *args)
