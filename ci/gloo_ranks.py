"""Run a measurement on two local gloo ranks (the CI benchmarks' collective timings).

``on_two_ranks(worker, *args)`` spawns two processes, joins them in a gloo group on a free
port, calls ``worker(comm, *args)`` on each (one torch thread, like a worker rank) and
returns rank 0's result. ``communicator="shm"`` wraps the group in the CPU plugin's
shared-memory communicator instead of plain gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _rank(rank: int, port: int, worker: Callable[..., Any], args: tuple, queue: Any,
          communicator: str = "gloo") -> None:
    import torch

    from engine.distributed import GlooCommunicator

    torch.set_num_threads(1)
    cls = GlooCommunicator
    if communicator == "shm":
        from engine.plugins.cpu.shm_communicator import ShmCommunicator

        cls = ShmCommunicator
    comm = cls.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    if communicator == "shm" and not comm.uses_shared_memory:
        raise RuntimeError("the shared-memory communicator fell back to gloo (no C kernels?)")
    try:
        result = worker(comm, *args)
        if rank == 0:
            queue.put(result)
    finally:
        from engine.distributed.parallel_state import destroy_parallel_state

        destroy_parallel_state()


def on_two_ranks(worker: Callable[..., Any], *args: Any, timeout_s: float = 120,
                 communicator: str = "gloo") -> Any:
    import torch.multiprocessing as mp

    from engine.model_executor.multiproc_executor import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, worker, args, queue, communicator))
             for r in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=timeout_s)
    for proc in procs:
        proc.join()
    return result
