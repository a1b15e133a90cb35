"""An example engine plugin (entry point ``example`` of the ``engine.plugins`` group).

It contributes a platform ("example-torch", see :mod:`.platform`), a model architecture
the engine does not ship (GPT-2, :mod:`.gpt2`) and a checkpoint quantization format
("example_int8", :mod:`.quant`). Hooks stay cheap: heavy modules load only when a hook
that needs them runs.
"""

from __future__ import annotations

from typing import Any

from engine.core.plugins.hookspecs import hookimpl


@hookimpl
def engine_plugin_api_version() -> int:
    return 1  # the plugin API this package was written against (a literal, on purpose)


@hookimpl
def engine_register_platforms() -> list:
    from engine_plugin_example.platform import ExampleTorchPlatform

    return [ExampleTorchPlatform]


@hookimpl
def engine_register_models(registry: Any) -> None:
    # a lazy "module:Class" path: the model module imports only when a config names it
    registry.register("GPT2LMHeadModel", "engine_plugin_example.gpt2:GPT2LMHeadModel")


@hookimpl
def engine_register_quant_methods() -> list:
    from engine_plugin_example.quant import ExampleInt8Config

    return [ExampleInt8Config]
