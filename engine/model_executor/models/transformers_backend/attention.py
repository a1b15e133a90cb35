"""transformers' attention interface routed onto the engine's paged attention.

:data:`ENGINE_ATTENTION` is registered in ``transformers.AttentionInterface``; a model
built with ``attn_implementation=ENGINE_ATTENTION`` calls :func:`engine_attention_forward`
from every attention module. Each module carries its engine
:class:`~engine.model_executor.layers.attention.Attention` (heads, KV heads, head size,
scale, sliding window, soft-cap read from the module and its config at build time; the
module's ``layer_idx`` is the cache index). The name is deliberately absent from
``AttentionMaskInterface``: transformers' mask builders then return None at once
(``masking_utils._preprocess_mask_arguments``), so no T x T mask is ever made -- the
paged kernel knows the causal / window structure from the step's metadata.

The flat token batch runs as one sequence of batch size 1: ``[1, H, T, D]`` queries,
keys and values become the engine's ``[T, H*D]``; the output goes back as ``[1, T, H, D]``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.attention import Attention

ENGINE_ATTENTION = "engine_paged"
_ATTR = "_engine_attention"  # set in the module's __dict__: not a registered submodule
_registered = False
_UNSET = object()


def register_engine_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)
    _registered = True


_CALLS_INTERFACE: dict[type, bool] = {}


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward dispatches through transformers' attention interface."""
    cls = type(module)
    if cls not in _CALLS_INTERFACE:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _CALLS_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _CALLS_INTERFACE[cls]


def attach(module: nn.Module, attn: Attention) -> None:
    module.__dict__[_ATTR] = attn


def attached(module: nn.Module) -> Attention | None:
    return module.__dict__.get(_ATTR)


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=1e-6)


def engine_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: Any = _UNSET,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the engine's paged cache."""
    attn = attached(module)
    if attn is None:
        raise RuntimeError(f"{type(module).__name__} has no engine attention layer attached")
    spec = attn.spec
    if softcap is not None and not _same(softcap, spec.logits_soft_cap):
        raise ValueError(f"layer {attn.layer_idx}: soft-cap {softcap} differs from the "
                         f"engine layer's {spec.logits_soft_cap}")
    if sliding_window is not _UNSET and (sliding_window or None) != spec.sliding_window:
        raise ValueError(f"layer {attn.layer_idx}: sliding window {sliding_window} differs "
                         f"from the engine layer's {spec.sliding_window}")
    if s_aux is not None:
        raise ValueError("attention sinks (s_aux) are not supported by the Transformers backend")
    if scaling is not None and not _same(scaling, spec.scale):
        # The module scales its queries itself (OPT passes 1.0): the same logits.
        query = query * (float(scaling) / spec.scale)
    num_tokens = query.shape[-2]
    head_size = attn.head_size
    v_dim = value.shape[-1]
    if v_dim != head_size:  # value heads narrower than query/key heads (MLA as MHA)
        value = torch.nn.functional.pad(value, (0, head_size - v_dim))
    q, k, v = (x.transpose(1, 2).reshape(num_tokens, -1) for x in (query, key, value))
    out = attn(q, k, v).view(1, num_tokens, attn.num_heads, head_size)
    if v_dim != head_size:
        out = out[..., :v_dim]
    return out, None
