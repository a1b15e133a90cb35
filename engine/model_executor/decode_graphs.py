"""Decode steps through forward graphs: one captured forward per batch size, replayed.

A decode-only step (one new token per request) of a given batch size makes the same
kernel calls every time; only the values in its inputs change. When the platform offers
a :class:`~engine.core.interfaces.ForwardGraphCapturer`, the runner keeps persistent
input buffers (token ids, positions, cache slots, sequence lengths, block tables), the
first decode step of each batch size captures the model's forward over slices of them,
and every later one refills the buffers and replays the graph: no module calls, no
views, no per-kernel argument conversion.

Each batch size gets its own graph, unpadded, so no step computes rows it does not need
(on CPUs arithmetic grows with every row). A forward the platform cannot record (a torch
op where it has no kernel, e.g. a layer without a fused kernel) raises
GraphCaptureError once per batch size; that size then runs eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    ForwardGraph,
    ForwardGraphCapturer,
    GraphCaptureError,
)
from engine.lora.layers import LoRABatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.input_batch import StepIndices

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Persistent decode inputs and the graphs captured over them, by batch size."""

    def __init__(
        self,
        capturer: ForwardGraphCapturer,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        hidden_input: tuple[int, torch.dtype] | None = None,
        layer_groups: list[int] | None = None,
        lora: bool = False,
    ) -> None:
        """``hidden_input`` (width, dtype): the model also takes a ``target_hidden``
        ``[n, width]`` input per row (an EAGLE head), kept in a persistent buffer too.
        ``layer_groups``: a hybrid model's KV cache group per layer (each group gets its
        own cache-slot and block-table buffers); None: one group. ``lora``: the model
        has LoRA slots; each row's adapter slot is a persistent input too."""
        self.capturer = capturer
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.max_batch_size = max_batch_size
        self._host = device.type == "cpu"
        n = max_batch_size
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i64)
        self.layer_groups = layer_groups
        num_extra = 0 if layer_groups is None else max(layer_groups)
        self.group_slot_mappings = [torch.full((n,), -1, **i64) for _ in range(num_extra)]
        self.group_block_tables = [torch.zeros(n, max_blocks_per_seq, **i64)
                                   for _ in range(num_extra)]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device) if lora \
            else None
        self.target_hidden = None
        if hidden_input is not None:
            width, dtype = hidden_input
            self.target_hidden = torch.zeros(n, width, dtype=dtype, device=device)
        self._graphs: dict[int, ForwardGraph] = {}
        self._eager_sizes: set[int] = set()
        # On the host the buffers are filled through numpy views made once.
        self._buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                         self.block_tables, *self.group_slot_mappings,
                         *self.group_block_tables)
        self._host_views = tuple(b.numpy() for b in self._buffers) if self._host else None

    @property
    def captured_sizes(self) -> list[int]:
        """The batch sizes whose forward has a graph."""
        return sorted(self._graphs)

    def covers(self, step: StepIndices) -> bool:
        """Whether ``step`` is a decode-only step of a batch size that can be replayed."""
        n = len(step.input_ids)
        return (
            n == len(step.rows)
            and 0 < n <= self.max_batch_size
            and n not in self._eager_sizes
        )

    def forward(
        self, step: StepIndices, target_hidden: torch.Tensor | None = None,
        lora_slots: np.ndarray | None = None,
    ) -> torch.Tensor | None:
        """The model's hidden states for a decode-only ``step`` (a view the next replay
        overwrites), or None when its batch size runs eagerly. ``lora_slots``: each
        row's adapter slot (int32, -1: none), for a model with LoRA slots."""
        n = len(step.input_ids)
        self._fill(step)
        if self.lora_slots is not None:
            self.lora_slots[:n].copy_(torch.from_numpy(lora_slots), non_blocking=True)
        if self.target_hidden is not None:
            self.target_hidden[:n].copy_(target_hidden)
        graph = self._graphs.get(n)
        if graph is None:
            graph = self._capture(n, step.max_seq_len)
            if graph is None:
                return None
        return graph.replay()

    def _fill(self, step: StepIndices) -> None:
        """Write the step's inputs into the persistent buffers' first rows."""
        n = len(step.input_ids)
        width = step.block_tables.shape[1]
        arrays = (step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                  step.block_tables, *step.group_slot_mappings, *step.group_block_tables)
        if self._host_views is not None:
            for view, array in zip(self._host_views, arrays):
                view[(slice(n), slice(width))[: view.ndim]] = array  # casts to int64 in place
            return
        for buffer, array in zip(self._buffers, arrays):
            target = buffer[(slice(n), slice(width))[: buffer.dim()]]
            target.copy_(torch.from_numpy(np.asarray(array, dtype=np.int64)), non_blocking=True)

    def _graph_metadata(self, n: int, max_seq_len: int, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor):
        return self.attn_backend.build_graph_metadata(AttentionBatch(
            num_reqs=n,
            num_tokens=n,
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=block_tables[:n],
            slot_mapping=slot_mapping[:n],
            max_query_len=1,
            max_seq_len=max_seq_len,
        ))

    def _capture(self, n: int, max_seq_len: int) -> ForwardGraph | None:
        metadata = self._graph_metadata(n, max_seq_len, self.slot_mapping, self.block_tables)
        if metadata is None:
            self._run_eagerly(n, f"attention backend {self.attn_backend.name} has no graph mode")
            return None
        layer_metadata = None
        if self.layer_groups is not None:
            groups = [metadata] + [
                self._graph_metadata(n, max_seq_len, slots, tables)
                for slots, tables in zip(self.group_slot_mappings, self.group_block_tables)]
            layer_metadata = [groups[g] for g in self.layer_groups]
        ids, positions = self.input_ids[:n], self.positions[:n]
        context = ForwardContext(metadata, self.kv_caches, layer_attn_metadata=layer_metadata)
        if self.lora_slots is not None:  # recorded with the LoRA kernels: slots vary
            context.lora = LoRABatch(self.lora_slots[:n], active=True)
        model = self.model
        extra = {} if self.target_hidden is None else {"target_hidden": self.target_hidden[:n]}

        def forward() -> torch.Tensor:
            with set_forward_context(context):
                return model(ids, positions, **extra)

        try:
            graph = self.capturer.capture(forward)
        except GraphCaptureError as exc:
            self._run_eagerly(n, str(exc))
            return None
        self._graphs[n] = graph
        logger.debug("captured the decode forward at batch size %d", n)
        return graph

    def _run_eagerly(self, n: int, reason: str) -> None:
        if not self._eager_sizes:
            logger.info("decode steps run eagerly (no forward graph): %s", reason)
        self._eager_sizes.add(n)
