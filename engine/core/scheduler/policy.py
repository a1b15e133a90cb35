"""Scheduling policies: who goes first among waiting and among running requests.

- ``fcfs``: arrival order at the scheduler (the order of ``add_request``).
- ``priority``: lower ``Request.priority`` first, then ``arrival_time``, then arrival order.

One total order (``SchedulingPolicy.key``) serves both queues: waiting requests are
admitted in that order, running requests are served in it, and the request preempted
when blocks run out is the last in it (the latest arrival, or the lowest priority).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Literal

from engine.core.request import Request

PolicyName = Literal["fcfs", "priority"]
SortKey = tuple[float | int, ...]


class RequestQueue(ABC):
    """The waiting queue of one policy."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a request ahead of its peers (preempted, or skipped this step)."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in service order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """A heap on the policy key; a preempted request simply re-enters at its rank."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[SortKey, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._policy.key(request), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        for i, (_, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


class SchedulingPolicy:
    """The total service order of one policy; keys are stable for a request's lifetime."""

    def __init__(self, name: PolicyName) -> None:
        if name not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {name!r}: expected 'fcfs' or 'priority'")
        self.name = name
        self._arrival_seq: dict[str, int] = {}
        self._counter = itertools.count()

    def register(self, request: Request) -> None:
        self._arrival_seq[request.request_id] = next(self._counter)

    def forget(self, request: Request) -> None:
        self._arrival_seq.pop(request.request_id, None)

    def key(self, request: Request) -> SortKey:
        seq = self._arrival_seq[request.request_id]
        if self.name == "fcfs":
            return (seq,)
        return (request.priority, request.arrival_time, seq)

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue() if self.name == "fcfs" else PriorityQueue(self)
