"""``--distributed-executor-backend mp``: one local process per rank.

Each rank is ``python -m engine.model_executor.worker_proc`` reading its
:class:`~engine.model_executor.worker_proc.WorkerSpec` on stdin; torch.distributed meets
at a free port of 127.0.0.1. The processes are the executor's children: a rank that exits
is seen at once (its return code), and the ranks exit by themselves if the executor's
process dies (they watch their parent).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

from engine.model_executor.worker_group import WorkerGroupExecutor

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
_STOP_GRACE_S = 3.0


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on right now (torch.distributed's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class MultiprocExecutor(WorkerGroupExecutor):
    backend_name = "mp"

    def __init__(self, config, platform) -> None:
        self._procs: list[subprocess.Popen] = []
        super().__init__(config, platform, LOCALHOST)

    def _launch(self) -> None:
        procs = self._procs
        self._on_release(lambda graceful: stop_processes(procs, graceful))
        init_method = f"tcp://{LOCALHOST}:{free_port()}"
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on loopback
        for rank in range(self.world_size):
            # Data-parallel replicas on this machine take consecutive slots (devices, CPUs).
            local_rank, local_world_size = self.config.parallel.node_share(rank)
            spec = self.worker_spec(rank, init_method, local_rank=local_rank,
                                    local_world_size=local_world_size, parent_pid=os.getpid())
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.model_executor.worker_proc"],
                stdin=subprocess.PIPE, env=env,
            )
            proc.stdin.write(spec_json(spec))
            proc.stdin.close()
            self._procs.append(proc)

    def _ended_ranks(self) -> list[tuple[int, str, bool]]:
        ended = []
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                ended.append((rank, f"(pid {proc.pid}) {how}", code != 0))
        return ended



def stop_processes(procs: list[subprocess.Popen], graceful: bool = True) -> None:
    """Wait briefly for the ranks to quit (``graceful``), then terminate, then kill what
    is left (a stopped process only dies of SIGKILL)."""
    deadline = time.monotonic() + (_STOP_GRACE_S if graceful else 0.0)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=2.0 if graceful else 0.5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spec_json(spec) -> bytes:
    import msgspec

    return msgspec.json.encode(spec)
