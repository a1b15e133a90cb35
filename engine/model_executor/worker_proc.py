"""The life of one worker rank, shared by the multi-process and the Ray executors.

Wire (ZeroMQ, msgspec-msgpack, nothing pickled). The executor binds, the worker connects:

- executor -> worker (one PUSH per rank, the same bytes to every rank):
  ``EXECUTE`` [tag, SchedulerOutput, bitmask shape, bitmask bytes] once per step: the
  scheduler's diff, never tensors of model state; ``CALL`` [tag, WorkerCall];
  ``QUIT`` [tag].
- worker -> executor (PUSH into one PULL): ``READY`` after loading (the rank's KV
  capacity), ``OUTPUT`` (only the output rank: the step's ModelRunnerOutput),
  ``RESULT`` (a WorkerCall's answer, from every rank), ``FAILED`` (the error, then exit).
- heartbeats from a thread of each worker into a second PULL, every
  ``HEARTBEAT_INTERVAL_S``: a rank that stops beating (stopped, wedged holding the GIL)
  is declared dead by the executor; one whose parent died exits by itself.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import msgspec

from engine.core.kv_cache.groups import KVCacheLayout

EXECUTE, CALL, QUIT = b"E", b"C", b"Q"
READY, OUTPUT, RESULT, FAILED, HEARTBEAT = b"R", b"O", b"T", b"F", b"H"
HEARTBEAT_INTERVAL_S = 0.5

logger = logging.getLogger(__name__)


class WorkerSpec(msgspec.Struct, gc=False):
    """Everything a rank needs to start (sent as JSON to a process or a Ray actor)."""

    config_json: str
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_init_method: str  # tcp://host:port of rank 0
    input_address: str
    result_address: str
    heartbeat_address: str
    local_rank: int = 0
    local_world_size: int = 1
    parent_pid: int | None = None  # exit when this process is gone (None: Ray owns us)


class WorkerCall(msgspec.Struct, array_like=True, gc=False):
    method: str
    args: list[Any] = []


class WorkerReply(msgspec.Struct, array_like=True, gc=False):
    rank: int
    result: Any = None
    error: str | None = None


class WorkerReady(msgspec.Struct, array_like=True, gc=False):
    rank: int
    pid: int
    kv_block_capacity: int
    kv_block_bytes: int
    weights_bytes: int
    vocab_size: int
    kv_cache_layout: KVCacheLayout | None = None


encoder = msgspec.msgpack.Encoder()
spec_decoder = msgspec.json.Decoder(WorkerSpec)
call_decoder = msgspec.msgpack.Decoder(WorkerCall)
reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
ready_decoder = msgspec.msgpack.Decoder(WorkerReady)


def _beat(ctx: Any, spec: WorkerSpec, stop: threading.Event) -> None:
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(spec.heartbeat_address)
    rank = spec.rank.to_bytes(4, "little")
    try:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
                logger.warning("worker rank %d: the executor's process is gone; exiting",
                               spec.rank)
                os._exit(1)
            try:
                sock.send_multipart([HEARTBEAT, rank], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close(linger=0)


def run_worker(spec: WorkerSpec) -> bool:
    """Join the process group, load this rank's shard, then serve the executor until it
    says QUIT. Any error is reported (FAILED) before the rank exits; False then."""
    import zmq

    ctx = zmq.Context(io_threads=1)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.result_address)
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(ctx, spec, stop), daemon=True,
                            name="engine-worker-heartbeat")
    beat.start()
    try:
        worker = _start(spec)
        ready = WorkerReady(spec.rank, os.getpid(), worker.capacity, worker.kv_block_bytes(),
                            worker.weights_bytes, worker.model.vocab_size,
                            worker.kv_cache_layout)
        outbox.send_multipart([READY, encoder.encode(ready)])
        _serve(worker, inbox, outbox)
        return True
    except Exception as exc:  # report it: the executor turns it into a clear error
        logger.exception("worker rank %d failed", spec.rank)
        outbox.send_multipart([FAILED, encoder.encode(
            WorkerReply(spec.rank, error=f"{type(exc).__name__}: {exc}"))])
        return False
    finally:
        stop.set()
        beat.join(timeout=2)
        inbox.close(linger=0)
        outbox.close()
        from engine.distributed.parallel_state import destroy_parallel_state

        try:
            destroy_parallel_state()
        except Exception as exc:  # noqa: BLE001 - peers may be gone already
            logger.debug("leaving the process group: %s", exc)
        ctx.term()


def _start(spec: WorkerSpec):
    from engine.core.config import EngineConfig
    from engine.core.plugins import get_plugin_registry, resolve_platform
    from engine.distributed.parallel_state import (
        ParallelLayout,
        init_parallel_state,
        rendezvous,
    )
    from engine.model_executor.worker import Worker

    get_plugin_registry().prepare_worker_process()
    config = EngineConfig.model_validate_json(spec.config_json)
    platform = resolve_platform(config.device.device)
    platform.bind_worker(spec.local_rank, spec.local_world_size)
    parallel = init_parallel_state(platform.communicator_cls(),
                                   ParallelLayout.of_rank(config.parallel, spec.rank),
                                   **rendezvous(config.parallel, spec.distributed_init_method))
    worker = Worker(config, platform, parallel)
    worker.capacity = worker.load()
    return worker


def _serve(worker: Any, inbox: Any, outbox: Any) -> None:
    from engine.model_executor.step_codec import decode_step

    while True:
        frames = inbox.recv_multipart(copy=False)
        tag = bytes(frames[0].buffer)
        if tag == QUIT:
            worker.shutdown()
            return
        if tag == EXECUTE:
            so, bitmask = decode_step(frames[1:])
            output = worker.execute_model(so, bitmask)
            if worker.is_output_rank:
                outbox.send_multipart([OUTPUT, encoder.encode(output)], copy=False)
        elif tag == CALL:
            call = call_decoder.decode(frames[1].buffer)
            result = getattr(worker, call.method)(*call.args)
            outbox.send_multipart([RESULT, encoder.encode(WorkerReply(worker.layout.rank,
                                                                      result))])
        else:
            raise ValueError(f"unknown message tag {tag!r} from the executor")


def main() -> None:
    import signal
    import sys

    # Ctrl-C reaches the whole process group: the executor, not the terminal, stops ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("ENGINE_LOG_LEVEL", "INFO").upper(),
        format=f"(Worker pid={os.getpid()}) %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    spec = spec_decoder.decode(sys.stdin.buffer.read())
    ok = run_worker(spec)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # skip interpreter teardown (seconds with torch loaded)


if __name__ == "__main__":
    main()
