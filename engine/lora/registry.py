"""The front end's view of the adapters the engine knows, by id.

Every adapter a request names is added to the engine (and so checked on every rank)
before the request is sent; this keeps the ids consistent: an id names one adapter until
it is removed."""

from __future__ import annotations

from engine.lora.request import LoRARequest


class AddedLoRAs:
    """Adapters added to the engine, by ``lora_int_id``."""

    def __init__(self) -> None:
        self._by_id: dict[int, LoRARequest] = {}

    def needs_adding(self, request: LoRARequest) -> bool:
        """False when the engine has this adapter already; ValueError when the id is
        taken by another adapter."""
        if not isinstance(request, LoRARequest):
            raise ValueError("lora_request must be an engine.LoRARequest, got "
                             f"{type(request).__name__}")
        known = self._by_id.get(request.lora_int_id)
        if known is None:
            return True
        if known != request:
            raise ValueError(f"LoRA id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} ({known.lora_path}); remove it first or "
                             "use another id")
        return False

    def added(self, request: LoRARequest) -> None:
        self._by_id[request.lora_int_id] = request

    def removed(self, lora_id: int) -> None:
        self._by_id.pop(lora_id, None)
