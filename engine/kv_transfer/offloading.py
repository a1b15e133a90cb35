"""``OffloadingConnector``: a second KV tier in host memory (vLLM's name and flag,
``--kv-offloading-size GiB``).

A prefix-cache block that is about to be evicted from the KV cache (the block pool takes
it back for new content) is first copied to a bounded pool of tier slots, keyed by its
prefix-cache block hash; a later request whose prefix misses the KV cache but hits the
tier loads those blocks back (reported as externally matched tokens, like the shared
storage connector) instead of recomputing them. The tier evicts least recently used.

Who decides what (as vLLM's OffloadingManager / worker split):

- scheduler side (:class:`TierIndex`): the whole index, hash -> slot in LRU order, plain
  Python. The block pool reports every eviction of a cached block
  (:meth:`OffloadingConnector.on_block_evicted`, wired by the scheduler); a lookup pins the
  slots it matched until the step's metadata is built, so a store in the same step never
  reuses a slot a load still reads.
- worker side: a dumb array of slots, ``slots x layers x one block`` in the cache's dtype
  (pinned host memory when the cache is on an accelerator; plain host memory, or a file
  ``offload_path`` - e.g. under ``/dev/shm`` - on the CPU platform). Each step carries the
  saves (block -> slot) and the loads (slot -> block) the scheduler decided; saves run
  first (an evicted block may be the very block a load or this step's forward writes).

Stores are bounded per step by the blocks that step evicts (at most the blocks it
allocates), and are never on the step's critical path for data the step needs: on an
accelerator they are queued on a side stream (the forward's stream waits on an event, the
host does not), loads too, reported done when their event has completed; on the CPU
platform a store is a memcpy of the evicted blocks before the forward. A preempted
request's blocks return to the KV cache's free queue still cached, so they are stored
when (and only if) they are evicted, and its resume loads them back: preemption by
swapping, for free.

Both halves live in the engine core's process (KV connectors run on one rank): the tier's
slot count comes from ``num_cpu_blocks`` (vLLM's extra-config key) or from
``kv_offloading_size`` GiB over the bytes of one block of every layer, which the worker
side learns at ``register_kv_caches`` and publishes for its scheduler side.

Counters (``stats()``, the KV transfer metrics): blocks / bytes stored (``blocks_sent``,
``bytes_sent``), blocks / bytes loaded back (``blocks_received``, ``bytes_received``); the
tokens loaded are the engine's ``external_tokens_loaded``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import msgspec

from engine.core.interfaces.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorRole,
    KVTransferStats,
)

logger = logging.getLogger(__name__)

SIZE_KEY = "kv_offloading_size"  # GiB
BLOCKS_KEY = "num_cpu_blocks"  # vLLM's: the tier's size in blocks
PATH_KEY = "offload_path"  # a file backing the pool (e.g. under /dev/shm)

# engine_id -> the tier's slot count, published by the worker side for its scheduler side.
_TIER_SLOTS: dict[str, int] = {}
_TIER_LOCK = threading.Lock()


class OffloadLoad(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    block_ids: list[int]
    slots: list[int]


class OffloadingMetadata(msgspec.Struct, gc=False):
    save_block_ids: list[int] = msgspec.field(default_factory=list)
    save_slots: list[int] = msgspec.field(default_factory=list)
    loads: list[OffloadLoad] = msgspec.field(default_factory=list)


class TierIndex:
    """The tier's index: block hash -> slot, least recently used first, ``capacity`` slots.

    ``store`` gives the slot a new hash goes to (a free one, else the least recently used
    unpinned one, whose hash is dropped), or None when the hash is already there (it is
    only refreshed) or every slot is pinned. ``pin`` keeps a slot from being reused until
    ``unpin_all``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the KV offloading tier needs at least one block, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._pinned: set[int] = set()
        self.evictions = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._slots)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        self._slots.move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def store(self, block_hash: bytes) -> int | None:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                self.dropped += 1
                return None
            slot = self._slots.pop(victim)
            self.evictions += 1
        self._slots[block_hash] = slot
        return slot


