"""The engine core: the step loop ``schedule -> execute -> update``.

It owns the scheduler (device-neutral) and the executor (model + KV cache on the
platform). Front ends reach it in-process (offline API, tests) or from another process
over ZeroMQ (the server); either way they exchange only ``engine_io`` messages.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from typing import Any

import msgspec

from engine.core.config import EngineConfig
from engine.core.engine_io import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine.core.plugins import resolve_platform
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerStats
from engine.core.scheduler.output import SchedulerOutput
from engine.lora.request import LoRARequest

# While only grammar compiles are pending, a step waits this long for one to finish.
_GRAMMAR_WAIT_S = 0.01
# While only KV transfers are in flight, a step polls them this often.
_KV_POLL_S = 0.002

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + executor, stepped by whoever owns it."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.model_executor.executor import make_executor
        from engine.structured_output.manager import StructuredOutputManager

        self.config = config
        self.platform = resolve_platform(config.device.device)
        parallel = config.parallel
        if parallel.dp_lockstep:  # rank 0 hosts the ranks' store before its workers join it
            from engine.distributed.dp_lockstep import dp_store

            dp_store(parallel, host=parallel.data_parallel_rank == 0)
        self.executor = make_executor(config, self.platform)
        # MoE experts shared with the other data-parallel ranks: the cores' step agreement
        # (engine.distributed.dp_lockstep); None: this core steps on its own.
        self.dp_lockstep = None
        if parallel.dp_lockstep:
            from engine.distributed.dp_lockstep import DPLockstep

            self.dp_lockstep = DPLockstep(parallel)
        self.structured_output_manager = StructuredOutputManager.from_engine_config(
            config, vocab_size=self.executor.vocab_size
        )
        spec = config.speculative
        governor = None
        if spec is not None:
            from engine.core.scheduler.spec_governor import SpeculationGovernor

            governor = SpeculationGovernor(spec.num_speculative_tokens, adaptive=spec.adaptive,
                                           disable_by_batch_size=spec.disable_by_batch_size)
        self.kv_connector = None
        if config.kv_transfer is not None:
            from engine.core.interfaces.kv_connector import KVConnectorRole
            from engine.kv_transfer.factory import make_connector

            self.kv_connector = make_connector(config, KVConnectorRole.SCHEDULER)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.executor.num_blocks,
            # A draft model writes its KV up to K tokens past the verified ones.
            num_lookahead_tokens=spec.num_speculative_tokens if spec and spec.uses_draft_kv else 0,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            structured_output_manager=self.structured_output_manager,
            spec_governor=governor,
            # Earlier pipeline stages do not sample: they learn the tokens from the diff.
            send_new_token_ids=config.parallel.pipeline_parallel_size > 1,
            num_micro_batches=self.executor.max_concurrent_batches,
            kv_connector=self.kv_connector,
            kv_cache_groups=self.executor.kv_cache_layout.groups,
            num_state_slots=self.executor.kv_cache_layout.num_state_slots,
            max_loras=0 if config.lora is None else config.lora.max_loras,
        )
        # Pipeline parallelism: up to one step in flight per stage (vLLM's batch queue).
        # Async scheduling: step N+1 is scheduled (and sent) while step N runs.
        self.batch_queue_size = (2 if config.scheduler.async_scheduling
                                 else self.executor.max_concurrent_batches)
        self.batch_queue: deque = deque()
        self.max_batches_in_flight = 0  # the deepest the queue got (stage utilisation)
        # Sleep mode: what sleeps ("weights", "kv_cache"), and at which level.
        self.sleeping_tags: set[str] = set()
        self.sleep_level = 0
        # pause_generation(mode="keep"): requests stay where they are, no step runs.
        self.scheduling_paused = False
        # Requests the core aborted itself (abort_all_requests): reported by the next step.
        self._aborted_outputs: list[EngineCoreOutput] = []
        self.scheduler.register_ready_check(
            RequestStatus.WAITING_FOR_GRAMMAR, self.structured_output_manager.is_ready
        )
        # Everything built so far lives as long as the engine: move it out of the
        # collector's generations, so the step loop's collections scan only new objects
        # (unfrozen, a full collection re-walked the model and tokenizer mid-step).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.sleeping_tags:
            raise ValueError("the engine is sleeping: call wake_up() before sending requests")
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or time.monotonic(),
            priority=request.priority,
            cache_salt=request.cache_salt,
            max_tokens=request.max_tokens,
            pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids,
            lora_request=request.lora_request,
            mm_features=request.mm_features or [],
        )
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            core_request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(core_request)
        if structured is not None:  # compiles off the step loop; the request waits
            self.structured_output_manager.add_request(
                request.request_id, structured, request.prompt_token_ids or ())

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Run one step; returns what every touched request produced."""
        failed = self._finish_failed_grammars()
        if self._aborted_outputs:
            failed, self._aborted_outputs = self._aborted_outputs + failed, []
        if self.scheduling_paused:
            self._lockstep_dummy_step()
            return self._paused_step(failed)
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue(failed)
        if not self.scheduler.has_unfinished_requests():
            self._lockstep_dummy_step()
            return EngineCoreOutputs(outputs=failed, timestamp=time.monotonic())
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        bitmask = self._grammar_bitmask(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output, grammar_bitmask=bitmask)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.observe_step_time(scheduler_output, time.perf_counter() - started)
        if scheduler_output.is_empty and self.kv_connector is not None and not outputs:
            time.sleep(_KV_POLL_S)  # only transfers in flight: poll them, do not spin
        return EngineCoreOutputs(outputs=failed + outputs, timestamp=time.monotonic())

    def _lockstep_dummy_step(self) -> None:
        """A step with nothing of this rank's own: in lockstep the forward still runs (a
        dummy one), so the other ranks' expert all-to-alls find this rank."""
        if self.dp_lockstep is not None:
            self.executor.execute_model(SchedulerOutput.empty())
            self.dp_lockstep.dummy_steps += 1

    def _grammar_bitmask(self, scheduler_output):
        if scheduler_output.structured_output_req_ids:
            return self.structured_output_manager.grammar_bitmask(
                scheduler_output.structured_output_req_ids,
                scheduler_output.scheduled_spec_decode_tokens,
            )
        if scheduler_output.is_empty:
            self.structured_output_manager.wait_for_compiles(_GRAMMAR_WAIT_S)
        return None

    def _step_with_batch_queue(self, failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """Pipeline parallelism: schedule another micro-batch while there is room in the
        queue (requests already in flight are passed over), and process the oldest step's
        output only when the queue is full or nothing else can be scheduled. Async
        scheduling is the same loop with two steps: step N+1 is scheduled and sent while
        step N runs (its requests included, one token ahead), then N's output is taken."""
        queue = self.batch_queue
        submitted = False
        if len(queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            if not so.is_empty:
                bitmask = self._grammar_bitmask(so)
                queue.append((self.executor.execute_model(so, bitmask, non_block=True), so))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
                submitted = True
            else:  # every request is in flight: the finished ids go with the next step
                self.scheduler.finished_req_ids |= so.finished_req_ids
                if not queue:
                    self._grammar_bitmask(so)  # waits briefly for pending compiles
        if not queue or (submitted and len(queue) < self.batch_queue_size):
            return EngineCoreOutputs(outputs=failed, timestamp=time.monotonic())
        future, so = queue.popleft()
        outputs = self.scheduler.update_from_output(so, future.result())
        return EngineCoreOutputs(outputs=failed + outputs, timestamp=time.monotonic())

    def check_health(self) -> None:
        """Raise when a worker rank is dead or unresponsive (the executor's check)."""
        self.executor.check_health()

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Finish requests whose grammar failed to compile: finish_reason abort, the
        error in stop_reason."""
        outputs = []
        for request_id, error in self.structured_output_manager.pop_failures():
            logger.error("request %s: %s", request_id, error)
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=int(FinishReason.ABORT),
                    stop_reason=f"structured output error: {error}",
                )
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (False while scheduling is paused: nothing runs)."""
        if self._aborted_outputs:
            return True
        if self.scheduling_paused:
            return bool(self.batch_queue)
        return self.scheduler.has_unfinished_requests()

    def abort_all_requests(self) -> int:
        """Abort every unfinished request (``pause_generation(mode="abort")``); the next
        step reports each with finish reason "abort". Returns how many."""
        ids = [rid for rid, r in self.scheduler.requests.items() if not r.is_finished]
        if ids:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._aborted_outputs += [
                EngineCoreOutput(request_id=rid, new_token_ids=[],
                                 finish_reason=int(FinishReason.ABORT)) for rid in ids]
        return len(ids)

    # -- sleep mode and pausing (RL training loops) ---------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache on every rank (level 1: the weights move to host memory;
        level 2: they are dropped and reloaded from the model directory on wake-up).

        Refused unless sleep mode is enabled and no request is unfinished (abort them or
        ``pause_generation(mode="abort")`` first); the prefix cache is reset, since the
        cached blocks' contents are gone, so the block pool is all free blocks again."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled: start the engine with "
                             "enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
        if self.sleeping_tags:
            raise ValueError(f"the engine is already sleeping (level {self.sleep_level}); "
                             "call wake_up() first")
        if self.scheduler.has_unfinished_requests() or self.batch_queue:
            raise ValueError(
                f"cannot sleep while {self.scheduler.get_num_unfinished_requests()} "
                "requests are unfinished: wait for them, abort them or "
                "pause_generation(mode='abort') first")
        if self.kv_connector is not None:
            raise ValueError("sleep mode cannot be combined with a KV connector yet")
        if self.dp_lockstep is not None:
            # Another rank may start a wave at any time, and its steps need this rank's
            # experts (a dummy forward over weights that are gone).
            raise ValueError("sleep mode is not supported with expert parallelism across "
                             "data-parallel ranks")
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("cannot sleep: KV blocks are still held by requests")
        self.executor.sleep(level)
        self.sleep_level = level
        self.sleeping_tags = {"weights", "kv_cache"}
        gc.collect()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both) on every rank. Waking
        the weights first lets a trainer update them before the KV cache takes memory."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' "
                             "and/or 'kv_cache'")
        if not wanted & self.sleeping_tags:
            return
        if (self.sleep_level == 2 and "kv_cache" in wanted and "weights" not in wanted
                and "weights" in self.sleeping_tags):
            raise ValueError("after a level-2 sleep wake the weights before the KV cache "
                             "(wake_up(tags=['weights']) first)")
        self.executor.wake_up(sorted(wanted & self.sleeping_tags, reverse=True))
        self.sleeping_tags -= wanted
        if not self.sleeping_tags:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def pause_scheduling(self) -> None:
        """Freeze every request where it is (``pause_generation(mode="keep")``)."""
        self.scheduling_paused = True

    def resume_scheduling(self) -> None:
        self.scheduling_paused = False

    def _paused_step(self, failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """While paused: only steps already in flight (pipeline stages) complete."""
        outputs = list(failed)
        if self.batch_queue:
            future, so = self.batch_queue.popleft()
            outputs += self.scheduler.update_from_output(so, future.result())
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    # -- weight updates (RL training loops) ---------------------------------------------
    def update_weights(self, path: str) -> None:
        """Every rank loads its shard of the checkpoint directory ``path`` (the running
        architecture) into a fresh model and swaps it in; see
        :mod:`engine.model_executor.weight_update`."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a checkpoint directory, not {path!r}")
        self._update_weights("update_weights", path)

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int) -> None:
        """Engine rank ``i`` joins the trainer's group (the trainer is rank 0, hosting
        ``master_address:master_port``) as rank ``rank_offset + i``."""
        ranks = self.config.parallel.world_size
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address must be a host name, not {master_address!r}")
        for name, value in (("master_port", master_port), ("rank_offset", rank_offset),
                            ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, not {value!r}")  # noqa: TRY004
        if rank_offset < 1 or rank_offset + ranks > world_size:
            raise ValueError(f"the engine's {ranks} rank(s) from rank_offset {rank_offset} "
                             f"do not fit a group of {world_size} (the trainer is rank 0)")
        self.executor.update_weights("init_weight_update_group", master_address,
                                     master_port, rank_offset, world_size)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], packed: bool = False) -> None:
        """Receive each (name, dtype, shape) tensor by broadcast from the trainer's rank 0,
        in order (``packed``: in byte buckets), every rank loading its shard (a full set of
        the model's tensors)."""
        from engine.distributed.weight_sync import check_broadcast_specs

        check_broadcast_specs(list(names), list(dtypes), [list(s) for s in shapes])
        self._update_weights("update_weights_from_distributed", list(names),
                             [str(d) for d in dtypes], [list(s) for s in shapes], bool(packed))

    def update_weights_from_tensors(self, handles: list[list[Any]]) -> None:
        """Load tensors shared by a trainer in the front end's process
        (``engine.model_executor.weight_update.share_tensors``)."""
        self._update_weights("update_weights_from_tensors", handles)

    def _update_weights(self, method: str, *args: Any) -> None:
        """Run an update on every rank, then forget the prefix cache (its blocks hold
        the old weights' keys and values). Refused while requests are unfinished."""
        if self.scheduler.has_unfinished_requests() or self.batch_queue:
            raise ValueError(
                f"cannot update the weights while {self.scheduler.get_num_unfinished_requests()}"
                " requests are unfinished: wait for them, abort them or "
                "pause_generation(mode='abort') first")
        if self.kv_connector is not None:
            raise ValueError("weight updates cannot be combined with a KV connector yet")
        try:
            self.executor.update_weights(method, *args)
        finally:  # a refused update may have reallocated the KV cache too
            if not self.scheduler.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset after a weight "
                                   "update")
        self.sleeping_tags.discard("weights")  # the new weights are loaded, hence awake
        if not self.sleeping_tags:
            self.sleep_level = 0
        gc.collect()

    # -- LoRA adapters (engine.lora) ---------------------------------------------------------
    def add_lora(self, request: Any) -> bool:
        """Check the adapter on every rank and keep it in their host caches; a ValueError
        names what does not fit (the adapter then stays unknown)."""
        if self.config.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True "
                             "(--enable-lora)")
        lora = request if isinstance(request, LoRARequest) else msgspec.convert(request,
                                                                                LoRARequest)
        self.executor.checked_rpc("add_lora", lora)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return any(self.executor.collective_rpc("remove_lora", int(lora_id)))

    def list_loras(self) -> list[int]:
        return self.executor.collective_rpc("list_loras")[0]

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.num_blocks

    def shutdown(self) -> None:
        """Release the model and cache (a process-backed core exits after this)."""
        self.structured_output_manager.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
        self.executor = None  # type: ignore[assignment]
