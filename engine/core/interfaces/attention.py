"""The attention-backend contract between the model executor and a platform.

A backend owns two things: the layout of the paged KV cache (one tensor per layer)
and the kernel that writes new K/V rows into it and attends over it. The model runner
describes each step with a device-neutral :class:`AttentionBatch`; the backend turns it
into whatever metadata its kernels want, once per step, and every attention layer of
the model then calls :meth:`AttentionImpl.forward` with that metadata.

Token layout of a step: the new tokens of all scheduled requests are concatenated
(request order = batch order). Request ``r`` owns rows ``query_start_loc[r] :
query_start_loc[r+1]`` of ``query``; those rows are the *last* ``query_len`` positions of
its context of ``seq_lens[r]`` tokens, so query row ``i`` sits at position
``seq_lens[r] - query_len + i`` and attends causally to keys ``0 ..= that position``
(restricted to the last ``sliding_window`` keys when a window is set). Prefill chunks and
single-token decodes mix freely in one batch.

Multi-head latent attention (MLA, DeepSeek-V2/V3) is a second layer kind
(``AttentionLayerSpec.kv_lora_rank`` set): the cache holds one latent entry per token,
``kv_lora_rank + rope_dim`` wide (the compressed KV, then the rotated key part), shared
by every head. The model absorbs the key up-projection into the queries, so attention is
multi-query over those entries: a query row of ``head_size = kv_lora_rank + rope_dim``
scores whole entries, and the values are the entries' first ``kv_lora_rank`` dims; the
layer's output is ``[T, num_heads, kv_lora_rank]`` (the model applies the value
up-projection). Its cache layout comes from :meth:`AttentionBackend.get_mla_kv_cache_shape`
and costs ``block_size * entry_size * dtype bytes`` per block and layer.

FP8 KV cache (vLLM's ``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``): a backend that lists
the format in :meth:`AttentionBackend.supported_kv_cache_dtypes` stores one byte per value
(``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, the same cache shape) and every layer
has two float32 scales, :attr:`AttentionImpl.k_scale` / :attr:`AttentionImpl.v_scale`
(from the checkpoint, else 1.0). Writing quantizes: the cache holds ``fp8(key /
k_scale)`` computed in float32, rounded to nearest even and saturated to the format's
largest finite value (448 for e4m3, 57344 for e5m2; NaN stays NaN), as
:func:`quantize_kv` does; reading dequantizes: ``key = float(cache) * k_scale`` (the
same for values with ``v_scale``). Kernels may fold the scales elsewhere (``k_scale``
into the softmax scale, ``v_scale`` into the output) as long as the result is that of
attention over the dequantized values. Only block ids reach the scheduler, so prefix
caching and speculative decoding do not see the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


# vLLM's --kv-cache-dtype values; "fp8" means "fp8_e4m3" (OCP e4m3fn).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_FP8_TORCH_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def canonical_kv_cache_dtype(name: str) -> str:
    """``auto``, ``fp8_e4m3`` or ``fp8_e5m2`` for a ``--kv-cache-dtype`` value."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; use one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if name == "fp8" else name


def kv_cache_torch_dtype(name: str, model_dtype: "torch.dtype") -> "torch.dtype":
    """The cache tensors' dtype: the model dtype for ``auto``, else the fp8 format."""
    import torch

    canonical = canonical_kv_cache_dtype(name)
    if canonical == "auto":
        return model_dtype
    return getattr(torch, _FP8_TORCH_DTYPES[canonical])


def is_fp8_kv_cache(dtype: "torch.dtype") -> bool:
    import torch

    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: "torch.Tensor", scale: float, dtype: "torch.dtype") -> "torch.Tensor":
    """What an fp8 cache of ``dtype`` stores for ``x``: ``x / scale`` in float32, saturated
    to the format's largest finite value, rounded to nearest even (the reference every
    backend's store matches bit for bit)."""
    import torch

    bound = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-bound, bound).to(dtype)


def dequantize_kv(cache: "torch.Tensor", scale: float, dtype: "torch.dtype | None" = None
                  ) -> "torch.Tensor":
    """``float(cache) * scale`` (float32, or rounded to ``dtype``)."""
    import torch

    out = cache.to(torch.float32) * scale
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


