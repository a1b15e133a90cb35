"""Scheduler load snapshot for metrics and logging."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Queue lengths and KV usage now; prefix-cache and preemption counts since the
    previous ``Scheduler.make_stats()`` call."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found computed
    num_preemptions: int
    prefix_cache_requests: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