def tier_num_blocks(config: Any, slot_bytes: int | None) -> int | None:
    """The tier's slots: ``num_cpu_blocks`` if given, else ``kv_offloading_size`` GiB over
    ``slot_bytes`` (None while that is unknown)."""
    extra = config.kv_connector_extra_config or {}
    if extra.get(BLOCKS_KEY) is not None:
        return int(extra[BLOCKS_KEY])
    size = extra.get(SIZE_KEY)
    if size is None:
        raise ValueError(f"OffloadingConnector needs kv_connector_extra_config.{SIZE_KEY} "
                         f"(GiB of host memory) or .{BLOCKS_KEY}; or use "
                         "--kv-offloading-size GiB")
    if float(size) <= 0:
        raise ValueError(f"{SIZE_KEY}={size}: must be > 0 GiB")
    if slot_bytes is None:
        return None
    num = int(float(size) * 2**30) // slot_bytes
    if num < 1:
        raise ValueError(f"{SIZE_KEY}={size} GiB holds no KV block ({slot_bytes} bytes "
                         "each, every layer)")
    return num


class OffloadingConnector(KVConnectorBase):
    name = "OffloadingConnector"
    metadata_cls = OffloadingMetadata

    def __init__(self, config: Any, role: KVConnectorRole, engine_config: Any = None) -> None:
        super().__init__(config, role, engine_config)
        self.block_size = engine_config.cache.block_size if engine_config is not None else 16
        tier_num_blocks(config, None)  # a missing or bad size fails at start
        if engine_config is not None and not engine_config.cache.enable_prefix_caching:
            raise ValueError("the KV offloading tier keeps prefix-cache blocks: it needs "
                             "prefix caching (drop --no-enable-prefix-caching)")
        # Scheduler side.
        self._index: TierIndex | None = None
        self._saves: list[tuple[int, int]] = []  # (block id, slot) this step
        self._loads: list[OffloadLoad] = []
        self._matched: dict[str, list[int]] = {}  # request -> its matched slots, in order
        # Worker side.
        self._caches: list[Any] = []
        self._layout: KVCacheLayout | None = None
        self._pool: Any = None
        self._slot_bytes = 0
        self._stream: Any = None
        self._pending: list[tuple[str, Any]] = []  # (request id, event) of async loads
        self._done_receiving: set[str] = set()
        self._stats = KVTransferStats()

    # -- scheduler side ---------------------------------------------------------------------
    @property
    def index(self) -> TierIndex:
        if self._index is None:
            num = tier_num_blocks(self.config, None)
            if num is None:
                with _TIER_LOCK:
                    num = _TIER_SLOTS.get(self.config.engine_id)
            if num is None:
                raise RuntimeError("the KV offloading tier's size in blocks is not known here "
                                   f"(its worker runs elsewhere): set {BLOCKS_KEY}")
            self._index = TierIndex(num)
        return self._index

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """The block pool is about to reuse ``block_id``, which holds ``block_hash``'s KV."""
        slot = self.index.store(block_hash)
        if slot is not None:
            self._saves.append((block_id, slot))

    def _hashes(self, request: Any) -> list[bytes]:
        from engine.core.kv_cache.hashing import update_block_hashes

        return update_block_hashes(request, self.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        bs, index = self.block_size, self.index
        hashes = self._hashes(request)
        first = num_computed_tokens // bs
        slots: list[int] = []
        for block_hash in hashes[first:]:
            slot = index.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        external = min((first + len(slots)) * bs, request.num_tokens - 1) - num_computed_tokens
        if external <= 0:
            self._matched.pop(request.request_id, None)
            return 0, False
        for block_hash, slot in zip(hashes[first:], slots):
            index.touch(block_hash)  # most recently used, and kept until the step is built
            index.pin(slot)
        self._matched[request.request_id] = slots
        return external, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        slots = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or not slots:
            return
        bs = self.block_size
        first = request.num_computed_tokens // bs
        last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        n = last - first
        self._loads.append(OffloadLoad(request.request_id, list(block_ids[first:last]),
                                       slots[:n]))

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingMetadata:
        meta = OffloadingMetadata(save_block_ids=[b for b, _ in self._saves],
                                  save_slots=[s for _, s in self._saves], loads=self._loads)
        self._saves, self._loads = [], []
        self._matched.clear()
        if self._index is not None:
            self._index.unpin_all()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        return False, None  # blocks are stored when evicted, not when their request ends

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any], layout: KVCacheLayout) -> None:
        import torch

        self._caches, self._layout = list(kv_caches), layout
        block_shape = tuple(kv_caches[0].select(layout.block_dim, 0).shape)
        for cache in kv_caches:
            if tuple(cache.select(layout.block_dim, 0).shape) != block_shape:
                raise ValueError("the KV offloading tier needs every layer's blocks of one "
                                 "shape")
        dtype = kv_caches[0].dtype
        numel = 1
        for d in block_shape:
            numel *= d
        self._slot_bytes = numel * kv_caches[0].element_size() * len(kv_caches)
        num = tier_num_blocks(self.config, self._slot_bytes)
        shape = (num, len(kv_caches), *block_shape)
        device = kv_caches[0].device
        path = (self.config.kv_connector_extra_config or {}).get(PATH_KEY)
        if device.type != "cpu":
            self._pool = torch.empty(shape, dtype=dtype, pin_memory=True)
            self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        elif path:
            total = num * len(kv_caches) * numel
            self._pool = torch.from_file(str(path), shared=True, size=total,
                                         dtype=dtype).view(shape)
        else:
            self._pool = torch.empty(shape, dtype=dtype)
        with _TIER_LOCK:
            _TIER_SLOTS[self.config.engine_id] = num
        logger.info("KV offloading tier: %d blocks of %d tokens (%.2f GiB%s)", num,
                    layout.block_size, num * self._slot_bytes / 2**30,
                    ", pinned host memory" if device.type != "cpu" else
                    f", file {path}" if path else ", host memory")

    def start_load_kv(self) -> None:
        metadata = getattr(self, "metadata", None)
        if not metadata or (not metadata.save_block_ids and not metadata.loads):
            return
        start = time.perf_counter()
        if self._stream is not None:
            self._transfer_async(metadata)
        else:
            self._transfer_sync(metadata)
        n = len(metadata.save_block_ids)
        self._stats.blocks_sent += n
        self._stats.bytes_sent += n * self._slot_bytes
        self._stats.transfer_seconds += time.perf_counter() - start

    def _transfer_sync(self, metadata: OffloadingMetadata) -> None:
        """Host caches: the evicted blocks' memcpy into their slots, then the loads."""
        import torch

        dim, pool = self._layout.block_dim, self._pool
        with torch.no_grad():
            if metadata.save_block_ids:
                ids = torch.tensor(metadata.save_block_ids, dtype=torch.long)
                slots = torch.tensor(metadata.save_slots, dtype=torch.long)
                for layer, cache in enumerate(self._caches):
                    pool[slots, layer] = cache.index_select(dim, ids).movedim(dim, 0)
            for load in metadata.loads:
                ids = torch.tensor(load.block_ids, dtype=torch.long)
                slots = torch.tensor(load.slots, dtype=torch.long)
                for layer, cache in enumerate(self._caches):
                    cache.index_copy_(dim, ids, pool[slots, layer].movedim(0, dim))
                self._count_load(load)
                self._done_receiving.add(load.request_id)

    def _transfer_async(self, metadata: OffloadingMetadata) -> None:
        """Accelerator caches: copies on a side stream that first waits for the work
        queued so far (the evicted blocks' content); the forward's stream then waits for
        the saves (it may overwrite those blocks), and each load's event is polled."""
        import torch

        dim, pool = self._layout.block_dim, self._pool
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for block_id, slot in zip(metadata.save_block_ids, metadata.save_slots):
                for layer, cache in enumerate(self._caches):
                    pool[slot, layer].copy_(cache.select(dim, block_id), non_blocking=True)
            saved = torch.cuda.Event()
            saved.record(self._stream)
            for load in metadata.loads:
                for block_id, slot in zip(load.block_ids, load.slots):
                    for layer, cache in enumerate(self._caches):
                        cache.select(dim, block_id).copy_(pool[slot, layer], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._pending.append((load.request_id, event))
                self._count_load(load)
        current.wait_event(saved)

    def _count_load(self, load: OffloadLoad) -> None:
        self._stats.blocks_received += len(load.slots)
        self._stats.bytes_received += len(load.slots) * self._slot_bytes

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        still: list[tuple[str, Any]] = []
        for rid, event in self._pending:
            if event.query():
                self._done_receiving.add(rid)
            else:
                still.append((rid, event))
        self._pending = still
        done, self._done_receiving = self._done_receiving, set()
        return set(), done

    def stats(self) -> KVTransferStats:
        if self._index is not None:
            self._stats.extra.update(tier_blocks=len(self._index),
                                     tier_capacity=self._index.capacity,
                                     tier_evictions=self._index.evictions)
        return self._stats

    def shutdown(self) -> None:
        with _TIER_LOCK:
            _TIER_SLOTS.pop(self.config.engine_id, None)
        self._pool = None
        self._caches = []
