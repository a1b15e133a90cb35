"""Which rank this process is, and the communicators of its parallel groups.

Ranks are laid out as vLLM lays them out: ``rank = pp_rank * tp_size + tp_rank``, so the
ranks of one pipeline stage are consecutive (one TP group per stage) and the ranks that
share a ``tp_rank`` form the pipeline group through which that rank's activations travel
from stage to stage. Every group is built over the platform's Communicator class (gloo on
CPU, NCCL/RCCL/XCCL on GPUs); model layers only ever see the Communicator objects here,
never torch.distributed.

The data-parallel and expert-parallel sizes are carried for the MoE layers: with
``enable_expert_parallel`` the experts are spread over the TP x DP ranks (EP size = their
product) instead of each expert being sharded over TP. When that spans data-parallel
ranks (``spans_data_parallel``), the torch.distributed world is every replica's workers:
``global_rank = dp_rank * world_size + rank``; the TP and PP groups stay inside one
replica and the EP group of a stage holds that stage's ranks of every replica, in
``(dp_rank, tp_rank)`` order (EP rank ``dp_rank * tp + tp_rank`` owns the experts
``[ep_rank * E / EP, (ep_rank + 1) * E / EP)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.interfaces import Communicator


@dataclass(frozen=True)
class ParallelLayout:
    """Group sizes and this process's place in them (pure arithmetic, no processes)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    rank: int = 0  # inside this replica
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is outside "
                             f"data_parallel_size {self.data_parallel_size}")

    @classmethod
    def of_rank(cls, parallel: Any, rank: int = 0) -> ParallelLayout:
        """Worker ``rank`` of the replica a ``ParallelConfig`` describes."""
        return cls(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                   data_parallel_size=parallel.data_parallel_size,
                   enable_expert_parallel=parallel.enable_expert_parallel, rank=rank,
                   data_parallel_rank=parallel.data_parallel_rank)

    @property
    def spans_data_parallel(self) -> bool:
        """Whether the process group spans the data-parallel replicas (their experts are
        shared: EP across DP)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def global_rank(self) -> int:
        """This process's rank in the torch.distributed world."""
        if not self.spans_data_parallel:
            return self.rank
        return self.data_parallel_rank * self.world_size + self.rank

    @property
    def global_world_size(self) -> int:
        return self.world_size * (self.data_parallel_size if self.spans_data_parallel else 1)

    @property
    def ep_rank(self) -> int:
        """This rank's place among its stage's expert-parallel ranks."""
        if not self.spans_data_parallel:
            return self.tp_rank
        return self.data_parallel_rank * self.tensor_parallel_size + self.tp_rank

    def ep_group_ranks(self, pp_rank: int) -> list[int]:
        """Global ranks of stage ``pp_rank``'s expert-parallel group, in EP-rank order."""
        replicas = self.data_parallel_size if self.spans_data_parallel else 1
        tp = self.tensor_parallel_size
        return [dp * self.world_size + pp_rank * tp + t for dp in range(replicas)
                for t in range(tp)]

    @property
    def world_size(self) -> int:
        """Ranks of one model replica (data-parallel replicas are separate worlds)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        if not self.enable_expert_parallel:
            return 1
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The one rank that reports sampled tokens: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(pp_rank * tp, (pp_rank + 1) * tp))

    def pp_group_ranks(self, tp_rank: int) -> list[int]:
        tp = self.tensor_parallel_size
        return [stage * tp + tp_rank for stage in range(self.pipeline_parallel_size)]

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's stage runs: contiguous, as even as possible,
        the earliest stages taking one extra layer each when they do not divide (vLLM
        gives the extras to middle stages instead; both agree for two stages)."""
        pp = self.pipeline_parallel_size
        if num_layers < pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} needs at least {pp} layers; the model has "
                f"{num_layers}"
            )
        base, extra = divmod(num_layers, pp)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))


@dataclass(frozen=True)
class ParallelState:
    """A layout plus live communicators: ``tp`` over this stage's TP ranks, ``pp`` over
    this rank's pipeline (group rank = stage)."""

    layout: ParallelLayout
    tp: Communicator
    pp: Communicator
    # Expert parallelism across data-parallel replicas: this stage's EP group (every
    # replica's TP ranks). None: EP, if on, is the TP group.
    ep: Communicator | None = None

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel_size


def single_process_state(communicator_cls: type[Communicator]) -> ParallelState:
    """The state of an engine that runs on one rank: every collective is the identity."""
    layout = ParallelLayout()
    return ParallelState(layout, communicator_cls(0, 1), communicator_cls(0, 1))


def init_parallel_state(
    communicator_cls: type[Communicator],
    layout: ParallelLayout,
    init_method: str | None = None,
    timeout_s: float = 600.0,
    store: Any = None,
) -> ParallelState:
    """Join the world (``init_method``: ``tcp://host:port``, or a torch.distributed
    ``store`` shared with other replicas) and build the TP, PP (and cross-replica EP)
    groups. Every rank of the world must call this with the same sizes: group creation
    is collective, so each rank creates every group in the same order and keeps its own."""
    import torch.distributed as dist

    init = getattr(communicator_cls, "init_process_group", None)
    if init is None:
        raise ValueError(
            f"communicator {communicator_cls.__name__} cannot start a process group "
            "(it has no init_process_group)"
        )
    world_size, me = layout.global_world_size, layout.global_rank
    kwargs: dict[str, Any] = {"timeout_s": timeout_s}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    world = init(me, world_size, **kwargs)
    backend = getattr(communicator_cls, "backend", None)

    def group_of(ranks: list[int]):
        if len(ranks) == world_size:
            return None  # the default group
        return dist.new_group(ranks, backend=backend)

    def join(ranks: list[int]) -> Communicator | None:
        group = group_of(ranks)
        return communicator_cls(ranks.index(me), len(ranks), group) if me in ranks else None

    replicas = layout.data_parallel_size if layout.spans_data_parallel else 1
    tp_comm = pp_comm = ep_comm = None
    for replica in range(replicas):
        offset = replica * layout.world_size
        for stage in range(layout.pipeline_parallel_size):
            tp_comm = join([offset + r for r in layout.tp_group_ranks(stage)]) or tp_comm
        for tp_rank in range(layout.tensor_parallel_size):
            pp_comm = join([offset + r for r in layout.pp_group_ranks(tp_rank)]) or pp_comm
    if layout.spans_data_parallel:
        for stage in range(layout.pipeline_parallel_size):
            ep_comm = join(layout.ep_group_ranks(stage)) or ep_comm
    assert tp_comm is not None and pp_comm is not None
    del world
    return ParallelState(layout, tp_comm, pp_comm, ep_comm)


def rendezvous(parallel: Any, init_method: str | None) -> dict[str, Any]:
    """How this replica's workers meet: its own ``init_method``, or, when the world spans
    the data-parallel replicas, the ranks' shared store (engine.distributed.dp_lockstep)."""
    if parallel.dp_lockstep:
        from engine.distributed.dp_lockstep import ep_world_store

        return {"store": ep_world_store(parallel)}
    return {"init_method": init_method}


def destroy_parallel_state() -> None:
    """Leave the process group (a worker's last act; harmless when none was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
