"""Building the configured KV connector for one role, from every plugin's connectors."""

from __future__ import annotations

from typing import Any

from engine.core.interfaces.kv_connector import KVConnectorBase, KVConnectorRole


def connector_classes() -> dict[str, type[KVConnectorBase]]:
    """Every installed connector by name (a name two plugins both claim is an error)."""
    from engine.core.plugins import get_plugin_registry

    found: dict[str, tuple[str, type[KVConnectorBase]]] = {}
    for plugin, cls in get_plugin_registry().kv_connectors():
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not (isinstance(cls, type)
                                             and issubclass(cls, KVConnectorBase)):
            raise ValueError(f"plugin {plugin!r} contributes {cls!r}, which is not a "
                             "KVConnectorBase subclass with a name")
        if name in found and found[name][1] is not cls:
            raise ValueError(f"KV connector {name!r} is contributed by both plugin "
                             f"{found[name][0]!r} and plugin {plugin!r}")
        found[name] = (plugin, cls)
    return {name: cls for name, (_, cls) in found.items()}


def make_connector(engine_config: Any, role: KVConnectorRole) -> KVConnectorBase:
    """The connector ``engine_config.kv_transfer`` names, built for ``role``."""
    config = engine_config.kv_transfer
    classes = connector_classes()
    cls = classes.get(config.kv_connector)
    if cls is None:
        raise ValueError(f"unknown KV connector {config.kv_connector!r}; installed: "
                         f"{', '.join(sorted(classes)) or '(none)'}")
    return cls(config, role, engine_config)
