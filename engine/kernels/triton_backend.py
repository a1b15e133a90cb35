"""The Triton attention backend shared by the GPU plugins (and the CPU platform in tests).

KV cache layout: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` in the model dtype or, with ``--kv-cache-dtype fp8 | fp8_e5m2``, fp8 codes
scaled by the layer's ``k_scale`` / ``v_scale`` (index 0 = K, 1 = V); an MLA layer's is ``[num_blocks,
block_size, entry_size]``, one latent entry per token. Each layer's ``forward`` writes the
step's new K/V rows (``reshape_and_cache``) and then runs ``unified_attention`` over the
cache (MLA layers: ``mla_write_cache`` and ``mla_attention``, in
:mod:`engine.kernels.mla_attention`; encoder layers, ``spec.causal`` False: no cache at
all, ``encoder_attention`` over the step's own K/V, in
:mod:`engine.kernels.encoder_attention`); whether long decodes split their keys over several
programs (split-KV) is decided once per step in :meth:`TritonAttentionBackend.build_metadata`.

Forcing split-KV (tests, and comparing both paths on a GPU): the constructor argument
``num_kv_splits=n``, or the environment variable ``ENGINE_TRITON_NUM_KV_SPLITS=n`` read
when the backend is constructed (the argument wins), makes every step use ``n`` splits,
prefill chunks included; ``n = 1`` forces the single-pass kernel. Unset: decided per step.
The engine builds its backend from the platform, so the variable is the way to reach it
end to end, e.g. ``ENGINE_TRITON_NUM_KV_SPLITS=4 engine generate ... --device cuda``.

Batch-invariant mode (``engine.core.batch_invariance``, read when the backend is
constructed, or the constructor's ``batch_invariant``): a query's reduction over its keys
runs in one order in a prefill chunk, a decode or a speculative verification, at any
batch size. Every step then runs the single-pass kernel (no split-KV; forcing splits is
an error) with one tile shape (``unified_attention(batch_invariant=True)``); MLA and
encoder layers get fixed tile shapes too (theirs otherwise follow the step's longest
query / request).

Importing this module needs no triton; constructing the backend does, and says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from engine.core.batch_invariance import batch_invariant_enabled
from engine.core.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionImpl,
    AttentionLayerSpec,
)
from engine.kernels.triton_utils import compute_units, require_triton

if TYPE_CHECKING:
    from engine.kernels.split_kv import SplitKVWorkspace

MIN_HEAD_SIZE = 16
MAX_HEAD_SIZE = 256  # beyond this the fp32 accumulator tile no longer fits in registers
NUM_KV_SPLITS_ENV = "ENGINE_TRITON_NUM_KV_SPLITS"
# MLA: the fp32 accumulator is [rows, kv_lora_rank] (DeepSeek-V2/V3: 512 + 64 rope dims)
MLA_MAX_LORA_RANK = 512
MLA_MAX_ROPE_DIM = 128


def forced_num_kv_splits_from_env() -> int | None:
    """``ENGINE_TRITON_NUM_KV_SPLITS`` as a positive int, or None when unset or empty."""
    raw = os.environ.get(NUM_KV_SPLITS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{NUM_KV_SPLITS_ENV} must be a positive integer, got {raw!r}")
    return value


@dataclass
class TritonAttentionMetadata:
    """Per-step inputs of the kernels, shared by every layer of the step.

    Encoder layers read only ``query_start_loc`` (their requests' segments, on the device)
    and ``max_query_len`` (a host int that sizes their tiles), so they launch without a
    device->host sync."""

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [R + 1], on the device
    seq_lens: torch.Tensor  # int32 [R]
    block_tables: torch.Tensor  # int32 [R, M]
    slot_mapping: torch.Tensor  # int64 [T]
    max_query_len: int
    max_seq_len: int
    num_kv_splits: int  # 1 = single pass; > 1 = split-KV with that many splits
    workspace: SplitKVWorkspace  # split-KV partial buffers, reused across layers/steps
    batch_invariant: bool = False  # one tile shape for every step, never split-KV
    # int32 [T] on the device: each query's key end where some query attends past its
    # position (AttentionBatch.key_ends_cpu: bidirectional image tokens); None: causal.
    key_ends: torch.Tensor | None = None


class TritonAttentionImpl(AttentionImpl):
    """One layer: store this step's K/V, then attend over the paged cache; an encoder
    layer (``spec.causal`` False) attends over its step's K/V instead and stores nothing."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        from engine.kernels.encoder_attention import encoder_attention
        from engine.kernels.reshape_and_cache import reshape_and_cache
        from engine.kernels.unified_attention import unified_attention

        self._encoder_attention = encoder_attention
        self._reshape_and_cache = reshape_and_cache
        self._unified_attention = unified_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """``key``/``value`` None: this layer reuses K/V another layer already stored.
        ``kv_cache`` None: an encoder layer's (it has none)."""
        if (key is None) != (value is None):
            raise ValueError("key and value must both be given or both be None")
        if not self.spec.causal:
            return self._encoder_forward(query, key, value, metadata)
        if key is not None:
            self._reshape_and_cache(key, value, kv_cache, metadata.slot_mapping,
                                    self.k_scale, self.v_scale)
        out = torch.empty_like(query)
        spec = self.spec
        return self._unified_attention(
            query,
            kv_cache,
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            metadata.max_seq_len,
            spec.scale,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
            num_kv_splits=metadata.num_kv_splits,
            workspace=metadata.workspace,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            attention_chunk_size=spec.attention_chunk_size,
            sinks=self._sink_logits(query.device),
            batch_invariant=metadata.batch_invariant,
            key_ends=metadata.key_ends,
        )

    def _sink_logits(self, device: torch.device) -> torch.Tensor | None:
        """``self.sinks`` as float32 ``[num_heads]`` on ``device`` (None without sinks)."""
        if not self.spec.use_sinks:
            return None
        if self.sinks is None:
            raise ValueError("this attention layer uses sinks (spec.use_sinks) but its "
                             "impl.sinks were never set (load the layer's weights first)")
        return self.sinks.detach().to(device=device, dtype=torch.float32)

    def _encoder_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """Bidirectional attention within each request's tokens of the step: no cache is
        written or read, so an encoder layer always brings its own K/V."""
        if key is None:
            raise ValueError("an encoder (non-causal) layer needs its own key and value; "
                             "it keeps no KV cache to share")
        spec = self.spec
        block_m = tile = None
        if metadata.batch_invariant:
            block_m, tile = _encoder_invariant_tiles(query, key)
        return self._encoder_attention(
            query,
            key,
            value,
            metadata.query_start_loc,
            metadata.max_query_len,
            spec.scale,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
            block_m=block_m,
            tile_size=tile,
        )


class TritonMLAAttentionImpl(AttentionImpl):
    """One MLA layer: store this step's latent entries, then attend over them (key: the
    entries ``[T, 1, D]``, value: None; output ``[T, num_heads, kv_lora_rank]``)."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        from engine.kernels.mla_attention import mla_attention, mla_write_cache

        self._write_cache = mla_write_cache
        self._attention = mla_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """``key`` None: the entries are already stored."""
        if key is not None:
            self._write_cache(key, kv_cache, metadata.slot_mapping)
        spec = self.spec
        block_m = None
        if metadata.batch_invariant:
            block_m = _mla_invariant_block_m(query, spec.kv_lora_rank)
        return self._attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            spec.kv_lora_rank,
            spec.scale,
            block_m=block_m,
        )


def _encoder_invariant_tiles(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    """Encoder tiles for batch-invariant mode: the shape for an unbounded request length
    (by default they shrink to the step's longest request, which follows the batch)."""
    from engine.kernels.encoder_attention import MIN_DOT, _launch_config
    from engine.kernels.triton_utils import next_power_of_2

    qpk_pad = next_power_of_2(query.shape[1] // key.shape[1])
    head_pad = max(MIN_DOT, next_power_of_2(query.shape[2]))
    config = _launch_config(1 << 30, qpk_pad, head_pad, query.dtype)
    return config.block_m, config.tile


def _mla_invariant_block_m(query: torch.Tensor, kv_lora_rank: int) -> int:
    """MLA's query-row tile for batch-invariant mode: the prefill one for every step (by
    default a pure-decode step takes a shorter one). Its key tile never varies."""
    from engine.kernels.mla_attention import MIN_DOT, launch_config
    from engine.kernels.triton_utils import next_power_of_2

    lora_pad = max(MIN_DOT, next_power_of_2(kv_lora_rank))
    return launch_config(query.shape[1], 2, lora_pad, query.dtype).block_m


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in portable Triton: any block size, head sizes 16..256, GQA;
    encoder (non-causal) layers too, MLA layers causal only."""

    name: ClassVar[str] = "triton"

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        num_compute_units: int | None = None,
        num_kv_splits: int | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        """``num_compute_units``: SMs/CUs used to size split-KV (probed when None);
        ``num_kv_splits``: force a split count every step (None: ``ENGINE_TRITON_NUM_KV_SPLITS``
        if set, else decide per step); ``batch_invariant``: None follows the process's
        batch-invariant mode."""
        require_triton()
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_kv_splits is None:
            num_kv_splits = forced_num_kv_splits_from_env()
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        if batch_invariant is None:
            batch_invariant = batch_invariant_enabled()
        if batch_invariant and num_kv_splits is not None and num_kv_splits > 1:
            raise ValueError(
                f"batch-invariant mode cannot split the keys (num_kv_splits={num_kv_splits}, "
                f"or {NUM_KV_SPLITS_ENV}): split-KV shares follow the batch")
        super().__init__(block_size, torch.device(device))
        from engine.kernels.split_kv import SplitKVWorkspace, choose_num_kv_splits

        self._choose_num_kv_splits = choose_num_kv_splits
        self._workspace = SplitKVWorkspace()
        self.num_compute_units = num_compute_units or compute_units(self.device)
        self.forced_num_kv_splits = num_kv_splits
        self.batch_invariant = bool(batch_invariant)
        self._num_kv_heads = 1  # the widest layer made so far sizes the split decision

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supported_kv_cache_dtypes(cls, mla: bool = False) -> tuple[str, ...]:
        """fp8 caches for MHA / GQA layers (engine.kernels.fp8_kv); MLA: the model dtype."""
        return ("auto",) if mla else ("auto", "fp8_e4m3", "fp8_e5m2")

    @classmethod
    def get_mla_kv_cache_shape(
        cls, num_blocks: int, block_size: int, entry_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, entry_size)

    @classmethod
    def supported_head_sizes(cls) -> list[int] | None:
        return list(range(MIN_HEAD_SIZE, MAX_HEAD_SIZE + 1))

    @classmethod
    def supports_encoder_attention(cls) -> bool:
        """Non-causal MHA / GQA layers (engine.kernels.encoder_attention); the base
        validate refuses non-causal MLA."""
        return True

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        """Any: the kernel looks up the block of every key position separately."""
        return None

    @classmethod
    def supports_attention_sinks(cls) -> bool:
        """Causal MHA / GQA layers (unified_attention; split-KV adds them at the merge)."""
        return True

    @classmethod
    def supports_chunked_local_attention(cls) -> bool:
        return True

    @classmethod
    def validate(cls, spec: AttentionLayerSpec, block_size: int) -> str | None:
        if spec.is_mla:
            return cls._validate_mla(spec, block_size)
        if not MIN_HEAD_SIZE <= spec.head_size <= MAX_HEAD_SIZE:
            return (
                f"{cls.name} supports head sizes {MIN_HEAD_SIZE}..{MAX_HEAD_SIZE}, "
                f"not {spec.head_size}"
            )
        if spec.num_kv_heads < 1 or spec.num_heads % spec.num_kv_heads != 0:
            return (
                f"{cls.name} needs num_heads ({spec.num_heads}) to be a multiple of "
                f"num_kv_heads ({spec.num_kv_heads})"
            )
        if block_size < 1:
            return f"{cls.name} needs a positive block size, not {block_size}"
        if not spec.causal and (spec.use_sinks or spec.attention_chunk_size is not None):
            return (f"{cls.name} encoder (non-causal) attention has no sinks or chunked "
                    "local attention")
        if spec.attention_chunk_size is not None and spec.attention_chunk_size <= 0:
            return f"attention_chunk_size must be positive, not {spec.attention_chunk_size}"
        return super().validate(spec, block_size)

    @classmethod
    def _validate_mla(cls, spec: AttentionLayerSpec, block_size: int) -> str | None:
        if spec.sliding_window or spec.logits_soft_cap:
            return f"{cls.name} MLA attention has no sliding window or logits soft cap"
        if block_size < 1:
            return f"{cls.name} needs a positive block size, not {block_size}"
        reason = super().validate(spec, block_size)  # one entry per token, wider than L
        if reason is not None:
            return reason
        rope_dim = spec.head_size - spec.kv_lora_rank
        if not 0 < spec.kv_lora_rank <= MLA_MAX_LORA_RANK or rope_dim > MLA_MAX_ROPE_DIM:
            return (
                f"{cls.name} MLA supports kv_lora_rank 1..{MLA_MAX_LORA_RANK} and rope dims "
                f"up to {MLA_MAX_ROPE_DIM}, not {spec.kv_lora_rank} + {rope_dim}"
            )
        return None

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        if self.batch_invariant:
            splits = 1
        elif self.forced_num_kv_splits is not None:
            splits = self.forced_num_kv_splits
        else:
            splits = self._choose_num_kv_splits(
                batch.num_reqs,
                self._num_kv_heads,
                batch.max_query_len,
                batch.max_seq_len,
                self.num_compute_units,
            )
        return TritonAttentionMetadata(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            slot_mapping=batch.slot_mapping,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            num_kv_splits=splits,
            workspace=self._workspace,
            batch_invariant=self.batch_invariant,
            key_ends=(None if batch.key_ends_cpu is None else torch.as_tensor(
                np.asarray(batch.key_ends_cpu, dtype=np.int32)).to(batch.seq_lens.device)),
        )

    @classmethod
    def supports_key_ends(cls) -> bool:
        return True

    def make_impl(self, spec: AttentionLayerSpec) -> TritonAttentionImpl | TritonMLAAttentionImpl:
        reason = self.validate(spec, self.block_size)
        if reason is not None:
            raise ValueError(reason)
        if spec.is_mla:
            return TritonMLAAttentionImpl(spec)
        if spec.causal:  # split-KV plans cache reads, which encoder layers never do
            self._num_kv_heads = max(self._num_kv_heads, spec.num_kv_heads)
        return TritonAttentionImpl(spec)
