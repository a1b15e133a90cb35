"""Architecture name -> model class.

Keys are the names in a HF config's ``architectures`` list. Every architecture comes
from a plugin's ``engine_register_models(registry)`` hook -- the built-ins from the
in-tree ``models`` plugin (:mod:`engine.core.plugins.builtin_models`), exactly as a
third party's -- with either a class or a lazy ``"module:Class"`` string. The engine's
registry asks the plugins once, lazily, when an architecture is first resolved or
listed, and records which plugin registered each name: a name a second plugin
registers is refused, naming both plugins.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)


class PluginModelRegistry:
    """What one plugin's ``engine_register_models`` hook is handed: the registry, with
    that plugin's name attached to every registration."""

    def __init__(self, registry: ModelRegistry, plugin: str) -> None:
        self._registry = registry
        self.plugin = plugin

    def register(self, architecture: str, model_cls: type[nn.Module] | str) -> None:
        self._registry.register(architecture, model_cls, plugin=self.plugin)

    def supported_architectures(self) -> list[str]:
        return self._registry.supported_architectures()

    def __contains__(self, architecture: str) -> bool:
        return architecture in self._registry


class ModelRegistry:
    """``plugins``: the plugin registry to ask (or a callable returning it, e.g.
    ``get_plugin_registry``); None: only what is registered directly."""

    def __init__(self, plugins: Any = None) -> None:
        self._entries: dict[str, type[nn.Module] | str] = {}
        self._owners: dict[str, str | None] = {}  # architecture -> plugin (None: direct)
        self._plugins = plugins
        self._asked: Any = None  # the plugin registry whose plugins filled this one

    def for_plugin(self, plugin: str) -> PluginModelRegistry:
        return PluginModelRegistry(self, plugin)

    def register(self, architecture: str, model_cls: type[nn.Module] | str,
                 plugin: str | None = None) -> None:
        """Map ``architecture`` to a class or a lazy ``"package.module:Class"`` path.

        ``plugin``: who registers it. Two different plugins registering one name is a
        ValueError naming both; a direct registration (no plugin) may replace one.
        """
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(
                f"lazy model path {model_cls!r} for {architecture} must be 'module:Class'"
            )
        if architecture in self._entries:
            owner = self._owners.get(architecture)
            if plugin is not None and owner is not None and owner != plugin:
                raise ValueError(
                    f"model architecture {architecture!r} is contributed by both plugin "
                    f"{owner!r} and plugin {plugin!r}"
                )
            logger.info("model architecture %s re-registered as %s", architecture, model_cls)
        self._entries[architecture] = model_cls
        self._owners[architecture] = plugin

    # -- plugins ------------------------------------------------------------------------
    def _plugin_registry(self) -> Any:
        source = self._plugins
        if source is None:
            return None
        return source() if callable(source) and not hasattr(source, "register_models") else source

    def _ensure_plugins(self) -> None:
        """Ask every plugin once (again when the process's plugin registry was rebuilt:
        the architectures of the previous one's plugins are forgotten first)."""
        plugins = self._plugin_registry()
        if plugins is None or plugins is self._asked:
            return
        for arch in [a for a, owner in self._owners.items() if owner is not None]:
            del self._entries[arch], self._owners[arch]
        self._asked = plugins
        try:
            plugins.register_models(self)
        except Exception:
            self._asked = None  # ask again next time (the error is the caller's to see)
            raise

    def contributions(self) -> list[tuple[str, str | None]]:
        """``(architecture, plugin)`` for every architecture (plugin None: direct)."""
        self._ensure_plugins()
        return [(arch, self._owners.get(arch)) for arch in sorted(self._entries)]

    def plugin_of(self, architecture: str) -> str | None:
        self._ensure_plugins()
        return self._owners.get(architecture)

    # -- queries ------------------------------------------------------------------------
    def supported_architectures(self) -> list[str]:
        self._ensure_plugins()
        return sorted(self._entries)

    def __contains__(self, architecture: str) -> bool:
        self._ensure_plugins()
        return architecture in self._entries

    def _load(self, architecture: str) -> type[nn.Module]:
        entry = self._entries[architecture]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[architecture] = entry
        return entry

    def resolve(self, architectures: list[str] | None) -> type[nn.Module]:
        """The class for the first supported name in ``architectures``."""
        self._ensure_plugins()
        for arch in architectures or []:
            if arch in self._entries:
                return self._load(arch)
        hint = ""
        if self._plugins is not None and os.environ.get("ENGINE_PLUGINS"):
            hint = (f" (ENGINE_PLUGINS={os.environ['ENGINE_PLUGINS']} limits the plugins "
                    "loaded; the built-in architectures come from the 'models' plugin)")
        raise ValueError(
            f"model architecture(s) {list(architectures or [])} not supported; "
            f"supported: {', '.join(self.supported_architectures()) or '(none)'}{hint}"
        )


def _process_plugin_registry() -> Any:
    from engine.core.plugins import get_plugin_registry

    return get_plugin_registry()


MODEL_REGISTRY = ModelRegistry(plugins=_process_plugin_registry)
