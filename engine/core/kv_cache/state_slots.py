"""Per-request state slots for models with recurrent (state-space) layers.

A Mamba / Mamba-2 / gated-DeltaNet layer keeps a fixed-size state per request (a conv
window and an SSM state) instead of a KV cache that grows with the tokens. Those states
live in tensors ``[num_slots, ...]`` the executor allocates per state layer; the KV cache
manager hands each running request one slot index, the same in every state layer, from
its first allocation until it is freed (finished, aborted or preempted: preemption
recomputes, so the state is rebuilt from the prompt).

Slot 0 is the null slot: never handed out, so a padded row (a forward graph's spare
rows, a decode kernel's batch padding) can point at it without touching a live request.
"""

from __future__ import annotations

NULL_STATE_SLOT = 0


class StateSlotAllocator:
    """``num_slots`` usable slots, ids ``1..num_slots`` (0 is the null slot)."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} must be a positive integer")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # pop() hands out slot 1 first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot (a new one on first call); None when none is free."""
        slot = self._owner.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            return None
        slot = self._owner[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (no-op if it holds none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
