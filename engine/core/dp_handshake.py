"""The head node's registration channel for data-parallel ranks on other nodes.

A node launcher (``--headless``, or a Ray actor's launcher) connects a DEALER to the
head's ROUTER at ``tcp://<data-parallel-address>:<data-parallel-rpc-port>`` and sends
:class:`Register` (which ranks it runs). The head answers :class:`Welcome` (the engine
config and, per rank, the tcp input/output addresses the head has bound for that rank's
core) or :class:`Refused`. From then on both sides beat: the launcher sends
:class:`Heartbeat` and, when a core process ends, :class:`RankExited`; the head sends
:class:`Heartbeat` and, when it shuts down, :class:`Goodbye`. A side that hears nothing
from the other for ``NODE_TIMEOUT_S`` counts it as gone: the head fails that node's
ranks (the ``data_parallel_on_rank_failure`` policy), the launcher stops its cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from engine.core.errors import EngineStartupError

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
NODE_TIMEOUT_S = float(os.environ.get("ENGINE_DP_NODE_TIMEOUT_S", "5"))
REGISTER_TIMEOUT_S = float(os.environ.get("ENGINE_DP_REGISTER_TIMEOUT_S", "600"))


class Register(msgspec.Struct, tag=True):
    """Launcher -> head: "I run ranks start_rank .. start_rank + size_local - 1"."""

    data_parallel_size: int
    start_rank: int
    size_local: int
    host: str
    pid: int


class RankAddresses(msgspec.Struct):
    """Where one remote rank's core connects: the head's bound tcp sockets."""

    rank: int
    input: str
    output: str


class Welcome(msgspec.Struct, tag=True):
    """Head -> launcher: the engine config (JSON of EngineConfig) and its ranks' sockets."""

    config_json: str
    ranks: list[RankAddresses]


class Refused(msgspec.Struct, tag=True):
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    pass


class RankExited(msgspec.Struct, tag=True):
    """Launcher -> head: a core process ended (``reason``: its exit status)."""

    rank: int
    reason: str


class Goodbye(msgspec.Struct, tag=True):
    """Head -> launcher: the head is shutting down; stop the cores."""

    reason: str


Message = Register | Welcome | Refused | Heartbeat | RankExited | Goodbye
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> Message:
    return _decoder.decode(payload)


def tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass
class _Node:
    identity: bytes
    ranks: tuple[int, ...]
    host: str
    last_seen: float = field(default_factory=time.monotonic)


