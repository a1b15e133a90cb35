"""The shared-memory communicator (csrc/shm_comm.c, engine.plugins.cpu.shm_communicator)
on real ranks: exact results against a rank-order float32 reference (and a float64 one),
chunking (a 4 KiB slot makes most tensors span several steps), every ISA level this CPU
runs, thousands of back-to-back collectives, uneven all_to_all against gloo's, and failures that must raise, not hang: a
peer that diverges, one that is late past the timeout, one that dies mid-collective.

Rank start-up costs seconds, so each world runs many checks (two worlds in all).
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from engine.plugins.cpu.shm_segment import CollectiveError
from tests.plugins.cpu.conftest import LEVELS, kernels_of

SLOT_BYTES = 4096  # 1024 float32 per rank and step: most tensors below are chunked
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rank_main(rank: int, world: int, port: int, body: Callable, env: dict[str, str],
               results: Any) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    comm = ShmCommunicator.init_process_group(rank, world, f"tcp://127.0.0.1:{port}",
                                              timeout_s=60)
    try:
        results.put((rank, "ok", body(comm, rank, world)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, rank named
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def _on_ranks(body: Callable, world: int, env: dict[str, str], expected: int,
              timeout_s: float = 90) -> dict[int, tuple[str, Any]]:
    """Run ``body(comm, rank, world)`` on ``world`` ranks; the results of the
    ``expected`` ranks that report (a rank that dies on purpose does not)."""
    from engine.model_executor.multiproc_executor import free_port

    for level in LEVELS:  # build each level once here, not in every rank at once
        kernels_of(level)
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    env = {"ENGINE_CPU_SHM_SLOT_BYTES": str(SLOT_BYTES), **env}
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, body, env, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    out: dict[int, tuple[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < expected:
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = (status, value)
    except queue_mod.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(out))} hung (results: {out})")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s deterministic input (every rank can rebuild its peers')."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def _rank_order_sum(world: int, shape: tuple[int, ...], dtype: torch.dtype,
                    seed: int) -> torch.Tensor:
    """The sum as the C code defines it: float32, rank 0 first, rounded once."""
    total = _data(0, shape, dtype, seed).float()
    for r in range(1, world):
        total = total + _data(r, shape, dtype, seed).float()
    return total.to(dtype)


def _check_all_reduce(comm, rank: int, world: int) -> None:
    for seed, dtype in enumerate(DTYPES):
        for numel in (1, 7, 1023, 1025, 5000, 10007):  # uneven, one slot, several slots
            x = _data(rank, (numel,), dtype, seed * 100 + numel)
            got = comm.all_reduce(x)
            assert got is x
            want = _rank_order_sum(world, (numel,), dtype, seed * 100 + numel)
            assert torch.equal(got, want), (dtype, numel)  # bit-identical on every rank
            exact = sum(_data(r, (numel,), dtype, seed * 100 + numel).double()
                        for r in range(world))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    # A non-contiguous view is reduced in place all the same.
    base = _data(rank, (40, 30), torch.float32, 7)
    view = base.t()
    comm.all_reduce(view)
    assert torch.equal(base, _rank_order_sum(world, (40, 30), torch.float32, 7))
    # Other dtypes go through gloo.
    ints = torch.full((5,), rank + 1, dtype=torch.int64)
    assert torch.equal(comm.all_reduce(ints), torch.full((5,), world * (world + 1) // 2))


def _check_gather_scatter_broadcast(comm, rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((3, 5, 7), (10, 300)):  # the second: rows split across steps
            for dim in range(-1, len(shape)):
                mine = _data(rank, shape, dtype, 11)
                got = comm.all_gather(mine, dim=dim)
                want = torch.cat([_data(r, shape, dtype, 11) for r in range(world)], dim=dim)
                assert torch.equal(got, want), (dtype, shape, dim)
    noncontig = _data(rank, (6, 4), torch.float32, 12).t()
    assert torch.equal(comm.all_gather(noncontig, dim=0),
                       torch.cat([_data(r, (6, 4), torch.float32, 12).t()
                                  for r in range(world)], dim=0))
    full = _data(rank, (2 * world, 3000), torch.float32, 13)
    part = comm.reduce_scatter(full, dim=0)
    assert torch.equal(part, _rank_order_sum(world, (2 * world, 3000), torch.float32, 13)
                       [2 * rank: 2 * rank + 2])
    for src in range(world):
        sent = _data(src, (3000,), torch.int64, 14)
        buf = sent.clone() if rank == src else torch.zeros(3000, dtype=torch.int64)
        assert torch.equal(comm.broadcast(buf, src=src), sent)
    comm.barrier()
    # all_to_all with uneven counts (through gloo): rank r sends j + 1 rows to rank j.
    send = [j + 1 for j in range(world)]
    rows = torch.arange(sum(send), dtype=torch.float32) + 100 * rank
    got = comm.all_to_all(rows.unsqueeze(1), send, [rank + 1] * world)
    starts = [sum(send[:rank])] * world
    want = torch.cat([torch.arange(starts[j], starts[j] + rank + 1, dtype=torch.float32)
                      + 100 * j for j in range(world)])
    assert torch.equal(got.squeeze(1), want)


def _check_back_to_back(comm, rank: int, world: int) -> None:
    """No lost wake-up: thousands of small collectives, each one checked."""
    x = torch.empty(16)
    for i in range(3000):
        x.fill_(rank + i)
        comm.all_reduce(x)
        assert float(x[0]) == world * i + world * (world - 1) / 2, i


def _rows_for(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n`` rows rank ``src`` sends rank ``dst`` (values name both)."""
    return (torch.arange(n * 7).reshape(n, 7) + 1000 * src + 100 * dst).to(dtype)


