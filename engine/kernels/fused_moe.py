"""Fused mixture-of-experts in portable Triton: align, two grouped GEMMs, combine.

Contract (engine/core/interfaces/moe.py): ``hidden [T, H]``, ``w13 [E, 2I, H]`` (gate rows
then up rows), ``w2 [E, H, I]``, ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]``
local expert ids (``-1``: served by another rank). The result is
``out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w1[e] x) * (w3[e] x))`` with
``e = topk_ids[t, j]`` and ``x = hidden[t]``, in hidden's dtype. Ungated experts
(``gated=False``, Nemotron-H): ``w13 [E, I, H]`` holds the up rows alone and the expert
is ``w2[e] @ act(w13[e] x)`` (``act`` a key of :data:`UNGATED_ACTIVATIONS`, e.g.
``relu2``: ``relu(x) ** 2``); step 3 then activates the ``[T * k, I]`` rows in place of
the gate / up product.

Algorithm. The ``T * k`` (token, choice) pairs are numbered ``pair = t * k + j``.

1. :func:`moe_align` sorts the pair ids by expert and pads every expert's run to a
   multiple of ``BLOCK_M`` with an invalid id (``T * k``). After that, every group of
   ``BLOCK_M`` consecutive sorted rows (a *block*) belongs to exactly one expert, so a
   GEMM program can load one expert's weight tile and apply it to all of its rows: the
   ragged per-expert batches become one regular grid. Padding costs at most
   ``BLOCK_M - 1`` wasted rows per expert that has tokens; the rows are masked, never
   computed into the output. Pairs routed elsewhere (``-1``) are dropped here.
2. :func:`_grouped_gemm_kernel` with ``w13``: each program computes one ``BLOCK_M x
   BLOCK_N`` tile of one block. Its rows gather their tokens from ``hidden`` (``token =
   pair // k``) and the product with ``w13[e].T`` is stored at the row of its pair id, so
   the intermediate ``[T * k, 2I]`` stays in pair order (no scatter pass afterwards).
3. :func:`_gated_activation_kernel`: ``act(gate) * up`` -> ``[T * k, I]`` (the gate / up
   biases added first when the layer has them; ``swigluoai``: GPT-OSS's clamped SwiGLU,
   engine/core/interfaces/moe.py).
4. :func:`_grouped_gemm_kernel` with ``w2``, each row scaled by its routing weight ->
   ``[T * k, H]``.
5. :func:`_moe_sum_kernel`: ``out[t] = sum_j partial[t * k + j]`` (plus ``topk_weights[t,
   j] * w2_bias[e]`` with a down bias), skipping the choices that are not on this rank,
   accumulated in float32. Every output element is written,
   so a token whose choices are all elsewhere gets exact zeros.

No step reads device data on the host: the aligned buffers are sized by the worst case
(:func:`max_padded_rows`) and GEMM programs of the unused tail blocks exit at once, so
the whole layer is free of host synchronisation (and capturable in a device graph).
Rows of pairs that are not on this rank are never written in the intermediates and
never read from them.

Importing this module needs no triton (so :meth:`TritonFusedMoEKernel.can_implement` can
say why it cannot run); calling :func:`fused_moe` does, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from engine.core.interfaces.moe import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    FusedMoEKernel,
    MoELayerSpec,
)
from engine.kernels.triton_utils import (
    SUPPORTED_DTYPES,
    TRITON_MISSING_MESSAGE,
    check_device,
    check_dtype,
    interpreting,
    next_power_of_2,
    optional_jit,
    require_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without triton; the kernels below are then never launched
    triton = None
    tl = None

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time
GPU_DEVICE_TYPES = ("cuda", "xpu")  # torch's ROCm build also says "cuda"

# Gate activations by the names HF configs use (see model_executor/layers/activation.py).
ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",  # exact, erf based (torch's F.gelu default)
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "swigluoai": "swigluoai",  # GPT-OSS's clamped SwiGLU (not act(gate) * up)
}
# Activations of ungated experts (``act(w13 x)``; engine/core/interfaces/moe.py).
UNGATED_ACTIVATIONS: dict[str, str] = {
    "relu2": "relu2",  # relu(x) ** 2 (Nemotron-H)
    "silu": "silu",
    "gelu": "gelu",
}



# --------------------------------------------------------------------------- alignment


class MoEAlignment(NamedTuple):
    """Pairs sorted by expert, every expert's run padded to a multiple of ``block_m``.

    ``sorted_pair_ids`` int32 ``[capacity]``: pair ids (``t * top_k + j``), expert by
    expert (ascending), tokens ascending within an expert; padding holds
    ``num_pairs`` (= ``T * top_k``, an id no pair has). ``capacity`` =
    :func:`max_padded_rows`, a multiple of ``block_m``; rows past the valid ones are
    padding too. ``block_expert_ids`` int32 ``[capacity // block_m]``: the expert of each
    block of ``block_m`` rows, ``-1`` for the unused tail. ``num_valid_padded_rows`` int32
    ``[1]`` (a device tensor, never read on the host here): ``sum_e roundup(count_e,
    block_m)``, the rows covered by the non-tail blocks.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_valid_padded_rows: torch.Tensor


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows alignment can produce, from shapes alone (no device read).

    Each expert with ``c > 0`` pairs takes ``roundup(c, block_m) <= c + block_m - 1``
    rows, at most ``min(E, num_pairs)`` experts have pairs, and the total is a multiple
    of ``block_m``; hence ``floor((num_pairs + min(E, num_pairs) * (block_m - 1)) /
    block_m) * block_m``. Decode (a few pairs, many experts) stays a few blocks.
    """
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the flattened (token, choice) pairs of ``topk_ids [T, k]`` by expert and pad
    each expert's run to a multiple of ``block_m`` (see :class:`MoEAlignment`).

    Ids outside ``[0, num_experts)`` (``-1``: another rank's expert) are dropped. Bulk
    torch ops only, no host synchronisation: a stable sort puts the pairs in expert order
    (the dropped ones last), per-expert counts and their padded exclusive prefix sums give
    each expert's first row, and a pair's row is that plus its rank inside its expert.
    """
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    device = topk_ids.device
    expert_of_pair = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = expert_of_pair.numel()
    here = (expert_of_pair >= 0) & (expert_of_pair < num_experts)
    bucket = torch.where(here, expert_of_pair, num_experts)  # bucket E: not on this rank

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded_counts = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    count_start = torch.cumsum(counts, 0) - counts

    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - count_start[sorted_bucket]
    sorted_here = sorted_bucket < num_experts
    capacity = max_padded_rows(num_pairs, num_experts, block_m)
    row = padded_start[sorted_bucket.clamp(max=num_experts - 1)] + rank_in_expert
    row = torch.where(sorted_here, row, capacity)  # dropped pairs land in a spare slot

    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, row, order.to(torch.int32))
    sorted_pair_ids = sorted_pair_ids[:capacity]

    block_first_row = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_first_row, right=True)
    block_expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_valid_padded_rows = padded_end[-1:].to(torch.int32)
    return MoEAlignment(sorted_pair_ids, block_expert_ids, num_valid_padded_rows)


