"""Clients for an engine core running in its own process (see ``core_proc``).

:class:`CoreProcess` starts the child (``python -m engine.core.core_proc``: a fresh
interpreter, never a fork of a process with torch threads), binds the two ipc sockets in
a private temp dir, waits for READY, and tears everything down on ``shutdown`` or, if
the user forgets, at garbage collection / interpreter exit (``weakref.finalize``). Both
it and :class:`AttachedCore` (a core someone else started: the ``--api-server-count``
launcher, another node) are a :class:`CoreChannel`: the sockets, READY and liveness.

:class:`SyncMPClient` implements the ``EngineCoreClient`` protocol for ``LLMEngine``;
:class:`AsyncMPClient` is the asyncio flavour used by ``AsyncLLM``. Both notice a dead
core (its DEAD message, or the process having exited) within ``POLL_S`` and raise
:class:`EngineDeadError` instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import engine
from engine.core import core_protocol as wire
from engine.core.config import EngineConfig
from engine.core.core_endpoints import pid_alive
from engine.core.core_proc import CONFIG_FILE, DP_RANK_ENV, ipc_addresses
from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.core.errors import EngineDeadError, EngineStartupError

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting client checks that the core process is alive
STARTUP_TIMEOUT_S = float(os.environ.get("ENGINE_CORE_STARTUP_TIMEOUT", "1800"))
SHUTDOWN_TIMEOUT_S = 5.0  # SIGTERM grace period before SIGKILL
_SEND_STALL_S = 5.0  # an alive core with no connected input socket counts as dead after this
_MAX_IPC_PATH = 100  # sun_path holds 108 bytes


# A front end's liveness check of a core it did not start: None while the core lives,
# else why it counts as dead ("process 123 is gone", "no heartbeat for 10 s", ...).
LivenessCheck = Callable[[], "str | None"]


def pid_liveness(pid: int) -> LivenessCheck:
    """A core on this machine lives while its process does (a zombie counts as dead)."""

    def check() -> str | None:
        return None if pid_alive(pid) else f"process {pid} is gone"

    return check


class CoreChannel(ABC):
    """The front end's two sockets to one core (bound here; the core connects), the
    wire encoding, the READY handshake and liveness, without owning the core's process:
    :class:`CoreProcess` spawns its core, :class:`AttachedCore` talks to one started by
    someone else (the ``--api-server-count`` launcher, a remote node)."""

    ready: wire.ReadyInfo

    def __init__(self, input_address: str, output_address: str) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # sends never block while the core lives
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.dead: EngineDeadError | None = None
        try:
            self.input_socket.bind(input_address)
            self.output_socket.bind(output_address)
        except BaseException:
            self._close_sockets()
            raise

    def _close_sockets(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()

    @abstractmethod
    def _exit_reason(self) -> str | None:
        """None while the core lives, else why it is gone (e.g. "exited with signal 9")."""

    @property
    def pid(self) -> int:
        return self.ready.pid

    # -- startup ----------------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> wire.ReadyInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.output_socket.poll(int(POLL_S * 1000)):
                tag, payload = self.output_socket.recv_multipart()
                if tag == wire.READY:
                    return wire.ready_decoder.decode(payload)
                if tag == wire.DEAD:
                    error = wire.dead_decoder.decode(payload).error
                    raise EngineStartupError(f"engine core failed to start: {error}")
                raise EngineStartupError(f"engine core sent {tag!r} before READY")
            reason = self._exit_reason()
            if reason is not None and not self.output_socket.poll(50):
                raise EngineStartupError(
                    f"engine core {reason} during startup (its log is above)"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core was not ready after {timeout_s:.0f} s")

    # -- liveness ---------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise EngineDeadError if the core has died (message or process exit)."""
        if self.dead is None:
            reason = self._exit_reason()
            if reason is not None:
                self.mark_dead(f"engine core {reason.replace('exited', 'exited unexpectedly', 1)}")
        if self.dead is not None:
            raise self.dead

    def mark_dead(self, reason: str) -> EngineDeadError:
        if self.dead is None:
            self.dead = EngineDeadError(reason)
            logger.error("%s", reason)
        return self.dead

    def exited(self) -> bool:
        return self._exit_reason() is not None

    # -- messages ---------------------------------------------------------------------------
    def send(self, tag: bytes, message: Any) -> None:
        """Send without ever blocking on a dead core (a PUSH with no peer would wait)."""
        self.check_alive()
        try:
            payload = wire.encoder.encode(message)
        except OverflowError as exc:  # e.g. a schema's integer past 64 bits: the client's
            raise ValueError(f"the request holds a value the engine cannot carry: {exc}"
                             ) from exc
        frames = [tag, payload]
        stalled_since = None
        while True:
            try:
                self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self.check_alive()
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since > _SEND_STALL_S:
                    raise self.mark_dead("engine core stopped reading its input") from None
                self.input_socket.poll(int(POLL_S * 1000), zmq.POLLOUT)

    def decode(self, tag: bytes, payload: memoryview | bytes) -> Any:
        """Decode one core -> front-end message; a DEAD message marks the core dead and raises."""
        if tag == wire.OUTPUTS:
            return wire.outputs_decoder.decode(payload)
        if tag == wire.UTILITY_RESULT:
            return wire.utility_result_decoder.decode(payload)
        if tag == wire.DEAD:
            raise self.mark_dead(f"engine core died: {wire.dead_decoder.decode(payload).error}")
        raise self.mark_dead(f"engine core sent an unknown message tag {tag!r}")



