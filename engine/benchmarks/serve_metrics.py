"""Serving-benchmark arithmetic: arrival schedules and per-point latency statistics.

Kept apart from the HTTP client so the numbers can be checked without a server. Times
are seconds in and milliseconds out. A streamed chunk may carry several tokens, so
output tokens always come from the server's usage, never from the chunk count; ITL is
the gap between consecutive content chunks, pooled over all requests (vLLM's definition),
while TPOT spreads each request's decode time over its output tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_ERROR_SAMPLES = 5  # error texts kept per point: enough to diagnose, not a log dump
PERCENTILES = (90, 99)


def arrival_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Send times (s after the start) of a Poisson process at ``rate`` requests/s.

    The first request goes at 0 and the gaps are exponential with mean 1/rate, drawn
    from a generator seeded with ``seed`` so every run of a sweep sees the same pattern
    scaled by its rate; ``inf`` sends everything at once.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate) or num_requests == 0:
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass
class RequestRecord:
    """What the client saw of one request (``perf_counter`` seconds)."""

    start_s: float
    end_s: float = math.nan
    success: bool = False
    chunk_times_s: list[float] = field(default_factory=list)  # content-bearing chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    def itl_s(self) -> np.ndarray:
        return np.diff(np.asarray(self.chunk_times_s, dtype=np.float64))

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token after the first; None with fewer than 2 tokens."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)


def summarize_ms(values_s: Any) -> dict[str, float | None]:
    """mean / median / std / p90 / p99 in ms (all None when there is nothing to summarize)."""
    ms = np.asarray(values_s, dtype=np.float64).ravel() * 1000.0
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if ms.size == 0:
        return dict.fromkeys(keys)
    stats = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES)]
    return {key: round(float(value), 3) for key, value in zip(keys, stats)}


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (a request ending frees its slot before a start
    at the same instant)."""
    if not records:
        return 0
    times = np.array([r.start_s for r in records] + [r.end_s for r in records])
    steps = np.array([1] * len(records) + [-1] * len(records))
    order = np.lexsort((steps, times))  # by time, ends (-1) first on ties
    return int(np.cumsum(steps[order]).max())


def point_metrics(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The figures of one sweep point, as vLLM's ``bench serve`` reports them."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itl = np.concatenate([r.itl_s() for r in ok]) if ok else np.zeros(0)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 4),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration_s, 4),
        "output_throughput": round(output_tokens / duration_s, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / duration_s, 3),
        "peak_concurrent_requests": peak_concurrency(records),
        "ttft_ms": summarize_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": summarize_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": summarize_ms(itl),
        "e2e_ms": summarize_ms([r.e2e_s for r in ok]),
        "errors": [r.error for r in records if not r.success][:MAX_ERROR_SAMPLES],
    }
