"""The engine core's sockets when several front ends (API servers) share it.

Whoever starts a core may write ``endpoints.json`` into its run directory
(:class:`EndpointsFile`): one ``{"input", "output", "pid"}`` entry per front end (ZeroMQ
addresses the front end binds, ipc:// or tcp://; ``pid`` optional, the front end's process
on this machine, so the core notices its death). Without the file the core connects the
run dir's two ipc sockets (one front end, :func:`engine.core.core_proc.ipc_addresses`).

:class:`CoreEndpoints` owns the sockets and routes: a request belongs to the front end
whose input it arrived on, its step outputs go only there (a step touching several
front ends' requests is split); a utility result goes to the caller; READY / DEAD go to
everyone. A front end that died is forgotten: its requests are aborted in the core (no
leaked KV blocks) and nothing more is sent to it (a PUSH to a gone peer would block).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq
from pydantic import BaseModel

from engine.core import core_protocol as wire
from engine.core.engine_io import EngineCoreOutputs

logger = logging.getLogger("engine.core.core_endpoints")

ENDPOINTS_FILE = "endpoints.json"
CLIENT_CHECK_S = 0.5  # how often the core checks that its front ends' processes live


class ClientEndpoint(BaseModel):
    """One front end: the addresses it binds (the core connects) and, optionally, its pid."""

    input: str
    output: str
    pid: int | None = None


class EndpointsFile(BaseModel):
    """``endpoints.json``: the front ends of one core, by client index (list position)."""

    clients: list[ClientEndpoint]

    def write(self, run_dir: str | Path) -> None:
        path = Path(run_dir) / ENDPOINTS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json())
        tmp.replace(path)  # a core never reads half a file


def load_endpoints(run_dir: str | Path) -> EndpointsFile | None:
    """The run dir's ``endpoints.json``, or None (one front end on the default ipc pair)."""
    path = Path(run_dir) / ENDPOINTS_FILE
    if not path.exists():
        return None
    endpoints = EndpointsFile.model_validate_json(path.read_text())
    if not endpoints.clients:
        raise ValueError(f"{path} lists no clients")
    return endpoints


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this machine (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


class CoreEndpoints:
    """One PULL + one PUSH per front end, and which front end owns which request."""

    def __init__(self, inputs: list[zmq.Socket], outputs: list[zmq.Socket],
                 parent_check: Callable[[], None],
                 pids: list[int | None] | None = None) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self._parent_check = parent_check  # raises when the core's parent is gone
        self.pids = pids or [None] * len(inputs)
        self.live = [True] * len(inputs)
        self.owner: dict[str, int] = {}
        self._poller = zmq.Poller()
        for sock in inputs:
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        self._next_client_check = 0.0

    @classmethod
    def connect(cls, ctx: zmq.Context, clients: list[ClientEndpoint],
                parent_check: Callable[[], None], send_retry_s: float) -> CoreEndpoints:
        inputs, outputs = [], []
        for client in clients:
            pull = ctx.socket(zmq.PULL)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never drop or stall on a slow reader
            push.setsockopt(zmq.SNDTIMEO, int(send_retry_s * 1000))
            push.setsockopt(zmq.LINGER, 5000)  # flush the last message (DEAD) on exit
            pull.connect(client.input)
            push.connect(client.output)
            inputs.append(pull)
            outputs.append(push)
        return cls(inputs, outputs, parent_check, [c.pid for c in clients])

    @property
    def num_clients(self) -> int:
        return len(self.inputs)

    # -- input ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> bool:
        return bool(self._poller.poll(timeout_ms))

    def receive_pending(self) -> Iterator[tuple[int, bytes, memoryview]]:
        """Every message waiting on any live client's input, as (client, tag, payload)."""
        for client, sock in enumerate(self.inputs):
            while self.live[client]:
                try:
                    tag, payload = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                yield client, bytes(tag.buffer), payload.buffer

    def dead_clients(self) -> list[int]:
        """Front ends (with a pid) found dead since the last call; checked every
        CLIENT_CHECK_S; they are marked so nothing more is sent to or read from them."""
        now = time.monotonic()
        if now < self._next_client_check:
            return []
        self._next_client_check = now + CLIENT_CHECK_S
        gone = [c for c, pid in enumerate(self.pids)
                if self.live[c] and pid is not None and not pid_alive(pid)]
        for client in gone:
            self.live[client] = False
            self._poller.unregister(self.inputs[client])
        return gone

    def take_requests(self, client: int) -> list[str]:
        """Forget (and return) the requests ``client`` owns."""
        ids = [rid for rid, owner in self.owner.items() if owner == client]
        for rid in ids:
            del self.owner[rid]
        return ids

    # -- output -----------------------------------------------------------------------------
    def send(self, tag: bytes, message: Any, client: int | None = None) -> None:
        """To ``client``, or to every live client when None."""
        frames = [tag, wire.encoder.encode(message)]
        targets = range(self.num_clients) if client is None else (client,)
        for target in targets:
            self._send_frames(target, frames)

    def send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Each client gets the outputs of its own requests (finished ones forgotten)."""
        if self.num_clients == 1:
            self._forget_finished(outputs)
            self._send_frames(0, [wire.OUTPUTS, wire.encoder.encode(outputs)])
            return
        split: dict[int, EngineCoreOutputs] = {}

        def part(request_id: str) -> EngineCoreOutputs | None:
            owner = self.owner.get(request_id)
            if owner is None:
                return None  # its front end is gone (or it was aborted)
            if owner not in split:
                split[owner] = EngineCoreOutputs(
                    outputs=[], finished_requests=[], timestamp=outputs.timestamp, kv_cache_usage=outputs.kv_cache_usage)
            return split[owner]

        for output in outputs.outputs:
            target = part(output.request_id)
            if target is not None:
                target.outputs.append(output)
        for request_id in outputs.finished_requests:
            target = part(request_id)
            if target is not None:
                target.finished_requests.append(request_id)
        self._forget_finished(outputs)
        for client, piece in split.items():
            self._send_frames(client, [wire.OUTPUTS, wire.encoder.encode(piece)])

    def _forget_finished(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.owner.pop(output.request_id, None)
        for request_id in outputs.finished_requests:
            self.owner.pop(request_id, None)

    def _send_frames(self, client: int, frames: list[Any]) -> None:
        """Send, never blocking forever: a PUSH with no peer waits, so retry on the
        socket's timeout, giving up when the core's parent or this client is gone."""
        if not self.live[client]:
            return
        sock = self.outputs[client]
        pid = self.pids[client]
        while True:
            try:
                sock.send_multipart(frames, copy=False)
                return
            except zmq.Again:
                self._parent_check()
                if pid is not None and not pid_alive(pid):
                    logger.warning("front end %d (pid %d) is gone: dropping its output",
                                   client, pid)
                    return

    def close(self) -> None:
        for sock in self.inputs:
            if sock is not None:
                sock.close(linger=0)
        for sock in self.outputs:
            if sock is not None:
                sock.close()
