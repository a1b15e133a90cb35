"""NixlConnector: real NIXL (UCX over TCP loopback) between real processes, no engine.

Every engine here is a spawned process (an "actor") holding a small CPU KV cache (3
layers of ``(2, num_blocks, heads, block_size * head)`` float32, the CPU backend's
layout, with known random contents) and both halves of a connector; the test drives the
scheduler-side calls with fake requests and passes the metadata through msgspec as the
engine does. The pure parts (scheduler protocol, geometry, layout check) run in-process
and need no NIXL.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import socket
import time
import traceback
from types import SimpleNamespace

import msgspec
import pytest

from engine.core.config import KVTransferConfig
from engine.core.interfaces.kv_connector import KVCacheLayout, KVConnectorRole
from engine.kv_transfer.nixl_connector import (
    NixlConnector,
    NixlConnectorMetadata,
    build_descriptors,
    compare_layouts,
    layer_geometry,
)

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
LAYERS, HEADS, HEAD, BS = 3, 2, 8, 4


def _nixl_problem() -> str | None:
    try:
        import nixl  # noqa: F401
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - missing wheel or unloadable libraries
        return f"nixl is not importable: {type(exc).__name__}: {exc}"
    return None


def _require_nixl() -> None:
    problem = _nixl_problem()
    if problem is not None:
        if os.environ.get("ENGINE_CI") == "1":
            pytest.fail(f"{problem} (NIXL must be installed in CI: pip install nixl)")
        pytest.skip(problem)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(num_blocks: int, *, heads: int = HEADS, head: int = HEAD, block_size: int = BS,
            layers: int = LAYERS) -> KVCacheLayout:
    return KVCacheLayout(num_layers=layers, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=heads, head_size=head, dtype="float32", block_dim=1,
                         block_bytes=2 * heads * block_size * head * 4, backend="cpu")


def _config(role: str, engine_id: str, port: int, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=engine_id,
                            kv_ip="127.0.0.1", kv_port=port, kv_connector_extra_config=extra)


def _engine_config(block_size: int = BS):
    return SimpleNamespace(cache=SimpleNamespace(block_size=block_size),
                           parallel=SimpleNamespace(tensor_parallel_size=1))


def _request(rid: str, n_prompt: int, params: dict | None, status=None):
    from engine.core.request import RequestStatus

    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                           num_prompt_tokens=n_prompt, kv_transfer_params=params,
                           status=status or RequestStatus.FINISHED_LENGTH,
                           output_token_ids=[])


def _through_msgspec(meta):
    """What the engine does to cross to a worker process."""
    raw = msgspec.msgpack.encode(meta)
    return msgspec.convert(msgspec.msgpack.decode(raw), NixlConnector.metadata_cls)


# -- the actor process -------------------------------------------------------------------
class _Node:
    """One process's engines: name -> (cache, scheduler half, worker half)."""

    def __init__(self) -> None:
        self.engines: dict[str, SimpleNamespace] = {}
        self.requests: dict[str, tuple] = {}

    def setup(self, name: str, role: str, engine_id: str, port: int, *, num_blocks: int = 64,
              heads: int = HEADS, head: int = HEAD, seed: int | None = None,
              **extra) -> None:
        import torch

        shape = (2, num_blocks, heads, BS * head)
        if seed is None:
            caches = [torch.zeros(shape) for _ in range(LAYERS)]
        else:
            gen = torch.Generator().manual_seed(seed)
            caches = [torch.randn(shape, generator=gen) for _ in range(LAYERS)]
        config = _config(role, engine_id, port, **extra)
        worker = NixlConnector(config, KVConnectorRole.WORKER, _engine_config())
        worker.register_kv_caches(caches, _layout(num_blocks, heads=heads, head=head))
        self.engines[name] = SimpleNamespace(
            caches=caches, worker=worker,
            sched=NixlConnector(config, KVConnectorRole.SCHEDULER, _engine_config()),
            # A scheduler half that does not know the block size: the worker slices.
            sched_nobs=NixlConnector(config, KVConnectorRole.SCHEDULER),
            sending=set(), receiving=set(), failed=set())

    def _step(self, e, sched) -> None:
        e.worker.bind_connector_metadata(_through_msgspec(sched.build_connector_meta(None)))
        e.worker.start_load_kv()
        sending, receiving = e.worker.get_finished(set())
        e.sending |= sending
        e.receiving |= receiving
        e.failed |= e.worker.get_failed_loads()

    def produce(self, name: str, rid: str, block_ids: list[int], n_prompt: int) -> dict:
        e = self.engines[name]
        req = _request(rid, n_prompt, {"do_remote_decode": True})
        assert e.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        delay, params = e.sched.request_finished(req, block_ids)
        assert delay is True and params is not None
        self._step(e, e.sched)  # the hold reaches the worker
        return params

    def consume(self, name: str, rid: str, params: dict, n_prompt: int, num_computed: int,
                block_ids: list[int], block_size_known: bool = True) -> tuple[int, bool]:
        e = self.engines[name]
        sched = e.sched if block_size_known else e.sched_nobs
        req = _request(rid, n_prompt, dict(params))
        matched = sched.get_num_new_matched_tokens(req, num_computed)
        self.requests[rid] = (req, block_ids, sched)
        if matched[1]:
            sched.update_state_after_alloc(req, block_ids, matched[0])
            assert req.kv_transfer_params["do_remote_prefill"] is False
        self._step(e, sched)
        return matched

    def finish(self, name: str, rid: str) -> tuple:
        """The consumer request finishes (or is aborted): request_finished, one step."""
        from engine.core.request import RequestStatus

        req, block_ids, sched = self.requests[rid]
        req.status = RequestStatus.FINISHED_ABORTED
        result = sched.request_finished(req, block_ids)
        self._step(self.engines[name], sched)
        return result

    def wait_for(self, name: str, kind: str, rid: str, timeout: float) -> float:
        """Step until ``rid`` is in ``kind`` (sending/receiving/failed); the seconds it took."""
        e = self.engines[name]
        start = time.monotonic()
        while rid not in getattr(e, kind):
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{rid} not in {kind} after {timeout}s: sending "
                                   f"{e.sending}, receiving {e.receiving}, failed {e.failed}"
                                   f", errors {e.worker.load_errors}")
            self._step(e, e.sched)
            time.sleep(0.005)
        return time.monotonic() - start

    def reported(self, name: str) -> dict:
        e = self.engines[name]
        return {"sending": set(e.sending), "receiving": set(e.receiving),
                "failed": set(e.failed), "errors": dict(e.worker.load_errors)}

    def blocks(self, name: str, block_ids: list[int]) -> bytes:
        import torch

        caches = self.engines[name].caches
        return torch.stack([c[:, block_ids] for c in caches]).contiguous().numpy().tobytes()

    def stats(self, name: str) -> dict:
        s = self.engines[name].worker.stats()
        return {"bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
                "blocks_sent": s.blocks_sent, "blocks_received": s.blocks_received,
                "transfer_seconds": s.transfer_seconds, "load_failures": s.load_failures,
                **s.extra}

    def close(self) -> None:
        for e in self.engines.values():
            e.worker.shutdown()