@dataclass
class AttentionBatch:
    """One step's batch, described without reference to any kernel.

    All tensors live on the platform's device. Shapes: ``R`` scheduled requests,
    ``T`` new tokens in total, ``M`` = block-table width.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: "torch.Tensor"  # int32 [R + 1], cumulative new-token counts
    seq_lens: "torch.Tensor"  # int32 [R], context length after this step's tokens
    block_tables: "torch.Tensor"  # int32 [R, M], physical block ids (padding: 0)
    slot_mapping: "torch.Tensor"  # int64 [T], cache slot of each new token (-1: skip)
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that plan on the CPU (avoid device->host syncs).
    query_start_loc_cpu: Any = None  # numpy int32 [R + 1]
    seq_lens_cpu: Any = None  # numpy int32 [R]
    # Per new token, the exclusive end (a key position) of what it attends to, where that
    # reaches past its own position: the tokens of one image attend to each other both
    # ways (Gemma 3). numpy int64 [T], ``position + 1`` for every other token; never past
    # the request's ``seq_len``. None: plain causal attention. Backends honour it only
    # when ``supports_key_ends()``; the window still counts back from each token's own
    # position.
    key_ends_cpu: Any = None

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static shape of one attention layer, fixed at model construction."""

    num_heads: int
    head_size: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent keys
    logits_soft_cap: float | None = None
    # MLA: the latent width; head_size is then kv_lora_rank + rope dims, num_kv_heads 1.
    kv_lora_rank: int | None = None
    # What the cache stores: "auto" (the model dtype), "fp8_e4m3" or "fp8_e5m2" (see the
    # module docstring; the backend's kv_cache_dtype when the layer was made).
    kv_cache_dtype: str = "auto"
    # False: an encoder layer (BERT-style embedders and classifiers). Each request's
    # new tokens attend to each other in both directions, nothing is read from or
    # written to a cache (the layer gets ``kv_cache=None``), and a ``sliding_window``
    # ``w`` keeps the keys within ``w // 2`` positions on either side (ModernBERT's
    # ``local_attention``).
    causal: bool = True
    # Chunked local attention (Llama 4's ``attention_chunk_size``): a query at position
    # ``p`` attends causally only to keys in its own chunk, positions ``C * (p // C) ..=
    # p``. Combined with no sliding window.
    attention_chunk_size: int | None = None
    # Learned attention sinks (GPT-OSS): one extra logit per query head,
    # ``AttentionImpl.sinks[h]`` (float32, this rank's heads), joins each row's softmax
    # denominator without contributing a value: ``out = sum_j e^{s_j} v_j / (e^{sink_h} +
    # sum_j e^{s_j})`` (after scale and soft-capping of the ``s_j``; the sink is not capped).
    use_sinks: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


