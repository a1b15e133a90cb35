"""The scheduler's account of the worker's encoder cache (vLLM's EncoderCacheManager).

An image's encoder output (its embedding rows) is computed once, in the step that first
schedules any of its tokens, and kept on the worker while a request still has tokens of
it to compute -- so a prompt chunked across the image encodes it once. Entries no
request needs any more stay (another request with the same content reuses them) until
their space is wanted; then they are evicted, least recently released first, and the
worker is told to drop them. Sizes are in embedding rows; plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        if cache_size <= 0:
            raise ValueError(f"encoder cache size must be positive, not {cache_size}")
        self.cache_size = cache_size
        self.num_free = cache_size  # rows held by no entry
        self.sizes: dict[str, int] = {}  # identifier -> rows, for every entry held
        self.users: dict[str, set[str]] = {}  # identifier -> requests that still need it
        self.unused: OrderedDict[str, int] = OrderedDict()  # held, needed by none (LRU)
        self._evicted: list[str] = []  # dropped since the last take_evicted()

    @property
    def num_reclaimable(self) -> int:
        """Rows free now or after evicting every unused entry."""
        return self.num_free + sum(self.unused.values())

    def has(self, identifier: str) -> bool:
        return identifier in self.sizes

    def use(self, identifier: str, request_id: str) -> None:
        """``request_id`` needs the held entry ``identifier`` (no encoding needed)."""
        self.unused.pop(identifier, None)
        self.users[identifier].add(request_id)

    def can_allocate(self, num_rows: int, budget: int) -> bool:
        """Whether an entry of ``num_rows`` fits this step's remaining encoder ``budget``
        and the cache (after evicting unused entries)."""
        return num_rows <= budget and num_rows <= self.num_reclaimable

    def allocate(self, identifier: str, num_rows: int, request_id: str) -> None:
        """Reserve rows for an entry the worker encodes this step, evicting unused ones."""
        while self.num_free < num_rows:
            victim, rows = self.unused.popitem(last=False)
            del self.sizes[victim], self.users[victim]
            self.num_free += rows
            self._evicted.append(victim)
        self.num_free -= num_rows
        self.sizes[identifier] = num_rows
        self.users[identifier] = {request_id}

    def release(self, identifier: str, request_id: str) -> None:
        """``request_id`` is done with ``identifier`` (its tokens are computed, or the
        request ended); an entry nobody needs becomes evictable."""
        users = self.users.get(identifier)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            self.unused[identifier] = self.sizes[identifier]

    def take_evicted(self) -> list[str]:
        """Entries evicted since the last call: the worker drops their rows."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> list[str]:
        """Forget every unused entry (e.g. on a prefix-cache reset); returns them."""
        dropped = list(self.unused)
        for identifier in dropped:
            self.num_free += self.sizes.pop(identifier)
            del self.users[identifier]
        self.unused.clear()
        self._evicted.extend(dropped)
        return dropped