def _check_all_to_all(comm, rank: int, world: int) -> None:
    """Uneven rows (rank r sends (r + 1 + j) * 150 rows of 7 values to rank j, rank 1
    none to rank 0): most exchanges span several 4 KiB slots; the same rows as gloo's."""
    from engine.distributed import GlooCommunicator

    def count(src: int, dst: int) -> int:
        return 0 if (src, dst) == (1, 0) else (src + 1 + dst) * 150

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        send = [count(rank, j) for j in range(world)]
        recv = [count(j, rank) for j in range(world)]
        rows = torch.cat([_rows_for(rank, j, send[j], dtype) for j in range(world)])
        got = comm.all_to_all(rows, send, recv)
        want = torch.cat([_rows_for(j, rank, recv[j], dtype) for j in range(world)])
        assert got.dtype == dtype and torch.equal(got, want), dtype
        assert torch.equal(GlooCommunicator.all_to_all(comm, rows, send, recv), want)
    counts = torch.tensor([rank * 10 + j for j in range(world)])  # MoE's count exchange
    assert comm.all_to_all(counts, [1] * world, [1] * world).tolist() == [
        j * 10 + rank for j in range(world)]


def _collectives(comm, rank: int, world: int) -> list[str]:
    from engine.core.plugins import current_platform
    from engine.distributed.parallel_state import ParallelLayout, init_parallel_state
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    assert comm.uses_shared_memory
    _check_all_reduce(comm, rank, world)
    _check_gather_scatter_broadcast(comm, rank, world)
    _check_back_to_back(comm, rank, world)
    _check_all_to_all(comm, rank, world)
    levels = []
    for level in LEVELS:  # every build of the C code this CPU runs
        per_level = ShmCommunicator(rank, world, isa_level=level)
        assert per_level.uses_shared_memory
        for dtype in DTYPES:
            x = _data(rank, (3001,), dtype, 21)
            assert torch.equal(per_level.all_reduce(x), _rank_order_sum(world, (3001,), dtype, 21))
        assert torch.equal(per_level.all_gather(_data(rank, (5, 700), torch.bfloat16, 22), 1),
                           torch.cat([_data(r, (5, 700), torch.bfloat16, 22)
                                      for r in range(world)], 1))
        _check_all_to_all(per_level, rank, world)
        levels.append(level)
    # The platform's choice, through init_parallel_state (the world is already joined).
    state = init_parallel_state(current_platform().communicator_cls(),
                                ParallelLayout(tensor_parallel_size=world, rank=rank))
    assert isinstance(state.tp, ShmCommunicator) and state.tp.uses_shared_memory
    ones = torch.ones(4)
    assert torch.equal(state.tp.all_reduce(ones), torch.full((4,), float(world)))
    # Ranks that run different collectives raise instead of mixing their bytes.
    diverged = ShmCommunicator(rank, world)
    with pytest.raises(CollectiveError, match="diverged"):
        diverged.all_reduce(torch.ones(10 + rank))
    with pytest.raises(CollectiveError, match="broken"):
        diverged.all_reduce(torch.ones(4))
    # An all_to_all whose counts the ranks disagree on: rank 0 expects one row more from
    # rank 2 than it sends; rank 0 raises after the last round, the others finish.
    uneven = ShmCommunicator(rank, world)
    send, recv = [700] * world, [700] * world
    if rank == 0:
        recv[2] = 701
    rows = torch.zeros(700 * world, 3)
    if rank == 0:
        with pytest.raises(CollectiveError, match="rank 2 runs a different collective"):
            uneven.all_to_all(rows, send, recv)
    else:
        assert uneven.all_to_all(rows, send, recv).shape == (700 * world, 3)
    return levels


def test_collectives_on_three_ranks_every_level():
    results = _on_ranks(_collectives, world=3, env={}, expected=3)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value == LEVELS


