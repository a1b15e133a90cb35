"""The engine core in its own process, so tokenization and HTTP never stall the step loop.

Run as ``python -m engine.core.core_proc --run-dir DIR --parent-pid PID`` by
:class:`engine.core.mp_client.CoreProcess`; ``DIR`` holds ``config.json`` (an
``EngineConfig``) and the two ipc sockets the parent has bound (``input``, ``output``).
The wire format is in :mod:`engine.core.core_protocol`.

Lifecycle: connect the sockets, let the installed platforms prepare the process (before
torch loads), build the ``EngineCore`` (the model loads here), send
READY (or DEAD with the error text if startup failed), then loop:

1. read input: without blocking while requests are running (drain everything pending),
   or block up to ``IDLE_POLL_S`` when idle;
2. step the core and send its outputs.

An exception in the loop sends DEAD with the error text and exits 1. SIGTERM/SIGINT, a
``shutdown`` utility call, or the parent disappearing end the loop cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from engine.core import core_protocol as wire
from engine.core.core_endpoints import ClientEndpoint, CoreEndpoints, load_endpoints
from engine.core.engine_io import EngineCoreOutput, EngineCoreOutputs
from engine.core.request import FinishReason
from engine.distributed.dp_lockstep import PeerRankLost

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

logger = logging.getLogger("engine.core.core_proc")

IDLE_POLL_S = 0.5  # how often an idle core checks that its parent is alive
PEER_LOST_GRACE_S = 5.0  # a lockstep rank whose peer left waits this long for its SIGTERM
SEND_RETRY_S = 0.5  # a blocked send re-checks the parent this often
CONFIG_FILE = "config.json"
DP_RANK_ENV = "ENGINE_DP_RANK_TAG"  # "_DP<rank>" in a data-parallel rank's log prefix


def ipc_addresses(run_dir: str | Path) -> tuple[str, str]:
    """(input, output) socket addresses inside a run directory."""
    return f"ipc://{run_dir}/input", f"ipc://{run_dir}/output"


class _ShutdownRequested(BaseException):
    """Raised by the signal handler; a BaseException so no ``except Exception`` eats it."""


class ParentGone(BaseException):
    """The front end that started this core no longer exists: nobody reads our output."""


class EngineCoreProc:
    """Owns an EngineCore and the two sockets; runs the busy loop."""

    # EngineCore methods a front end may call as utilities (looked up when called).
    CORE_UTILITIES = ("reset_prefix_cache", "sleep", "wake_up", "is_sleeping",
                      "pause_scheduling", "abort_all_requests", "resume_scheduling",
                      "update_weights", "init_weight_update_group",
                      "update_weights_from_distributed", "update_weights_from_tensors",
                      "add_lora", "remove_lora", "list_loras")

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int,
        endpoints: CoreEndpoints | None = None,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        # Several front ends (endpoints.json) or the one pair: routes replies per client.
        self.endpoints = endpoints or CoreEndpoints(
            [input_socket], [output_socket], self._check_parent)
        self._client = 0  # the front end whose message is being handled
        self.shutdown_requested = False
        self._totals = wire.EngineCoreStats(num_kv_blocks=core.num_kv_blocks)
        # A data-parallel rank reports its KV usage with each step's outputs (routing).
        self._report_kv_usage = core.config.parallel.data_parallel_size > 1
        self._utilities: dict[str, Callable[..., Any]] = {
            "get_stats": self._get_stats,
            "ping": lambda: True,
            "shutdown": self._request_shutdown,
        }

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        if self.core.dp_lockstep is not None:
            self._run_lockstep()
            return
        while not self.shutdown_requested:
            busy = self.core.has_unfinished_requests()
            self._process_input(block=not busy)
            if not busy:  # a worker rank that died while idle fails the core now
                self.core.check_health()
            if self.shutdown_requested or not self.core.has_unfinished_requests():
                continue
            self._send_step_outputs(self.core.step())

    def _run_lockstep(self) -> None:
        """The loop of a data-parallel rank whose experts span the ranks: every
        iteration the cores agree whether any has work; if so every core steps (a dummy
        forward where it has none), so each forward's all-to-all finds every rank."""
        sync = self.core.dp_lockstep
        while not self.shutdown_requested:
            busy = self.core.has_unfinished_requests()
            # Idle everywhere: wait (bounded) for a request or the front end's WAKE.
            self._process_input(block=not busy and not sync.wave_running)
            if not busy:
                self.core.check_health()
            if self.shutdown_requested:
                return
            try:
                if not sync.any_busy(self.core.has_unfinished_requests()):
                    continue
            except PeerRankLost:
                # A shutdown stops the ranks one after another: ours is on its way (the
                # signal ends this wait cleanly). Else a rank died: this one fails too.
                time.sleep(PEER_LOST_GRACE_S)
                raise
            self._send_step_outputs(self.core.step())

    def _send_step_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.outputs or outputs.finished_requests:
            if self._report_kv_usage:
                outputs.kv_cache_usage = self.core.scheduler.kv_cache_manager.usage
            self.send(wire.OUTPUTS, outputs)

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise ParentGone

    def _process_input(self, block: bool) -> None:
        """Handle every pending message; when ``block``, first wait for one (bounded)."""
        self._check_parent()
        self._abort_dead_clients()
        if block and not self.endpoints.poll(int(IDLE_POLL_S * 1000)):
            return
        for client, tag, payload in self.endpoints.receive_pending():
            self._client = client
            self._handle(tag, payload)

    def _abort_dead_clients(self) -> None:
        """A front end that died leaves no requests behind (their KV blocks are freed)."""
        for client in self.endpoints.dead_clients():
            request_ids = self.endpoints.take_requests(client)
            logger.warning("front end %d is gone: aborting its %d request(s)", client,
                           len(request_ids))
            if request_ids:
                self.core.abort_requests(request_ids)

    def _handle(self, tag: bytes, payload: memoryview) -> None:
        if tag == wire.ADD:
            self._add_request(payload)
        elif tag == wire.ABORT:
            request_ids = wire.abort_decoder.decode(payload)
            for request_id in request_ids:
                self.endpoints.owner.pop(request_id, None)
            self.core.abort_requests(request_ids)
        elif tag == wire.UTILITY:
            self._call_utility(wire.utility_call_decoder.decode(payload))
        elif tag == wire.WAKE:
            pass  # it has done its work: the wait for input is over
        else:
            raise ValueError(f"unknown message tag {tag!r} from the front end")

    def _add_request(self, payload: memoryview) -> None:
        request = wire.request_decoder.decode(payload)
        self.endpoints.owner[request.request_id] = self._client
        try:
            self.core.add_request(request)
        except ValueError as exc:
            # One bad request must not kill the engine: finish it so its caller never hangs.
            logger.error("rejected request %s: %s", request.request_id, exc)
            rejected = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=int(FinishReason.ABORT),
            )
            self.send(
                wire.OUTPUTS, EngineCoreOutputs(outputs=[rejected], timestamp=time.monotonic())
            )

    # -- utility calls ----------------------------------------------------------------------
    def _call_utility(self, call: wire.UtilityCall) -> None:
        method = self._utilities.get(call.method)
        if method is None and call.method in self.CORE_UTILITIES:
            method = getattr(self.core, call.method)
        if method is None:
            known = ", ".join(sorted((*self._utilities, *self.CORE_UTILITIES)))
            reply = wire.UtilityResult(
                call.call_id, error=f"ValueError: unknown utility {call.method!r} (known: {known})"
            )
        else:
            try:
                reply = wire.UtilityResult(call.call_id, result=method(*call.args))
            except Exception as exc:  # noqa: BLE001 - the caller gets the error; the engine lives on
                reply = wire.UtilityResult(call.call_id, error=wire.describe_exception(exc))
        self.send(wire.UTILITY_RESULT, reply)

    def _get_stats(self) -> wire.EngineCoreStats:
        """Fold the scheduler's interval counters into cumulative totals."""
        interval = self.core.get_stats()
        totals = self._totals
        totals.num_running = interval.num_running
        totals.num_waiting = interval.num_waiting
        totals.kv_cache_usage = interval.kv_cache_usage
        totals.prefix_cache_queries_total += interval.prefix_cache_queries
        totals.prefix_cache_hits_total += interval.prefix_cache_hits
        totals.prefix_cache_requests_total += interval.prefix_cache_requests
        totals.num_preemptions_total += interval.num_preemptions
        if interval.spec is not None:  # None: speculative decoding is off
            totals.add_spec_interval(interval.spec)
        totals.prompt_tokens_computed_total += interval.prompt_tokens_computed
        totals.kv_transfer_loaded_tokens_total += interval.external_tokens_loaded
        if self.core.kv_connector is not None:
            totals.kv_transfer_enabled = True
            totals.kv_transfer_blocks_held = interval.num_held_for_send
            kv = interval.kv_transfer
            if kv is not None:  # the worker side's cumulative counters
                totals.kv_transfer_bytes_sent_total = kv.bytes_sent
                totals.kv_transfer_bytes_received_total = kv.bytes_received
                totals.kv_transfer_blocks_sent_total = kv.blocks_sent
                totals.kv_transfer_blocks_received_total = kv.blocks_received
                totals.kv_transfer_seconds_total = kv.transfer_seconds
                totals.kv_transfer_load_failures_total = kv.load_failures
        if interval.expert_load is not None:
            totals.add_expert_load(interval.expert_load)
            parallel = self.core.config.parallel
            totals.moe_expert_parallel_size = (
                parallel.tensor_parallel_size * parallel.data_parallel_size
                if parallel.dp_lockstep else parallel.tensor_parallel_size
                if parallel.enable_expert_parallel else 1)
        sync = self.core.dp_lockstep
        if sync is not None:
            totals.dp_lockstep_waves_total = sync.waves
            totals.dp_dummy_steps_total = sync.dummy_steps
        totals.structured_output = self.core.structured_output_manager.stats.snapshot()
        totals.max_loras = interval.max_loras
        totals.running_lora_adapters = interval.running_lora_adapters
        totals.waiting_lora_adapters = interval.waiting_lora_adapters
        return totals

    def _request_shutdown(self) -> bool:
        self.shutdown_requested = True
        return True

    # -- output -----------------------------------------------------------------------------
    def send(self, tag: bytes, message: Any) -> None:
        """Step outputs to their requests' front ends, a utility result to its caller,
        anything else to every front end."""
        if tag == wire.OUTPUTS:
            self.endpoints.send_outputs(message)
        elif tag == wire.UTILITY_RESULT:
            self.endpoints.send(tag, message, self._client)
        else:
            self.endpoints.send(tag, message)