class CoreProcess(CoreChannel):
    """The child process, its sockets and its run directory."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.config = config
        self.run_dir = Path(tempfile.mkdtemp(prefix="engine-core-", dir=_ipc_temp_root()))
        try:
            super().__init__(*ipc_addresses(self.run_dir))
        except BaseException:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        try:
            (self.run_dir / CONFIG_FILE).write_text(config.model_dump_json())
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine.core.core_proc",
                    "--run-dir",
                    str(self.run_dir),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stdin=subprocess.DEVNULL,
                env=_child_env(config),
            )
        except BaseException:
            self._close_sockets()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(
            self,
            _cleanup,
            self.process,
            self.ctx,
            (self.input_socket, self.output_socket),
            self.run_dir,
        )
        try:
            self.ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _exit_reason(self) -> str | None:
        returncode = self.process.poll()
        return None if returncode is None else f"process exited with {_describe_exit(returncode)}"

    # -- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL), close the sockets, remove the run dir."""
        if self.dead is None:
            self.dead = EngineDeadError("the engine core has been shut down")
        self._finalizer()


class AttachedCore(CoreChannel):
    """A channel to a core this process did not start (the launcher of several API
    servers, or another node, started it with an ``endpoints.json`` naming these
    addresses). Liveness: ``liveness`` when given (e.g. a heartbeat for a remote core),
    else the pid the core reported in READY (same machine). ``shutdown`` only closes the
    sockets: the core's owner stops it."""

    def __init__(self, input_address: str, output_address: str, *,
                 liveness: LivenessCheck | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        super().__init__(input_address, output_address)
        self._liveness = liveness
        self._finalizer = weakref.finalize(
            self, _close_channel, self.ctx, (self.input_socket, self.output_socket))
        try:
            self.ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        if self._liveness is None:
            self._liveness = pid_liveness(self.ready.pid)

    def _exit_reason(self) -> str | None:
        if self._liveness is None:  # before READY without a custom check: the timeout rules
            return None
        reason = self._liveness()
        return None if reason is None else f"exited ({reason})"

    def shutdown(self) -> None:
        """Close this side's sockets (the core's owner stops the core)."""
        if self.dead is None:
            self.dead = EngineDeadError("the engine core channel has been closed")
        self._finalizer()


def _close_channel(ctx: zmq.Context, sockets: tuple[zmq.Socket, ...]) -> None:
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def _cleanup(
    process: subprocess.Popen, ctx: zmq.Context, sockets: tuple[zmq.Socket, ...], run_dir: Path
) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine core %d ignored SIGTERM; killing it", process.pid)
            process.kill()
            process.wait()
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(run_dir, ignore_errors=True)


def _ipc_temp_root() -> str | None:
    root = tempfile.gettempdir()
    # ipc:// paths must fit in sun_path; fall back to /tmp for long TMPDIRs.
    return root if len(root) + 40 < _MAX_IPC_PATH else "/tmp"


def _child_env(config: EngineConfig) -> dict[str, str]:
    """Make the child import the same ``engine`` as this process (and name its
    data-parallel rank in its log lines)."""
    env = dict(os.environ)
    package_root = str(Path(engine.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    parallel = config.parallel
    env[DP_RANK_ENV] = (f"_DP{parallel.data_parallel_rank}"
                        if parallel.data_parallel_size > 1 else "")
    return env


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _track_finished(in_flight: set[str], outputs: EngineCoreOutputs) -> None:
    for output in outputs.outputs:
        if output.finish_reason is not None:
            in_flight.discard(output.request_id)
    in_flight.difference_update(outputs.finished_requests)


class OneCore:
    """What a client over one core process (``self.proc``) reports about it."""

    proc: CoreChannel

    @property
    def num_kv_blocks(self) -> int:
        return self.proc.ready.num_kv_blocks

    @property
    def ready(self) -> wire.ReadyInfo:
        return self.proc.ready

    @property
    def pids(self) -> list[int]:
        return [self.proc.ready.pid]

    def wake(self) -> None:
        """End a lockstep data-parallel core's wait for input (another rank got work)."""
        self.proc.send(wire.WAKE, None)


class CoreUtilities:
    """The core's utility calls as methods, over the client's own ``call_utility``
    (shared by the one-core client and the data-parallel one, whose ``call_utility`` runs
    on every rank)."""

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        self.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self.call_utility("is_sleeping"))

    def pause_scheduling(self) -> None:
        self.call_utility("pause_scheduling")

    def abort_all_requests(self) -> int:
        return int(self.call_utility("abort_all_requests"))

    def resume_scheduling(self) -> None:
        self.call_utility("resume_scheduling")


class AsyncCoreUtilities:
    """:class:`CoreUtilities` for the asyncio clients."""

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    async def sleep(self, level: int = 1) -> None:
        await self.call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call_utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return bool(await self.call_utility("is_sleeping"))

    async def pause_scheduling(self) -> None:
        await self.call_utility("pause_scheduling")

    async def resume_scheduling(self) -> None:
        await self.call_utility("resume_scheduling")

    async def update_weights(self, method: str, *args: Any) -> None:
        await self.call_utility(method, *args)


class SyncMPClient(OneCore, CoreUtilities):
    """``EngineCoreClient`` over a core process: ``LLMEngine(config, client=SyncMPClient(config))``.

    ``get_output`` blocks until the core sends a step's outputs; with nothing in flight
    it returns an empty ``EngineCoreOutputs`` at once (as ``InprocClient`` does).
    """

    def __init__(
        self, config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S,
        channel: CoreChannel | None = None,
    ) -> None:
        # ``channel``: a core someone else started (AttachedCore); else spawn our own.
        self.proc = channel or CoreProcess(config, startup_timeout_s)
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._results: dict[int, wire.UtilityResult] = {}
        self._in_flight: set[str] = set()
        self._call_ids = itertools.count()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.proc.send(wire.ADD, request)
        self._in_flight.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in the core; a no-op on a dead core (its requests are gone anyway)."""
        self._in_flight.difference_update(request_ids)
        if request_ids and self.proc.dead is None and not self.proc.exited():
            self.proc.send(wire.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        while not self._outputs:
            if not self._in_flight:
                return EngineCoreOutputs(timestamp=time.monotonic())
            self._receive_once()
        return self._outputs.popleft()

    def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``method`` in the core between steps and return its result."""
        return self.wait_utility(self.send_utility(method, *args), method, timeout_s)

    def send_utility(self, method: str, *args: Any) -> int:
        """Start a utility call; :meth:`wait_utility` takes its result (split so that a
        front end over several cores starts a collective call on all before waiting)."""
        call_id = next(self._call_ids)
        self.proc.send(wire.UTILITY, wire.UtilityCall(call_id, method, list(args)))
        return call_id

    def wait_utility(self, call_id: int, method: str, timeout_s: float | None = None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while call_id not in self._results:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"engine core did not answer {method!r} within {timeout_s} s")
            self._receive_once()
        return _unwrap(self._results.pop(call_id), method)

    def get_stats(self) -> wire.EngineCoreStats:
        return msgspec.convert(self.call_utility("get_stats"), wire.EngineCoreStats)


    def update_weights(self, method: str, *args: Any) -> None:
        """One of the core's weight-update utilities by name (EngineCore.update_weights*,
        init_weight_update_group)."""
        self.call_utility(method, *args)

    # -- for a front end over several cores (engine.core.dp_client) ------------------------
    @property
    def output_socket(self) -> zmq.Socket:
        return self.proc.output_socket

    def check_alive(self) -> None:
        self.proc.check_alive()

    def exited(self) -> bool:
        return self.proc.exited()

    def take_outputs(self) -> list[EngineCoreOutputs]:
        """Every step output received so far (without waiting)."""
        taken = list(self._outputs)
        self._outputs.clear()
        return taken

    def receive_once(self) -> None:
        """Wait up to POLL_S for one message and keep it (outputs: see take_outputs)."""
        self._receive_once()

    def _receive_once(self) -> None:
        """Wait up to POLL_S for one message; raise EngineDeadError if the core died."""
        sock = self.proc.output_socket
        if not sock.poll(int(POLL_S * 1000)):
            self.proc.check_alive()
            return
        tag, payload = sock.recv_multipart(copy=False)
        message = self.proc.decode(bytes(tag.buffer), payload.buffer)
        if isinstance(message, EngineCoreOutputs):
            _track_finished(self._in_flight, message)
            self._outputs.append(message)
        else:
            self._results[message.call_id] = message

    def shutdown(self) -> None:
        self.proc.shutdown()


class AsyncMPClient(OneCore, AsyncCoreUtilities):
    """asyncio client over a core process.

    A reader task (started on first use, in the running loop) takes every message off the
    output socket: step outputs go to a queue for ``get_output``, utility results to the
    waiting ``call_utility``. When the core dies the reader wakes every waiter with
    ``EngineDeadError``.
    """

    def __init__(
        self, config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S,
        channel: CoreChannel | None = None,
    ) -> None:
        # The handshake is synchronous: construction returns once the model is loaded.
        # ``channel``: a core someone else started (AttachedCore); else spawn our own.
        self.proc = channel or CoreProcess(config, startup_timeout_s)
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._socket: zmq.asyncio.Socket | None = None

    @property
    def dead(self) -> EngineDeadError | None:
        return self.proc.dead

    def check_alive(self) -> None:
        self.proc.check_alive()

    def exited(self) -> bool:
        """The core's process has ended (noticed or not)."""
        return self.proc.exited()

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self.proc.send(wire.ADD, request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.abort_requests_nowait(request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Synchronous abort (sending never blocks), usable from ``finally`` blocks; a
        no-op on a dead core."""
        if request_ids and self.proc.dead is None and not self.proc.exited():
            self.proc.send(wire.ABORT, list(request_ids))

    async def get_output(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self._outputs is not None
        if self._outputs.empty() and self.proc.dead is not None:
            raise self.proc.dead
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``method`` in the core between steps and return its result."""
        self._ensure_reader()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self.proc.send(wire.UTILITY, wire.UtilityCall(call_id, method, list(args)))
            return _unwrap(await future, method)
        finally:
            self._pending.pop(call_id, None)

    async def get_stats(self) -> wire.EngineCoreStats:
        return msgspec.convert(await self.call_utility("get_stats"), wire.EngineCoreStats)


    # -- the reader -------------------------------------------------------------------------
    def _ensure_reader(self) -> None:
        """Start the reader in the running loop (again, if the caller moved to a new loop)."""
        self.proc.check_alive()
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._reader is not None and not self._reader.done():
            return
        if self._loop is not loop:
            self._loop = loop
            self._socket = zmq.asyncio.Socket.from_socket(self.proc.output_socket)
            self._outputs = asyncio.Queue()
            self._pending = {}
        self._reader = loop.create_task(self._read_loop(), name="engine-core-output-reader")

    async def _read_loop(self) -> None:
        assert self._socket is not None
        sock = self._socket
        try:
            while True:
                if not await sock.poll(int(POLL_S * 1000)):
                    if self.proc.exited() and not await sock.poll(50):
                        self.proc.check_alive()  # raises EngineDeadError
                    continue
                tag, payload = await sock.recv_multipart(copy=False)
                self._dispatch(self.proc.decode(bytes(tag.buffer), payload.buffer))
        except EngineDeadError as error:
            self._fail_all(error)
        except Exception as exc:  # noqa: BLE001 - a broken socket or message: nothing more arrives
            self._fail_all(
                self.proc.mark_dead(
                    f"engine core connection failed: {wire.describe_exception(exc)}"
                )
            )

    def _dispatch(self, message: EngineCoreOutputs | wire.UtilityResult) -> None:
        if isinstance(message, EngineCoreOutputs):
            assert self._outputs is not None
            self._outputs.put_nowait(message)
            return
        future = self._pending.get(message.call_id)
        if future is not None and not future.done():
            future.set_result(message)

    def _fail_all(self, error: EngineDeadError) -> None:
        assert self._outputs is not None
        self._outputs.put_nowait(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self._detach_socket()
        self.proc.shutdown()

    def _detach_socket(self) -> None:
        """Make the loop stop watching the asyncio wrapper's fd before ``proc`` closes the
        socket: the next core's socket (a restart) may get the same fd number, and a stale
        registration would hide its events from the loop."""
        sock, loop, self._socket = self._socket, self._loop, None
        if sock is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            sock._clear_io_state()  # what zmq.asyncio's close() does, minus closing


class UtilityRefusedError(RuntimeError, ValueError):
    """A utility call the core refused as invalid (a ValueError there): the caller's
    mistake, e.g. sleeping while requests run; a RuntimeError like any failed call."""


def _unwrap(result: wire.UtilityResult, method: str) -> Any:
    if result.error is not None:
        if result.error.startswith("ValueError: "):  # a refused call, not a failure
            raise UtilityRefusedError(f"engine core utility {method!r} refused: "
                                      + result.error.removeprefix("ValueError: "))
        raise RuntimeError(f"engine core utility {method!r} failed: {result.error}")
    return result.result