class HeadRegistry:
    """The head's side: binds the rpc port, welcomes nodes, tracks their ranks' liveness.

    A background thread owns the ROUTER socket; :meth:`liveness` gives each remote rank's
    check for its :class:`~engine.core.mp_client.AttachedCore` (None while alive).
    """

    def __init__(self, address: str, port: int, config_json: str,
                 ranks: dict[int, RankAddresses], data_parallel_size: int, *,
                 register_timeout_s: float = REGISTER_TIMEOUT_S,
                 node_timeout_s: float = NODE_TIMEOUT_S) -> None:
        self.endpoint = tcp(address, port)
        self._config_json = config_json
        self._ranks = ranks
        self._size = data_parallel_size
        self._node_timeout_s = node_timeout_s
        self._register_deadline = time.monotonic() + register_timeout_s
        self._register_timeout_s = register_timeout_s
        self._owner: dict[int, _Node] = {}  # rank -> the node that registered it
        self._exited: dict[int, str] = {}  # rank -> why its core is gone
        self._stop = threading.Event()
        self._goodbye = "the head is shutting down"
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)  # let Goodbye go out
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise EngineStartupError(
                f"cannot listen for data-parallel nodes at {self.endpoint}: {exc} (is "
                "--data-parallel-address this node's address, and the port free?)") from exc
        self._thread = threading.Thread(target=self._run, name="engine-dp-registry",
                                        daemon=True)
        self._thread.start()
        logger.info("waiting for data-parallel ranks %s to register at %s",
                    sorted(ranks), self.endpoint)

    # -- what the front end asks -------------------------------------------------------------
    def rank_gone(self, rank: int) -> str | None:
        """None while remote ``rank`` lives (or may still register), else why not."""
        reason = self._exited.get(rank)
        if reason is not None:
            return reason
        node = self._owner.get(rank)
        now = time.monotonic()
        if node is None:
            if now > self._register_deadline:
                return (f"no node registered data-parallel rank {rank} at {self.endpoint} "
                        f"within {self._register_timeout_s:.0f} s (start it with --headless "
                        "--data-parallel-start-rank ...)")
            return None
        if now - node.last_seen > self._node_timeout_s:
            return (f"node {node.host} (ranks {list(node.ranks)}) sent nothing for "
                    f"{now - node.last_seen:.1f} s")
        return None

    def liveness(self, rank: int):
        """A LivenessCheck for ``rank``'s AttachedCore."""
        return lambda: self.rank_gone(rank)

    def registered(self, rank: int) -> bool:
        return rank in self._owner

    def close(self, reason: str = "the head is shutting down") -> None:
        """Tell every node to stop its cores, then stop listening."""
        if self._stop.is_set():
            return
        self._goodbye = reason
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if self._sock.poll(int(HEARTBEAT_S * 1000 / 2)):
                    while True:
                        try:
                            identity, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(identity, payload)
                now = time.monotonic()
                if now >= next_beat:
                    self._broadcast(Heartbeat())
                    next_beat = now + HEARTBEAT_S
            self._broadcast(Goodbye(self._goodbye))
        except Exception:  # a broken registry must not pass silently: its ranks fail
            logger.exception("data-parallel registry failed")
            for rank in self._ranks:
                self._exited.setdefault(rank, "the head's node registry failed")
        finally:
            self._sock.close()
            self._ctx.term()

    def _nodes(self) -> list[_Node]:
        return list({id(n): n for n in self._owner.values()}.values())

    def _broadcast(self, message: Message) -> None:
        payload = encode(message)
        for node in self._nodes():
            self._sock.send_multipart([node.identity, payload])

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            message = decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("ignoring a malformed message on %s: %s", self.endpoint, exc)
            return
        if isinstance(message, Register):
            self._register(identity, message)
            return
        node = next((n for n in self._nodes() if n.identity == identity), None)
        if node is None:
            return  # a node we refused, or one from an earlier head
        node.last_seen = time.monotonic()
        if isinstance(message, RankExited) and message.rank in node.ranks:
            logger.error("data-parallel rank %d on %s exited: %s", message.rank, node.host,
                         message.reason)
            self._exited.setdefault(message.rank,
                                    f"core on node {node.host} {message.reason}")

    def _register(self, identity: bytes, message: Register) -> None:
        ranks = tuple(range(message.start_rank, message.start_rank + message.size_local))
        if ranks and all(r in self._owner and self._owner[r].identity == identity
                         for r in ranks):  # a resent Register: welcome again
            self._sock.send_multipart([identity, encode(
                Welcome(self._config_json, [self._ranks[r] for r in ranks]))])
            return
        reason = None
        if message.data_parallel_size != self._size:
            reason = (f"the node runs --data-parallel-size {message.data_parallel_size}, "
                      f"the head {self._size}")
        elif not ranks or any(r not in self._ranks for r in ranks):
            reason = (f"ranks {list(ranks)} are not all ones the head waits for "
                      f"({sorted(self._ranks)})")
        elif any(r in self._owner for r in ranks):
            taken = [r for r in ranks if r in self._owner]
            reason = f"ranks {taken} are already registered by another node"
        if reason is not None:
            logger.error("refused data-parallel node %s: %s", message.host, reason)
            self._sock.send_multipart([identity, encode(Refused(reason))])
            return
        node = _Node(identity, ranks, message.host)
        for rank in ranks:
            self._owner[rank] = node
        logger.info("data-parallel node %s (pid %d) registered ranks %s", message.host,
                    message.pid, list(ranks))
        welcome = Welcome(self._config_json, [self._ranks[r] for r in ranks])
        self._sock.send_multipart([identity, encode(welcome)])


class NodeLink:
    """The launcher's side: register, then beat and report over one DEALER socket."""

    def __init__(self, address: str, port: int) -> None:
        self.endpoint = tcp(address, port)
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(self.endpoint)
        self.last_heard = time.monotonic()
        self._next_beat = 0.0

    def register(self, message: Register, timeout_s: float = REGISTER_TIMEOUT_S) -> Welcome:
        """Send Register until the head answers; EngineStartupError when refused or when
        no head answers within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        payload = encode(message)
        resend_at = 0.0
        while True:
            now = time.monotonic()
            if now > deadline:
                raise EngineStartupError(f"no data-parallel head answered at {self.endpoint} "
                                         f"within {timeout_s:.0f} s")
            if now >= resend_at:  # the head may start later; queued copies are harmless
                self._sock.send(payload)
                resend_at = now + 5.0
            if not self._sock.poll(200):
                continue
            reply = decode(self._sock.recv())
            if isinstance(reply, Welcome):
                self.last_heard = time.monotonic()
                return reply
            if isinstance(reply, Refused):
                raise EngineStartupError(f"the data-parallel head at {self.endpoint} refused "
                                         f"this node: {reply.reason}")

    def tick(self, exited: list[RankExited]) -> str | None:
        """Report ended cores, beat, read the head: None while the head is there, else
        why this node should stop (Goodbye, or silence past NODE_TIMEOUT_S)."""
        for message in exited:
            self._sock.send(encode(message))
        now = time.monotonic()
        if now >= self._next_beat:
            self._sock.send(encode(Heartbeat()))
            self._next_beat = now + HEARTBEAT_S
        while self._sock.poll(0):
            message = decode(self._sock.recv())
            self.last_heard = time.monotonic()
            if isinstance(message, Goodbye):
                return f"the head said goodbye: {message.reason}"
        silent = time.monotonic() - self.last_heard
        if silent > NODE_TIMEOUT_S:
            return f"the head at {self.endpoint} sent nothing for {silent:.1f} s"
        return None

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