def send_message(sock: zmq.Socket, tag: bytes, message: Any, parent_pid: int) -> None:
    """Send, never blocking forever: a PUSH socket with no peer (the parent died) waits,
    so retry on a timeout and give up once the parent is gone."""
    frames = [tag, wire.encoder.encode(message)]
    while True:
        try:
            sock.send_multipart(frames, copy=False)
            return
        except zmq.Again:
            if os.getppid() != parent_pid:
                raise ParentGone from None


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _ShutdownRequested(signal.Signals(signum).name)


def _report_death(endpoints: CoreEndpoints, exc: Exception, what: str) -> int:
    """Log ``exc``, tell every front end the core is dead (with the error), exit code 1."""
    logger.exception("engine core %s", what)
    endpoints.send(wire.DEAD, wire.EngineDeadInfo(wire.describe_exception(exc)))
    return 1


def run_engine_core(run_dir: Path, parent_pid: int) -> int:
    """The child's whole life; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    def check_parent() -> None:
        if os.getppid() != parent_pid:
            raise ParentGone

    ctx = zmq.Context(io_threads=1)
    listed = load_endpoints(run_dir)
    if listed is None:  # one front end: the run dir's ipc pair
        input_address, output_address = ipc_addresses(run_dir)
        listed_clients = [ClientEndpoint(input=input_address, output=output_address)]
    else:
        listed_clients = listed.clients
    endpoints = CoreEndpoints.connect(ctx, listed_clients, check_parent, SEND_RETRY_S)
    input_socket, output_socket = endpoints.inputs[0], endpoints.outputs[0]
    core = None
    try:
        try:
            from engine.core.config import EngineConfig
            from engine.core.engine_core import EngineCore
            from engine.core.plugins import get_plugin_registry

            # Before any probe imports torch: settings device runtimes read when they load.
            get_plugin_registry().prepare_worker_process()
            config = EngineConfig.model_validate_json((run_dir / CONFIG_FILE).read_text())
            core = EngineCore(config)
        except Exception as exc:
            return _report_death(endpoints, exc, "failed to start")
        ready = wire.ReadyInfo(core.num_kv_blocks, config.scheduler.max_model_len, os.getpid())
        endpoints.send(wire.READY, ready)
        logger.info("engine core ready: %d KV blocks, %d front end(s)", core.num_kv_blocks,
                    endpoints.num_clients)
        proc = EngineCoreProc(core, input_socket, output_socket, parent_pid, endpoints)
        try:
            proc.run()
        except Exception as exc:
            return _report_death(endpoints, exc, "step loop failed")
        return 0
    except _ShutdownRequested as why:
        logger.info("engine core shutting down (%s)", why)
        return 0
    except ParentGone:
        logger.warning("engine core exiting: its parent process %d is gone", parent_pid)
        shutil.rmtree(run_dir, ignore_errors=True)  # nobody else is left to remove it
        return 0
    finally:
        # No more signals mid-cleanup: a second SIGTERM must not skip closing the sockets.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if core is not None:
            core.shutdown()
        endpoints.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="engine core process (started by the front end)")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", required=True, type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("ENGINE_LOG_LEVEL", "INFO").upper(),
        format=f"(EngineCore{os.environ.get(DP_RANK_ENV, '')} pid={os.getpid()}) "
               "%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_engine_core(args.run_dir, args.parent_pid)


if __name__ == "__main__":
    exit_code = main()
    # Sockets are closed and the last message delivered; skip interpreter teardown
    # (seconds with torch loaded), so shutdown and restarts stay quick.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
