"""Per-request hand-off of RequestOutputs from the output processor to an async consumer.

One slot, not a queue: if the consumer (an HTTP stream) is slower than the engine, DELTA
outputs are merged into the pending one and CUMULATIVE ones replace it, so memory stays
bounded and the consumer always gets everything with no duplicates.
"""

from __future__ import annotations

import asyncio

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import RequestOutputKind


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put_nowait(self, output: RequestOutput | BaseException) -> None:
        """Hand over an output (or an error that ``get`` will raise)."""
        if isinstance(output, BaseException) or not isinstance(self._pending, RequestOutput):
            if not isinstance(self._pending, BaseException):
                self._pending = output
        else:
            self._pending.add(output, aggregate=self.aggregate)
        self._ready.set()

    put = put_nowait

    async def get(self) -> RequestOutput:
        """Wait for the next (possibly merged) output."""
        while self._pending is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._pending is None else self._take()

    def _take(self) -> RequestOutput:
        output, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output
