"""Which rank this process is, and the communicators of its parallel groups.

Ranks are laid out as vLLM lays them out: ``rank = pp_rank * tp_size + tp_rank``, so the
ranks of one pipeline stage are consecutive (one TP group per stage) and the ranks that
share a ``tp_rank`` form the pipeline group through which that rank's activations travel
from stage to stage. Every group is built over the platform's Communicator class (gloo on
CPU, NCCL/RCCL/XCCL on GPUs); model layers only ever see the Communicator objects here,
never torch.distributed.

The data-parallel and expert-parallel sizes are carried for the MoE layers: with
``enable_expert_parallel`` the experts are spread over the TP x DP ranks (EP size = their
product) instead of each expert being sharded over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.interfaces import Communicator


@dataclass(frozen=True)
class ParallelLayout:
    """Group sizes and this process's place in them (pure arithmetic, no processes)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

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
    init_method: str,
    timeout_s: float = 600.0,
) -> ParallelState:
    """Join the world (``init_method``: ``tcp://host:port``) and build the TP and PP
    groups. Every rank must call this with the same sizes: group creation is collective,
    so each rank creates every group in the same order and keeps its own."""
    import torch.distributed as dist

    init = getattr(communicator_cls, "init_process_group", None)
    if init is None:
        raise ValueError(
            f"communicator {communicator_cls.__name__} cannot start a process group "
            "(it has no init_process_group)"
        )
    world = init(layout.rank, layout.world_size, init_method=init_method, timeout_s=timeout_s)
    backend = getattr(communicator_cls, "backend", None)

    def group_of(ranks: list[int]):
        if len(ranks) == layout.world_size:
            return None  # the default group
        return dist.new_group(ranks, backend=backend)

    tp_comm = pp_comm = None
    for stage in range(layout.pipeline_parallel_size):
        ranks = layout.tp_group_ranks(stage)
        group = group_of(ranks)
        if layout.rank in ranks:
            tp_comm = communicator_cls(ranks.index(layout.rank), len(ranks), group)
    for tp_rank in range(layout.tensor_parallel_size):
        ranks = layout.pp_group_ranks(tp_rank)
        group = group_of(ranks)
        if layout.rank in ranks:
            pp_comm = communicator_cls(ranks.index(layout.rank), len(ranks), group)
    assert tp_comm is not None and pp_comm is not None
    del world
    return ParallelState(layout, tp_comm, pp_comm)


def destroy_parallel_state() -> None:
    """Leave the process group (a worker's last act; harmless when none was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
