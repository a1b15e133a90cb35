"""The Communicator contract (``engine.core.interfaces.communicator``) on 2 real ranks.

Each rank holds small integers (exact in float32 and float64), so every collective has
an exact reference. Clauses: ``[comm.init]`` communicator_cls().init_process_group;
``[comm.all_reduce]``, ``[comm.all_gather]``, ``[comm.reduce_scatter]``,
``[comm.broadcast]``, ``[comm.send_recv]``, ``[comm.all_to_all]``, ``[comm.barrier]``.
"""

from __future__ import annotations

import socket

import pytest
import torch

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_tensor(rank: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1) + rank


def _eq(clause: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.cpu()
    assert got.shape == expected.shape and torch.equal(got, expected), (
        f"{clause} rank result {got.tolist()} != expected {expected.tolist()}")


def _worker(rank: int, platform_name: str, port: int) -> None:
    import torch.distributed as dist

    from engine.core.plugins import resolve_platform

    torch.set_num_threads(1)
    platform = resolve_platform(platform_name)
    if platform.device_type != "cpu":
        platform.bind_worker(rank, WORLD)
    device = platform.device(rank if platform.device_type != "cpu" else 0)
    comm = platform.communicator_cls().init_process_group(
        rank, WORLD, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        inputs = [_rank_tensor(r) for r in range(WORLD)]
        total = sum(inputs)
        mine = inputs[rank].to(device)
        _eq("[comm.all_reduce]", comm.all_reduce(mine.clone()), total)
        for dim in (0, -1):
            _eq(f"[comm.all_gather] dim {dim}", comm.all_gather(mine, dim=dim),
                torch.cat(inputs, dim=dim))
            size = total.shape[dim] // WORLD
            _eq(f"[comm.reduce_scatter] dim {dim}", comm.reduce_scatter(mine, dim=dim),
                total.narrow(dim, rank * size, size))
        _eq("[comm.broadcast]", comm.broadcast(mine.clone(), src=1), inputs[1])
        if rank == 0:
            comm.send(mine, dst=1)
        else:
            _eq("[comm.send_recv]", comm.recv(torch.empty_like(mine), src=0), inputs[0])
        # all_to_all: rank r sends (r + 1 + j) rows to rank j.
        send = [rank + 1 + j for j in range(WORLD)]
        recv = [j + 1 + rank for j in range(WORLD)]
        rows = torch.arange(sum(send) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * rank
        got = comm.all_to_all(rows.to(device), send, recv)
        expected = []
        for j in range(WORLD):
            theirs = torch.arange(sum(j + 1 + k for k in range(WORLD)) * 3,
                                  dtype=torch.float32).reshape(-1, 3) + 100 * j
            start = sum(j + 1 + k for k in range(rank))
            expected.append(theirs[start:start + j + 1 + rank])
        _eq("[comm.all_to_all]", got, torch.cat(expected))
        comm.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _device_count(platform) -> int:
    if platform.device_type == "cpu":
        return WORLD
    module = getattr(torch, platform.device_type, None)
    count = getattr(module, "device_count", None)
    return int(count()) if count is not None else 0


@pytest.mark.conformance("comm.init", "comm.all_reduce", "comm.all_gather",
                         "comm.reduce_scatter", "comm.broadcast", "comm.send_recv",
                         "comm.all_to_all", "comm.barrier")
@pytest.mark.multi_device
def test_collectives_on_two_ranks(engine_platform, engine_platform_name):
    """[comm.*] all_reduce, all_gather, reduce_scatter, broadcast, send/recv, all_to_all
    and barrier on 2 ranks started with communicator_cls().init_process_group."""
    import torch.multiprocessing as mp

    comm_cls = engine_platform.communicator_cls()
    if not hasattr(comm_cls, "init_process_group"):
        pytest.skip(f"[comm.init] {comm_cls.__name__} has no init_process_group to start "
                    "a process group with")
    count = _device_count(engine_platform)
    if count < WORLD:
        pytest.skip(f"needs {WORLD} {engine_platform.device_type} devices, found {count}")
    # fork for the host platform (inherits the imported torch); spawn for device runtimes.
    method = "fork" if engine_platform.device_type == "cpu" else "spawn"
    mp.start_processes(_worker, args=(engine_platform_name, _free_port()), nprocs=WORLD,
                       start_method=method)