def _actor_main(conn, env: dict) -> None:
    os.environ.update(env)  # before NIXL creates its UCX context
    node = _Node()
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            conn.send(("ok", getattr(node, method)(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            conn.send(("err", traceback.format_exc()))
    node.close()
    conn.send(("ok", None))


class Actor:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_actor_main, args=(child, UCX_ENV), daemon=True)
        self.proc.start()

    def send(self, method: str, *args, **kwargs) -> None:
        self.conn.send((method, args, kwargs))

    def result(self, timeout: float = 30):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"actor call took over {timeout}s")
        status, value = self.conn.recv()
        if status == "err":
            raise AssertionError(f"actor call failed:\n{value}")
        return value

    def __call__(self, method: str, *args, timeout: float = 30, **kwargs):
        self.send(method, *args, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        self.begin_close()
        self.end_close()

    def begin_close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass

    def end_close(self) -> None:
        if self.proc.is_alive():
            try:
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.kill()


@pytest.fixture(scope="module")
def cluster():
    _require_nixl()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    producer, consumer, doomed = Actor(ctx), Actor(ctx), Actor(ctx)
    ports = SimpleNamespace(p1=_free_port(), p2=_free_port(), pk=_free_port(),
                            c=_free_port(), ghost=_free_port())
    try:
        # The setups run concurrently (each is a process start, torch, a NIXL agent).
        producer.send("setup", "p1", "kv_producer", "prod-1", ports.p1, seed=1,
                      abort_timeout_s=2)
        doomed.send("setup", "pk", "kv_producer", "prod-k", ports.pk, seed=3)
        consumer.send("setup", "c", "kv_consumer", "cons-1", ports.c, num_blocks=48,
                      transfer_timeout_s=3, handshake_timeout_s=2)
        for actor in (producer, doomed, consumer):
            actor.result(60)
        # Same model but another head size: its layout must be refused.
        producer("setup", "p2", "kv_producer", "prod-2", ports.p2, seed=2, head=16)
        yield SimpleNamespace(producer=producer, consumer=consumer, doomed=doomed,
                              ports=ports)
    finally:
        for actor in (producer, consumer, doomed):
            actor.begin_close()
        for actor in (producer, consumer, doomed):
            actor.end_close()


# -- end to end ----------------------------------------------------------------------------
@pytest.mark.parametrize("block_size_known", [True, False])
def test_blocks_arrive_byte_for_byte_and_producer_frees(cluster, block_size_known):
    p, c = cluster.producer, cluster.consumer
    rid = f"req-copy-{block_size_known}"
    n_prompt = 37  # 10 blocks of 4; the consumer loads tokens 8..35 (blocks 2..8)
    remote_ids = [60, 3, 17, 18, 19, 20, 5, 40, 41, 9]  # runs and gaps
    local_ids = [30, 31, 2, 3, 4, 10, 11, 12, 20, 21] if block_size_known else \
        [32, 33, 6, 7, 8, 13, 14, 15, 22, 23]
    params = p("produce", "p1", rid, remote_ids, n_prompt)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prod-1"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", cluster.ports.p1)
    assert params["remote_block_ids"] == remote_ids and params["remote_request_id"] == rid

    matched = c("consume", "c", "c-" + rid, params, n_prompt, 8, local_ids,
                block_size_known=block_size_known)
    assert matched == (n_prompt - 1 - 8, True)
    c("wait_for", "c", "receiving", "c-" + rid, 10)

    loaded = slice(2, math.ceil((n_prompt - 1) / BS))  # blocks 2..8
    assert c("blocks", "c", local_ids[loaded]) == p("blocks", "p1", remote_ids[loaded])
    # The local prefix hit (blocks 0, 1) and the last prompt token's block are untouched.
    untouched = local_ids[:2] + local_ids[loaded.stop:]
    assert c("blocks", "c", untouched) == bytes(len(untouched) * LAYERS * 2 * HEADS * BS
                                                * HEAD * 4)

    took = p("wait_for", "p1", "sending", rid, 5)
    assert c("finish", "c", "c-" + rid) == (True, None)  # freed once the worker says so
    c("wait_for", "c", "sending", "c-" + rid, 2)
    assert took < 2, "done_sending must come from the notification, not the abort timeout"
    block_bytes = LAYERS * 2 * HEADS * BS * HEAD * 4
    c_stats, p_stats = c("stats", "c"), p("stats", "p1")
    assert c_stats["blocks_received"] >= 7 and c_stats["bytes_received"] >= 7 * block_bytes
    assert p_stats["blocks_sent"] >= 7 and p_stats["bytes_sent"] >= 7 * block_bytes
    assert c_stats["load_failures"] == 0 and p_stats["holds_timed_out"] == 0


def test_unclaimed_hold_is_released_after_abort_timeout(cluster):
    p = cluster.producer
    p("produce", "p1", "req-orphan", [1, 2], 6)
    took = p("wait_for", "p1", "sending", "req-orphan", 6)
    assert 1.5 < took < 4  # abort_timeout_s=2
    assert p("stats", "p1")["holds_timed_out"] == 1


def test_layout_mismatch_is_refused_with_both_layouts(cluster):
    p, c = cluster.producer, cluster.consumer
    params = p("produce", "p2", "req-mismatch", [0, 1, 2], 9)
    assert c("consume", "c", "c-mismatch", params, 9, 0, [40, 41, 42]) == (8, True)
    c("wait_for", "c", "failed", "c-mismatch", 10)
    reported = c("reported", "c")
    assert "c-mismatch" not in reported["receiving"]
    error = reported["errors"]["c-mismatch"]
    assert "layout differs" in error and "head_size: local 8, remote 16" in error
    assert "2 KV heads x 8" in error and "2 KV heads x 16" in error  # both layouts named


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is stopped (state ``T`` in /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


def test_stalled_or_killed_producer_fails_the_load_without_hanging(cluster):
    k, c = cluster.doomed, cluster.consumer
    # A first load from it works (and leaves its handshake cached) ...
    first = k("produce", "pk", "req-k1", [4, 5], 8)
    c("consume", "c", "c-k1", first, 8, 0, [44, 45])
    c("wait_for", "c", "receiving", "c-k1", 10)
    stalled, after, last = (k("produce", "pk", f"req-k{i}", [6 + 2 * i, 7 + 2 * i], 8)
                            for i in (2, 3, 4))
    # ... then it stops answering (SIGSTOP: its UCX never serves the READ): the transfer
    # times out ...
    os.kill(k.proc.pid, signal.SIGSTOP)
    _wait_stopped(k.proc.pid)  # the signal lands asynchronously: no READ may beat it
    try:
        start = time.monotonic()
        c("consume", "c", "c-k2", stalled, 8, 0, [40, 41])
        c("wait_for", "c", "failed", "c-k2", 10)
        assert time.monotonic() - start < 3 + 2  # transfer_timeout_s=3, plus slack
        assert "not done after 3s" in c("reported", "c")["errors"]["c-k2"]
        # A posted READ cannot be cancelled: the request's blocks stay unreleased while
        # it may still land.
        assert c("finish", "c", "c-k2") == (True, None)
        time.sleep(0.3)
        assert c("finish", "c", "c-k1") == (True, None)  # long done: released at once
        assert "c-k1" in c("reported", "c")["sending"]
        assert "c-k2" not in c("reported", "c")["sending"]
        assert c("stats", "c")["timed_out_loads_pending"] == 1
    finally:
        os.kill(k.proc.pid, signal.SIGCONT)
    c("wait_for", "c", "sending", "c-k2", 10)  # it ended (landed late): released now
    assert c("stats", "c")["timed_out_loads_pending"] == 0
    # ... it recovers (a new handshake) ...
    c("consume", "c", "c-k3", after, 8, 0, [42, 43])
    c("wait_for", "c", "receiving", "c-k3", 10)
    # ... then dies holding a request's blocks.
    k.kill()
    start = time.monotonic()
    c("consume", "c", "c-k4", last, 8, 0, [46, 47])
    c("wait_for", "c", "failed", "c-k4", 10)
    assert time.monotonic() - start < 3 + 2
    reported = c("reported", "c")
    assert not {"c-k2", "c-k4"} & reported["receiving"]
    assert c("stats", "c")["transfer_timeouts"] >= 1


def test_unreachable_producer_fails_the_handshake(cluster):
    """A producer killed before any handshake: nobody answers its side channel."""
    c = cluster.consumer
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": "ghost", "remote_host": "127.0.0.1",
              "remote_port": cluster.ports.ghost, "remote_block_ids": [0, 1],
              "remote_request_id": "req-ghost"}
    start = time.monotonic()
    c("consume", "c", "c-ghost", params, 8, 0, [36, 37])
    c("wait_for", "c", "failed", "c-ghost", 10)
    assert time.monotonic() - start < 2 + 2  # handshake_timeout_s=2
    assert "handshake" in c("reported", "c")["errors"]["c-ghost"]


# -- in-process: the scheduler protocol -------------------------------------------------
def test_scheduler_protocol():
    from engine.core.request import RequestStatus

    prod = NixlConnector(_config("kv_producer", "p", 20000, abort_timeout_s=7),
                         KVConnectorRole.SCHEDULER, _engine_config())
    req = _request("r1", 10, {"do_remote_decode": True})
    assert prod.get_num_new_matched_tokens(req, 0) == (0, False)
    before = time.time()
    delay, params = prod.request_finished(req, [4, 5, 6])
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "p", "remote_host": "127.0.0.1",
                      "remote_port": 20000, "remote_block_ids": [4, 5, 6],
                      "remote_request_id": "r1", "remote_tp_size": 1}
    meta = _through_msgspec(prod.build_connector_meta(None))
    assert [h.request_id for h in meta.holds] == ["r1"]
    assert before + 7 <= meta.holds[0].expires_at <= time.time() + 7
    assert prod.build_connector_meta(None) == NixlConnectorMetadata()  # sent once
    # Not a remote decode, or aborted: nothing kept.
    assert prod.request_finished(_request("r2", 10, None), [1]) == (False, None)
    aborted = _request("r3", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    assert prod.request_finished(aborted, [1]) == (False, None)

    cons = NixlConnector(_config("kv_consumer", "c", 20100), KVConnectorRole.SCHEDULER,
                         _engine_config())
    creq = _request("c1", 10, dict(params))
    assert cons.get_num_new_matched_tokens(creq, 4) == (5, True)  # 10 - 1 - 4
    cons.update_state_after_alloc(creq, [7, 8, 9], 5)
    meta = _through_msgspec(cons.build_connector_meta(None))
    (load,) = meta.loads
    # Tokens 4..8 are blocks 1 and 2 (block 0 is the local hit).
    assert (load.local_block_ids, load.remote_block_ids) == ([8, 9], [5, 6])
    assert (load.remote_engine_id, load.remote_request_id, load.remote_port) == ("p", "r1",
                                                                                   20000)
    assert cons.build_connector_meta(None).loads == []
    # Loaded once: asking again finds nothing to load.
    assert cons.get_num_new_matched_tokens(creq, 0) == (0, False)
    # Prefix hit covering the prompt, missing params, too few remote blocks: local compute.
    assert cons.get_num_new_matched_tokens(_request("c2", 10, dict(params)), 9) == (0, False)
    broken = {k: v for k, v in params.items() if k != "remote_host"}
    assert cons.get_num_new_matched_tokens(_request("c3", 10, broken), 0) == (0, False)
    short = {**params, "remote_block_ids": [1]}
    assert cons.get_num_new_matched_tokens(_request("c4", 10, short), 0) == (0, False)
    # Finished before it was scheduled: the producer is told to free its blocks.
    assert cons.request_finished(_request("c5", 10, dict(params)), []) == (False, None)
    (notify,) = cons.build_connector_meta(None).loads
    assert notify.notify_only and notify.remote_request_id == "r1"
    # Aborted while its load may be in flight: blocks kept until the load is over.
    creq6 = _request("c6", 10, dict(params), RequestStatus.FINISHED_ABORTED)
    assert cons.get_num_new_matched_tokens(creq6, 0) == (9, True)
    cons.update_state_after_alloc(creq6, [1, 2, 3], 9)
    cons.build_connector_meta(None)
    assert cons.request_finished(creq6, [1, 2, 3]) == (True, None)
    assert cons.build_connector_meta(None).release_after_load == ["c6"]


def test_worker_slices_when_the_scheduler_does_not_know_the_block_size():
    cons = NixlConnector(_config("kv_consumer", "c", 20100), KVConnectorRole.SCHEDULER)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h",
              "remote_port": 1, "remote_block_ids": [10, 11, 12, 13],
              "remote_request_id": "r"}
    req = _request("c", 14, params)
    assert cons.get_num_new_matched_tokens(req, 4) == (9, True)
    cons.update_state_after_alloc(req, [0, 1, 2, 3], 9)
    (load,) = cons.build_connector_meta(None).loads
    assert not load.presliced and (load.token_start, load.token_end) == (4, 13)
    worker = NixlConnector(_config("kv_consumer", "c", 20100), KVConnectorRole.WORKER)
    worker._layout = _layout(16)
    assert worker._blocks_to_move(load) == ([1, 2, 3], [11, 12, 13])


