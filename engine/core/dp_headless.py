"""A node's launcher of data-parallel ranks for a head elsewhere (``engine serve
--headless``, or a Ray actor on the node Ray picked).

It registers with the head (:mod:`engine.core.dp_handshake`), starts one core process per
rank it was welcomed for (config and ``endpoints.json`` with the head's tcp addresses in
each core's run dir, this launcher as the core's parent), then supervises: a core that
ends is reported to the head at once; the head's Goodbye or silence, SIGTERM/SIGINT, or
the launcher's own parent going away (a Ray actor) stops every core. Cores exit by
themselves when the launcher dies (their parent check), so no core outlives it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.core_endpoints import ClientEndpoint, EndpointsFile
from engine.core.core_proc import CONFIG_FILE
from engine.core.dp_handshake import NodeLink, RankExited, Register, Welcome
from engine.core.mp_client import SHUTDOWN_TIMEOUT_S, _child_env, _describe_exit

logger = logging.getLogger(__name__)

SUPERVISE_S = 0.1


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


class RankLauncher:
    """This node's core processes, one per welcomed rank."""

    def __init__(self, welcome: Welcome) -> None:
        base = EngineConfig.model_validate_json(welcome.config_json)
        self.root = Path(tempfile.mkdtemp(prefix="engine-dp-node-"))
        self.procs: dict[int, subprocess.Popen] = {}
        # This node's slots (node_share: devices, CPUs) count from its own first rank.
        node = {"data_parallel_backend": "mp",
                "data_parallel_size_local": len(welcome.ranks),
                "data_parallel_start_rank": min(r.rank for r in welcome.ranks)}
        for rank_addr in welcome.ranks:
            parallel = base.parallel.model_copy(
                update={**node, "data_parallel_rank": rank_addr.rank})
            config = base.model_copy(update={"parallel": parallel})
            run_dir = self.root / f"rank{rank_addr.rank}"
            run_dir.mkdir()
            (run_dir / CONFIG_FILE).write_text(config.model_dump_json())
            EndpointsFile(clients=[ClientEndpoint(input=rank_addr.input,
                                                  output=rank_addr.output)]).write(run_dir)
            self.procs[rank_addr.rank] = subprocess.Popen(
                [sys.executable, "-m", "engine.core.core_proc", "--run-dir", str(run_dir),
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, env=_child_env(config))
            logger.info("started data-parallel rank %d (pid %d) for %s", rank_addr.rank,
                        self.procs[rank_addr.rank].pid, rank_addr.input)
        self._reported: set[int] = set()

    def newly_exited(self) -> list[RankExited]:
        """Cores that ended since the last call."""
        exited = []
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and rank not in self._reported:
                self._reported.add(rank)
                exited.append(RankExited(rank, f"exited with {_describe_exit(code)}"))
        return exited

    def all_exited(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs.values())

    def stop(self) -> None:
        """SIGTERM every core, SIGKILL after the grace period, remove the run dirs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def run_node(address: str, rpc_port: int, data_parallel_size: int, start_rank: int,
             size_local: int, parent_pid: int | None = None) -> int:
    """Register, run the cores until the head goes or every core ended; exit code."""
    link = NodeLink(address, rpc_port)
    launcher = None
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        welcome = link.register(Register(data_parallel_size, start_rank, size_local,
                                         socket.gethostname(), os.getpid()))
        launcher = RankLauncher(welcome)
        while True:
            why = link.tick(launcher.newly_exited())
            if why is not None:
                logger.info("stopping this node's data-parallel ranks: %s", why)
                return 0
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.info("the launcher's parent is gone: stopping its ranks")
                return 1
            if launcher.all_exited():
                link.tick(launcher.newly_exited())
                logger.error("every data-parallel rank on this node has exited")
                return 1
            time.sleep(SUPERVISE_S)
    except _Stop as why:
        logger.info("stopping this node's data-parallel ranks (%s)", why)
        return 0
    finally:
        for sig in previous:  # a second SIGTERM must not cut the cores' cleanup short
            signal.signal(sig, signal.SIG_IGN)
        if launcher is not None:
            launcher.stop()
        link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.core.dp_headless`` (what a Ray rank actor starts)."""
    parser = argparse.ArgumentParser(description="data-parallel ranks for a remote head")
    parser.add_argument("--address", required=True)
    parser.add_argument("--rpc-port", required=True, type=int)
    parser.add_argument("--data-parallel-size", required=True, type=int)
    parser.add_argument("--start-rank", required=True, type=int)
    parser.add_argument("--size-local", required=True, type=int)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ENGINE_LOG_LEVEL", "INFO").upper(),
                        format=f"(DPNode pid={os.getpid()}) %(levelname)s %(name)s: "
                               "%(message)s", stream=sys.stderr)
    return run_node(args.address, args.rpc_port, args.data_parallel_size, args.start_rank,
                    args.size_local, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
