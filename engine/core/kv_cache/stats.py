"""Prefix-cache hit statistics, counted in tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0  # admissions that looked up the cache
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found computed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
