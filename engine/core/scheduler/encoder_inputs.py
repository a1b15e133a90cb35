"""Which images (videos) each step encodes: the scheduler's encoder budget.

A prompt chunk that reaches an item's tokens needs the item's encoder output in the same
step. When the output is in the worker's encoder cache (an earlier chunk encoded it, or
another request with the same content), the chunk just uses it; otherwise the step
encodes it, if the step's encoder budget and the cache have room -- else the chunk is
cut short before the item, and the item waits for a later step (vLLM's rule). An entry is
released by a request once all of the item's tokens are computed, or when the request
is preempted or ends.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.multimodal.encoder_cache import EncoderCacheManager


class EncoderInputScheduler:
    def __init__(self, cache_size: int, budget: int, whole_items: bool = False) -> None:
        """``cache_size``: embedding rows the worker's encoder cache holds; ``budget``:
        rows one step may encode. Both at least the longest prompt, so any item fits.
        ``whole_items``: a chunk never ends inside an item (its tokens attend to each
        other both ways, so all of them run in one step; --disable-chunked-mm-input)."""
        self.cache = EncoderCacheManager(cache_size)
        self.budget = budget
        self.whole_items = whole_items
        self._budget_left = budget
        self._encoding: set[str] = set()  # identifiers this step encodes

    def begin_step(self) -> None:
        self._budget_left = self.budget
        self._encoding = set()

    def plan(self, request: Request, num_computed: int, num_new: int) -> tuple[int, list[int]]:
        """``(num_new, items to encode)`` for a chunk of ``num_new`` tokens from
        ``num_computed``: the chunk ends before the first item it cannot encode."""
        to_encode: list[int] = []
        planned: set[str] = set()
        rows = 0
        end = num_computed + num_new
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed:
                continue  # its tokens are computed (or came from the prefix cache)
            if self.whole_items and feature.end > end:  # stop before the item instead
                return max(0, feature.offset - num_computed), to_encode
            key = feature.identifier
            if key in planned or key in self._encoding or self.cache.has(key):
                continue
            if not self.cache.can_allocate(rows + feature.length, self._budget_left):
                return max(0, feature.offset - num_computed), to_encode
            rows += feature.length
            planned.add(key)
            to_encode.append(index)
        return num_new, to_encode

    def commit(self, request: Request, num_computed: int, num_new: int,
               to_encode: list[int]) -> None:
        """The chunk is scheduled: reserve what it encodes, mark what it reuses."""
        end = num_computed + num_new
        encode = set(to_encode)
        rid = request.request_id
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed:
                continue
            if index in encode:
                self.cache.allocate(feature.identifier, feature.length, rid)
                self._encoding.add(feature.identifier)
                self._budget_left -= feature.length
            else:
                self.cache.use(feature.identifier, rid)

    def release_computed(self, request: Request) -> None:
        """Release the items whose tokens are all computed."""
        for feature in request.mm_features:
            if feature.end > request.num_computed_tokens:
                break
            self.cache.release(feature.identifier, request.request_id)

    def release_all(self, request: Request) -> None:
        for feature in request.mm_features:
            self.cache.release(feature.identifier, request.request_id)

    def take_evicted(self) -> list[str]:
        return self.cache.take_evicted()