# --------------------------------------------------------------------------- kernels


@optional_jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: hidden [T, H] (A_ROWS_PER_PAIR = top_k) or [T * k, I] (= 1)
    b_ptr,  # [E, N, K]: the experts' weights; each block computes a @ b[e].T
    c_ptr,  # [T * k, N]: output rows by pair id
    routing_weights_ptr,  # float32 [T * k] (read only when MUL_ROUTING_WEIGHT)
    sorted_pair_ids_ptr,  # int32 [num_blocks * BLOCK_M]
    block_expert_ids_ptr,  # int32 [num_blocks]
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROWS_PER_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of one aligned block (a single expert)."""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + block)
    if expert < 0:  # the unused tail of the worst-case sized alignment
        return

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + rows)
    row_valid = pair < num_pairs  # padding rows hold num_pairs
    a_row = (pair // A_ROWS_PER_PAIR).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + expert.to(tl.int64) * stride_be
        + cols[None, :].to(tl.int64) * stride_bn
        + ks[:, None] * stride_bk
    )  # [BLOCK_K, BLOCK_N]: the transposed tile of w[e]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = ks < K - k_start
        # Cast right after the load: the interpreter cannot do arithmetic on bf16.
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if MUL_ROUTING_WEIGHT:
        weight = tl.load(routing_weights_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    c_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@optional_jit
def _sigmoid(x):
    """Overflow-free logistic: exp of a non-positive argument only."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@optional_jit
