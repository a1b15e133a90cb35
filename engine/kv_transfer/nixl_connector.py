"""``NixlConnector``: disaggregated prefill/decode, the consumer pulling KV blocks over NIXL.

vLLM's protocol, so a vLLM proxy and client work unchanged:

- A producer (``kv_producer`` / ``kv_both``) gets a request with ``kv_transfer_params``
  ``{"do_remote_decode": true}`` (the proxy sends it with ``max_tokens=1``) and prefills it.
  When it finishes, :meth:`request_finished` keeps its blocks (``delay_free``) and
  returns the params a consumer needs: ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_host`` / ``remote_port`` (the producer's side channel), ``remote_block_ids``,
  ``remote_request_id`` (and ``remote_tp_size`` when known).
- A consumer (``kv_consumer`` / ``kv_both``) gets a request with those params: all prompt
  tokens but the last (which it computes itself, for its logits) past its local prefix
  hit arrive asynchronously. The worker handshakes with the producer's side channel once
  per producer engine (:mod:`.nixl_side_channel`: agent metadata, layout, per-layer
  addresses), checks that both KV layouts are the same, and posts one NIXL READ of the
  remote blocks into the local ones, with a notification naming the producer's request.
- The producer's worker sees the notification and reports the request in
  ``done_sending``: the scheduler frees its blocks. A hold no consumer claims within
  ``abort_timeout_s`` (extra config, default 120; env ``ENGINE_NIXL_ABORT_TIMEOUT_S``)
  is released all the same (warning).

Descriptors. Every layer's whole cache tensor is registered once (DRAM for CPU tensors,
VRAM for GPU ones). One block of one layer is ``cache.select(block_dim, b)``: for each
index of the dims before ``block_dim`` (the K/V half of an MHA cache; none for MLA) a
contiguous region at ``data_ptr + (outer . strides + b * stride[block_dim]) * itemsize``.
A transfer's descriptor list has one entry per (layer, half, run of consecutive blocks):
a run is blocks consecutive on both sides, merged into one descriptor where the cache's
blocks are adjacent in memory.

Failures never hang: a handshake without answer (producer gone) fails after
``handshake_timeout_s`` (default 10), a transfer that errors (a killed producer: UCX sees
the disconnect) or is not done after ``transfer_timeout_s`` (extra config, default 30)
fails; failed loads go to :meth:`get_failed_loads` and are recomputed. A layout mismatch
fails the load with an error naming both layouts.

A posted READ cannot be cancelled (UCX completes it even after the transfer handle is
released and the remote agent removed): a timed-out READ from a producer that is stalled,
not dead, may still land later. So a timed-out load is reported failed at once but
watched until it ends (or ``abort_timeout_s`` more), and every consumer request that had
a load is finished with ``delay_free``: the worker reports it in ``done_sending`` when no
READ can write its blocks any more (the next step, unless such a READ is pending), so its
blocks never go to another request under a late READ.

UCX picks its transports itself; tests and loopback setups use ``UCX_TLS=tcp
UCX_NET_DEVICES=lo`` (read when the NIXL agent is created, in :meth:`register_kv_caches`).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from engine.core.interfaces.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorRole,
    KVTransferStats,
)
from engine.kv_transfer.nixl_layout import (  # noqa: F401 - re-exported for callers
    _LAYOUT_MUST_MATCH,
    _REMOTE_PARAMS,
    KVLayoutMismatchError,
    _float_option,
    _LayerGeometry,
    _layout_from_dict,
    _registration_spans,
    _remote_params_problem,
    _runs,
    build_descriptors,
    compare_layouts,
    layer_geometry,
)
from engine.kv_transfer.nixl_side_channel import (
    PROTOCOL_VERSION,
    HandshakeError,
    SideChannelServer,
    fetch_handshake,
)

logger = logging.getLogger(__name__)

DEFAULT_ABORT_TIMEOUT_S = 120.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
ABORT_TIMEOUT_ENV = "ENGINE_NIXL_ABORT_TIMEOUT_S"

_NOTIF_DONE = "done"  # the consumer read the blocks: free them (with blocks, bytes)
_NOTIF_RELEASE = "release"  # the consumer will not read them: free them


# -- metadata (scheduler -> worker, through msgspec) --------------------------------------
class NixlLoad(msgspec.Struct, gc=False):
    """One consumer request's READ of remote blocks into local ones."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_tp_size: int | None = None
    # presliced: the lists are exactly the blocks to move (the scheduler knew the block
    # size). Otherwise they are all the request's blocks and the worker moves those that
    # cover tokens [token_start, token_end).
    presliced: bool = True
    token_start: int = 0
    token_end: int = 0
    # Nothing to read (the request needs no remote token after all, or it finished before
    # it was scheduled): only tell the producer to free its blocks.
    notify_only: bool = False
    # The scheduler could not build a valid load (it is failed as soon as it arrives).
    error: str | None = None


