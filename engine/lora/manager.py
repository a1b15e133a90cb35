"""The worker side of multi-LoRA: adapters known by id, a host LRU cache, device slots.

- **Known adapters** (id -> :class:`LoRARequest`): every adapter the front end added.
  The front end adds an adapter (checked here, on every rank) before the first request
  that uses it, so a bad adapter is refused before it can reach a step.
- **Host cache**: up to ``max_cpu_loras`` adapters read, checked and cut to this rank's
  shards, in the slots' dtype, least recently used evicted first. An evicted adapter is
  read again from its directory when a step needs it.
- **Device slots**: ``max_loras`` per layer (:class:`~engine.lora.layers.
  LoRALinearSlots`). Each step, the adapters of the scheduled requests (the scheduler
  keeps them to ``max_loras``) are placed in slots, evicting the least recently used
  slot not needed this step, and every token gets its adapter's slot.

Which linear an adapter module adapts, and which of its fused shards: the model's own
checkpoint-name mapping (its stacked ``q_proj -> qkv_proj`` rules and name mapper), so
an adapter loads exactly where the base checkpoint's tensor of that name would.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from engine.core.config import LoRAConfig
from engine.core.interfaces import LoRAKernel, Platform
from engine.lora.layers import LoRALinearSlots, ShardWeights
from engine.lora.peft import AdapterModule, read_adapter
from engine.lora.request import LoRARequest
from engine.model_executor.layers.linear import LinearBase, ParamLayout

logger = logging.getLogger(__name__)

HostAdapter = dict[str, dict[Any, ShardWeights]]  # layer name -> shard id -> matrices
WHOLE_LAYER = object()  # a module adapting every shard of a fused layer at once
_B_LAYOUT = ParamLayout(output_dim=0, input_dim=None)  # lora_B [out, r]: cut like outputs
_A_LAYOUT = ParamLayout(output_dim=None, input_dim=1)  # lora_A [r, in]: cut like inputs


def select_lora_kernel(platform: Platform, dtype: torch.dtype, device: torch.device
                       ) -> LoRAKernel:
    """The platform's first LoRA kernel that takes ``dtype`` on ``device``, else the
    portable torch one."""
    for kernel_cls in platform.lora_kernels():
        if kernel_cls.can_implement(dtype, device) is None:
            return kernel_cls()
    from engine.kernels.lora_torch import TorchLoRAKernel

    return TorchLoRAKernel()


def lora_target_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    """The model's linear layers an adapter may target (every linear but the LM head)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, LinearBase) and not name.startswith("lm_head")}


