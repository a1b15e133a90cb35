"""Model definitions and the architecture registry."""

from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.registry import MODEL_REGISTRY, ModelRegistry

__all__ = ["MODEL_REGISTRY", "ModelInitContext", "ModelKVSpec", "ModelRegistry"]
