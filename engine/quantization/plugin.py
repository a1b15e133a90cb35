"""The built-in checkpoint formats, contributed through the same plugin hook a third
party's format uses (entry point ``quantization`` of the ``engine.plugins`` group)."""

from __future__ import annotations

from engine.core.interfaces import PLUGIN_API_VERSION, QuantMethod
from engine.core.plugins.hookspecs import hookimpl


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION  # in-tree: evolves with the engine


@hookimpl
def engine_register_quant_methods() -> list[type[QuantMethod]]:
    from engine.quantization.awq import AWQConfig
    from engine.quantization.compressed_tensors import CompressedTensorsConfig
    from engine.quantization.fp8 import Fp8Config
    from engine.quantization.gptq import GPTQConfig
    from engine.quantization.mxfp4 import Mxfp4Config

    return [CompressedTensorsConfig, GPTQConfig, AWQConfig, Fp8Config, Mxfp4Config]
