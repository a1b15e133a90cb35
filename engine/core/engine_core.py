"""The engine core: the step loop ``schedule -> execute -> update``.

It owns the scheduler (device-neutral) and the executor (model + KV cache on the
platform). Front ends reach it in-process (offline API, tests) or from another process
over ZeroMQ (the server); either way they exchange only ``engine_io`` messages.
"""

from __future__ import annotations

import logging
import time

from engine.core.config import EngineConfig
from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.core.plugins import resolve_platform
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + executor, stepped by whoever owns it."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.model_executor.executor import Executor

        self.config = config
        self.platform = resolve_platform(config.device.device)
        self.executor = Executor(config, self.platform)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time or time.monotonic(),
                priority=request.priority,
                cache_salt=request.cache_salt,
                max_tokens=request.max_tokens,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Run one step; returns what every touched request produced."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.num_blocks

    def shutdown(self) -> None:
        """Release the model and cache (a process-backed core exits after this)."""
        self.executor = None  # type: ignore[assignment]
