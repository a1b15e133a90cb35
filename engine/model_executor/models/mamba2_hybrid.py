"""What the Llama-based attention + Mamba-2 hybrids (Falcon-H1, Nemotron-H) share: their
caches are found from the modules they built, so a family only decides which layer holds
what.

KV cache layers are the :class:`LlamaAttention` modules (each built with its
``cache_index`` among them), state layers the :class:`Mamba2Mixer` modules (ordered by
``state_index``). Pipeline parallelism is refused; tensor parallelism splits both kinds
of layer (each reports its rank's share of the cache).
"""

from __future__ import annotations

from typing import Any

from engine.model_executor.layers.mamba2 import Mamba2Mixer
from engine.model_executor.models.interface import ModelKVSpec
from engine.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from engine.model_executor.state_cache import StateCacheSpec


class ConfigView:
    """A HF config with a few fields read differently (e.g. another family's names for
    the fields :class:`LlamaModel` reads); everything else is the config's."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        self.__dict__.update(overrides)
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Mamba2HybridForCausalLM(LlamaForCausalLM):
    """A Llama-family model some of whose layers are Mamba-2 mixers."""

    supports_pipeline_parallel = False

    def kv_layout(self) -> tuple[int, int]:
        attn = [m for m in self.model.modules() if isinstance(m, LlamaAttention)]
        return len(attn), attn[0].num_kv_heads if attn else 1

    def kv_cache_spec(self) -> ModelKVSpec:
        return ModelKVSpec(self.num_layers, self.num_kv_heads, self.head_size,
                           (None,) * self.num_layers)

    def state_cache_spec(self) -> StateCacheSpec:
        mixers = sorted((m for m in self.model.modules() if isinstance(m, Mamba2Mixer)),
                        key=lambda m: m.state_index)
        return StateCacheSpec(tuple(m.state_layer_spec() for m in mixers))
