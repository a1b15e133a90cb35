"""``MultiConnector``: several KV connectors as one (vLLM's name and semantics).

``kv_connector_extra_config.connectors`` lists the children as KV transfer configs (each
``{"kv_connector": ..., "kv_role": ..., "kv_connector_extra_config": {...}}``; the role,
engine id and side-channel address default to the parent's). A request loads from the
first child that has tokens for it (every child is asked, in order, so each sees the
request); every child saves what it saves; a finished request's blocks are held until
every child that asked to hold them reports them sent. ``--kv-offloading-size`` next to a
``--kv-transfer-config`` builds one: the configured connector first, then the
``OffloadingConnector``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.core.interfaces.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorRole,
    KVTransferStats,
)

CONNECTORS_KEY = "connectors"


class MultiConnectorMetadata(msgspec.Struct, gc=False):
    metas: list[Any] = msgspec.field(default_factory=list)
    # Finished requests more than one child holds: sends to wait for past the first.
    extra_async_saves: dict[str, int] = msgspec.field(default_factory=dict)


def child_configs(config: Any) -> list[Any]:
    """The children's KV transfer configs, with the parent's defaults filled in."""
    from engine.core.config import KVTransferConfig

    children = (config.kv_connector_extra_config or {}).get(CONNECTORS_KEY)
    if not isinstance(children, list) or not children:
        raise ValueError(f"MultiConnector needs kv_connector_extra_config.{CONNECTORS_KEY}: "
                         "a non-empty list of KV transfer configs")
    out = []
    for child in children:
        if isinstance(child, KVTransferConfig):
            child = child.model_dump()
        if not isinstance(child, dict):
            raise ValueError(  # noqa: TRY004 - a config error, like the others
                f"MultiConnector: a child config must be an object, got {child!r}")
        if child.get("kv_connector") == "MultiConnector":
            raise ValueError("MultiConnector: a child cannot be a MultiConnector")
        merged = {"kv_role": config.kv_role, "engine_id": config.engine_id,
                  "kv_ip": config.kv_ip, "kv_port": config.kv_port, **child}
        out.append(KVTransferConfig.from_value(merged))
    return out


class MultiConnector(KVConnectorBase):
    name = "MultiConnector"
    metadata_cls = MultiConnectorMetadata

    def __init__(self, config: Any, role: KVConnectorRole, engine_config: Any = None) -> None:
        super().__init__(config, role, engine_config)
        from engine.kv_transfer.factory import connector_classes

        classes = connector_classes()
        self.connectors: list[KVConnectorBase] = []
        for child in child_configs(config):
            cls = classes.get(child.kv_connector)
            if cls is None:
                raise ValueError(f"MultiConnector: unknown KV connector {child.kv_connector!r};"
                                 f" installed: {', '.join(sorted(classes))}")
            self.connectors.append(cls(child, role, engine_config))
        self.uses_layer_hooks = any(c.uses_layer_hooks for c in self.connectors)
        self._hooked = [c for c in self.connectors if c.uses_layer_hooks]
        # Scheduler side: which child loads each request; held requests' extra holders.
        self._chosen: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        # Worker side: sends still to come before a request counts as sent.
        self._sends_left: dict[str, int] = {}

    # -- scheduler side ---------------------------------------------------------------------
    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        for connector in self.connectors:
            hook = getattr(connector, "on_block_evicted", None)
            if hook is not None:
                hook(block_id, block_hash)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        chosen: tuple[int, int, bool] | None = None
        for i, connector in enumerate(self.connectors):
            tokens, asynchronous = connector.get_num_new_matched_tokens(request,
                                                                        num_computed_tokens)
            if chosen is None and tokens > 0:
                chosen = (i, tokens, asynchronous)
        if chosen is None:
            self._chosen.pop(request.request_id, None)
            return 0, False
        self._chosen[request.request_id] = chosen[0]
        return chosen[1], chosen[2]

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(
                request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: Any) -> MultiConnectorMetadata:
        meta = MultiConnectorMetadata(
            metas=[c.build_connector_meta(scheduler_output) for c in self.connectors],
            extra_async_saves=self._extra_async_saves)
        self._extra_async_saves = {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(request.request_id, None)
        holders, params = 0, None
        for connector in self.connectors:
            delay, child_params = connector.request_finished(request, block_ids)
            holders += bool(delay)
            if child_params is not None:
                params = child_params if params is None else {**params, **child_params}
        if holders > 1:
            self._extra_async_saves[request.request_id] = holders - 1
        return holders > 0, params

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any], layout: KVCacheLayout) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches, layout)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.metadata = metadata
        if metadata is None:
            for connector in self.connectors:
                connector.bind_connector_metadata(None)
            return
        for rid, extra in metadata.extra_async_saves.items():
            self._sends_left[rid] = self._sends_left.get(rid, 0) + extra
        for connector, meta in zip(self.connectors, metadata.metas):
            if meta is not None and not isinstance(meta, connector.metadata_cls):
                meta = msgspec.convert(meta, connector.metadata_cls)
            connector.bind_connector_metadata(meta)

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def wait_for_layer_load(self, layer_index: int) -> None:
        for connector in self._hooked:
            connector.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int, kv_cache: Any, attn_metadata: Any) -> None:
        for connector in self._hooked:
            connector.save_kv_layer(layer_index, kv_cache, attn_metadata)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        receiving: set[str] = set()
        for connector in self.connectors:
            sent, received = connector.get_finished(finished_req_ids)
            receiving |= received
            for rid in sent:
                left = self._sends_left.get(rid, 0)
                if left:
                    self._sends_left[rid] = left - 1
                    if left == 1:
                        del self._sends_left[rid]
                    continue
                sending.add(rid)
        return sending, receiving

    def get_failed_loads(self) -> set[str]:
        failed: set[str] = set()
        for connector in self.connectors:
            failed |= connector.get_failed_loads()
        return failed

    def stats(self) -> KVTransferStats:
        total = KVTransferStats()
        for connector in self.connectors:
            s = connector.stats()
            total.bytes_sent += s.bytes_sent
            total.bytes_received += s.bytes_received
            total.blocks_sent += s.blocks_sent
            total.blocks_received += s.blocks_received
            total.transfer_seconds += s.transfer_seconds
            total.load_failures += s.load_failures
            total.extra.update({f"{connector.name}.{k}": v for k, v in s.extra.items()})
        return total

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()
