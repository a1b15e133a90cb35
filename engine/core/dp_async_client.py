"""Data parallelism for the asyncio front end (``AsyncLLM``, the server): one client
over N engine-core processes (see :mod:`engine.core.dp_client` for the ranks, routing and
failure handling it shares with the offline client)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.core import core_protocol as wire
from engine.core.config import EngineConfig
from engine.core.dp_client import _DPClientBase, start_cores
from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.core.errors import EngineDeadError
from engine.core.mp_client import STARTUP_TIMEOUT_S, AsyncCoreUtilities, AsyncMPClient


def start_async_client(config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S
                       ) -> AsyncMPClient | AsyncDPClient:
    """The asyncio client ``config`` asks for: one core, or one per data-parallel rank."""
    if config.parallel.data_parallel_size == 1:
        return AsyncMPClient(config, startup_timeout_s=startup_timeout_s)
    return AsyncDPClient.start(config, startup_timeout_s=startup_timeout_s)


class AsyncDPClient(AsyncCoreUtilities, _DPClientBase):
    """asyncio client over N core processes, for ``AsyncLLM``.

    One forwarding task per rank (started on first use, in the running loop) moves that
    rank's step outputs into one queue, counting its finished requests out of the router;
    a rank's death arrives in the same queue (a RankDeadError, or the client's fatal
    EngineDeadError), so ``get_output`` raises it in order with the outputs.
    """

    def __init__(self, clients: list[AsyncMPClient], config: EngineConfig) -> None:
        super().__init__(clients, config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._merged: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()
        self._forwarders: dict[int, asyncio.Task] = {}

    @classmethod
    def start(cls, config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S
              ) -> AsyncDPClient:
        return cls(start_cores(lambda c, attach: AsyncMPClient(
            c, startup_timeout_s=startup_timeout_s,
            channel=attach(startup_timeout_s) if attach else None), config), config)

    def _deliver(self, error: EngineDeadError) -> None:
        self._merged.put_nowait(error)

    def _ensure_forwarders(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new loop: the old one's queue and tasks are gone
            self._loop = loop
            self._merged = asyncio.Queue()
            self._forwarders = {}
        for rank in self.router.live_ranks():
            task = self._forwarders.get(rank)
            if task is None or task.done():
                self._forwarders[rank] = loop.create_task(
                    self._forward(rank), name=f"engine-dp-forward-{rank}")

    async def _forward(self, rank: int) -> None:
        client = self.clients[rank]
        try:
            while True:
                outputs = await client.get_output()
                self.router.on_outputs(rank, outputs)
                self._merged.put_nowait(outputs)
        except EngineDeadError as error:
            self._rank_failed(rank, error)
        except Exception as exc:  # noqa: BLE001 - a broken rank connection: it is dead
            self._rank_failed(rank, EngineDeadError(wire.describe_exception(exc)))

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_forwarders()
        while True:
            self._check_usable()
            self._ranks_or_dead()
            rank = self.router.route(request)
            try:
                await self.clients[rank].add_request(request)
                self._wake_others(rank)
                return
            except EngineDeadError as error:
                self.router.forget([request.request_id])
                self._rank_failed(rank, error)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.abort_requests_nowait(request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Abort on the owning ranks (sending never blocks); a dead rank's are gone."""
        for rank, ids in self.router.forget(request_ids).items():
            if self.router.live[rank]:
                try:
                    self.clients[rank].abort_requests_nowait(ids)
                except EngineDeadError as error:
                    self._rank_failed(rank, error)

    async def get_output(self) -> EngineCoreOutputs:
        self._ensure_forwarders()
        if self._dead is not None and self._merged.empty():
            raise self._dead
        item = await self._merged.get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    # -- utilities --------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``method`` on every live rank concurrently and combine the results."""
        combine, plan = self._utility_plan(method, args)
        results = await asyncio.gather(*(self.clients[rank].call_utility(method, *rank_args)
                                         for rank, rank_args in plan))
        return combine(list(results))

    async def get_engine_stats(self) -> list[wire.EngineCoreStats | None]:
        """Each rank's stats (None: a dead rank, or one that failed to answer)."""
        self._check_usable()

        async def one(rank: int) -> wire.EngineCoreStats | None:
            if not self.router.live[rank]:
                return None
            try:
                return await self.clients[rank].get_stats()
            except EngineDeadError:
                return None

        return list(await asyncio.gather(*(one(r) for r in range(self.num_ranks))))

    async def get_stats(self) -> wire.EngineCoreStats:
        stats = [s for s in await self.get_engine_stats() if s is not None]
        return wire.EngineCoreStats.merge(stats)


    def shutdown(self) -> None:
        for task in self._forwarders.values():
            if not task.done():
                task.cancel()
        super().shutdown()

