"""Streaming checkpoint tensors into model parameters.

Tensors are read one at a time from safetensors files (memory-mapped), copied into the
already-allocated parameter (casting to the model dtype on the way) and dropped, so peak
memory stays near the model size. Checkpoint names are mapped to parameter names by the
model (merged projections carry a shard id); the loader records which parameters, and
which shards of merged ones, were filled, so a missing or unexpected tensor is a clear
error instead of silently random weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.linear import default_weight_loader
from engine.model_executor.lazy_tensor import LazyTensor


def safetensors_weights_iterator(files: Iterable[Path], lazy: bool = False
                                 ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """``(name, tensor)`` for every tensor of every file, on the CPU. ``lazy``: yield
    :class:`LazyTensor` handles, read only as far as a parameter's loader asks (a
    tensor-parallel rank reads its part of each matrix, never the whole)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if lazy:
                    handle = f.get_slice(name)
                    yield name, LazyTensor(handle, tuple(handle.get_shape()))
                else:
                    yield name, f.get_tensor(name)


@dataclass(frozen=True)
class StackedParam:
    """Checkpoint tensors named ``*{source}*`` load into shard ``shard_id`` of ``*{target}*``."""

    target: str  # e.g. ".qkv_proj."
    source: str  # e.g. ".q_proj."
    shard_id: Any  # e.g. "q"


# vLLM's checkpoint spellings of an attention layer's fp8 KV cache scales, as suffixes of
# ``<layer>.self_attn``: the parameters of its ``attn`` (layers/attention.py) they fill.
# ``kv_scale`` is the deprecated single scale (both); ``k_proj.k_scale`` ModelOpt's;
# ``k_proj.output_scale`` llm-compressor / compressed-tensors'.
_KV_SCALE_NAMES = {
    ".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": ("k_scale", "v_scale"),
    ".k_proj.k_scale": ("k_scale",), ".v_proj.v_scale": ("v_scale",),
    ".k_proj.output_scale": ("k_scale",), ".v_proj.output_scale": ("v_scale",),
}
# Scales of fp8 queries / probabilities (attention computed in fp8): nothing here uses
# them, so checkpoints that carry them still load.
_UNUSED_ATTENTION_SCALES = (".q_scale", ".prob_scale", ".q_proj.output_scale",
                            ".prob_output_scale")


def kv_scale_targets(ckpt_name: str, params: dict[str, Any]) -> list[str] | None:
    """The KV cache scale parameters a checkpoint tensor fills (vLLM's
    ``maybe_remap_kv_scale_name``), [] for the query / probability scales nothing uses,
    None when ``ckpt_name`` is no attention scale of this model."""
    if ".self_attn." not in ckpt_name:
        return None
    for suffix, targets in _KV_SCALE_NAMES.items():
        if ckpt_name.endswith(suffix):
            base = ckpt_name[: -len(suffix)]
            attn = base if base.endswith(".attn") else base + ".attn"
            names = [f"{attn}.{target}" for target in targets]
            if all(name in params for name in names):
                return names
    if ckpt_name.endswith(_UNUSED_ATTENTION_SCALES):
        return []
    return None


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Iterable[StackedParam] = (),
    skip_substrings: Iterable[str] = (),
    ignore: Iterable[str] = (),
    optional: Iterable[str] = (),
    name_mapper: Callable[[str], tuple[str, Any] | None] | None = None,
) -> set[str]:
    """Load ``weights`` into ``module``'s parameters; return the parameter names filled.

    ``skip_substrings``: checkpoint names containing any of these are dropped
    (e.g. ``rotary_emb.inv_freq``). ``ignore``: exact checkpoint names dropped (e.g. a
    saved ``lm_head.weight`` when the head is tied). ``optional``: parameters that may
    stay unloaded (the caller handles them). ``name_mapper(name)`` -> ``(parameter,
    shard_id)`` or None, consulted before ``stacked``: names that carry their shard id
    (a MoE layer's ``experts.{e}.w1``). Parameters flagged ``optional_weight`` (an
    attention layer's KV cache scales, whose checkpoint names :func:`kv_scale_targets`
    maps) may stay unloaded too. Raises ``ValueError`` naming every unexpected
    checkpoint tensor and every parameter (or shard) left unloaded.
    """
    params = dict(module.named_parameters())
    stacked = list(stacked)
    skip_substrings = tuple(skip_substrings)
    ignore = set(ignore)
    loaded: set[tuple[str, Any]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name in ignore or any(s in ckpt_name for s in skip_substrings):
            continue
        scale_targets = None if ckpt_name in params else kv_scale_targets(ckpt_name, params)
        if scale_targets is not None:
            for name in scale_targets:
                loader = getattr(params[name], "weight_loader", default_weight_loader)
                try:
                    loader(params[name], tensor)
                except ValueError as exc:
                    raise ValueError(f"cannot load checkpoint tensor {ckpt_name!r}: {exc}"
                                     ) from exc
                loaded.add((name, None))
            continue
        name, shard_id = ckpt_name, None
        mapped = name_mapper(ckpt_name) if name_mapper is not None else None
        if mapped is not None:
            name, shard_id = mapped
        for rule in () if mapped is not None else stacked:
            if rule.source in ckpt_name:
                name, shard_id = ckpt_name.replace(rule.source, rule.target), rule.shard_id
                break
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"cannot load checkpoint tensor {ckpt_name!r}: {exc}") from exc
        loaded.add((name, shard_id))
    optional = set(optional)
    missing: list[str] = []
    for name, param in params.items():
        shard_ids = getattr(param, "shard_ids", None)
        if shard_ids is None:
            if (name, None) not in loaded and name not in optional and not getattr(
                    param, "optional_weight", False):
                missing.append(name)
            continue
        lacking = [s for s in shard_ids if (name, s) not in loaded]
        if lacking and name not in optional:
            missing.append(f"{name} (shards {lacking})")
    problems = []
    if unexpected:  # both lists together: a wrong format shows as "has X, lacks Y"
        problems.append(f"checkpoint has {len(unexpected)} tensor(s) the model does not "
                        f"expect: {_first_ten(sorted(unexpected))}")
    if missing:
        problems.append(f"checkpoint lacks {len(missing)} tensor(s): {_first_ten(missing)}")
    if problems:
        raise ValueError("; ".join(problems))
    return {name for name, _ in loaded}


def _first_ten(names: list[str]) -> str:
    more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
    return ", ".join(names[:10]) + more
