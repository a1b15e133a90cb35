"""Varlen bookkeeping shared by the bulk-torch state-space kernels.

A batch is packed as ``[total_tokens, ...]`` with ``query_start_loc`` (int32 ``[R + 1]``
cumulative offsets, as in the attention metadata). Chunked algorithms must never let a
chunk straddle two requests, so each request is cut into its own chunks (the last one
zero-padded) and all chunks of the batch are stacked as ``[num_chunks, chunk, ...]``: the
intra-chunk work is then one batched op for the whole batch, and only the inter-chunk
recurrence loops, once per chunk index (not per token, not per request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (exact checks); everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def seq_lens(query_start_loc: torch.Tensor) -> torch.Tensor:
    q = query_start_loc.to(torch.int64)
    return q[1:] - q[:-1]


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of every packed token, int64 ``[T]``."""
    lens = seq_lens(query_start_loc)
    ids = torch.arange(lens.numel(), device=lens.device)
    return torch.repeat_interleave(ids, lens, output_size=num_tokens)


def load_initial_states(
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Gather each request's slot; a fresh prefill (``has_initial_state`` False) starts at 0."""
    states = state_cache[state_indices.to(torch.int64)].to(dtype)
    if has_initial_state is not None:
        keep = has_initial_state.to(device=states.device, dtype=torch.bool)
        states = states * keep.view(-1, *([1] * (states.dim() - 1))).to(dtype)
    return states


_SCRATCH: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = {}


def gather_states(state_cache: torch.Tensor, state_indices: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The slots' states as a dense ``[R, ...]`` tensor the caller may update in place.

    Decode gathers the whole state every step; on CPU a fresh buffer of that size costs
    more in page faults than the copy itself, so same-dtype gathers go into a scratch
    buffer kept per (dtype, device) and reused (valid until the next call). One buffer per
    inference-mode state too: a tensor made under ``torch.inference_mode`` (the engine's
    forwards) cannot be written outside it.
    """
    idx = state_indices.to(torch.int64)
    if state_cache.dtype != dtype or state_cache.device.type != "cpu":
        return state_cache.index_select(0, idx).to(dtype)
    shape = (idx.numel(), *state_cache.shape[1:])
    numel = math.prod(shape)
    key = (dtype, state_cache.device, torch.is_inference_mode_enabled())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=state_cache.device)
    out = buf[:numel].view(shape)
    torch.index_select(state_cache, 0, idx, out=out)
    return out


def store_final_states(
    state_cache: torch.Tensor, state_indices: torch.Tensor, states: torch.Tensor
) -> None:
    """Write the final states back into their slots, in the cache's own dtype."""
    state_cache[state_indices.to(torch.int64)] = states.to(state_cache.dtype)


def softplus_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dt + bias, softplus, clamp: the Mamba / Mamba-2 time-step preprocessing."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


@dataclass
class ChunkLayout:
    """Where each packed token sits in the ``[num_chunks * chunk_size]`` padded buffer."""

    chunk_size: int
    num_chunks: int
    token_pos: torch.Tensor  # int64 [T]: index into the flattened padded buffer
    first_chunk: torch.Tensor  # int64 [R]: first chunk of each request
    # (request ids, chunk ids) of the requests that own a chunk at index j, for each j
    steps: list[tuple[torch.Tensor, torch.Tensor]]


def chunk_layout(query_start_loc: torch.Tensor, chunk_size: int) -> ChunkLayout:
    """Cut every request into ``ceil(len / chunk_size)`` chunks (one host sync)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    qsl = query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    num_tokens = int(qsl[-1].item()) if qsl.numel() else 0
    n_chunks = (lens + chunk_size - 1) // chunk_size
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    req = token_requests(qsl, num_tokens)
    local = torch.arange(num_tokens, device=qsl.device) - qsl[:-1][req]
    token_pos = first_chunk[req] * chunk_size + local
    n_host = n_chunks.tolist()
    max_chunks = max(n_host, default=0)
    steps = []
    for j in range(max_chunks):
        reqs = torch.tensor([r for r, n in enumerate(n_host) if n > j], device=qsl.device)
        steps.append((reqs, first_chunk[reqs] + j))
    return ChunkLayout(chunk_size, int(sum(n_host)), token_pos, first_chunk, steps)


def to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[T, ...]`` -> ``[num_chunks, chunk_size, ...]``, zeros in the padding."""
    out = x.new_zeros(layout.num_chunks * layout.chunk_size, *x.shape[1:])
    out[layout.token_pos] = x
    return out.view(layout.num_chunks, layout.chunk_size, *x.shape[1:])


def from_chunks(y: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[num_chunks, chunk_size, ...]`` -> ``[T, ...]`` (drops the padding)."""
    return y.reshape(layout.num_chunks * layout.chunk_size, *y.shape[2:])[layout.token_pos]


def initial_state_flags(has_initial_state: torch.Tensor | None, num_reqs: int,
                        device: torch.device) -> torch.Tensor:
    """``has_initial_state`` as the kernels take it: None means every request reads its
    slot (decodes and continued prefills)."""
    if has_initial_state is None:
        return torch.ones(num_reqs, dtype=torch.bool, device=device)
    return has_initial_state
