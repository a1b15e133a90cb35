"""TorchDistributedCommunicator on a real two-rank gloo process group.

Each rank holds ``base * (rank + 1) + rank`` in float64, so every collective has an exact
reference computed locally from all ranks' inputs.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.core.interfaces import Communicator
from engine.distributed import (
    GlooCommunicator,
    NcclCommunicator,
    TorchDistributedCommunicator,
    XcclCommunicator,
)

WORLD = 2


def _rank_tensor(rank: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * (rank + 1) + rank


class _NativeGloo(GlooCommunicator):
    """gloo through the single-tensor ops the NCCL/xccl paths use."""

    native_tensor_collectives = True


def _assert_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact comparison (float64 sums of small integers); cheaper than torch.testing."""
    assert got.shape == expected.shape and torch.equal(got, expected), (got, expected)


def _check_collectives(comm: TorchDistributedCommunicator) -> None:
    rank = comm.rank
    inputs = [_rank_tensor(r) for r in range(WORLD)]
    total = sum(inputs)
    mine = inputs[rank]

    _assert_equal(comm.all_reduce(mine.clone()), total)
    for dim in (0, 1, -1):
        expected = torch.cat(inputs, dim=dim)
        _assert_equal(comm.all_gather(mine, dim=dim), expected)
    for dim in (0, -1):
        size = total.shape[dim] // WORLD
        expected = total.narrow(dim, rank * size, size)
        _assert_equal(comm.reduce_scatter(mine, dim=dim), expected)
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(mine, dim=1)  # 3 rows over 2 ranks

    got = comm.broadcast(mine.clone(), src=1)
    _assert_equal(got, inputs[1])

    if rank == 0:
        comm.send(mine, dst=1)
    else:
        received = comm.recv(torch.empty_like(mine), src=0)
        _assert_equal(received, inputs[0])
    comm.barrier()


class _PortableAllToAll(GlooCommunicator):
    """The Communicator interface's portable all_to_all (all-gather based), which a
    communicator without a native one inherits."""

    all_to_all = Communicator.all_to_all


def _check_all_to_all(comm: TorchDistributedCommunicator) -> None:
    """Rank r sends ``counts[r][j]`` rows (valued 100 r + j) to rank j, a zero split
    included; every rank gets exactly the rows addressed to it, in rank order."""
    counts = [[1, 0], [3, 2]]  # counts[src][dst]
    rank = comm.rank
    send = torch.cat([torch.full((counts[rank][j], 3), 100.0 * rank + j, dtype=torch.float64)
                      for j in range(WORLD)])
    got = comm.all_to_all(send, counts[rank], [counts[src][rank] for src in range(WORLD)])
    expected = torch.cat([torch.full((counts[src][rank], 3), 100.0 * src + rank,
                                     dtype=torch.float64) for src in range(WORLD)])
    _assert_equal(got, expected)


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    comm = GlooCommunicator.init_process_group(
        rank, WORLD, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60
    )
    try:
        assert dist.get_backend() == "gloo"
        _check_collectives(comm)
        _check_collectives(_NativeGloo(rank, WORLD))
        _check_all_to_all(comm)
        _check_all_to_all(_PortableAllToAll(rank, WORLD))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_collectives_match_reference() -> None:
    # fork: the ranks inherit the imported torch instead of paying for it again.
    mp.start_processes(_worker, args=(_free_port(),), nprocs=WORLD, start_method="fork")


def test_single_rank_is_identity_without_process_group() -> None:
    comm = GlooCommunicator(rank=0, world_size=1)
    x = _rank_tensor(0)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x, dim=1) is x
    assert comm.reduce_scatter(x, dim=0) is x
    assert comm.broadcast(x) is x
    comm.barrier()


def test_for_backend_names_the_torch_backend() -> None:
    assert TorchDistributedCommunicator.for_backend("gloo") is GlooCommunicator
    assert TorchDistributedCommunicator.for_backend("nccl") is NcclCommunicator
    assert TorchDistributedCommunicator.for_backend("xccl") is XcclCommunicator
    other = TorchDistributedCommunicator.for_backend("mybackend")
    assert other.backend == "mybackend"
    assert TorchDistributedCommunicator.for_backend("mybackend") is other
    with pytest.raises(ValueError, match="backend name"):
        TorchDistributedCommunicator.for_backend("")


def test_bad_ranks_are_rejected() -> None:
    with pytest.raises(ValueError, match="outside a world of 2"):
        GlooCommunicator.init_process_group(rank=2, world_size=2)
    with pytest.raises(ValueError, match="outside a group of 2"):
        GlooCommunicator(rank=0, world_size=2).send(torch.zeros(1), dst=5)
