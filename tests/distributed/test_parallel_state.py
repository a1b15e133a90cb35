"""ParallelLayout's rank arithmetic (vLLM's layout: rank = pp_rank * tp + tp_rank) and
init_parallel_state on a real two-rank gloo world, once as TP=2 and once as PP=2."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.core.interfaces import Communicator
from engine.distributed import GlooCommunicator
from engine.distributed.parallel_state import (
    ParallelLayout,
    destroy_parallel_state,
    init_parallel_state,
    single_process_state,
)

# --- layout arithmetic -------------------------------------------------------------


def test_tp2_pp2_rank_mapping_is_vllms():
    expected = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}  # rank: (tp_rank, pp_rank)
    for rank, (tp_rank, pp_rank) in expected.items():
        layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, rank=rank)
        assert layout.world_size == 4
        assert (layout.tp_rank, layout.pp_rank) == (tp_rank, pp_rank)
        assert rank == layout.pp_rank * 2 + layout.tp_rank
        assert layout.is_first_stage == (pp_rank == 0)
        assert layout.is_last_stage == (pp_rank == 1)
        assert layout.is_output_rank == (rank == 2)  # TP rank 0 of the last stage
        assert layout.tp_group_ranks(0) == [0, 1]
        assert layout.tp_group_ranks(1) == [2, 3]
        assert layout.pp_group_ranks(0) == [0, 2]
        assert layout.pp_group_ranks(1) == [1, 3]
        # this rank is in exactly its own TP and PP group
        assert rank in layout.tp_group_ranks(pp_rank)
        assert rank in layout.pp_group_ranks(tp_rank)


def test_groups_partition_the_world():
    layout = ParallelLayout(tensor_parallel_size=4, pipeline_parallel_size=3)
    tp_groups = [layout.tp_group_ranks(s) for s in range(3)]
    pp_groups = [layout.pp_group_ranks(t) for t in range(4)]
    assert sorted(r for g in tp_groups for r in g) == list(range(12))
    assert sorted(r for g in pp_groups for r in g) == list(range(12))
    for rank in range(12):
        lay = ParallelLayout(tensor_parallel_size=4, pipeline_parallel_size=3, rank=rank)
        assert lay.tp_group_ranks(lay.pp_rank).index(rank) == lay.tp_rank
        assert lay.pp_group_ranks(lay.tp_rank).index(rank) == lay.pp_rank
    outputs = [r for r in range(12)
               if ParallelLayout(tensor_parallel_size=4, pipeline_parallel_size=3,
                                 rank=r).is_output_rank]
    assert outputs == [8]


def test_single_rank_layout():
    layout = ParallelLayout()
    assert (layout.world_size, layout.tp_rank, layout.pp_rank) == (1, 0, 0)
    assert layout.is_first_stage and layout.is_last_stage and layout.is_output_rank
    assert layout.stage_layers(7) == range(7)


def _stages(num_layers: int, pp: int) -> list[range]:
    return [ParallelLayout(pipeline_parallel_size=pp, rank=r).stage_layers(num_layers)
            for r in range(pp)]


def test_stage_layers_even_and_uneven():
    assert _stages(4, 2) == [range(2), range(2, 4)]
    assert _stages(5, 2) == [range(3), range(3, 5)]
    assert _stages(2, 2) == [range(1), range(1, 2)]
    # with TP the stage, not the rank, decides
    for rank, expected in ((0, range(3)), (1, range(3)), (2, range(3, 5)),
                           (3, range(3, 5))):
        layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, rank=rank)
        assert layout.stage_layers(5) == expected


@pytest.mark.parametrize(("num_layers", "pp"), [(7, 3), (10, 4), (9, 4), (3, 3), (32, 5)])
def test_stage_layers_contiguous_cover_and_balanced(num_layers, pp):
    stages = _stages(num_layers, pp)
    assert [i for s in stages for i in s] == list(range(num_layers))  # contiguous, in order
    sizes = [len(s) for s in stages]
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) >= 1


def test_stage_layers_needs_a_layer_per_stage():
    with pytest.raises(ValueError, match="needs at least 3 layers"):
        ParallelLayout(pipeline_parallel_size=3, rank=0).stage_layers(2)


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="outside a world of 4"):
        ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, rank=4)
    with pytest.raises(ValueError, match="outside a world of 2"):
        ParallelLayout(tensor_parallel_size=2, rank=-1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelLayout(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        ParallelLayout(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        ParallelLayout(data_parallel_size=0)


def test_expert_parallel_size():
    assert ParallelLayout(tensor_parallel_size=2, data_parallel_size=3).expert_parallel_size == 1
    ep = ParallelLayout(tensor_parallel_size=2, data_parallel_size=3, enable_expert_parallel=True)
    assert ep.expert_parallel_size == 6
    assert ep.world_size == 2  # DP replicas are separate worlds


def test_expert_parallel_across_data_parallel_ranks_spans_one_world():
    """EP = DP x TP: one torch.distributed world over every replica's workers; TP / PP
    groups stay inside a replica, each stage's EP group holds that stage of every
    replica in (dp_rank, tp_rank) order."""
    def layout(dp_rank, rank, ep=True):
        return ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2,
                              data_parallel_size=3, enable_expert_parallel=ep, rank=rank,
                              data_parallel_rank=dp_rank)

    ranks = {(d, r): layout(d, r) for d in range(3) for r in range(4)}
    assert sorted(lay.global_rank for lay in ranks.values()) == list(range(12))
    assert all(lay.global_world_size == 12 for lay in ranks.values())
    assert layout(2, 3).global_rank == 11 and layout(1, 0).global_rank == 4
    assert layout(0, 0).ep_group_ranks(0) == [0, 1, 4, 5, 8, 9]
    assert layout(0, 0).ep_group_ranks(1) == [2, 3, 6, 7, 10, 11]
    for (d, r), lay in ranks.items():  # its EP rank is its place in its stage's group
        group = lay.ep_group_ranks(lay.pp_rank)
        assert group.index(lay.global_rank) == lay.ep_rank == d * 2 + lay.tp_rank
    # Without expert parallelism the replicas stay separate worlds.
    dense = layout(2, 3, ep=False)
    assert (dense.global_rank, dense.global_world_size, dense.ep_group_ranks(1)) == (3, 4, [2, 3])
    with pytest.raises(ValueError, match="data_parallel_rank 3 is outside"):
        layout(3, 0)


# --- states --------------------------------------------------------------------------


class _NoGroupCommunicator(Communicator):
    """A communicator class that cannot start a process group."""

    def all_reduce(self, tensor):
        return tensor

    all_gather = reduce_scatter = broadcast = send = recv = barrier = all_reduce


def test_single_process_state_is_identity():
    state = single_process_state(GlooCommunicator)
    assert (state.tp_rank, state.tp_size, state.pp_rank, state.pp_size) == (0, 1, 0, 1)
    assert (state.tp.rank, state.tp.world_size, state.pp.rank, state.pp.world_size) == (0, 1, 0, 1)
    x = torch.arange(3.0)
    assert state.tp.all_reduce(x) is x
    assert state.pp.all_gather(x) is x


def test_init_parallel_state_needs_a_group_starting_communicator():
    with pytest.raises(ValueError, match="cannot start a process group"):
        init_parallel_state(_NoGroupCommunicator, ParallelLayout(), "tcp://127.0.0.1:1")


def test_destroy_without_a_group_is_harmless():
    destroy_parallel_state()


# --- two real ranks -----------------------------------------------------------------

WORLD = 2


def _check_tp2(state, rank: int) -> None:
    assert (state.tp_rank, state.tp_size, state.pp_rank, state.pp_size) == (rank, 2, 0, 1)
    assert (state.tp.rank, state.tp.world_size) == (rank, 2)
    assert (state.pp.rank, state.pp.world_size) == (0, 1)
    assert state.layout.is_output_rank == (rank == 0)
    mine = torch.arange(6, dtype=torch.float64) * (rank + 1) + rank
    expected = sum(torch.arange(6, dtype=torch.float64) * (r + 1) + r for r in range(WORLD))
    assert torch.equal(state.tp.all_reduce(mine.clone()), expected)
    gathered = state.tp.all_gather(mine.reshape(2, 3), dim=-1)
    assert torch.equal(gathered, torch.cat([torch.arange(6, dtype=torch.float64).reshape(2, 3)
                                            * (r + 1) + r for r in range(WORLD)], dim=-1))
    # the PP group of a single stage is one rank: every collective is the identity
    assert state.pp.all_reduce(mine) is mine


def _check_pp2(state, rank: int) -> None:
    assert (state.tp_rank, state.tp_size, state.pp_rank, state.pp_size) == (0, 1, rank, 2)
    assert (state.tp.rank, state.tp.world_size) == (0, 1)
    assert (state.pp.rank, state.pp.world_size) == (rank, 2)
    assert state.layout.is_first_stage == (rank == 0)
    assert state.layout.is_output_rank == (rank == 1)
    assert state.layout.stage_layers(5) == (range(3) if rank == 0 else range(3, 5))
    hidden = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    if rank == 0:  # stage 0 -> stage 1 (activations)
        state.pp.send(hidden, dst=1)
        tokens = state.pp.recv(torch.zeros(2, dtype=torch.int64), src=1)
        assert tokens.tolist() == [7, 9]
    else:  # stage 1 -> stage 0 (sampled tokens back to the first stage)
        got = state.pp.recv(torch.zeros(3, 4, dtype=torch.float64), src=0)
        assert torch.equal(got, hidden)
        state.pp.send(torch.tensor([7, 9]), dst=0)
    assert torch.equal(state.pp.broadcast(torch.full((2,), float(rank)), src=1),
                       torch.ones(2))
    x = torch.ones(2)
    assert state.tp.all_reduce(x) is x  # one rank per stage: TP is the identity
    state.pp.barrier()


def _worker(rank: int, port: int, tp: int, pp: int) -> None:
    torch.set_num_threads(1)
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank)
    state = init_parallel_state(GlooCommunicator, layout, f"tcp://127.0.0.1:{port}",
                                timeout_s=60)
    try:
        assert isinstance(state.tp, GlooCommunicator) and isinstance(state.pp, GlooCommunicator)
        (_check_tp2 if tp == 2 else _check_pp2)(state, rank)
    finally:
        destroy_parallel_state()
    import torch.distributed as dist

    assert not dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_init_parallel_state_two_ranks(tp, pp):
    mp.start_processes(_worker, args=(_free_port(), tp, pp), nprocs=WORLD, start_method="fork")
