"""Architecture name -> model class.

Keys are the names in a HF config's ``architectures`` list. Built-ins are registered
as ``"module:Class"`` strings so that resolving one model never imports the others;
plugins register through the ``engine_register_models(registry)`` hook with either a
class or such a string, and may replace a built-in.
"""

from __future__ import annotations

import importlib
import logging

from torch import nn

logger = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, type[nn.Module] | str] = {}

    def register(self, architecture: str, model_cls: type[nn.Module] | str) -> None:
        """Map ``architecture`` to a class or a lazy ``"package.module:Class"`` path."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(
                f"lazy model path {model_cls!r} for {architecture} must be 'module:Class'"
            )
        if architecture in self._entries:
            logger.info("model architecture %s re-registered as %s", architecture, model_cls)
        self._entries[architecture] = model_cls

    def supported_architectures(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, architecture: str) -> bool:
        return architecture in self._entries

    def _load(self, architecture: str) -> type[nn.Module]:
        entry = self._entries[architecture]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[architecture] = entry
        return entry

    def resolve(self, architectures: list[str] | None) -> type[nn.Module]:
        """The class for the first supported name in ``architectures``."""
        for arch in architectures or []:
            if arch in self._entries:
                return self._load(arch)
        raise ValueError(
            f"model architecture(s) {list(architectures or [])} not supported; "
            f"supported: {', '.join(self.supported_architectures())}"
        )


_BUILTINS = {
    "LlamaForCausalLM": "engine.model_executor.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.model_executor.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "engine.model_executor.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.model_executor.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "engine.model_executor.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.model_executor.models.mixtral:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.model_executor.models.mixtral:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "engine.model_executor.models.deepseek_v3:DeepseekV3ForCausalLM",
    "EagleLlamaForCausalLM": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
    "LlamaForCausalLMEagle": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
    "EAGLEModel": "engine.model_executor.models.eagle_llama:EagleLlamaForCausalLM",
}

MODEL_REGISTRY = ModelRegistry()
for _arch, _path in _BUILTINS.items():
    MODEL_REGISTRY.register(_arch, _path)
