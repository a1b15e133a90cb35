"""Real `engine serve` subprocesses on 127.0.0.1 for the OpenAI server tests.

Each server is started with ``python -m engine.cli serve <tiny model> ...`` and waited on
through ``/health``. Stopping it sends SIGTERM (the graceful path) and checks that both
the server and its engine-core child are gone: no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 180.0
SERVED_NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def child_pids(parent: int, marker: str) -> list[int]:
    """Children of ``parent`` whose command line contains ``marker`` (reads /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


class ServerProcess:
    """One `engine serve` subprocess."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: list[str],
                 num_cores: int = 1) -> None:
        self.num_cores = num_cores  # engine-core processes (data parallelism: one a rank)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "engine.cli", "serve", str(model_dir),
            "--device", "cpu", "--dtype", "float32", "--port", str(self.port),
            "--max-model-len", "256", "--kv-cache-space", "0.05",
            "--served-model-name", SERVED_NAME, "--disable-uvicorn-access-log",
            *extra_args,
        ]
        env = dict(os.environ, ENGINE_API_KEY="")
        self._log = open(log_path, "wb")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.core_pid: int | None = None
        self.core_pids: list[int] = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    cores = child_pids(self.proc.pid, "engine.core.core_proc")
                    assert len(cores) == self.num_cores, cores
                    self.core_pid, self.core_pids = cores[0], cores
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM, wait; return the exit code (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server ignored SIGTERM for 30 s:\n{self.log()}")
        self._log.close()
        return self.proc.returncode

    def assert_no_orphans(self) -> None:
        assert self.core_pid is not None
        deadline = time.monotonic() + 10
        while any(map(_alive, self.core_pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, self.core_pids)), "engine core outlived the server"


@pytest.fixture(scope="module")
def start_server(llama_dir, tmp_path_factory):
    """``start_server(*extra_args) -> ServerProcess`` (ready); stopped at module end."""
    servers: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(llama_dir, log_path, list(extra_args))
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
        server.assert_no_orphans()
        assert "Traceback" not in server.log(), server.log()  # no unexpected errors
