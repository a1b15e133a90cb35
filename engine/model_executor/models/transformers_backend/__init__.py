"""The Transformers modeling backend (vLLM's ``--model-impl transformers``): any
transformers decoder-only causal LM whose attention goes through transformers' attention
interface, run on the engine's paged attention, linear layers and fused-MoE kernels.
:mod:`.support` decides which implementation runs; :mod:`.base` holds the model."""

from engine.model_executor.models.transformers_backend.support import (
    BACKEND_NAME,
    MODEL_IMPLS,
    check_model_impl,
    resolve_model_class,
    unsupported_reason,
)

__all__ = ["BACKEND_NAME", "MODEL_IMPLS", "check_model_impl", "resolve_model_class",
           "unsupported_reason"]
