"""Data-parallel ranks that step together: MoE experts shared across replicas.

With ``--enable-expert-parallel`` and ``--data-parallel-size N`` the experts of every MoE
layer are spread over all N x TP workers (EP = DP x TP) while attention stays data
parallel: each replica schedules its own requests, but every forward's expert
all-to-all needs every EP rank. So the engine cores run in lockstep:

* each loop iteration, every core all-reduces "I have unfinished requests" over a gloo
  group of the cores (:class:`DPLockstep`); while any has, every core steps (a core with
  nothing scheduled runs a one-token dummy forward, ``ModelRunner._dummy_forward``);
  when none has, the wave ends and every core waits for input;
* an idle core waits at most ``IDLE_POLL_S`` for input before the next all-reduce; the
  front end sends a WAKE to every other rank with each new request, so a wave starts at
  once on every rank. Decisions are only ever taken by the collective, so a stale WAKE
  costs one extra all-reduce and can never split the ranks.

Every rank meets through one TCP store that DP rank 0's core hosts at
``data_parallel_master_ip:data_parallel_master_port`` (the front end picks the port):
the cores' sync group and the workers' torch.distributed world (over every replica's
workers) use it under their own prefixes.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.config import ParallelConfig

STORE_TIMEOUT_S = 600.0  # ranks load their models concurrently; the slowest gates the rest
SYNC_TIMEOUT_S = 1800.0  # one rank's step (a long prefill) holds the others' all-reduce

_store: Any = None  # this process's connection to the rendezvous store (one per process)


def dp_store(parallel: ParallelConfig, host: bool = False) -> Any:
    """This process's connection to the ranks' rendezvous store, made by the first call:
    DP rank 0's engine core hosts it (``host``, before it builds its executor); other
    cores and every TP worker process connect as clients."""
    global _store
    if _store is None:
        import torch.distributed as dist

        if not parallel.data_parallel_master_port:
            raise ValueError("data_parallel_master_port is not set: the front end that "
                             "starts the data-parallel ranks picks it")
        _store = dist.TCPStore(parallel.data_parallel_master_ip,
                               parallel.data_parallel_master_port, is_master=host,
                               timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                               wait_for_workers=False)
    return _store


def ep_world_store(parallel: ParallelConfig) -> Any:
    """Where every replica's workers form one torch.distributed world."""
    import torch.distributed as dist

    return dist.PrefixStore("ep_world/", dp_store(parallel))


class PeerRankLost(RuntimeError):
    """Another rank left the step agreement: it died, or it is being shut down first."""


class DPLockstep:
    """The engine cores' step agreement (module docstring)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        import torch
        import torch.distributed as dist

        self.rank = parallel.data_parallel_rank
        self.size = parallel.data_parallel_size
        store = dist.PrefixStore("dp_sync/", dp_store(parallel))
        self._group = dist.ProcessGroupGloo(store, self.rank, self.size,
                                            datetime.timedelta(seconds=SYNC_TIMEOUT_S))
        self._flag = torch.zeros(1, dtype=torch.int32)
        self.wave_running = False
        self.waves = 0  # waves this rank took part in (stats, tests)
        self.dummy_steps = 0  # steps this rank ran with nothing of its own scheduled

    def any_busy(self, busy: bool) -> bool:
        """All-reduce ``busy`` over the cores: whether any rank has unfinished requests.
        Every core calls this once per loop iteration."""
        self._flag[0] = int(busy)
        try:
            self._group.allreduce([self._flag]).wait()
        except RuntimeError as exc:  # gloo: a peer's connection closed
            raise PeerRankLost(f"data-parallel rank {self.rank}: another rank left the "
                               f"lockstep (its experts are gone with it): {exc}") from exc
        running = bool(self._flag[0])
        if running and not self.wave_running:
            self.waves += 1
        self.wave_running = running
        return running