def _late_then_dead(comm, rank: int, world: int) -> dict[str, Any]:
    """Rank 2 is late past the others' timeout, then dies inside a collective."""
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    assert comm.uses_shared_memory
    comm.all_reduce(torch.ones(8))
    seen: dict[str, Any] = {}
    if rank == 2:
        time.sleep(2.0)
    else:
        start = time.monotonic()
        with pytest.raises(CollectiveError, match="did not arrive within 0.5 s") as late:
            comm.all_reduce(torch.ones(8))
        seen["late"] = (time.monotonic() - start, str(late.value))
    fresh = ShmCommunicator(rank, world)  # a new segment: the first one is broken
    for _ in range(5):
        fresh.all_reduce(torch.ones(100_000))  # several steps each
    replay = _graph_of_a_sharded_lookup(fresh, rank, world)
    if rank == 2:
        os._exit(3)  # dies while the others wait for it
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 2 died") as dead:
        fresh.all_reduce(torch.ones(100_000))
    seen["dead"] = (time.monotonic() - start, str(dead.value))
    # A replayed graph's all-reduce fails the same way (the error names the dead rank).
    with pytest.raises(CollectiveError, match="broken|rank 2 died"):
        replay()
    return seen


def _graph_of_a_sharded_lookup(comm, rank: int, world: int) -> Callable[[], torch.Tensor]:
    """A tensor-parallel embedding (this rank's rows, then the all-reduce) captured as a
    forward graph: its replays meet the other ranks in the recorded all-reduce and give
    the whole table's rows; a collective the graph cannot replay is refused at capture,
    without running. Returns a replay."""
    from engine.core.interfaces import GraphCaptureError
    from engine.plugins.cpu.graphs import CPUGraphCapturer
    from engine.plugins.cpu.native import load_kernels
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    kernels = load_kernels()
    vocab, hidden, rows = 37, 24, -(-37 // world)
    table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(5))
    start = min(rank * rows, vocab)
    num_real = max(0, min(rows, vocab - start))
    shard = torch.zeros(rows, hidden)
    shard[:num_real] = table[start : start + num_real]
    ids = torch.zeros(6, dtype=torch.int64)
    capturer = CPUGraphCapturer(kernels)
    unset, four = ShmCommunicator(rank, world), torch.ones(4)  # its segment: not made yet
    with pytest.raises(GraphCaptureError, match="first collective"):
        capturer.capture(lambda: unset.all_reduce(four))  # no gloo traffic in a capture
    with pytest.raises(GraphCaptureError, match="shm_comm_all_gather"):
        capturer.capture(lambda: comm.all_gather(shard, 0))
    graph = capturer.capture(lambda: comm.all_reduce(
        kernels.embedding_shard(ids, shard, start, num_real, vocab)))
    for step in range(3):
        ids.copy_(torch.tensor([0, vocab - 1, 5 + step, rows, rows - 1, 2 * step]))
        assert torch.equal(graph.replay(), table[ids]), (rank, step)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # before any peer waits
        ids[0] = vocab
        graph.replay()
    ids[0] = 0
    return graph.replay


def test_late_and_dead_peers_raise_quickly():
    results = _on_ranks(_late_then_dead, world=3, env={"ENGINE_CPU_SHM_TIMEOUT_S": "0.5"},
                        expected=2)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["late"][0] < 1.5, value
        assert value["dead"][0] < 2.0, value  # liveness checks run every 5 ms of waiting


def test_platform_choice(monkeypatch):
    from engine.distributed import GlooCommunicator
    from engine.plugins.cpu.platform import CPUPlatform
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    platform = CPUPlatform()
    monkeypatch.setenv("ENGINE_CPU_COMMUNICATOR", "gloo")
    assert platform.communicator_cls() is GlooCommunicator
    monkeypatch.setenv("ENGINE_CPU_COMMUNICATOR", "shm")
    assert platform.communicator_cls() is ShmCommunicator
    monkeypatch.setenv("ENGINE_CPU_NATIVE_KERNELS", "0")
    assert platform.communicator_cls() is GlooCommunicator
    monkeypatch.setenv("ENGINE_CPU_COMMUNICATOR", "nccl")
    with pytest.raises(ValueError, match="expected auto, shm or gloo"):
        platform.communicator_cls()


def test_single_rank_is_the_identity_and_bad_slots_are_refused(monkeypatch):
    from engine.plugins.cpu.shm_communicator import ShmCommunicator, slot_bytes_setting

    comm = ShmCommunicator(0, 1)
    x = torch.ones(3)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x
    comm.barrier()
    monkeypatch.setenv("ENGINE_CPU_SHM_SLOT_BYTES", "100")
    assert slot_bytes_setting() == 128
    monkeypatch.setenv("ENGINE_CPU_SHM_SLOT_BYTES", "-1")
    with pytest.raises(ValueError, match="positive number of bytes"):
        slot_bytes_setting()
