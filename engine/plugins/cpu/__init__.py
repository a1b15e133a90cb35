"""The in-tree CPU plugin, registered through the ``engine.plugins`` entry point "cpu".

Written exactly as a third-party plugin would be: module-level ``@hookimpl`` functions.
"""

from engine.core.interfaces import PLUGIN_API_VERSION, Platform
from engine.core.plugins.hookspecs import hookimpl
from engine.plugins.cpu.platform import CPUPlatform


@hookimpl
def engine_plugin_api_version() -> int:
    # In-tree plugins evolve with the engine; a third party returns a literal instead.
    return PLUGIN_API_VERSION


@hookimpl
def engine_register_platforms() -> list[type[Platform]]:
    return [CPUPlatform]
