"""The built-in KV connectors, contributed through the same hook a third party's use
(entry point ``kv_transfer`` of the ``engine.plugins`` group)."""

from __future__ import annotations

from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins.hookspecs import hookimpl


@hookimpl
def engine_plugin_api_version() -> int:
    return PLUGIN_API_VERSION  # in-tree: evolves with the engine


@hookimpl
def engine_register_kv_connectors() -> list[type]:
    from engine.kv_transfer.multi import MultiConnector
    from engine.kv_transfer.nixl_connector import NixlConnector
    from engine.kv_transfer.offloading import OffloadingConnector
    from engine.kv_transfer.shared_storage import SharedStorageConnector

    return [SharedStorageConnector, NixlConnector, OffloadingConnector, MultiConnector]
