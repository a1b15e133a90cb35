"""The head's data-parallel ranks on other nodes (``--headless`` nodes, or Ray-placed).

:class:`RemoteRanks` picks, per remote rank, two tcp addresses on the head (the rank's
input and output sockets), listens for nodes (:class:`~engine.core.dp_handshake.HeadRegistry`)
and, with ``data_parallel_backend='ray'``, places one launcher per rank with Ray
(:mod:`engine.core.dp_ray`). :meth:`attach` gives each rank's front-end channel: an
:class:`~engine.core.mp_client.AttachedCore` bound at those addresses whose liveness is
the registry's view of that rank (its launcher's reports and heartbeats). When every
remote channel is shut down, the nodes are told to stop and Ray's actors are removed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.core.config import EngineConfig
from engine.core.dp_handshake import HeadRegistry, RankAddresses, tcp
from engine.core.dp_placement import NodePlan
from engine.core.mp_client import AttachedCore

logger = logging.getLogger(__name__)


def head_address(config: EngineConfig) -> str:
    """The address remote cores reach the head at: --data-parallel-address, or (Ray)
    this node's address as Ray sees it."""
    parallel = config.parallel
    if parallel.data_parallel_backend == "ray":
        from engine.core.dp_ray import ray_node_address

        return ray_node_address()
    if not parallel.data_parallel_address:
        raise ValueError("ranks on other nodes need --data-parallel-address")
    return parallel.data_parallel_address


class _RemoteCore(AttachedCore):
    """A remote rank's channel; closing the last one releases the nodes."""

    def __init__(self, owner: RemoteRanks, rank: int, addresses: RankAddresses,
                 startup_timeout_s: float) -> None:
        self._owner, self._rank = owner, rank
        super().__init__(addresses.input, addresses.output,
                         liveness=owner.registry.liveness(rank),
                         startup_timeout_s=startup_timeout_s)

    def shutdown(self) -> None:
        super().shutdown()
        self._owner.release(self._rank)


class RemoteRanks:
    """Addresses, registry and (Ray) placement for the ranks not started here."""

    def __init__(self, config: EngineConfig, plan: NodePlan) -> None:
        from engine.model_executor.multiproc_executor import free_port

        parallel = config.parallel
        host = head_address(config)
        self.addresses = {
            rank: RankAddresses(rank, tcp(host, free_port(host)), tcp(host, free_port(host)))
            for rank in plan.remote_ranks}
        ray_backend = parallel.data_parallel_backend == "ray"
        rpc_port = free_port(host) if ray_backend else parallel.data_parallel_rpc_port
        self.registry = HeadRegistry(host, rpc_port, config.model_dump_json(),
                                     self.addresses, parallel.data_parallel_size)
        self._open = set(plan.remote_ranks)
        self._lock = threading.Lock()
        self._placer: Any = None
        if ray_backend:
            from engine.core.dp_ray import RayRankPlacer

            try:
                self._placer = RayRankPlacer(config, host, rpc_port)
            except BaseException:
                self.registry.close("Ray could not place the ranks")
                raise

    def attach(self, rank: int, startup_timeout_s: float) -> AttachedCore:
        """Rank ``rank``'s channel, once its core is READY (blocks until then)."""
        return _RemoteCore(self, rank, self.addresses[rank], startup_timeout_s)

    def release(self, rank: int) -> None:
        with self._lock:
            self._open.discard(rank)
            last = not self._open
        if last:
            self.close()

    def close(self) -> None:
        """Tell the nodes to stop their cores; remove Ray's actors (idempotent)."""
        self.registry.close()
        if self._placer is not None:
            self._placer.stop()
