"""``SharedStorageConnector``: KV blocks as files keyed by block hash, in one directory.

A producer (``kv_producer`` / ``kv_both``) writes every prompt block its steps complete:
``blocks/<hash>.kv`` holds that block of every layer (a safetensors file, written to a
temporary name and renamed, so a reader never sees half a block). The key is the prefix
cache's block hash (it names the whole prefix, salt included); a prompt's partial last
block is saved under the hash of its partial tokens. A consumer (``kv_consumer`` /
``kv_both``) looks its prompt's blocks up by the same hashes and loads the longest run
found, except the prompt's last token, which it computes itself (its logits are needed).

So two instances on one directory are prefill and decode of a disaggregated pair, and one
instance restarted on it finds the prefixes it computed before (a persistent prefix cache).
``layout.json`` names the KV layout the directory holds; an engine with another layout
(model, dtype, block size, attention backend) is refused at start.

Loads run in the worker before the forward of the step that carries them and are reported
done in that step; the request runs from the next step. A block that cannot be read
fails the request's load: it is recomputed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from engine.core.interfaces.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorRole,
    KVTransferStats,
)

logger = logging.getLogger(__name__)

PATH_KEY = "shared_storage_path"
_LAYOUT_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_size", "dtype", "block_dim",
                  "block_bytes", "mla", "backend", "tp_size")


class BlockFile(msgspec.Struct, array_like=True, gc=False):
    block_id: int
    key: str  # hex block hash


class StorageLoad(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    blocks: list[BlockFile]


class SharedStorageMetadata(msgspec.Struct, gc=False):
    loads: list[StorageLoad] = msgspec.field(default_factory=list)
    saves: list[BlockFile] = msgspec.field(default_factory=list)


def storage_dir(config: Any) -> Path:
    path = (config.kv_connector_extra_config or {}).get(PATH_KEY)
    if not path:
        raise ValueError(f"SharedStorageConnector needs kv_connector_extra_config."
                         f"{PATH_KEY}: the directory the KV blocks live in")
    return Path(path).expanduser()


class _Tracked:
    """What the scheduler side keeps of a request it has seen."""

    __slots__ = ("request", "block_ids")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.block_ids: list[int] = []


class SharedStorageConnector(KVConnectorBase):
    name = "SharedStorageConnector"
    metadata_cls = SharedStorageMetadata

    def __init__(self, config: Any, role: KVConnectorRole, engine_config: Any = None) -> None:
        super().__init__(config, role, engine_config)
        self.root = storage_dir(config)
        self.blocks_dir = self.root / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self.block_size = engine_config.cache.block_size if engine_config is not None else 16
        self.produces, self.consumes = config.is_producer, config.is_consumer
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[StorageLoad] = []
        # Worker side.
        self._caches: list[Any] = []
        self._layout: KVCacheLayout | None = None
        self._done_receiving: set[str] = set()
        self._failed: set[str] = set()
        self._stats = KVTransferStats()

    # -- keys -------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.blocks_dir / f"{key}.kv"

    def _prompt_keys(self, request: Any) -> list[str]:
        """The keys of the prompt's blocks in order: full blocks by their prefix-cache
        hash, then the partial last block (if any) by the hash of its tokens."""
        from engine.core.kv_cache.hashing import (
            hash_block_tokens,
            request_extra_keys,
            update_block_hashes,
        )

        bs, prompt = self.block_size, request.num_prompt_tokens
        hashes = update_block_hashes(request, bs)[: prompt // bs]
        keys = [h.hex() for h in hashes]
        if prompt % bs:
            tail = request.prompt_token_ids[(prompt // bs) * bs : prompt]
            parent = hashes[-1] if hashes else None
            partial = hash_block_tokens(parent, list(tail), (*request_extra_keys(request),
                                                             "partial"))
            keys.append(partial.hex())
        return keys

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        self._tracked.setdefault(request.request_id, _Tracked(request))
        if not self.consumes:
            return 0, False
        bs, prompt = self.block_size, request.num_prompt_tokens
        keys = self._prompt_keys(request)
        first = num_computed_tokens // bs
        found = first
        while found < len(keys) and self._path(keys[found]).is_file():
            found += 1
        available = min(found * bs, prompt)
        external = min(available, prompt - 1) - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        first = request.num_computed_tokens // bs
        last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        keys = self._prompt_keys(request)
        blocks = [BlockFile(block_ids[i], keys[i]) for i in range(first, last)]
        self._loads.append(StorageLoad(request.request_id, blocks))

    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageMetadata:
        """This step's loads, and (producer) the prompt blocks it completes."""
        # A connector runs with one KV cache group: group 0's table is the request's.
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._tracked:
                self._tracked[new.req_id].block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if req_id in self._tracked:
                self._tracked[req_id].block_ids.extend(new_blocks[0])
        saves: list[BlockFile] = []
        if self.produces:
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    saves.extend(self._completed_blocks(tracked, scheduled))
        meta = SharedStorageMetadata(loads=self._loads, saves=saves)
        self._loads = []
        return meta

    def _completed_blocks(self, tracked: _Tracked, scheduled: int) -> list[BlockFile]:
        """Prompt blocks the step fills (the request has already advanced past it)."""
        request, bs = tracked.request, self.block_size
        after = min(request.num_computed_tokens, request.num_prompt_tokens)
        before = max(0, request.num_computed_tokens - scheduled)
        if after <= before:
            return []
        keys = self._prompt_keys(request)
        first = before // bs
        last = after // bs if after < request.num_prompt_tokens else len(keys)
        return [BlockFile(tracked.block_ids[i], keys[i]) for i in range(first, last)
                if i < len(tracked.block_ids) and not self._path(keys[i]).is_file()]

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None  # the files were written by the steps themselves

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any], layout: KVCacheLayout) -> None:
        self._caches, self._layout = list(kv_caches), layout
        mine = {k: v for k, v in asdict(layout).items() if k in _LAYOUT_FIELDS}
        layout_file = self.root / "layout.json"
        if layout_file.is_file():
            theirs = json.loads(layout_file.read_text())
            if theirs != mine:
                raise ValueError(
                    f"the shared KV storage {self.root} holds blocks of another layout "
                    f"({theirs}); this engine's is {mine}: use another "
                    f"{PATH_KEY} for this model / dtype / block size / backend")
        else:
            tmp = layout_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(mine, indent=1))
            os.replace(tmp, layout_file)

    def _block_views(self, block_id: int) -> list[Any]:
        dim = self._layout.block_dim
        return [cache.select(dim, block_id) for cache in self._caches]

    def start_load_kv(self) -> None:
        """Read every block of this step's loads into its cache block (all layers)."""
        import torch
        from safetensors.torch import load_file

        metadata = getattr(self, "metadata", None)
        if not metadata:
            return
        for load in metadata.loads:
            start = time.perf_counter()
            try:
                for block in load.blocks:
                    stored = load_file(str(self._path(block.key)))["kv"]
                    views = self._block_views(block.block_id)
                    if tuple(stored.shape) != (len(views), *views[0].shape):
                        raise ValueError(f"block {block.key} has shape {tuple(stored.shape)}")
                    with torch.no_grad():
                        for layer, view in enumerate(views):
                            view.copy_(stored[layer])
                    self._stats.bytes_received += stored.numel() * stored.element_size()
                    self._stats.blocks_received += 1
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                logger.warning("request %s: loading its KV from %s failed (%s); it is "
                               "recomputed", load.request_id, self.root, exc)
                self._failed.add(load.request_id)
                self._stats.load_failures += 1
                continue
            finally:
                self._stats.transfer_seconds += time.perf_counter() - start
            self._done_receiving.add(load.request_id)

    def wait_for_save(self) -> None:
        """Write the blocks the step completed (every layer's part of each)."""
        import torch
        from safetensors.torch import save_file

        metadata = getattr(self, "metadata", None)
        if not metadata or not metadata.saves:
            return
        start = time.perf_counter()
        for block in metadata.saves:
            path = self._path(block.key)
            if path.is_file():
                continue
            stacked = torch.stack([v.contiguous() for v in self._block_views(block.block_id)])
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file({"kv": stacked.cpu()}, str(tmp))
            os.replace(tmp, path)
            self._stats.bytes_sent += stacked.numel() * stacked.element_size()
            self._stats.blocks_sent += 1
        self._stats.transfer_seconds += time.perf_counter() - start

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self._done_receiving = self._done_receiving, set()
        return set(), done

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def stats(self) -> KVTransferStats:
        return self._stats
