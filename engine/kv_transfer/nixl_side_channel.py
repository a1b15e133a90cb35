"""The NIXL connector's side channel: how a consumer learns a producer's NIXL agent.

A producer rank ``r`` serves ``tcp://{kv_ip}:{kv_port + r}`` (a ZeroMQ ROUTER socket, on a
daemon thread). A consumer rank ``r`` asks that address once per producer engine (a
ZeroMQ REQ socket, with a receive timeout: a producer that is gone is an error after
``timeout_s``, never a hang) and gets one msgpack map back:

``version``, ``engine_id``, ``agent_name``, ``agent_metadata`` (``nixl_agent.
get_agent_metadata()``: the UCX worker address and the registered memory's remote keys),
``layout`` (the producer's :class:`KVCacheLayout` as a dict), ``mem_type`` ("DRAM" or
"VRAM"), ``device_id`` and ``layers``: per layer cache tensor its ``addr``
(``data_ptr()``), ``shape``, ``strides`` (elements) and ``element_size``, from which the
consumer computes the address of any remote (layer, K/V half, block) region.

The payload is built once (after the memory is registered), so the server thread never
touches the NIXL agent.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_HANDSHAKE = b"nixl-handshake"


class HandshakeError(RuntimeError):
    """The producer's side channel did not answer (or answered nonsense)."""


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers handshakes with a fixed payload until :meth:`stop`."""

    def __init__(self, host: str, port: int, payload: dict[str, Any]) -> None:
        import zmq

        self.address = zmq_address(host, port)
        self._payload = msgspec.msgpack.encode(payload)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise RuntimeError(f"NIXL side channel cannot listen on {self.address}: {exc} "
                               "(another engine on this kv_port? choose another kv_port: "
                               "rank r listens on kv_port + r)") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel",
                                        daemon=True)
        self._thread.start()
        logger.info("NIXL side channel listening on %s", self.address)

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(100)):
                    continue
                frames = self._sock.recv_multipart()
                # REQ peers: [identity, b"", request]
                if len(frames) < 3:
                    continue
                ident, request = frames[0], frames[-1]
                if request == _HANDSHAKE:
                    reply = self._payload
                else:
                    reply = msgspec.msgpack.encode({"error": f"unknown request {request[:40]!r}"})
                self._sock.send_multipart([ident, b"", reply])
        except Exception:  # the socket was closed under us, or zmq failed: stop serving
            if not self._stop.is_set():
                logger.exception("NIXL side channel on %s stopped", self.address)
        finally:
            self._sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


def fetch_handshake(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """The producer's handshake payload; :class:`HandshakeError` after ``timeout_s``."""
    import zmq

    address = zmq_address(host, port)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        sock.send(_HANDSHAKE)
        raw = sock.recv()
    except zmq.Again:
        raise HandshakeError(f"no handshake answer from the producer's side channel "
                             f"{address} within {timeout_s:g}s (producer down or "
                             f"unreachable?)") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(f"handshake with {address} failed: {exc}") from None
    finally:
        sock.close()
        ctx.term()
    try:
        payload = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError as exc:
        raise HandshakeError(f"undecodable handshake answer from {address}: {exc}") from None
    if not isinstance(payload, dict):
        raise HandshakeError(f"handshake answer from {address} is not a map")
    if "error" in payload:
        raise HandshakeError(f"{address} refused the handshake: {payload['error']}")
    if payload.get("version") != PROTOCOL_VERSION:
        raise HandshakeError(f"{address} speaks side-channel protocol "
                             f"{payload.get('version')!r}, this engine {PROTOCOL_VERSION}")
    missing = [k for k in ("engine_id", "agent_name", "agent_metadata", "layout", "layers",
                           "mem_type", "device_id") if k not in payload]
    if missing:
        raise HandshakeError(f"handshake answer from {address} lacks {', '.join(missing)}")
    return payload