class NixlHold(msgspec.Struct, gc=False):
    """A producer request whose blocks are kept for a consumer until ``expires_at``
    (``time.time()`` seconds)."""

    request_id: str
    expires_at: float
    num_blocks: int = 0


class NixlConnectorMetadata(msgspec.Struct, gc=False):
    loads: list[NixlLoad] = msgspec.field(default_factory=list)
    holds: list[NixlHold] = msgspec.field(default_factory=list)
    # Consumer requests that finished (aborted) while their load may still be in flight:
    # the worker reports them in done_sending once the load is over (their blocks are
    # kept until then, so a READ never lands in freed blocks).
    release_after_load: list[str] = msgspec.field(default_factory=list)


# -- worker-side bookkeeping ---------------------------------------------------------------
@dataclass
class _Remote:
    engine_id: str
    agent_name: str
    host: str
    port: int
    layout: KVCacheLayout
    mem_type: str
    device_id: int
    layers: list[_LayerGeometry]


class _PendingLoad:
    __slots__ = (
        "agent_name",
        "deadline",
        "handle",
        "nblocks",
        "nbytes",
        "posted_at",
        "release_after",
        "reported",
        "spec",
        "zombie_until",
    )

    def __init__(self, spec: NixlLoad, deadline: float) -> None:
        self.spec = spec
        self.deadline = deadline  # time.monotonic()
        self.posted_at = 0.0
        self.handle: Any = None
        self.nbytes = 0
        self.nblocks = 0
        self.release_after = False
        self.agent_name = ""
        self.reported = False  # done_receiving / failed already said
        self.zombie_until = 0.0  # timed out: watched until then (time.monotonic())


