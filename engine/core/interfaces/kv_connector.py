"""KV connectors: KV cache that comes from, or goes to, outside this engine instance.

Disaggregated prefill/decode (a producer prefills, a consumer decodes on the KV it
receives), an external or persistent prefix cache: both are a :class:`KVConnectorBase`,
in two halves like vLLM's V1 connector, one object per role:

Scheduler side (plain Python, in the engine core; never touches tensors):

- :meth:`get_num_new_matched_tokens`: how many prompt tokens past the locally computed
  ones the outside can supply, and whether they arrive asynchronously (the request then
  waits in ``WAITING_FOR_REMOTE_KV`` until the worker reports them received);
- :meth:`update_state_after_alloc`: the blocks just allocated for those tokens;
- :meth:`build_connector_meta`: what the worker side must do this step (loads, saves),
  a msgspec-encodable value carried in the scheduler output;
- :meth:`request_finished`: whether to keep the finished request's blocks until the
  worker reports them sent (a producer waiting for its consumer to pull), and the
  ``kv_transfer_params`` returned to the client.

Worker side (in every rank's model runner):

- :meth:`register_kv_caches` once; per step :meth:`bind_connector_metadata`, then
  :meth:`start_load_kv` before the forward, :meth:`wait_for_layer_load` before each
  layer's attention, :meth:`save_kv_layer` after each layer's attention wrote its KV,
  :meth:`wait_for_save` after the forward; :meth:`get_finished` reports the requests whose
  asynchronous sends and receives completed, :meth:`get_failed_loads` those whose load
  failed (the scheduler recomputes them: never wrong output).

Connectors are contributed by plugins (``engine_register_kv_connectors``) and selected by
name in vLLM's ``--kv-transfer-config`` JSON.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class KVCacheLayout:
    """What a worker-side connector knows of the paged KV cache it moves blocks of.

    Every layer's cache is one tensor whose dim ``block_dim`` indexes blocks; a block of
    one layer is ``cache.select(block_dim, block_id)``, ``block_bytes`` bytes (all layers:
    ``num_layers * block_bytes``)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_dim: int
    block_bytes: int
    mla: bool = False
    backend: str = ""  # the attention backend whose layout this is
    tp_rank: int = 0
    tp_size: int = 1

    def describe(self) -> str:
        kind = "MLA latent" if self.mla else f"{self.num_kv_heads} KV heads x {self.head_size}"
        return (f"{self.num_layers} layers of {kind}, {self.dtype}, blocks of "
                f"{self.block_size} tokens ({self.backend} layout, tp {self.tp_rank}/"
                f"{self.tp_size})")


@dataclass
class KVTransferStats:
    """Counters a worker-side connector keeps (cumulative since start)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    transfer_seconds: float = 0.0
    load_failures: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class KVConnectorBase(ABC):
    """One connector, built once per role: ``cls(config, role, engine_config)``.

    ``config`` is the engine's KV transfer config (``kv_connector``, ``kv_role``,
    ``kv_connector_extra_config``, ``engine_id`` ...), ``engine_config`` the whole engine
    config (block size, model). ``metadata_cls``: the msgspec Struct type of
    :meth:`build_connector_meta`'s value, so it can cross to worker processes."""

    name: ClassVar[str]
    metadata_cls: ClassVar[type]
    # True: wait_for_layer_load / save_kv_layer are called around every layer's attention
    # (layer-wise streaming); the forward then always runs eagerly (a captured forward
    # graph cannot call back into Python). False: only the step-level calls.
    uses_layer_hooks: ClassVar[bool] = False

    def __init__(self, config: Any, role: KVConnectorRole, engine_config: Any = None) -> None:
        self.config = config
        self.role = role
        self.engine_config = engine_config

    # -- scheduler side ---------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """``(tokens, asynchronous)``: prompt tokens after ``num_computed_tokens`` the
        outside can supply for ``request``."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for the request, the external tokens included."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's instructions for the worker side (an instance of metadata_cls)."""

    @abstractmethod
    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a request that finished."""

    # -- worker side ------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        """The rank's per-layer cache tensors (called once, after allocation)."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.metadata = metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin (or, synchronously, do) the bound metadata's loads."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer ``layer_index``'s loads of this step are in its cache."""

    def save_kv_layer(self, layer_index: int, kv_cache: torch.Tensor, attn_metadata: Any
                      ) -> None:
        """Layer ``layer_index``'s attention wrote this step's KV into ``kv_cache``."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the cache as it is."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_receiving)`` request ids since the last call.
        ``finished_req_ids``: requests the scheduler finished this step."""
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (they are recomputed)."""
        return set()

    def stats(self) -> KVTransferStats:
        return KVTransferStats()

    def shutdown(self) -> None:
        """Release ports, threads and registrations."""
