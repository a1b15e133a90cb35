"""`engine serve --api-server-count K`: K API server processes on one port, over shared
engine cores, so tokenization, detokenization and HTTP are not bound to one Python process.

The launcher (:func:`run_api_server_group`, the ``engine serve`` process):

1. binds the listening socket once (so a taken port fails before any model loads) and
   hands its fd to every server: one accept queue, the kernel gives each connection to a
   server that is waiting in accept, and a dead server loses no queued connection (with
   SO_REUSEPORT each process would get its own hashed queue, dropped when it dies);
2. starts K servers (``python -m engine.entrypoints.openai.api_server_group SPEC``): each
   binds its own input/output ZeroMQ pair for every core (:class:`AttachedCore`) and runs
   the ordinary app over an ``AsyncLLM`` on those channels;
3. starts the engine cores (one per data-parallel rank), each with an ``endpoints.json``
   naming the K servers' pairs and pids (:mod:`engine.core.core_endpoints`);
4. watches: a server that exits during startup, or any later with
   ``--api-server-on-failure exit``, stops everything (exit code non-zero); with
   ``continue`` the others serve on (the cores abort the dead one's requests). A core's
   death is each server's to handle (as a single server does). SIGTERM / SIGINT stop the
   servers (graceful), then the cores; nothing outlives the launcher (cores and servers
   watch their parent).

Metrics: the servers share a private ``PROMETHEUS_MULTIPROC_DIR`` (removed at exit), so
``/metrics`` on any of them sums the per-request series over all K; the cores' series are
fetched from the cores once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from engine.core.config import EngineConfig
from engine.core.core_endpoints import ClientEndpoint, EndpointsFile
from engine.core.core_proc import CONFIG_FILE
from engine.core.dp_client import rank_config, with_rendezvous_port
from engine.core.mp_client import _child_env, _describe_exit, _ipc_temp_root
from engine.entrypoints.openai.metrics import MULTIPROC_ENV
from engine.entrypoints.openai.serving_base import ServerSettings

logger = logging.getLogger("engine.server.group")

OnFailure = Literal["exit", "continue"]
WATCH_S = 0.2  # how often the launcher checks its children
CORE_STOP_S = 5.0  # SIGTERM grace for a core before SIGKILL
SERVER_STOP_EXTRA_S = 15.0  # beyond the servers' own graceful-shutdown time
PARENT_CHECK_S = 1.0  # how often a server checks that the launcher lives


class ApiServerSpec(BaseModel):
    """What one API server process needs (written to a file by the launcher)."""

    index: int
    config_json: str  # the EngineConfig (its data_parallel_rank is set per core)
    cores: list[ClientEndpoint]  # this server's pair on each core, by data-parallel rank
    settings: dict[str, Any]  # ServerSettings' fields
    listen_fd: int
    ready_file: str  # touched once every core answered READY
    parent_pid: int
    log_level: str
    access_log: bool
    timeout_graceful_shutdown: int


@dataclasses.dataclass
class _Child:
    """A process the launcher started."""

    name: str
    process: subprocess.Popen

    def exit_reason(self) -> str | None:
        code = self.process.poll()
        return None if code is None else _describe_exit(code)


class ApiServerGroup:
    """The launcher's children and their run directory."""

    def __init__(self, config: EngineConfig, settings: ServerSettings, count: int, *,
                 log_level: str, access_log: bool, timeout_graceful_shutdown: int) -> None:
        if count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {count}")
        self.count = count
        self.timeout_graceful_shutdown = timeout_graceful_shutdown
        self.run_dir = Path(tempfile.mkdtemp(prefix="engine-api-", dir=_ipc_temp_root()))
        self.metrics_dir = self.run_dir / "prometheus"
        self.metrics_dir.mkdir()
        self.config = with_rendezvous_port(config)
        self.listener = socket.create_server((settings.host, settings.port), backlog=2048)
        self.listener.set_inheritable(True)
        self.servers: list[_Child] = []
        self.cores: list[_Child] = []
        self._settings = dataclasses.asdict(settings)
        self._log_level = log_level
        self._access_log = access_log

    def _pair(self, server: int, rank: int) -> ClientEndpoint:
        base = f"ipc://{self.run_dir}/s{server}r{rank}"
        return ClientEndpoint(input=base + "-in", output=base + "-out")

    # -- start ------------------------------------------------------------------------------
    def start(self) -> None:
        """Servers first (their pids go into the cores' endpoints.json), then the cores;
        a core's READY waits in its socket until the server binds."""
        ranks = range(self.config.parallel.data_parallel_size)
        env = dict(_child_env(self.config), **{MULTIPROC_ENV: str(self.metrics_dir)})
        env.pop("ENGINE_DP_RANK_TAG", None)
        for index in range(self.count):
            spec = ApiServerSpec(
                index=index, config_json=self.config.model_dump_json(),
                cores=[self._pair(index, rank) for rank in ranks], settings=self._settings,
                listen_fd=self.listener.fileno(), ready_file=str(self._ready_file(index)),
                parent_pid=os.getpid(), log_level=self._log_level,
                access_log=self._access_log,
                timeout_graceful_shutdown=self.timeout_graceful_shutdown)
            spec_path = self.run_dir / f"server{index}.json"
            spec_path.write_text(spec.model_dump_json())
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.entrypoints.openai.api_server_group",
                 str(spec_path)],
                stdin=subprocess.DEVNULL, env=env, pass_fds=(self.listener.fileno(),))
            self.servers.append(_Child(f"API server {index} (pid {process.pid})", process))
        for rank in ranks:
            core_config = rank_config(self.config, rank)
            core_dir = self.run_dir / f"core{rank}"
            core_dir.mkdir()
            (core_dir / CONFIG_FILE).write_text(core_config.model_dump_json())
            clients = [self._pair(i, rank).model_copy(update={"pid": s.process.pid})
                       for i, s in enumerate(self.servers)]
            EndpointsFile(clients=clients).write(core_dir)
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.core.core_proc", "--run-dir", str(core_dir),
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, env=_child_env(core_config))
            self.cores.append(_Child(f"engine core {rank} (pid {process.pid})", process))

    def _ready_file(self, index: int) -> Path:
        return self.run_dir / f"server{index}.ready"

    def started(self) -> bool:
        return all(self._ready_file(i).exists() for i in range(self.count))

    # -- watch ------------------------------------------------------------------------------
    def watch(self, on_failure: OnFailure, stop: threading.Event) -> int:
        """Until ``stop`` is set (exit 0) or a failure ends the group; the exit code."""
        gone: set[int] = set()
        while not stop.wait(WATCH_S):
            startup = not self.started()
            for index, server in enumerate(self.servers):
                reason = server.exit_reason()
                if reason is None or index in gone:
                    continue
                gone.add(index)
                code = server.process.returncode or 1
                if startup or on_failure == "exit":
                    logger.error("%s exited with %s; stopping the server (%s)", server.name,
                                 reason, "during startup" if startup
                                 else "--api-server-on-failure exit")
                    return code
                if len(gone) == len(self.servers):
                    logger.error("%s exited with %s; no API server is left", server.name,
                                 reason)
                    return code
                logger.warning("%s exited with %s; %d API server(s) serve on "
                               "(--api-server-on-failure continue)", server.name, reason,
                               len(self.servers) - len(gone))
            if startup:
                for core in self.cores:
                    reason = core.exit_reason()
                    if reason is not None:
                        logger.error("%s exited with %s during startup", core.name, reason)
                        return 1
        return 0

    # -- stop -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Servers first (SIGTERM: they finish or abort in-flight requests), then cores;
        SIGKILL whatever outlives its grace period; remove the run directory."""
        self.listener.close()
        _stop(self.servers, self.timeout_graceful_shutdown + SERVER_STOP_EXTRA_S)
        _stop(self.cores, CORE_STOP_S)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _stop(children: list[_Child], grace_s: float) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %.0f s; killing it", child.name, grace_s)
            child.process.kill()
            child.process.wait()


def run_api_server_group(config: EngineConfig, settings: ServerSettings, count: int, *,
                         on_failure: OnFailure = "exit", log_level: str = "info",
                         access_log: bool = True, timeout_graceful_shutdown: int = 10) -> int:
    """Run K API servers over the cores ``config`` asks for until SIGTERM / SIGINT (exit
    code 0) or a failure (non-zero); see the module docstring."""
    stop = threading.Event()
    group = ApiServerGroup(config, settings, count, log_level=log_level,
                           access_log=access_log,
                           timeout_graceful_shutdown=timeout_graceful_shutdown)
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        group.start()
        logger.info("%d API servers on http://%s:%d over %d engine core(s)", count,
                    settings.host, settings.port, len(group.cores))
        return group.watch(on_failure, stop)
    finally:
        group.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- one API server process -------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """A server whose launcher is gone (SIGKILL) stops itself: no orphans."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def serve_one(spec: ApiServerSpec) -> int:
    """Attach to every core, then serve the app on the shared listening socket."""
    from engine.core.dp_async_client import AsyncDPClient
    from engine.core.mp_client import AsyncMPClient, AttachedCore
    from engine.entrypoints.async_llm import AsyncLLM
    from engine.entrypoints.openai.api_server import run_server

    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True,
                     name="engine-parent-watch").start()
    config = EngineConfig.model_validate_json(spec.config_json)
    clients: list[AsyncMPClient] = []
    try:
        for rank, pair in enumerate(spec.cores):
            channel = AttachedCore(pair.input, pair.output)
            clients.append(AsyncMPClient(rank_config(config, rank), channel=channel))
    except BaseException:
        for client in clients:
            client.shutdown()
        raise
    client = clients[0] if len(clients) == 1 else AsyncDPClient(clients, config)
    engine = AsyncLLM(config, client=client)
    Path(spec.ready_file).touch()
    listener = socket.socket(fileno=spec.listen_fd)
    try:
        return run_server(engine, ServerSettings(**spec.settings), log_level=spec.log_level,
                          access_log=spec.access_log,
                          timeout_graceful_shutdown=spec.timeout_graceful_shutdown,
                          sockets=[listener])
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m engine.entrypoints.openai.api_server_group SPEC")
    spec = ApiServerSpec.model_validate_json(Path(args[0]).read_text())
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"(APIServer{spec.index} pid={os.getpid()}) %(asctime)s %(levelname)s "
               "%(name)s: %(message)s")
    from engine.core.errors import EngineStartupError

    try:
        return serve_one(spec)
    except EngineStartupError as exc:
        logger.error("API server %d could not start: %s", spec.index, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