def _gated_activation_kernel(
    gate_up_ptr,  # [T * k, 2I]: gate columns, then up columns ([T * k, I]: not GATED)
    out_ptr,  # [T * k, I]
    expert_of_pair_ptr,  # [T * k]: topk_ids flattened
    bias_ptr,  # [E, 2I] gate then up biases (HAS_BIAS)
    intermediate_size,
    num_experts,
    stride_gm,
    stride_gn,
    stride_om,
    stride_on,
    stride_be,
    stride_bn,
    ACTIVATION: tl.constexpr,  # "silu" | "gelu" | "gelu_tanh" | "swigluoai" | "relu2"
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # False: out = act(x), the row holding the up projection alone
    ALPHA: tl.constexpr,  # swigluoai's sigmoid gain
    LIMIT: tl.constexpr,  # swigluoai's clamp
    BLOCK_I: tl.constexpr,
):
    """``out[pair] = act(gate) * up`` (not GATED: ``act(up)``) for one pair's row (one
    column tile of it)."""
    pair = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(expert_of_pair_ptr + pair)
    if (expert < 0) | (expert >= num_experts):  # not on this rank: the row was never written
        return
    cols = col_tile * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < intermediate_size
    row = gate_up_ptr + pair.to(tl.int64) * stride_gm
    gate = tl.load(row + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    bias = bias_ptr + expert.to(tl.int64) * stride_be  # read only when HAS_BIAS
    if HAS_BIAS:
        gate += tl.load(bias + cols * stride_bn, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(row + (cols + intermediate_size) * stride_gn, mask=mask, other=0.0)
        up = up.to(tl.float32)
        if HAS_BIAS:
            up += tl.load(bias + (cols + intermediate_size) * stride_bn, mask=mask,
                          other=0.0).to(tl.float32)
    else:
        up = tl.full([BLOCK_I], 1.0, dtype=tl.float32)
    if ACTIVATION == "relu2":
        gate = tl.maximum(gate, 0.0)
        gated = gate * gate * up
    elif ACTIVATION == "swigluoai":
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        gated = (up + 1.0) * (gate * _sigmoid(gate * ALPHA))
    else:
        if ACTIVATION == "silu":
            act = gate * _sigmoid(gate)
        elif ACTIVATION == "gelu":
            act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        else:  # gelu_tanh: 0.5 x (1 + tanh(u)) = x * sigmoid(2u)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = gate * _sigmoid(2.0 * u)
        gated = act * up
    out = out_ptr + pair.to(tl.int64) * stride_om + cols * stride_on
    tl.store(out, gated.to(out_ptr.dtype.element_ty), mask=mask)


@optional_jit
def _moe_sum_kernel(
    partial_ptr,  # [T * k, H]: weighted expert outputs by pair id
    expert_of_pair_ptr,  # [T * k]
    out_ptr,  # [T, H]
    routing_weights_ptr,  # [T * k] float32 (HAS_BIAS)
    bias_ptr,  # [E, H] down biases (HAS_BIAS)
    hidden_size,
    num_experts,
    stride_pm,
    stride_ph,
    stride_ot,
    stride_oh,
    stride_be,
    stride_bh,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j partial[t * k + j]`` (+ ``weight_j * bias[e_j]``) over the choices
    on this rank (fp32 sum)."""
    token = tl.program_id(0).to(tl.int64)
    col_tile = tl.program_id(1)
    cols = col_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(expert_of_pair_ptr + pair)
        if (expert >= 0) & (expert < num_experts):  # else the row was never written
            ptrs = partial_ptr + pair * stride_pm + cols * stride_ph
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                weight = tl.load(routing_weights_ptr + pair)
                bias = bias_ptr + expert.to(tl.int64) * stride_be + cols * stride_bh
                acc += weight * tl.load(bias, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + token * stride_ot + cols * stride_oh
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile shapes of the grouped GEMMs (``block_m`` also sets the alignment padding)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def choose_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> FusedMoEConfig:
    """Tiles from shapes only (untuned defaults in the spirit of vLLM's).

    ``block_m`` follows the mean rows per expert, clamped to 16..64: decode sends one or
    two rows to an expert, and every row past them is padding the GEMM multiplies for
    nothing, while prefill wants tall tiles so a weight tile serves many rows. tl.dot
    needs every dimension >= 16. float32 runs its dots at IEEE precision on CUDA cores,
    which needs small tiles to stay in registers.
    """
    rows_per_expert = -(-num_pairs // num_experts)
    block_m = min(max(next_power_of_2(rows_per_expert), 16), 64)
    if dtype == torch.float32:
        return FusedMoEConfig(min(block_m, 32), 32, 32)
    if block_m == 64:
        return FusedMoEConfig(64, 64, 32)
    return FusedMoEConfig(block_m, 64, 64)


def _dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype fed to tl.dot (fp32 accumulation always) and its fp32 precision mode."""
    if _INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def _new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Intermediate buffers (tests replace this to poison them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _validate(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    num_tokens, hidden_size = hidden.shape
    rows = "2I" if gated else "I"
    if w13.dim() != 3 or w13.shape[2] != hidden_size or (gated and w13.shape[1] % 2):
        raise ValueError(f"w13 must be [E, {rows}, {hidden_size}], got {tuple(w13.shape)}")
    num_experts, inter2, _ = w13.shape
    inter = inter2 // 2 if gated else inter2
    if w2.shape != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w2 must be [{num_experts}, {hidden_size}, {inter}], got {tuple(w2.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, k], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, tensor in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_dtype(name, tensor)
    supported = ACTIVATIONS if gated else UNGATED_ACTIVATIONS
    if activation not in supported:
        raise ValueError(
            f"{'' if gated else 'ungated '}activation {activation!r} is not supported; "
            f"supported: {', '.join(supported)}"
        )
    biases = [b for b in (w13_bias, w2_bias) if b is not None]
    if w13_bias is not None and w13_bias.shape != (num_experts, inter2):
        raise ValueError(f"w13_bias must be [{num_experts}, {inter2}], got "
                         f"{tuple(w13_bias.shape)}")
    if w2_bias is not None and w2_bias.shape != (num_experts, hidden_size):
        raise ValueError(f"w2_bias must be [{num_experts}, {hidden_size}], got "
                         f"{tuple(w2_bias.shape)}")
    check_device(_INTERPRETED, hidden, w13, w2, topk_weights, topk_ids, *biases)


def _grouped_gemm(
    a: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    alignment: MoEAlignment,
    a_rows_per_pair: int,
    routing_weights: torch.Tensor | None,
    config: FusedMoEConfig,
) -> None:
    """``out[pair] = a[pair // a_rows_per_pair] @ weights[e].T`` (times the pair's routing
    weight when given) for every aligned row, ``e`` its block's expert."""
    num_pairs, n = out.shape
    k = weights.shape[2]
    num_blocks = alignment.block_expert_ids.shape[0]
    if num_blocks == 0:
        return
    dot_dtype, dot_precision = _dot_types(a.dtype)
    grid = (num_blocks, triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a,
        weights,
        out,
        routing_weights if routing_weights is not None else out,
        alignment.sorted_pair_ids,
        alignment.block_expert_ids,
        n,
        k,
        num_pairs,
        *a.stride(),
        *weights.stride(),
        *out.stride(),
        A_ROWS_PER_PAIR=a_rows_per_pair,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        MUL_ROUTING_WEIGHT=routing_weights is not None,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: FusedMoEConfig | None = None,
    out: torch.Tensor | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
) -> torch.Tensor:
    """The experts' half of a MoE layer: ``[T, H]`` in hidden's dtype (the module
    docstring gives the formula and the steps).

    ``activation``: a key of :data:`ACTIVATIONS`. ``config``: override the tiles chosen by
    :func:`choose_config` (powers of two, >= 16 on a GPU). ``out``: a ``[T, H]`` tensor of
    hidden's dtype to write into (every element is written), returned. ``w13_bias [E, 2I]``
    / ``w2_bias [E, H]``: expert biases (either optional). ``gated=False``: ungated experts,
    ``w13 [E, I, H]`` (``w13_bias [E, I]``) and ``activation`` a key of
    :data:`UNGATED_ACTIVATIONS`.
    """
    require_triton()
    _validate(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, gated)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter2, _ = w13.shape
    intermediate_size = inter2 // 2 if gated else inter2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    device = hidden.device
    if out is None:
        out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=device)
    elif out.shape != (num_tokens, hidden_size) or out.dtype != hidden.dtype:
        raise ValueError(
            f"out must be [{num_tokens}, {hidden_size}] {hidden.dtype}, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    else:
        check_device(_INTERPRETED, hidden, out)
    if num_tokens == 0:
        return out
    if top_k == 0:
        return out.zero_()
    if config is None:
        config = choose_config(num_pairs, num_experts, hidden.dtype)
    for tile in (config.block_m, config.block_n, config.block_k):
        if tile < 1 or tile & (tile - 1):
            raise ValueError(f"tile sizes must be powers of two, got {config}")

    expert_of_pair = topk_ids.reshape(-1).contiguous()
    routing_weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    alignment = moe_align(topk_ids, num_experts, config.block_m)

    gate_up = _new_buffer((num_pairs, inter2), hidden.dtype, device)
    _grouped_gemm(hidden, w13, gate_up, alignment, top_k, None, config)

    activated = _new_buffer((num_pairs, intermediate_size), hidden.dtype, device)
    block_i = min(1024, next_power_of_2(intermediate_size))
    _gated_activation_kernel[(num_pairs, triton.cdiv(intermediate_size, block_i))](
        gate_up,
        activated,
        expert_of_pair,
        w13_bias if w13_bias is not None else gate_up,
        intermediate_size,
        num_experts,
        *gate_up.stride(),
        *activated.stride(),
        *(w13_bias.stride() if w13_bias is not None else (0, 0)),
        ACTIVATION=(ACTIVATIONS if gated else UNGATED_ACTIVATIONS)[activation],
        HAS_BIAS=w13_bias is not None,
        GATED=gated,
        ALPHA=SWIGLUOAI_ALPHA,
        LIMIT=SWIGLUOAI_LIMIT,
        BLOCK_I=block_i,
    )

    partial = _new_buffer((num_pairs, hidden_size), hidden.dtype, device)
    _grouped_gemm(activated, w2, partial, alignment, 1, routing_weights, config)

    block_h = min(1024, next_power_of_2(hidden_size))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        partial,
        expert_of_pair,
        out,
        routing_weights,
        w2_bias if w2_bias is not None else partial,
        hidden_size,
        num_experts,
        *partial.stride(),
        *out.stride(),
        *(w2_bias.stride() if w2_bias is not None else (0, 0)),
        TOP_K=top_k,
        HAS_BIAS=w2_bias is not None,
        BLOCK_H=block_h,
    )
    return out


# --------------------------------------------------------------------------- interface


class TritonFusedMoEKernel(FusedMoEKernel):
    """:func:`fused_moe` behind the platform interface (cuda, rocm, xpu; CPU tensors
    only under ``TRITON_INTERPRET=1``)."""

    name: ClassVar[str] = "triton_fused_moe"
    supports_expert_bias: ClassVar[bool] = True
    supports_ungated: ClassVar[bool] = True

    @classmethod
    def can_implement(cls, spec: MoELayerSpec) -> str | None:
        if triton is None:
            return TRITON_MISSING_MESSAGE
        device_type = spec.device.type
        if device_type == "cpu":
            if not _INTERPRETED:
                return (
                    "Triton kernels need a GPU; CPU tensors run only under TRITON_INTERPRET=1 "
                    "(set before engine.kernels.fused_moe is imported)"
                )
        elif device_type not in GPU_DEVICE_TYPES:
            return f"Triton kernels run on {', '.join(GPU_DEVICE_TYPES)} devices, not {device_type}"
        activations = ACTIVATIONS if spec.gated else UNGATED_ACTIVATIONS
        if spec.activation not in activations:
            supported = ", ".join(activations)
            kind = "activation" if spec.gated else "ungated activation"
            return f"{kind} {spec.activation!r} is not supported; supported: {supported}"
        if spec.dtype not in SUPPORTED_DTYPES:
            return f"dtype {spec.dtype} is not supported (float16, bfloat16, float32)"
        if min(spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k) < 1:
            return f"sizes must be positive: {spec}"
        return None

    def apply(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        gated: bool = True,
    ) -> torch.Tensor:
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation,
                         w13_bias=w13_bias, w2_bias=w2_bias, gated=gated)
