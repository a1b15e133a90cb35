"""Batch-invariant mode: a request's tokens and logprobs do not depend on its batch.

A kernel whose reduction order follows the batch (a GEMM that switches schedule with the
row count, split-KV attention sized to fill the machine, a norm that splits a row over
threads when rows are few) rounds a request's values differently alone than among 63
others; greedy ties then flip and logprobs drift. On-policy RL compares the rollout
engine's logprobs with the trainer's, so it needs them bitwise stable (Thinking
Machines' "Defeating Nondeterminism in LLM Inference"; vLLM's ``VLLM_BATCH_INVARIANT``).

With the mode on (``--batch-invariant``, ``LLM(batch_invariant=True)`` or
``ENGINE_BATCH_INVARIANT=1``) every kernel that reduces picks one order per row and
keeps it for any batch size, any position in the batch, prefill or decode, any chunk
size and speculative verification: GEMMs, attention, RMSNorm, log-softmax and the
sampler. The worker turns it on in its process (:func:`set_batch_invariant`) before the
model is built, so kernel selection (``DenseLayerSpec.batch_invariant``) and the
platform's kernels read :func:`batch_invariant_enabled`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENV = "ENGINE_BATCH_INVARIANT"
_enabled: bool | None = None  # None: follow the environment


def env_requests_batch_invariance() -> bool:
    """``$ENGINE_BATCH_INVARIANT`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def batch_invariant_enabled() -> bool:
    """Whether this process runs its kernels batch-invariant."""
    return env_requests_batch_invariance() if _enabled is None else _enabled


def set_batch_invariant(enabled: bool) -> None:
    """Turn the mode on or off for this process (the worker does, from its config)."""
    global _enabled
    _enabled = bool(enabled)


INVARIANT_ROWS = 16  # rows per F.linear call in batch-invariant mode


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over chunks of exactly INVARIANT_ROWS rows (the last zero-padded):
    a library GEMM picks its algorithm, and so its reduction order, from the shape, so
    one shape for every call makes a row's result independent of the batch (the
    batch-invariant fallback for a layer no invariant kernel takes)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = -(-n // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(INVARIANT_ROWS)])
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])
