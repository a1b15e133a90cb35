"""The unified scheduler: waiting/running queues, policy, token budget -> SchedulerOutput.

Exports are resolved lazily: ``engine.core.engine_io`` imports ``scheduler.output``,
and the scheduler itself imports ``engine_io``, so importing the scheduler eagerly here
would make that a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.scheduler.scheduler import Scheduler
    from engine.core.scheduler.stats import SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from engine.core.scheduler.scheduler import Scheduler

        return Scheduler
    if name == "SchedulerStats":
        from engine.core.scheduler.stats import SchedulerStats

        return SchedulerStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