# -- in-process: geometry and layout check ----------------------------------------------
@pytest.mark.parametrize("shape,block_dim", [
    ((2, 9, 3, 4 * 5), 1),  # CPU backend MHA: (2, blocks, heads, block_size*head)
    ((2, 9, 4, 3, 5), 1),  # Triton backend MHA: (2, blocks, block_size, heads, head)
    ((9, 4, 7), 0),  # MLA: (blocks, block_size, latent)
])
def test_descriptors_address_exactly_the_blocks(shape, block_dim):
    import torch

    src = [torch.randn(shape) for _ in range(2)]
    dst = [torch.zeros(shape) for _ in range(2)]
    geo = lambda ts: [layer_geometry(t.data_ptr(), t.shape, t.stride(), t.element_size(),
                                     block_dim) for t in ts]
    local_blocks, remote_blocks = [0, 1, 2, 5, 7], [3, 4, 5, 1, 8]
    loc, rem, nbytes = build_descriptors(geo(dst), 0, geo(src), 0, local_blocks,
                                         remote_blocks)
    assert nbytes == 2 * len(local_blocks) * src[0].select(block_dim, 0).nbytes
    # Runs merged: (0,3)(1,4)(2,5) is one run, then two single blocks, per layer and half.
    halves = 2 if block_dim == 1 else 1
    assert len(loc) == 2 * halves * 3
    for (la, ln, _), (ra, rn, _) in zip(loc.tolist(), rem.tolist()):  # copy by hand
        assert ln == rn
        ctypes.memmove(la, ra, ln)
    for s, d in zip(src, dst):
        for lb, rb in zip(local_blocks, remote_blocks):
            assert torch.equal(d.select(block_dim, lb), s.select(block_dim, rb))
        untouched = [b for b in range(shape[block_dim]) if b not in local_blocks]
        assert not d.index_select(block_dim, torch.tensor(untouched)).any()


