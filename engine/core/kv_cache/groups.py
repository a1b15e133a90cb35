"""KV cache groups: which layers share a block table (vLLM's hybrid KV cache manager).

A model whose layers attend differently (Gemma 2/3 and GPT-OSS interleave sliding-window
and full layers, Llama 4 chunked-local and full ones) does not need the same tokens in
every layer's cache: a sliding-window layer of window ``W`` only ever reads the last
``W`` keys, a chunked-local layer of chunk ``C`` only its current chunk. The layers are
therefore split into *groups* of one attention kind, each group with its own block table
per request, all drawing block ids from one shared :class:`BlockPool`:

- every group has the same number of layers, ``group_size`` (the smallest kind's layer
  count; a kind with more layers is split into several groups, the last possibly
  shorter). The executor allocates ``group_size`` cache tensors of ``num_blocks`` blocks;
  the ``j``-th layer of every group uses tensor ``j``. Groups hold disjoint block ids, so
  they never write the same slot, and one block id costs ``group_size`` layers of memory
  instead of ``num_layers``;
- a full-attention group keeps every block of a request; a windowed group (sliding or
  chunked local) frees blocks once no future query can read them and holds the null
  block in their place.

A model with one attention kind has one group: the plain paged cache, no overhead.

A model with state layers (Mamba mixers) groups only its attention layers here (layer
indices count attention layers only; a pure state-space model has one empty group whose
blocks cost nothing); its per-request states take ``num_state_slots`` slots instead
(:mod:`engine.core.kv_cache.state_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (indices into the model's KV layers) and attention kind."""

    layer_indices: tuple[int, ...]
    sliding_window: int | None = None  # attend to at most this many most recent keys
    attention_chunk_size: int | None = None  # attend within chunks of this many positions

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError("a KV cache group is sliding-window or chunked-local, not both")
        for name in ("sliding_window", "attention_chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def kind(self) -> str:
        if self.sliding_window is not None:
            return f"sliding_window({self.sliding_window})"
        if self.attention_chunk_size is not None:
            return f"chunked_local({self.attention_chunk_size})"
        return "full"

    @property
    def is_windowed(self) -> bool:
        """Whether the group can drop blocks a request no longer reads."""
        return self.sliding_window is not None or self.attention_chunk_size is not None

    def first_needed_position(self, position: int) -> int:
        """The first key position a query at ``position`` or later reads."""
        if self.sliding_window is not None:
            return max(0, position - self.sliding_window + 1)
        if self.attention_chunk_size is not None:
            return position - position % self.attention_chunk_size
        return 0

    def max_blocks_held(self, block_size: int, max_step_tokens: int) -> int | None:
        """Most blocks one request holds in this group at any time (None: unbounded),
        with up to ``max_step_tokens`` new tokens written in one step."""
        span = self.sliding_window or self.attention_chunk_size
        if span is None:
            return None
        # The readable keys before a step's first query, the step's own tokens, and one
        # partly filled block at each end.
        return -(-(span - 1 + max_step_tokens) // block_size) + 1


@dataclass(frozen=True)
class KVCacheLayout:
    """How the model's KV layers map onto cache groups and cache tensors."""

    groups: tuple[KVCacheGroupSpec, ...]
    num_layers: int
    # Per-request state slots of a model with state layers (0: it has none).
    num_state_slots: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Cache tensors to allocate: the most layers any group has."""
        return max((len(g.layer_indices) for g in self.groups), default=0)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or any(g.is_windowed for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """``(group, tensor)`` of every layer, by layer index."""
        slots = [(-1, -1)] * self.num_layers
        for gid, group in enumerate(self.groups):
            for j, layer in enumerate(group.layer_indices):
                slots[layer] = (gid, j)
        return slots

    def describe(self) -> str:
        """``"2 groups: full x4 layers, sliding_window(512) x4 layers"``-style summary."""
        parts = [f"{g.kind} x{len(g.layer_indices)}" for g in self.groups]
        return f"{len(self.groups)} KV cache group(s) of {self.group_size} layers: " + ", ".join(parts)


def single_group_layout(num_layers: int) -> KVCacheLayout:
    """Every layer in one full-attention group (also the fallback of a hybrid model
    when the hybrid manager is off: its windowed layers then keep every block)."""
    return KVCacheLayout((KVCacheGroupSpec(tuple(range(num_layers))),), num_layers)


def build_kv_cache_layout(
    sliding_windows: Sequence[int | None],
    attention_chunk_sizes: Sequence[int | None] = (),
    hybrid: bool = True,
) -> KVCacheLayout:
    """Group ``len(sliding_windows)`` layers by attention kind.

    ``hybrid`` False (``--disable-hybrid-kv-cache-manager``, KV connectors, pipeline
    stages) gives one full group. Kinds are ordered full first, then by their first
    layer, so group 0 is a full-attention group whenever the model has one (a draft
    model's cache shares group 0's block ids).
    """
    num_layers = len(sliding_windows)
    chunks = list(attention_chunk_sizes) or [None] * num_layers
    if len(chunks) != num_layers:
        raise ValueError(f"{len(chunks)} chunk sizes for {num_layers} layers")
    if not hybrid or num_layers == 0:
        return single_group_layout(num_layers)
    kinds: dict[tuple[int | None, int | None], list[int]] = {}
    for layer, (window, chunk) in enumerate(zip(sliding_windows, chunks)):
        if window is not None and chunk is not None:
            raise ValueError(f"layer {layer} has both a sliding window and attention chunks")
        kinds.setdefault((window, chunk), []).append(layer)
    if len(kinds) == 1 and (None, None) in kinds:
        return single_group_layout(num_layers)
    ordered = sorted(kinds.items(), key=lambda kv: (kv[0] != (None, None), kv[1][0]))
    group_size = min(len(layers) for _, layers in ordered)
    groups = []
    for (window, chunk), layers in ordered:
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start:start + group_size]),
                                           sliding_window=window, attention_chunk_size=chunk))
    return KVCacheLayout(tuple(groups), num_layers)
