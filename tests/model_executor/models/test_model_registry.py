"""Architecture registry: built-ins, plugin registrations, clear errors."""

from __future__ import annotations

import pytest
from torch import nn

from engine.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.model_executor.models.registry import MODEL_REGISTRY, ModelRegistry


def test_builtins_resolve():
    assert MODEL_REGISTRY.resolve(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert MODEL_REGISTRY.resolve(["Unknown", "Qwen2ForCausalLM"]) is Qwen2ForCausalLM
    assert MODEL_REGISTRY.resolve(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert {"MistralForCausalLM", "LlamaForCausalLM"} <= set(
        MODEL_REGISTRY.supported_architectures()
    )


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match=r"\['FooForCausalLM'\].*LlamaForCausalLM"):
        MODEL_REGISTRY.resolve(["FooForCausalLM"])
    with pytest.raises(ValueError, match="not supported"):
        MODEL_REGISTRY.resolve(None)


class PluginModel(nn.Module):
    pass


def test_plugin_registration_by_class_and_lazy_path():
    registry = ModelRegistry()
    registry.register("PluginForCausalLM", PluginModel)
    registry.register("LazyForCausalLM", "engine.model_executor.models.llama:MistralForCausalLM")
    assert registry.resolve(["PluginForCausalLM"]) is PluginModel
    assert registry.resolve(["LazyForCausalLM"]).__name__ == "MistralForCausalLM"
    registry.register("PluginForCausalLM", LlamaForCausalLM)  # a plugin may replace one
    assert registry.resolve(["PluginForCausalLM"]) is LlamaForCausalLM
    with pytest.raises(ValueError, match="module:Class"):
        registry.register("Bad", "no_colon_here")
