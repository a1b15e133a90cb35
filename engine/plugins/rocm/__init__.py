"""The in-tree AMD ROCm plugin (entry point "rocm"; RCCL collectives appear as "nccl")."""

from engine.core.interfaces import PLUGIN_API_VERSION, Platform
from engine.core.plugins.hookspecs import hookimpl
from engine.plugins.rocm.platform import ROCmPlatform


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def engine_register_platforms() -> list[type[Platform]]:
    return [ROCmPlatform]