class AttentionImpl(ABC):
    """Per-layer attention: write this step's K/V into the cache, then attend.

    ``k_scale`` / ``v_scale``: the layer's fp8 cache scales (see the module docstring),
    set by the attention layer once its weights are loaded (before any forward is run
    or captured); a cache of the model dtype ignores them."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    # ``spec.use_sinks``: the layer's sink logits, float32 [num_heads] on the backend's
    # device, set by the attention layer when its weights are loaded.
    sinks: "torch.Tensor | None" = None

    def __init__(self, spec: AttentionLayerSpec) -> None:
        self.spec = spec

    def release_kv_cache(self) -> None:
        """Forget whatever this layer derived from its KV cache tensor (views, packed
        handles): sleep mode frees the cache and a new one may come. Default: none kept."""

    @abstractmethod
    def forward(
        self,
        query: "torch.Tensor",  # [T, num_heads, head_size]
        key: "torch.Tensor",  # [T, num_kv_heads, head_size]
        value: "torch.Tensor",  # [T, num_kv_heads, head_size]
        kv_cache: "torch.Tensor",  # this layer's cache, shape from get_kv_cache_shape
        metadata: Any,  # what the backend's build_metadata returned this step
    ) -> "torch.Tensor":  # [T, num_heads, head_size]
        """Store key/value at ``slot_mapping`` and return causal attention output.

        Encoder layers (``spec.causal`` False): ``kv_cache`` is None; attend within each
        request's tokens of this step (``query_start_loc`` segments) in both directions,
        windowed as the spec's docstring says; nothing is stored.

        MLA layers: ``key`` is the new tokens' latent entries ``[T, 1, head_size]``,
        ``value`` is None, and the output is ``[T, num_heads, kv_lora_rank]``."""


class AttentionBackend(ABC):
    """A family of attention kernels with one KV cache layout."""

    name: ClassVar[str]
    # What the caches of the layers made from now on store (canonical_kv_cache_dtype);
    # "auto": the model dtype. Set with set_kv_cache_dtype before the model is built.
    kv_cache_dtype: str = "auto"

    def __init__(self, block_size: int, device: "torch.device") -> None:
        self.block_size = block_size
        self.device = device

    @classmethod
    def supported_kv_cache_dtypes(cls, mla: bool = False) -> tuple[str, ...]:
        """The ``canonical_kv_cache_dtype`` values this backend's kernels store and read
        (for MLA layers when ``mla``); "auto" alone: no fp8 cache."""
        return ("auto",)

    def set_kv_cache_dtype(self, name: str) -> None:
        """Store ``name`` (a ``--kv-cache-dtype`` value) in the caches of every layer made
        from now on; ValueError when the kernels cannot."""
        canonical = canonical_kv_cache_dtype(name)
        supported = self.supported_kv_cache_dtypes()
        if canonical not in supported:
            raise ValueError(f"attention backend {self.name!r} has no {name} KV cache "
                             f"(--kv-cache-dtype {' | '.join(supported)})")
        self.kv_cache_dtype = canonical

    @classmethod
    @abstractmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (K and V together)."""

    @classmethod
    def kv_cache_block_dim(cls, mla: bool = False) -> int:
        """The dim of one layer's cache tensor that indexes blocks (what a KV connector
        slices to move a block): dim 1 of the ``(2, num_blocks, ...)`` MHA layouts,
        dim 0 of the ``(num_blocks, ...)`` MLA ones."""
        return 0 if mla else 1

    @classmethod
    def get_mla_kv_cache_shape(
        cls, num_blocks: int, block_size: int, entry_size: int
    ) -> tuple[int, ...] | None:
        """Shape of one MLA layer's cache (one latent entry per token); None: this
        backend has no MLA kernels."""
        return None

    @classmethod
    def supported_head_sizes(cls) -> list[int] | None:
        """Head sizes the kernels handle; None means any."""
        return None

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        """Block sizes the kernels handle; None means any."""
        return None

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attention_sinks(cls) -> bool:
        """Whether the kernels add learned per-head sink logits (``spec.use_sinks``)."""
        return False

    @classmethod
    def supports_chunked_local_attention(cls) -> bool:
        """Whether the kernels restrict queries to their chunk (``spec.attention_chunk_size``)."""
        return False

    @classmethod
    def supports_encoder_attention(cls) -> bool:
        """Whether the kernels run non-causal encoder layers (``spec.causal`` False)."""
        return False

    @classmethod
    def supports_key_ends(cls) -> bool:
        """Whether prefill queries may attend past their own position up to
        ``AttentionBatch.key_ends_cpu`` (bidirectional image tokens: Gemma 3)."""
        return False

    @classmethod
    def validate(cls, spec: AttentionLayerSpec, block_size: int) -> str | None:
        """Why this backend cannot serve ``spec`` (None when it can)."""
        if spec.is_mla:
            if cls.get_mla_kv_cache_shape(1, block_size, spec.head_size) is None:
                return f"{cls.name} has no multi-head latent attention (MLA) kernels"
            if spec.num_kv_heads != 1 or spec.kv_lora_rank >= spec.head_size:
                return (f"an MLA layer has one latent entry per token (num_kv_heads 1) wider "
                        f"than its kv_lora_rank, not {spec.num_kv_heads} x {spec.head_size}")
        if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes(spec.is_mla):
            what = "multi-head latent attention (MLA) layers" if spec.is_mla else "layers"
            return (f"{cls.name} has no {spec.kv_cache_dtype} KV cache for {what}; use "
                    "--kv-cache-dtype auto")
        heads = cls.supported_head_sizes()
        if heads is not None and spec.head_size not in heads and not spec.is_mla:
            return f"{cls.name} supports head sizes {heads}, not {spec.head_size}"
        blocks = cls.supported_block_sizes()
        if blocks is not None and block_size not in blocks:
            return f"{cls.name} supports block sizes {blocks}, not {block_size}"
        if spec.sliding_window is not None and not cls.supports_sliding_window():
            return f"{cls.name} does not support sliding-window attention"
        if spec.use_sinks and (spec.is_mla or not cls.supports_attention_sinks()):
            return f"{cls.name} has no attention sinks"
        if spec.attention_chunk_size is not None and (
                spec.is_mla or not cls.supports_chunked_local_attention()):
            return f"{cls.name} has no chunked local attention"
        if not spec.causal and (spec.is_mla or not cls.supports_encoder_attention()):
            return f"{cls.name} has no non-causal (encoder) attention"
        return None

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: "torch.dtype", num_layers: int
    ) -> list["torch.Tensor"]:
        """One zero-filled cache tensor of ``shape`` per layer, on this backend's device.

        A backend may override how the memory is obtained (e.g. pages the OS zero-fills
        on first touch); the contents must read as zeros either way.
        """
        import torch

        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Turn the step's batch into kernel metadata, once per step for all layers."""

    def build_graph_metadata(self, batch: AttentionBatch) -> Any | None:
        """Metadata for a decode-only batch (one token per request) whose tensors are the
        model runner's persistent buffers, for a captured forward: unlike
        :meth:`build_metadata`'s, it must read those tensors themselves (or views of them),
        never copies, since every replay reads what the runner wrote there for its step.
        The runner passes ``seq_lens`` and ``block_tables`` as int64 and nothing but
        tensors (no host copies). None (the default): this backend cannot be captured."""
        return None

    @abstractmethod
    def make_impl(self, spec: AttentionLayerSpec) -> AttentionImpl:
        """The per-layer kernel object for a layer of shape ``spec``."""
