"""Plugins: pluggy hookspecs, entry-point discovery and platform resolution.

The process-wide registry is built on first use from the installed entry points of the
``engine.plugins`` group (filtered by ``ENGINE_PLUGINS``). The engine asks
:func:`current_platform` for its hardware; ``--device`` is applied once with
:func:`set_current_platform`. Tests call :func:`reset_plugin_registry` after changing
what is installed or the environment.
"""

from __future__ import annotations

import threading

import pluggy

from engine.core.interfaces import Platform
from engine.core.plugins.hookspecs import PROJECT_NAME, hookimpl, hookspec
from engine.core.plugins.registry import (
    ALLOWLIST_ENV,
    PLUGIN_GROUP,
    PlatformInfo,
    PluginInfo,
    PluginRegistry,
    PluginStatus,
    parse_allowlist,
)

_lock = threading.Lock()
_registry: PluginRegistry | None = None
_current: Platform | None = None


def get_plugin_registry() -> PluginRegistry:
    """The process-wide registry (discovered once, from entry points and ENGINE_PLUGINS)."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = PluginRegistry.from_env()
        return _registry


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every successfully loaded plugin (for calling hooks)."""
    return get_plugin_registry().pm


def resolve_platform(device: str = "auto") -> Platform:
    """The platform for ``device`` ("auto" or a name); ValueError lists what is installed."""
    return get_plugin_registry().resolve_platform(device)


def set_current_platform(device: str | Platform = "auto") -> Platform:
    """Fix the process's platform (a name, "auto", or an instance) and return it."""
    global _current
    platform = device if isinstance(device, Platform) else resolve_platform(device)
    _current = platform
    return platform


def current_platform() -> Platform:
    """The process's platform: the one set by :func:`set_current_platform`, else auto."""
    global _current
    if _current is None:
        _current = resolve_platform("auto")
    return _current


def reset_plugin_registry() -> None:
    """Forget the registry, its probe results and the current platform (for tests)."""
    global _registry, _current
    with _lock:
        _registry = None
        _current = None


__all__ = [
    "ALLOWLIST_ENV",
    "PLUGIN_GROUP",
    "PROJECT_NAME",
    "PlatformInfo",
    "PluginInfo",
    "PluginRegistry",
    "PluginStatus",
    "current_platform",
    "get_plugin_manager",
    "get_plugin_registry",
    "hookimpl",
    "hookspec",
    "parse_allowlist",
    "reset_plugin_registry",
    "resolve_platform",
    "set_current_platform",
]
