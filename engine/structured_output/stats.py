"""Counters of grammar preparation: time per compile (a histogram) and cache hits/misses.

Plain cumulative numbers (no Prometheus objects), so the engine core can keep one and
hand a :meth:`CompileStats.snapshot` to whoever exports it; the server's ``/metrics``
turns snapshots into Prometheus metrics (``engine.entrypoints.openai.metrics``).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

# Upper bounds (seconds) of the histogram buckets; +Inf is implied.
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class CompileStats:
    """Thread-safe (compiles run in worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.count = 0
        self.total_s = 0.0
        self.buckets = [0] * len(COMPILE_BUCKETS)  # per bucket, not cumulative

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def miss(self) -> None:
        with self._lock:
            self.misses += 1

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        with self._lock:
            self.count += 1
            self.total_s += seconds
            index = bisect.bisect_left(COMPILE_BUCKETS, seconds)
            if index < len(self.buckets):
                self.buckets[index] += 1

    def snapshot(self) -> dict[str, Any]:
        """``{"hits", "misses", "count", "sum", "buckets": [(le, cumulative count)...]}``"""
        with self._lock:
            cumulative, running = [], 0
            for le, n in zip(COMPILE_BUCKETS, self.buckets):
                running += n
                cumulative.append([le, running])
            return {
                "hits": self.hits,
                "misses": self.misses,
                "count": self.count,
                "sum": self.total_s,
                "buckets": cumulative,
            }
