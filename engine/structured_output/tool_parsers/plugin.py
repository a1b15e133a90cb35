"""The built-in tool-call parsers, contributed through the same hook a third party's use
(entry point ``tool_parsers`` of the ``engine.plugins`` group). Registered as
``"module:Class"`` strings: a parser's module is imported when it is first used."""

from __future__ import annotations

from typing import Any

from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins.hookspecs import hookimpl

_PKG = "engine.structured_output.tool_parsers"
BUILTINS = {
    "hermes": "engine.structured_output.tool_calls:HermesToolParser",
    "llama3_json": f"{_PKG}.llama:Llama3JsonToolParser",
    "mistral": f"{_PKG}.mistral:MistralToolParser",
    "pythonic": f"{_PKG}.pythonic:PythonicToolParser",
    "qwen3_coder": f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
    "granite": f"{_PKG}.granite:GraniteToolParser",
    "deepseek_v3": f"{_PKG}.deepseek_v3:DeepSeekV3ToolParser",
    "openai": f"{_PKG}.openai:OpenAIToolParser",
}


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION  # in-tree: evolves with the engine


@hookimpl
def engine_register_tool_parsers(registry: Any) -> None:
    for name, path in BUILTINS.items():
        registry.register(name, path)
