"""engine: a hardware-agnostic LLM inference and serving engine.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``,
``EngineArgs``, ``BeamSearchParams`` (``LLM.beam_search``), and for pooling models
``PoolingParams`` with the pooling outputs. Heavy modules (torch, the model executor) load
on first use, so
``import engine`` and the CLI start fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "engine.entrypoints.llm",
    "SamplingParams": "engine.core.sampling_params",
    "RequestOutputKind": "engine.core.sampling_params",
    "RequestOutput": "engine.core.outputs",
    "CompletionOutput": "engine.core.outputs",
    "EngineArgs": "engine.core.engine_args",
    "PoolingParams": "engine.core.pooling_params",
    "PoolingRequestOutput": "engine.core.outputs",
    "EmbeddingRequestOutput": "engine.core.outputs",
    "ClassificationRequestOutput": "engine.core.outputs",
    "ScoringRequestOutput": "engine.core.outputs",
    "BeamSearchParams": "engine.core.beam_search",
    "LoRARequest": "engine.lora.request",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from engine.core.beam_search import BeamSearchParams
    from engine.core.engine_args import EngineArgs
    from engine.core.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from engine.core.pooling_params import PoolingParams
    from engine.core.sampling_params import RequestOutputKind, SamplingParams
    from engine.entrypoints.llm import LLM
    from engine.lora.request import LoRARequest


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