def test_layout_comparison_names_each_difference():
    local = _layout(64)
    assert compare_layouts(local, {**local.__dict__, "num_blocks": 10, "tp_rank": 3}) == []
    diffs = compare_layouts(local, {**local.__dict__, "block_size": 16, "dtype": "bfloat16"})
    assert diffs == ["dtype: local 'float32', remote 'bfloat16'",
                     "block_size: local 4, remote 16"]


def test_producer_frees_on_notification_even_before_its_hold_arrives():
    """Worker bookkeeping with a stand-in agent: a notification may overtake the hold."""
    worker = NixlConnector(_config("kv_producer", "p", 20000, abort_timeout_s=60),
                           KVConnectorRole.WORKER)
    notifs: dict[str, list[bytes]] = {}
    worker._agent = SimpleNamespace(get_new_notifs=lambda: notifs.copy() or {})

    def step(holds=()):
        worker.bind_connector_metadata(NixlConnectorMetadata(holds=list(holds)))
        return worker.get_finished(set())

    from engine.kv_transfer.nixl_connector import NixlHold

    notifs["c"] = [msgspec.msgpack.encode(["done", "early", 2, 1024]), b"not ours"]
    assert step() == (set(), set())  # nothing held yet: remembered
    notifs.clear()
    assert step([NixlHold("early", time.time() + 60, 2)]) == ({"early"}, set())
    assert step([NixlHold("late", time.time() + 60, 1),
                 NixlHold("expired", time.time() - 1, 1)]) == ({"expired"}, set())
    notifs["c"] = [msgspec.msgpack.encode(["release", "late"])]
    assert step() == ({"late"}, set())
    stats = worker.stats()
    assert (stats.blocks_sent, stats.bytes_sent, stats.extra["holds_timed_out"]) == (2, 1024, 1)
