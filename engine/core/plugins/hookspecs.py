"""The hooks a plugin may implement (pluggy project name ``"engine"``).

A plugin is any importable object (usually a module) named by an entry point in the
``engine.plugins`` group whose functions carry ``@hookimpl``. Only
``engine_plugin_api_version`` is required; every other hook is optional. The in-tree
cpu/cuda/rocm/xpu plugins are written exactly like a third party's.

Hooks run once per process, when the plugin registry is first built (platforms) or when
a later registry (models, attention backends, quant methods) asks for contributions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from engine.core.interfaces import AttentionBackend, Platform, QuantMethod
    from engine.core.interfaces.kv_connector import KVConnectorBase

PROJECT_NAME = "engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def engine_plugin_api_version() -> int:
    """The engine plugin API version this plugin was written against.

    Return a literal (e.g. ``1``), not ``engine.core.interfaces.PLUGIN_API_VERSION``:
    the point is that the engine can refuse a plugin built for another version.
    """


@hookspec
def engine_register_platforms() -> list[type[Platform]]:
    """Platform classes this plugin provides (not instances; they are probed first)."""


@hookspec
def engine_register_models(registry: Any) -> None:
    """Register model architectures into ``registry`` (the engine's model registry)."""


@hookspec
def engine_register_tool_parsers(registry: Any) -> None:
    """Register tool-call parsers into ``registry`` (the engine's tool-parser registry):
    ``registry.register(name, ToolParserSubclass or "module:Class")``; ``name`` is what
    ``--tool-call-parser`` selects. A name another plugin registers is refused."""


@hookspec
def engine_register_attention_backends() -> list[type[AttentionBackend]]:
    """Extra attention backends, selectable by name."""


@hookspec
def engine_register_quant_methods() -> list[type[QuantMethod]]:
    """Extra checkpoint quantization formats."""


@hookspec
def engine_register_kv_connectors() -> list[type[KVConnectorBase]]:
    """KV connectors (``KVConnectorBase`` subclasses), selected by their ``name`` in
    ``--kv-transfer-config``."""
