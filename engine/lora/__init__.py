"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch.

``request``: what a caller names (:class:`LoRARequest`, vLLM's shape); ``peft``: reading
and checking a PEFT adapter directory; ``layers``: the per-layer slot buffers the linear
layers add from; ``manager``: the worker side (device slots, a host LRU cache, the
step's token-to-slot map); ``registry``: the front end's named adapters.
"""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