class LoRAManager:
    """Adapters of one rank's model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, platform: Platform,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.kernel = select_lora_kernel(platform, dtype, device)
        self.layers = lora_target_layers(model)
        for layer in self.layers.values():
            layer.lora = LoRALinearSlots(layer, config.max_loras, config.max_lora_rank, dtype,
                                         device, self.kernel)
        self.known: dict[int, LoRARequest] = {}
        # Where every adapter ever seen lives, removed ones included: requests already
        # running under a removed adapter finish with it (read again if need be).
        self._sources: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, HostAdapter] = OrderedDict()
        self._slot_owner = np.zeros(config.max_loras, dtype=np.int64)  # adapter id; 0: free
        self._slot_used = np.zeros(config.max_loras, dtype=np.int64)  # last step it served
        self._step = 0
        logger.info("LoRA: %d linear layers with %d adapter slots of rank %d (%.1f MiB), "
                    "kernel %s", len(self.layers), config.max_loras, config.max_lora_rank,
                    self.nbytes / 2**20, self.kernel.name)

    @property
    def nbytes(self) -> int:
        """Device memory the slots hold (counted with the weights)."""
        return sum(layer.lora.nbytes for layer in self.layers.values())

    # -- adapters ---------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Check the adapter against this model and keep it in the host cache; raises
        ValueError naming what does not fit. Re-adding a known id must name the same
        adapter."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"LoRA id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} ({known.lora_path}); remove it first")
        if request.lora_int_id not in self._host or known is None:
            self._cache(request.lora_int_id, self._load(request))
        self.known[request.lora_int_id] = self._sources[request.lora_int_id] = request

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter: its host copy and device slot are freed (a running request
        under it reads it again at its next step)."""
        found = self.known.pop(lora_id, None) is not None
        self._host.pop(lora_id, None)
        for slot in np.flatnonzero(self._slot_owner == lora_id):
            self._free_slot(int(slot))
        return found

    def list(self) -> list[int]:
        return sorted(self.known)

    def register(self, request: LoRARequest) -> None:
        """A request arrived under ``request``: remember where its adapter lives (added
        already by the front end, normally; else it is read when a step needs it)."""
        if request.lora_int_id not in self._sources:
            self.known[request.lora_int_id] = self._sources[request.lora_int_id] = request

    # -- the step ---------------------------------------------------------------------------
    def slots_for(self, lora_ids: np.ndarray) -> np.ndarray:
        """Each row's device slot (int32, ``-1``: no adapter), placing the step's
        adapters in slots first."""
        self._step += 1
        wanted = np.unique(lora_ids[lora_ids > 0])
        if len(wanted) > len(self._slot_owner):
            raise RuntimeError(f"a step holds {len(wanted)} LoRA adapters, above "
                               f"max_loras={len(self._slot_owner)}")
        slot_of = {}
        for lora_id in wanted.tolist():
            slot_of[lora_id] = self._place(lora_id, wanted)
        slots = np.full(len(lora_ids), -1, dtype=np.int32)
        for lora_id, slot in slot_of.items():
            slots[lora_ids == lora_id] = slot
        return slots

    def _place(self, lora_id: int, needed: np.ndarray) -> int:
        hits = np.flatnonzero(self._slot_owner == lora_id)
        if len(hits):
            slot = int(hits[0])
        else:
            free = np.flatnonzero(self._slot_owner == 0)
            if len(free):
                slot = int(free[0])
            else:  # the least recently used slot whose adapter this step does not need
                evictable = np.flatnonzero(~np.isin(self._slot_owner, needed))
                slot = int(evictable[np.argmin(self._slot_used[evictable])])
            self._write_slot(slot, lora_id)
        self._slot_used[slot] = self._step
        return slot

    def _write_slot(self, slot: int, lora_id: int) -> None:
        adapter = self._host.get(lora_id)
        if adapter is None:
            request = self._sources.get(lora_id)
            if request is None:
                raise RuntimeError(f"LoRA id {lora_id} was never added")
            adapter = self._load(request)
            self._cache(lora_id, adapter)
        else:
            self._host.move_to_end(lora_id)
        for name, layer in self.layers.items():
            shards = adapter.get(name)
            if shards is None:
                layer.lora.clear_slot(slot)
            else:
                layer.lora.write_slot(slot, shards)
        self._slot_owner[slot] = lora_id

    def _free_slot(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.lora.clear_slot(slot)
        self._slot_owner[slot] = 0
        self._slot_used[slot] = 0

    def _cache(self, lora_id: int, adapter: HostAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.config.host_cache_size:
            self._host.popitem(last=False)

    # -- loading ----------------------------------------------------------------------------
    def _load(self, request: LoRARequest) -> HostAdapter:
        """Read the adapter, map each module onto this model's layers and cut it to this
        rank; every mismatch is a ValueError naming the module."""
        adapter = read_adapter(request.lora_path, self.config.max_lora_rank)
        where = f"LoRA adapter {request.lora_name!r}"
        host: HostAdapter = {}
        for module in adapter.modules.values():
            name, shard_id = self._target(module.name, where)
            layer = self.layers[name]
            shards = host.setdefault(name, {})
            parts = (self._split_fused(layer, module, where) if shard_id is WHOLE_LAYER
                     else [(shard_id, module)])
            for part_id, part in parts:
                if part_id in shards:
                    raise ValueError(f"{where}: two modules adapt shard {part_id!r} of {name}")
                shards[part_id] = self._rank_shard(layer, part, part_id, where)
        return host

    def _split_fused(self, layer: LinearBase, module: AdapterModule, where: str
                     ) -> list[tuple[Any, AdapterModule]]:
        """A module adapting a fused layer whole (a checkpoint that fuses q/k/v or
        gate/up itself, e.g. Phi-3's ``qkv_proj``): every shard gets the same A and its
        rows of B (the full model's rows, in the layer's shard order)."""
        full = [layer.lora.shard_size(s) * layer.output_parts.get(s, (0, 1))[1]
                for s in layer.lora.shard_ids]
        if module.lora_b.shape[0] != sum(full):
            raise ValueError(f"{where}: module {module.name!r} has {module.lora_b.shape[0]} "
                             f"output rows, the model's fused layer {sum(full)} (adapter "
                             "made for another base model?)")
        rows = module.lora_b.split(full, dim=0)
        return [(shard, AdapterModule(module.name, module.lora_a, b, module.scaling))
                for shard, b in zip(layer.lora.shard_ids, rows)]

    def _target(self, module: str, where: str) -> tuple[str, Any]:
        """The model layer (and fused shard) an adapter module adapts."""
        checkpoint_name = module + ".weight"
        name_mapper = getattr(self.model, "load_name_mapper", lambda: None)()
        mapped = None if name_mapper is None else name_mapper(checkpoint_name)
        if mapped is not None:
            param_name, shard_id = mapped
        else:
            param_name, shard_id = checkpoint_name, None
            for rule in getattr(self.model, "stacked_params", ()):
                if rule.source in checkpoint_name:
                    param_name = checkpoint_name.replace(rule.source, rule.target)
                    shard_id = rule.shard_id
                    break
        name = param_name.removesuffix(".weight")
        layer = self.layers.get(name)
        if layer is not None and len(layer.shard_sizes) > 1 and shard_id is None:
            return name, WHOLE_LAYER
        if layer is None or (len(layer.shard_sizes) > 1) != (shard_id is not None):
            raise ValueError(f"{where} adapts {module!r}, which is not a linear layer of "
                             "this model that LoRA can serve (adapter made for another "
                             "model?)")
        return name, shard_id

    def _rank_shard(self, layer: LinearBase, module: AdapterModule, shard_id: Any,
                    where: str) -> ShardWeights:
        """This rank's part of one module's matrices, scaling folded into B."""
        slots: LoRALinearSlots = layer.lora
        out_part = layer.output_parts.get(shard_id, (0, 1))[1]
        in_part = 1 if layer.input_part is None else layer.input_part[1]
        want_out, want_in = slots.shard_size(shard_id) * out_part, slots.in_features * in_part
        a, b = module.lora_a, module.lora_b
        if b.shape[0] != want_out or a.shape[1] != want_in:
            raise ValueError(
                f"{where}: module {module.name!r} maps {a.shape[1]} -> {b.shape[0]} features,"
                f" the model's layer {want_in} -> {want_out} (adapter made for another base "
                "model?)")
        b = (b.to(torch.float32) * module.scaling).to(self.dtype)
        b = layer._rank_part(b, _B_LAYOUT, shard_id)
        a = layer._rank_part(a.to(self.dtype), _A_LAYOUT, shard_id)
        return ShardWeights(a.contiguous(), b.contiguous())
