"""Which data-parallel ranks run on which node, and the rules the flags must follow.

One place for the checks so ``EngineArgs`` (the CLI's errors) and ``ParallelConfig`` (a
config built by hand, or received by a headless node) refuse the same things the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default


def check_placement(size: int, size_local: int | None, start_rank: int,
                    address: str | None, backend: str, headless: bool | None = None) -> None:
    """ValueError naming the flag when the data-parallel layout cannot run. ``headless``
    None (a config, whose node role is not known): only the rules every node shares."""
    if backend == "ray":
        if size_local is not None or start_rank or headless:
            raise ValueError(
                "--data-parallel-backend ray places every rank itself (one Ray actor per "
                "rank, on the node Ray picks): leave out --data-parallel-size-local, "
                "--data-parallel-start-rank and --headless, and start only the head")
        return
    if headless:
        if not address:
            raise ValueError("--headless needs --data-parallel-address (the head node's "
                             "address, where its --data-parallel-rpc-port listens)")
        if size_local is None:
            raise ValueError("--headless needs --data-parallel-size-local (the ranks this "
                             "node runs)")
        if start_rank == 0:
            raise ValueError("--headless needs --data-parallel-start-rank >= 1: rank 0 runs "
                             "on the head node, with the API server")
    local = size if size_local is None else size_local
    if start_rank + local > size:
        raise ValueError(
            f"--data-parallel-start-rank ({start_rank}) + --data-parallel-size-local "
            f"({local}) is more than --data-parallel-size ({size}): this node's ranks "
            f"{start_rank}..{start_rank + local - 1} do not exist")
    if headless is None or headless:
        return
    if start_rank:
        raise ValueError(
            f"--data-parallel-start-rank {start_rank} without --headless: the head node "
            "(the one with the API server) runs ranks from 0; other nodes run --headless")
    if local < size and not address:
        raise ValueError(
            f"--data-parallel-size-local ({local}) < --data-parallel-size ({size}): ranks "
            f"{local}..{size - 1} run on other nodes, which register with this head at "
            "--data-parallel-address (this node's address they can reach) and "
            "--data-parallel-rpc-port")


@dataclass(frozen=True)
class NodePlan:
    """The ranks this node starts and the ranks other nodes bring (the head's view)."""

    local_ranks: tuple[int, ...]
    remote_ranks: tuple[int, ...]

    @property
    def multi_node(self) -> bool:
        return bool(self.remote_ranks)


def node_plan(size: int, size_local: int | None, start_rank: int, backend: str) -> NodePlan:
    """The head's ranks (``start_rank`` .. + ``size_local``) and everyone else's; with
    Ray every rank is placed by Ray, so none is started here as a plain process."""
    if backend == "ray":
        return NodePlan((), tuple(range(size)))
    local = size if size_local is None else size_local
    mine = tuple(range(start_rank, start_rank + local))
    return NodePlan(mine, tuple(r for r in range(size) if r not in mine))