class NixlConnector(KVConnectorBase):
    name = "NixlConnector"
    metadata_cls = NixlConnectorMetadata

    def __init__(self, config: Any, role: KVConnectorRole, engine_config: Any = None) -> None:
        super().__init__(config, role, engine_config)
        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        kv_role = getattr(config, "kv_role", "kv_both")
        self.produces = kv_role in ("kv_producer", "kv_both")
        self.consumes = kv_role in ("kv_consumer", "kv_both")
        self.engine_id = str(config.engine_id)
        self.kv_ip = str(getattr(config, "kv_ip", "127.0.0.1"))
        self.kv_port = int(getattr(config, "kv_port", 14579))
        self.abort_timeout_s = _float_option(extra, "abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S,
                                             ABORT_TIMEOUT_ENV)
        self.transfer_timeout_s = _float_option(extra, "transfer_timeout_s",
                                                DEFAULT_TRANSFER_TIMEOUT_S)
        self.handshake_timeout_s = min(
            _float_option(extra, "handshake_timeout_s", DEFAULT_HANDSHAKE_TIMEOUT_S),
            self.transfer_timeout_s)
        cache = getattr(engine_config, "cache", None)
        parallel = getattr(engine_config, "parallel", None)
        self.block_size: int | None = (getattr(cache, "block_size", None)
                                       or extra.get("block_size"))
        self.tp_size: int | None = (getattr(parallel, "tensor_parallel_size", None)
                                    or extra.get("tp_size"))
        # Scheduler side.
        self._matched: dict[str, int] = {}  # request id -> num_computed_tokens it was asked with
        self._loads: dict[str, NixlLoad] = {}
        self._holds: dict[str, NixlHold] = {}
        self._release_after_load: list[str] = []
        self._loads_issued: set[str] = set()
        self._warned: set[str] = set()
        # Worker side.
        self._lock = threading.RLock()
        self._agent: Any = None
        self._agent_name = ""
        self._layout: KVCacheLayout | None = None
        self._layers: list[_LayerGeometry] = []
        self._mem_type = "DRAM"
        self._device_id = 0
        self._reg_descs: Any = None
        self._server: SideChannelServer | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._remotes: dict[str, _Remote] = {}
        self._refused: dict[str, str] = {}  # engine id -> why its layout is refused
        self._handshaking: dict[str, tuple[Future, str, int]] = {}
        self._waiting: dict[str, list[_PendingLoad]] = {}  # engine id -> loads awaiting it
        self._inflight: dict[str, _PendingLoad] = {}
        # Timed-out READs: reported failed, but UCX cannot cancel a posted READ, so it may
        # still land; watched until it is over (their blocks are not released before).
        self._zombies: dict[str, _PendingLoad] = {}
        # Loads whose local blocks a READ may still write (queued, in flight, zombie).
        self._by_request: dict[str, _PendingLoad] = {}
        self._held: dict[str, float] = {}  # producer request id -> expires_at (time.time())
        self._early_notifs: dict[str, tuple[float, int, int]] = {}
        self._bound: Any = None
        self._done_sending: set[str] = set()
        self._done_receiving: set[str] = set()
        self._failed: set[str] = set()
        self._leaked_handles: list[Any] = []
        self._stats = KVTransferStats()
        self._counters = {"handshakes": 0, "handshake_failures": 0, "holds_timed_out": 0,
                          "transfer_timeouts": 0, "late_transfers_done": 0}
        # Why recent loads failed (request id -> message), for logs and tests.
        self.load_errors: dict[str, str] = {}
        self._closed = False

    # =====================================================================================
    # scheduler side
    # =====================================================================================
    def _remote_prefill_params(self, request: Any) -> dict[str, Any] | None:
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        return params

    def _warn_once(self, request_id: str, message: str, *args: Any) -> None:
        if request_id not in self._warned:
            if len(self._warned) > 10000:
                self._warned.clear()
            self._warned.add(request_id)
            logger.warning(message, *args)

    @staticmethod
    def _num_prompt_tokens(request: Any) -> int:
        n = getattr(request, "num_prompt_tokens", None)
        return int(n) if n is not None else len(request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = self._remote_prefill_params(request)
        if params is None:
            return 0, False
        rid = request.request_id
        if not self.consumes:
            self._warn_once(rid, "request %s asks for a remote prefill, but this engine's "
                            "kv_role is not a consumer: computing it locally", rid)
            return 0, False
        problem = _remote_params_problem(params)
        if problem is not None:
            self._warn_once(rid, "request %s: %s; computing the prompt locally", rid, problem)
            return 0, False
        prompt = self._num_prompt_tokens(request)
        external = prompt - 1 - num_computed_tokens
        if external <= 0:
            logger.debug("request %s: the local prefix cache covers its prompt (%d of %d "
                         "tokens): nothing to load", rid, num_computed_tokens, prompt)
            return 0, False
        if self.block_size and len(params["remote_block_ids"]) * self.block_size < prompt - 1:
            self._warn_once(rid, "request %s: %d remote blocks of %d tokens cannot hold its "
                            "%d prompt tokens; computing the prompt locally", rid,
                            len(params["remote_block_ids"]), self.block_size, prompt)
            return 0, False
        self._matched[rid] = num_computed_tokens
        return external, True

    def _load_spec(self, request_id: str, params: dict[str, Any], **kw: Any) -> NixlLoad:
        return NixlLoad(request_id=request_id, remote_engine_id=params["remote_engine_id"],
                        remote_host=params["remote_host"], remote_port=params["remote_port"],
                        remote_request_id=params["remote_request_id"],
                        remote_tp_size=params.get("remote_tp_size"), **kw)

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = self._remote_prefill_params(request)
        if params is None or not self.consumes:
            return
        rid = request.request_id
        # Whatever happens next (loaded, failed and recomputed, preempted), this request
        # never loads again.
        params["do_remote_prefill"] = False
        if _remote_params_problem(params) is not None:
            self._matched.pop(rid, None)
            return
        remote_blocks = list(params["remote_block_ids"])
        computed = self._matched.pop(rid, None)
        if num_external_tokens <= 0:
            self._loads[rid] = self._load_spec(rid, params, local_block_ids=[],
                                               remote_block_ids=remote_blocks,
                                               notify_only=True)
            return
        if computed is None:
            computed = max(0, self._num_prompt_tokens(request) - 1 - num_external_tokens)
        end_token = computed + num_external_tokens
        if self.block_size:
            bs = self.block_size
            first, last = computed // bs, math.ceil(end_token / bs)
            local, remote = list(block_ids[first:last]), remote_blocks[first:last]
            error = None
            if len(local) != last - first or len(remote) != last - first:
                error = (f"tokens {computed}..{end_token} need blocks {first}..{last - 1}: "
                         f"{len(block_ids)} local and {len(remote_blocks)} remote blocks")
            spec = self._load_spec(rid, params, local_block_ids=local, remote_block_ids=remote,
                                   error=error)
        else:
            spec = self._load_spec(rid, params, local_block_ids=list(block_ids),
                                   remote_block_ids=remote_blocks, presliced=False,
                                   token_start=computed, token_end=end_token)
        self._loads[rid] = spec
        self._loads_issued.add(rid)

    def build_connector_meta(self, scheduler_output: Any) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(loads=list(self._loads.values()),
                                     holds=list(self._holds.values()),
                                     release_after_load=self._release_after_load)
        self._loads, self._holds, self._release_after_load = {}, {}, []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._warned.discard(rid)
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            params = {}
        # Consumer side.
        if params.get("do_remote_prefill") and self.consumes:
            # Finished before it was ever scheduled: tell the producer to free its blocks.
            params["do_remote_prefill"] = False
            if _remote_params_problem(params) is None:
                self._loads[rid] = self._load_spec(
                    rid, params, local_block_ids=[],
                    remote_block_ids=list(params["remote_block_ids"]), notify_only=True)
            return False, None
        if rid in self._loads_issued:
            self._loads_issued.discard(rid)
            pending = self._loads.get(rid)
            if pending is not None and not pending.notify_only:
                # Its load was never sent to the worker: do not send it now.
                pending.local_block_ids = []
                pending.notify_only = True
                pending.error = None
                return False, None
            if not params.get("do_remote_decode"):
                # Its READ may still be running (waiting for it, or timed out: a posted
                # READ cannot be cancelled): the worker reports the request in
                # done_sending once no READ can write its blocks (at once if none).
                self._release_after_load.append(rid)
                return True, None
        # Producer side.
        if not params.get("do_remote_decode"):
            return False, None
        if not self.produces:
            logger.warning("request %s asks for a remote decode, but this engine's kv_role "
                           "is not a producer: not keeping its KV", rid)
            return False, None
        status = getattr(request, "status", None)
        if status is not None:
            from engine.core.request import RequestStatus

            if status != RequestStatus.FINISHED_LENGTH:
                # Aborted, or stopped at its first token: no decode follows.
                return False, None
        if not block_ids:
            return False, None
        self._holds[rid] = NixlHold(request_id=rid,
                                    expires_at=time.time() + self.abort_timeout_s,
                                    num_blocks=len(block_ids))
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.kv_ip,
            "remote_port": self.kv_port,
            "remote_block_ids": list(block_ids),
            "remote_request_id": rid,
        }
        if self.tp_size:
            out["remote_tp_size"] = int(self.tp_size)
        return True, out

    # =====================================================================================
    # worker side
    # =====================================================================================
    def register_kv_caches(self, kv_caches: list[Any], layout: KVCacheLayout) -> None:
        with self._lock:
            if self._agent is not None:
                raise RuntimeError("NixlConnector.register_kv_caches was already called")
            if len(kv_caches) != layout.num_layers:
                raise ValueError(f"{len(kv_caches)} KV cache tensors for a layout of "
                                 f"{layout.num_layers} layers")
            try:
                from nixl._api import nixl_agent, nixl_agent_config
            except ImportError as exc:
                raise RuntimeError(f"the NixlConnector needs NIXL: pip install nixl "
                                   f"(import failed: {exc})") from exc
            devices = {(t.device.type, t.device.index) for t in kv_caches}
            if len(devices) != 1:
                raise ValueError(f"KV caches on several devices: {sorted(map(str, devices))}")
            dev_type, dev_index = devices.pop()
            self._mem_type = "VRAM" if dev_type == "cuda" else "DRAM"
            self._device_id = int(dev_index or 0) if self._mem_type == "VRAM" else 0
            self._layers = [layer_geometry(t.data_ptr(), t.shape, t.stride(), t.element_size(),
                                           layout.block_dim) for t in kv_caches]
            self._layout = layout
            self._agent_name = f"{self.engine_id}-rank{layout.tp_rank}"
            self._agent = nixl_agent(self._agent_name, nixl_agent_config(backends=["UCX"]))
            if "UCX" not in self._agent.backends:
                raise RuntimeError("NIXL has no UCX backend (see the NIXL log above)")
            spans = _registration_spans(kv_caches)
            self._reg_descs = self._agent.register_memory(
                [(addr, size, self._device_id, "") for addr, size in spans], self._mem_type)
            self._executor = ThreadPoolExecutor(max_workers=4,
                                                thread_name_prefix="nixl-handshake")
            if self.produces:
                payload = {
                    "version": PROTOCOL_VERSION,
                    "engine_id": self.engine_id,
                    "agent_name": self._agent_name,
                    "agent_metadata": self._agent.get_agent_metadata(),
                    "layout": asdict(layout),
                    "mem_type": self._mem_type,
                    "device_id": self._device_id,
                    "layers": [{"addr": t.data_ptr(), "shape": list(t.shape),
                                "strides": list(t.stride()), "element_size": t.element_size()}
                               for t in kv_caches],
                }
                self._server = SideChannelServer(self.kv_ip, self.kv_port + layout.tp_rank,
                                                 payload)
            logger.info("NIXL agent %s: %d layers (%s) registered as %s, %d region(s), "
                        "%.1f MiB", self._agent_name, layout.num_layers, layout.describe(),
                        self._mem_type, len(spans), sum(s for _, s in spans) / 2**20)

    def bind_connector_metadata(self, metadata: Any) -> None:
        with self._lock:
            self.metadata = metadata
            self._bound = metadata

    def _take_metadata(self) -> None:
        """Process the bound metadata (once)."""
        meta, self._bound = self._bound, None
        if meta is None:
            return
        if not isinstance(meta, NixlConnectorMetadata):
            meta = msgspec.convert(meta, NixlConnectorMetadata)
        for hold in meta.holds:
            early = self._early_notifs.pop(hold.request_id, None)
            if early is not None:
                self._sent(hold.request_id, early[1], early[2])
            else:
                self._held[hold.request_id] = hold.expires_at
        for spec in meta.loads:
            self._queue_load(spec)
        for rid in meta.release_after_load:
            pending = self._by_request.get(rid)
            if pending is not None:
                pending.release_after = True
            else:
                self._done_sending.add(rid)

    def start_load_kv(self) -> None:
        with self._lock:
            self._take_metadata()
            self._poll_handshakes()

    # -- loads -----------------------------------------------------------------------------
    def _queue_load(self, spec: NixlLoad) -> None:
        pending = _PendingLoad(spec, time.monotonic() + self.transfer_timeout_s)
        rid = spec.request_id
        if spec.error is not None:
            self._finish(pending, False, spec.error)
            return
        if self._agent is None or self._layout is None:
            self._finish(pending, False, "the NIXL connector has no registered KV cache")
            return
        if spec.remote_tp_size is not None and spec.remote_tp_size != self._layout.tp_size:
            self._finish(pending, False, f"the producer runs tensor parallel "
                         f"{spec.remote_tp_size}, this engine {self._layout.tp_size} (not "
                         "supported)")
            return
        if not spec.notify_only:
            if rid in self._by_request:
                self._finish(pending, False, "a load for this request is already running",
                             report=False)
                return
            self._by_request[rid] = pending
        engine = spec.remote_engine_id
        if engine in self._refused:
            self._finish(pending, False, self._refused[engine])
        elif engine in self._remotes:
            self._post(pending, self._remotes[engine])
        else:
            self._waiting.setdefault(engine, []).append(pending)
            if engine not in self._handshaking:
                port = spec.remote_port + self._layout.tp_rank
                assert self._executor is not None
                fut = self._executor.submit(fetch_handshake, spec.remote_host, port,
                                            self.handshake_timeout_s)
                self._handshaking[engine] = (fut, spec.remote_host, port)

    def _poll_handshakes(self) -> None:
        for engine, (fut, host, port) in list(self._handshaking.items()):
            if not fut.done():
                continue
            del self._handshaking[engine]
            waiting = self._waiting.pop(engine, [])
            try:
                remote = self._add_remote(engine, fut.result(), host, port)
            except KVLayoutMismatchError as exc:
                logger.error("%s", exc)
                self._refused[engine] = str(exc)
                for pending in waiting:
                    self._finish(pending, False, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - HandshakeError, NIXL refusing it
                self._counters["handshake_failures"] += 1
                reason = f"handshake with engine {engine} at {host}:{port} failed: {exc}"
                for pending in waiting:
                    self._finish(pending, False, reason)
                continue
            for pending in waiting:
                self._post(pending, remote)
        now = time.monotonic()
        for engine, waiting in list(self._waiting.items()):
            for pending in [p for p in waiting if now > p.deadline]:
                waiting.remove(pending)
                self._finish(pending, False, f"no handshake with engine {engine} within "
                             f"{self.transfer_timeout_s:g}s")

    def _add_remote(self, engine: str, payload: dict[str, Any], host: str, port: int
                    ) -> _Remote:
        assert self._layout is not None
        if payload["engine_id"] != engine:
            raise HandshakeError(f"the side channel at {host}:{port} belongs to engine "
                                 f"{payload['engine_id']}, not {engine}")
        remote_layout = payload["layout"]
        diffs = compare_layouts(self._layout, remote_layout)
        layers = []
        if not diffs:
            try:
                layers = [layer_geometry(l["addr"], l["shape"], l["strides"],
                                         l["element_size"], int(remote_layout["block_dim"]))
                          for l in payload["layers"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise HandshakeError(f"bad layer geometry from {host}:{port}: {exc}") from None
            shapes_local = [g.block_shape for g in self._layers]
            shapes_remote = [g.block_shape for g in layers]
            if shapes_local != shapes_remote:
                diffs.append(f"block shapes: local {shapes_local[:1]}, remote "
                             f"{shapes_remote[:1]}")
        if diffs:
            other = _layout_from_dict(remote_layout)
            raise KVLayoutMismatchError(
                f"NIXL: refusing KV from engine {engine} at {host}:{port}: its KV cache "
                f"layout differs from this engine's ({'; '.join(diffs)}). Local: "
                f"{self._layout.describe()}. Remote: "
                f"{other.describe() if other else remote_layout}. Both engines need the same "
                "model, dtype, attention backend, block size and tensor-parallel size "
                "(block-size conversion is not implemented).")
        agent_name = self._agent.add_remote_agent(payload["agent_metadata"])
        if isinstance(agent_name, bytes):
            agent_name = agent_name.decode()
        remote = _Remote(engine_id=engine, agent_name=agent_name, host=host, port=port,
                         layout=_layout_from_dict(remote_layout) or self._layout,
                         mem_type=str(payload["mem_type"]), device_id=int(payload["device_id"]),
                         layers=layers)
        self._remotes[engine] = remote
        self._counters["handshakes"] += 1
        logger.info("NIXL: handshake with engine %s (agent %s at %s:%d) done", engine,
                    agent_name, host, port)
        return remote

    def _drop_remote(self, remote: _Remote) -> None:
        """Forget a remote that failed (the next load handshakes again)."""
        if self._remotes.get(remote.engine_id) is remote:
            del self._remotes[remote.engine_id]
            busy = itertools.chain(self._inflight.values(), self._zombies.values())
            if not any(p.agent_name == remote.agent_name for p in busy):
                try:
                    self._agent.remove_remote_agent(remote.agent_name)
                except Exception as exc:  # noqa: BLE001 - already gone
                    logger.debug("NIXL: removing agent %s: %s", remote.agent_name, exc)

    def _blocks_to_move(self, spec: NixlLoad) -> tuple[list[int], list[int]]:
        local, remote = spec.local_block_ids, spec.remote_block_ids
        if not spec.presliced:
            assert self._layout is not None
            bs = self._layout.block_size
            first, last = spec.token_start // bs, math.ceil(spec.token_end / bs)
            if len(local) < last or len(remote) < last:
                raise ValueError(f"tokens {spec.token_start}..{spec.token_end} need blocks "
                                 f"{first}..{last - 1}: {len(local)} local and {len(remote)} "
                                 "remote blocks")
            local, remote = local[first:last], remote[first:last]
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
        return list(local), list(remote)

    def _post(self, pending: _PendingLoad, remote: _Remote) -> None:
        spec = pending.spec
        if spec.notify_only:
            self._notify(remote, _NOTIF_RELEASE, spec.remote_request_id)
            return
        try:
            local, rblocks = self._blocks_to_move(spec)
            bad = [b for b in local if not 0 <= b < self._layers[0].num_blocks]
            bad += [b for b in rblocks if not 0 <= b < remote.layers[0].num_blocks]
            if bad:
                raise ValueError(f"block ids out of range: {bad[:8]}")
        except ValueError as exc:
            self._finish(pending, False, f"invalid load: {exc}")
            self._notify(remote, _NOTIF_RELEASE, spec.remote_request_id)
            return
        if not local:
            self._notify(remote, _NOTIF_RELEASE, spec.remote_request_id)
            self._finish(pending, True)
            return
        loc_arr, rem_arr, nbytes = build_descriptors(self._layers, self._device_id,
                                                     remote.layers, remote.device_id,
                                                     local, rblocks)
        notif = msgspec.msgpack.encode([_NOTIF_DONE, spec.remote_request_id, len(local),
                                        nbytes])
        pending.nbytes, pending.nblocks, pending.agent_name = nbytes, len(local), remote.agent_name
        pending.posted_at = time.monotonic()
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(loc_arr, self._mem_type),
                self._agent.get_xfer_descs(rem_arr, remote.mem_type), remote.agent_name, notif)
            pending.handle = handle
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own error types
            self._release(pending)
            self._finish(pending, False, f"posting the READ from engine {remote.engine_id} "
                         f"failed: {type(exc).__name__}: {exc}")
            self._drop_remote(remote)
            return
        if state == "ERR":
            self._release(pending)
            self._finish(pending, False, f"the READ from engine {remote.engine_id} failed")
            self._drop_remote(remote)
            return
        self._inflight[spec.request_id] = pending
        if state == "DONE":
            self._check_inflight(pending, remote)

    def _notify(self, remote: _Remote, kind: str, remote_request_id: str, *extra: int) -> None:
        try:
            self._agent.send_notif(remote.agent_name,
                                   msgspec.msgpack.encode([kind, remote_request_id, *extra]))
        except Exception as exc:  # noqa: BLE001 - best effort (the hold times out)
            logger.debug("NIXL: cannot notify engine %s about %s: %s", remote.engine_id,
                         remote_request_id, exc)

    def _release(self, pending: _PendingLoad) -> None:
        handle, pending.handle = pending.handle, None
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - could not cancel: keep it alive
            logger.debug("NIXL: cannot release a transfer handle: %s", exc)
            self._leaked_handles.append(handle)

    def _check_inflight(self, pending: _PendingLoad, remote: _Remote | None) -> None:
        spec = pending.spec
        try:
            state = self._agent.check_xfer_state(pending.handle)
            reason = f"the READ from engine {spec.remote_engine_id} failed"
        except Exception as exc:  # noqa: BLE001
            state, reason = "ERR", (f"the READ from engine {spec.remote_engine_id} failed: "
                                    f"{type(exc).__name__}: {exc}")
        if state == "PROC":
            if time.monotonic() <= pending.deadline:
                return
            # Fail the load now (no hang), but the READ cannot be cancelled: keep watching
            # it, keep its blocks unreleased and the remote agent loaded (invalidating it
            # would only hide the READ's completion).
            self._counters["transfer_timeouts"] += 1
            del self._inflight[spec.request_id]
            pending.zombie_until = time.monotonic() + self.abort_timeout_s
            self._zombies[spec.request_id] = pending
            self._report(pending, False, f"the READ from engine {spec.remote_engine_id} was "
                         f"not done after {self.transfer_timeout_s:g}s")
            return
        del self._inflight[spec.request_id]
        self._release(pending)
        if state == "DONE":
            self._stats.bytes_received += pending.nbytes
            self._stats.blocks_received += pending.nblocks
            self._stats.transfer_seconds += time.monotonic() - pending.posted_at
            self._finish(pending, True)
            return
        self._finish(pending, False, reason)
        if remote is not None:
            self._drop_remote(remote)

    def _check_zombie(self, pending: _PendingLoad) -> None:
        rid = pending.spec.request_id
        try:
            state = self._agent.check_xfer_state(pending.handle)
        except Exception:  # noqa: BLE001 - the handle is gone: nothing more will land
            state = "ERR"
        if state == "PROC" and time.monotonic() < pending.zombie_until:
            return
        del self._zombies[rid]
        if state == "DONE":
            self._counters["late_transfers_done"] += 1
        if state == "PROC":
            logger.error("NIXL: the READ of request %s is still not done %gs after its "
                         "timeout; releasing its blocks anyway", rid,
                         self.abort_timeout_s + self.transfer_timeout_s)
        else:
            logger.info("NIXL: the timed-out READ of request %s ended late (%s)", rid, state)
        self._release(pending)
        self._settle(pending)

    def _finish(self, pending: _PendingLoad, ok: bool, reason: str = "",
                report: bool = True) -> None:
        """The load is over: report it and release its blocks."""
        if pending.spec.notify_only:
            if not ok:
                logger.debug("NIXL: could not tell the producer to free request %s: %s",
                             pending.spec.remote_request_id, reason)
            return
        if report:
            self._report(pending, ok, reason)
        self._settle(pending)

    def _settle(self, pending: _PendingLoad) -> None:
        """No READ can write the load's blocks any more."""
        rid = pending.spec.request_id
        if self._by_request.get(rid) is pending:
            del self._by_request[rid]
            if pending.release_after:
                self._done_sending.add(rid)

    def _report(self, pending: _PendingLoad, ok: bool, reason: str = "") -> None:
        rid = pending.spec.request_id
        if pending.reported:
            return
        pending.reported = True
        if not ok:
            self._stats.load_failures += 1
            if len(self.load_errors) > 1000:
                self.load_errors.pop(next(iter(self.load_errors)))
            self.load_errors[rid] = reason
            logger.warning("NIXL: the KV load of request %s failed (it is recomputed): %s",
                           rid, reason)
        if pending.release_after:
            return  # the request is gone: only its blocks' release is reported
        if ok:
            self._done_receiving.add(rid)
        else:
            self._failed.add(rid)

    # -- producer side ---------------------------------------------------------------------
    def _sent(self, rid: str, blocks: int, nbytes: int) -> None:
        self._done_sending.add(rid)
        self._stats.blocks_sent += blocks
        self._stats.bytes_sent += nbytes

    def _poll_notifs(self) -> None:
        if self._agent is None:
            return
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:  # noqa: BLE001
            logger.warning("NIXL: reading notifications failed: %s", exc)
            return
        now = time.time()
        for agent_name, messages in notifs.items():
            for raw in messages:
                try:
                    kind, rid, *rest = msgspec.msgpack.decode(raw)
                    blocks, nbytes = (int(rest[0]), int(rest[1])) if kind == _NOTIF_DONE \
                        else (0, 0)
                except Exception:  # noqa: BLE001 - not one of ours
                    logger.debug("NIXL: ignoring a notification from %s: %r", agent_name,
                                 raw[:64])
                    continue
                if kind not in (_NOTIF_DONE, _NOTIF_RELEASE):
                    continue
                if rid in self._held:
                    del self._held[rid]
                    self._sent(rid, blocks, nbytes)
                else:
                    # Before the hold's metadata came (or after it timed out).
                    self._early_notifs[rid] = (now, blocks, nbytes)
        for rid, expires_at in list(self._held.items()):
            if now >= expires_at:
                del self._held[rid]
                self._counters["holds_timed_out"] += 1
                logger.warning("NIXL: no consumer read the KV of request %s within %gs: "
                               "freeing its blocks", rid, self.abort_timeout_s)
                self._done_sending.add(rid)
        for rid, (at, _, _) in list(self._early_notifs.items()):
            if now - at > self.abort_timeout_s:
                del self._early_notifs[rid]

    # -- reporting -------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            if self._closed:
                return set(), set()
            self._take_metadata()
            self._poll_handshakes()
            for pending in list(self._inflight.values()):
                self._check_inflight(pending, self._remotes.get(pending.spec.remote_engine_id))
            for pending in list(self._zombies.values()):
                self._check_zombie(pending)
            self._poll_notifs()
            sending, receiving = self._done_sending, self._done_receiving
            self._done_sending, self._done_receiving = set(), set()
            return sending, receiving

    def get_failed_loads(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
            return failed

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing to wait for: a consumer request runs only after its whole load."""

    def save_kv_layer(self, layer_index: int, kv_cache: Any, attn_metadata: Any) -> None:
        """Nothing to save: the consumer pulls the blocks."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""

    def stats(self) -> KVTransferStats:
        with self._lock:
            s = self._stats
            extra = {k: float(v) for k, v in self._counters.items()}
            extra.update(inflight_loads=float(len(self._inflight)),
                         timed_out_loads_pending=float(len(self._zombies)),
                         held_requests=float(len(self._held)))
            return KVTransferStats(bytes_sent=s.bytes_sent, bytes_received=s.bytes_received,
                                   blocks_sent=s.blocks_sent, blocks_received=s.blocks_received,
                                   transfer_seconds=s.transfer_seconds,
                                   load_failures=s.load_failures, extra=extra)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._server is not None:
                self._server.stop()
                self._server = None
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            if self._agent is None:
                return
            for pending in itertools.chain(self._inflight.values(), self._zombies.values()):
                self._release(pending)
            self._inflight.clear()
            self._zombies.clear()
            for remote in self._remotes.values():
                try:
                    self._agent.remove_remote_agent(remote.agent_name)
                except Exception as exc:  # noqa: BLE001 - already gone
                    logger.debug("NIXL: removing agent %s: %s", remote.agent_name, exc)
            self._remotes.clear()
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except Exception as exc:  # noqa: BLE001
                    logger.debug("NIXL: deregistering the KV cache failed: %s", exc)
                self._reg_descs = None
            self._agent = None
