"""State-space and linear-attention kernels (Mamba, Mamba-2, gated DeltaNet), varlen.

Batches are packed ``[total_tokens, ...]`` with ``query_start_loc`` (int32 ``[R + 1]``);
request ``r`` owns state slot ``state_indices[r]`` of a state cache ``[num_slots, ...]``
and starts from it when ``has_initial_state[r]`` (a continued prefill), else from zeros.
Every op updates the slots in place with the final state. Decode ops take one token per
request (``[R, ...]``) and always read the slot.

``has_initial_state=None`` means every request reads its slot. Every request has at
least one token; ``state_indices`` are valid slots (no padding ids). States are computed
in float32 (float64 for float64 inputs) whatever the cache dtype, then stored in it.

Each op here dispatches on the inputs' device: CPU tensors take the bulk-torch
implementation, accelerator tensors the Triton kernels (imported lazily, so ``import
engine.kernels.ssm`` never needs triton). ``backend="torch" | "triton"`` forces one (the
Triton kernels then run on CPU tensors only under ``TRITON_INTERPRET=1``). Triton
prefill: chunked matmul forms for Mamba-2 and gated DeltaNet, recurrent (state in
registers) for conv and Mamba-1; Triton decode: the recurrent kernels.

Ops (shapes: T tokens, R requests, H heads, G groups, P head_dim, N d_state):

- ``causal_conv1d_prefill(x [T, dim], weight [dim, W], conv_state [S, dim, W-1], ...)``
  and ``causal_conv1d_decode(x [R, dim], ...)``.
- ``mamba2_ssd_prefill(x [T, H, P], dt [T, H], A [H], B/C [T, G, N], ssm_state
  [S, H, P, N], ...)`` and ``mamba2_ssd_decode`` (Mamba-2, SSD chunked scan).
- ``selective_scan_prefill(x [T, dim], dt [T, dim], A [dim, N], B/C [T, N], ssm_state
  [S, dim, N], ...)`` and ``selective_scan_decode`` (Mamba-1).
- ``gated_delta_prefill(q/k [T, Hk, K], v [T, Hv, V], g/beta [T, Hv], ssm_state
  [S, Hv, K, V], ...)`` and ``gated_delta_decode`` (Qwen3-Next gated DeltaNet).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

_TORCH_MODULES = {
    "causal_conv1d": "conv1d",
    "mamba2_ssd": "mamba_ssd",
    "selective_scan": "selective_scan",
    "gated_delta": "gated_delta",
}


def _impl(op: str, phase: str, backend: str | None, x: torch.Tensor) -> Callable[..., Any]:
    if backend is None:
        backend = "torch" if x.device.type == "cpu" else "triton"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', not {backend!r}")
    module = _TORCH_MODULES[op] if backend == "torch" else f"triton_{_TORCH_MODULES[op]}"
    mod = importlib.import_module(f"engine.kernels.ssm.{module}")
    return getattr(mod, f"{op}_{phase}")


def causal_conv1d_prefill(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Causal depthwise conv over a varlen prefill; see :mod:`.conv1d`."""
    return _impl("causal_conv1d", "prefill", backend, x)(x, *args, **kw)


def causal_conv1d_decode(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """One-token conv step per request; see :mod:`.conv1d`."""
    return _impl("causal_conv1d", "decode", backend, x)(x, *args, **kw)


def mamba2_ssd_prefill(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Mamba-2 chunked SSD scan over a varlen prefill; see :mod:`.mamba_ssd`."""
    return _impl("mamba2_ssd", "prefill", backend, x)(x, *args, **kw)


def mamba2_ssd_decode(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Mamba-2 single-step state update; see :mod:`.mamba_ssd`."""
    return _impl("mamba2_ssd", "decode", backend, x)(x, *args, **kw)


def selective_scan_prefill(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Mamba-1 selective scan over a varlen prefill; see :mod:`.selective_scan`."""
    return _impl("selective_scan", "prefill", backend, x)(x, *args, **kw)


def selective_scan_decode(x: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Mamba-1 single-step state update; see :mod:`.selective_scan`."""
    return _impl("selective_scan", "decode", backend, x)(x, *args, **kw)


def gated_delta_prefill(q: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Gated DeltaNet chunked form over a varlen prefill; see :mod:`.gated_delta`."""
    return _impl("gated_delta", "prefill", backend, q)(q, *args, **kw)


def gated_delta_decode(q: torch.Tensor, *args: Any, backend: str | None = None, **kw: Any):
    """Gated DeltaNet recurrent single step; see :mod:`.gated_delta`."""
    return _impl("gated_delta", "decode", backend, q)(q, *args, **kw)


__all__ = [
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "gated_delta_decode",
    "gated_delta_prefill",
    "mamba2_ssd_decode",
    "mamba2_ssd_prefill",
    "selective_scan_decode",
    "selective_scan_prefill",
]
