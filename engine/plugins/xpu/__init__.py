"""The in-tree Intel XPU plugin (entry point "xpu")."""

from engine.core.interfaces import PLUGIN_API_VERSION, Platform
from engine.core.plugins.hookspecs import hookimpl
from engine.plugins.xpu.platform import XPUPlatform


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def engine_register_platforms() -> list[type[Platform]]:
    return [XPUPlatform]
