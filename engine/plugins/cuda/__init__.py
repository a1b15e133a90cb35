"""The in-tree NVIDIA CUDA plugin (entry point "cuda")."""

from engine.core.interfaces import PLUGIN_API_VERSION, Platform
from engine.core.plugins.hookspecs import hookimpl
from engine.plugins.cuda.platform import CUDAPlatform


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def engine_register_platforms() -> list[type[Platform]]:
    return [CUDAPlatform]
