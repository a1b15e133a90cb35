"""Weight-only integer GEMMs (W4A16 / W8A16) in portable Triton: ``y = x @ dequant(W).T
(+ bias)`` over the canonical int encoding (engine/core/interfaces/quant.py: codes uint8
``[N, K]``, weight = (code - zero) * scale, group scales / zero points ``[N, K / group]``,
zero None = the midpoint ``2^(bits-1)``, optional act-order ``g_idx``).

Two kernels over two packed layouts, the same arithmetic:

- :class:`TritonW4A16Gemm` (``triton_w4a16``; 4- and 8-bit codes despite the name) packs
  the codes into int32 words along K, ``32 / bits`` a word (code j of a word at bits
  ``bits * j``: GPTQ's ``qweight`` orientation), stored ``[K / pack, N]`` so a tile's
  rows are N-contiguous; scales / zero points are stored ``[G, N]``. Any N, any K that
  fills whole words.
- :class:`TritonMarlinGemm` (``triton_marlin``, kernel family "marlin", what ``--quantization
  gptq_marlin | awq_marlin | marlin`` asks for) repacks the same words tile-contiguously;
  see "Marlin-style layout" below.

Dequantization happens in registers: a program loads a ``[BLOCK_K / pack, BLOCK_N]`` tile
of words with one load, unpacks it by broadcasting against the ``pack`` shifts and
reshaping to ``[BLOCK_K, BLOCK_N]`` (row ``k = word * pack + j``), subtracts the zero
point, multiplies by the group scale in float32, and feeds ``tl.dot`` (fp16 / bf16
operands with float32 accumulation on a GPU; float32 operands at IEEE precision for
float32 activations and in the interpreter). The weight is never materialised in memory.

Groups. The host picks ``BLOCK_K`` so a K tile lies inside one scale group whenever it
can (``group % BLOCK_K == 0``, a single group per row (per-channel), or ``BLOCK_K`` lowered
to a power-of-two group >= 16): one scale row ``[BLOCK_N]`` per tile. Otherwise (groups
smaller than, or not aligned with, the tile) every row of the tile gathers its own
group's scales (``GROUP_MODE`` 1): correct for any group that divides K, at the price of
cached redundant scale loads.

Act-order (GPTQ ``desc_act``: ``g_idx`` assigns input feature k to a group out of order).
``prepare`` sorts the input features by group once (the codes' columns permuted with
them) and ``apply`` permutes x's columns the same way once per call (an
``index_select`` of ``M x K`` activations, tiny next to the weights at decode and
coalesced at prefill). The kernel then sees contiguous groups, exactly as without
act-order, instead of gathering a scale per input feature inside the inner loop. (vLLM's
Marlin handles act-order the same way: it permutes the activations.)

Split-K (decode shapes, ``M <= 16``). Few rows leave the grid with only ``N / BLOCK_N``
programs, too few to stream the weights at full bandwidth, so ``split_k`` programs share
each output tile's K range. Each writes its float32 partial tile to a ``[split_k, M, N]``
workspace and a second, tiny kernel sums the splits in a fixed order, adds the bias and
casts. Atomics (``tl.atomic_add`` on float32 works on NVIDIA, AMD and Intel GPUs and in
the interpreter) would save that pass but add in a run-dependent order, making outputs,
and so greedy decoding, nondeterministic from run to run; the workspace is small (16
rows) and stays in L2. Every workspace element read is written first, so it needs no
zero-fill. Nothing in ``apply`` reads device data on the host (no sync; capturable in a
device graph).

Marlin-style layout. Marlin (IST Austria's fp16 x int4 kernel, which vLLM ships as
CUDA) gets its speed first from how the weights lie in memory: offline they are
reshuffled so each warp streams one contiguous, perfectly coalesced range with 128-bit
loads, and nothing is re-read. :class:`TritonMarlinGemm` is a Triton kernel over the same
idea, not a port of that CUDA code: ``prepare`` cuts N into stripes of
``TILE_N = 64`` output features and stores each stripe as one contiguous
``[K / pack, TILE_N]`` block of words (``words[N / 64, K / pack, 64]``), scales and zero
points likewise stripe by stripe (``[N / 64, G, 64]``: a group's row of a stripe is 256
contiguous bytes, next to the following group's). A program owns one stripe; its
``BLOCK_K x 64`` weight tile at step k is the contiguous word range ``[k * 64 / pack,
(k + BLOCK_K) * 64 / pack)`` of that stripe (4 KiB for int4 at ``BLOCK_K = 128``), read
with one unmasked load whose contiguity the compiler sees from constexpr strides, and
successive steps (and the K ranges of split-K programs) walk the stripe front to back:
every program is one sequential stream, where the plain layout reads ``BLOCK_K / pack``
rows ``4 N`` bytes apart. Marlin's further tricks (nibbles interleaved for lop3 int4 ->
fp16 conversion, tiles permuted to the mma fragment layout, its own stream-K
partitioning) are left to Triton's compiler, which owns the register layout here. It
needs ``N % 64 == 0`` and ``K % 64 == 0`` (whole tiles, no weight masks).

Importing this module needs no triton (so ``can_implement`` can say why it cannot run);
the kernels need it. Run them on CPU tensors with ``TRITON_INTERPRET=1`` set before the
import (the tests do).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.core.interfaces import QuantizedGemmKernel, QuantizedLayerSpec, QuantizedWeights
from engine.kernels.triton_utils import (
    SUPPORTED_DTYPES,
    TRITON_MISSING_MESSAGE,
    check_device,
    compute_units,
    interpreting,
    optional_jit,
    require_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without triton; the kernels below are then never launched
    triton = None
    tl = None

if TYPE_CHECKING:
    from torch import nn

    from engine.core.interfaces import DeviceCapability

INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time
MARLIN_TILE_N = 64  # output features per stripe of the Marlin-style layout
SPLIT_K_MAX_M = 16  # rows up to which the decode configs (and split-K) apply
MAX_SPLIT_K = 16
ORDER_ENV = "ENGINE_TRITON_INT_GEMM"  # auto (Marlin-style first) | plain (plain first)



@dataclass
class IntGemmLaunches:
    """Launch counters (tests read them to prove these kernels ran)."""

    int_gemm: int = 0  # plain-layout GEMM launches
    marlin_gemm: int = 0  # Marlin-style GEMM launches
    split_k_reduce: int = 0

    def reset(self) -> None:
        self.int_gemm = self.marlin_gemm = self.split_k_reduce = 0

    def snapshot(self) -> dict[str, int]:
        return {"int_gemm": self.int_gemm, "marlin_gemm": self.marlin_gemm,
                "split_k_reduce": self.split_k_reduce}


launches = IntGemmLaunches()


# --------------------------------------------------------------------------- packing


def pack_factor(bits: int) -> int:
    """Codes per int32 word."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit codes: these kernels pack 4 and 8")
    return 32 // bits


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> int32 words ``[N, K / pack]`` along K, code ``j`` of a
    word (input feature ``word * pack + j``) at bits ``bits * j``."""
    pack = pack_factor(bits)
    n, k = codes.shape
    if k % pack:
        raise ValueError(f"{k} input features do not fill int32 words of {pack} codes")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes exceed {bits} bits")
    grouped = codes.reshape(n, k // pack, pack)
    words = torch.zeros((n, k // pack), dtype=torch.int64, device=codes.device)
    for j in range(pack):  # one code position at a time: temporaries stay ~ the codes' size
        words |= grouped[..., j].to(torch.int64) << (bits * j)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # wrap into int32
    return words.to(torch.int32)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_words`: ``[N, K / pack]`` int32 -> uint8 ``[N, K]``."""
    pack = pack_factor(bits)
    shifts = torch.arange(pack, device=words.device, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).to(torch.uint8)


def marlin_repack(codes: torch.Tensor, bits: int, tile_n: int = MARLIN_TILE_N
                  ) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> the Marlin-style words ``[N / tile_n, K / pack, tile_n]``
    (contiguous): stripe ``s`` holds output features ``s * tile_n ...``, each a column of
    words along K (module docstring)."""
    n, _ = codes.shape
    if n % tile_n:
        raise ValueError(f"{n} output features are not whole stripes of {tile_n}")
    words = pack_words(codes, bits)  # [N, K / pack]
    return words.reshape(n // tile_n, tile_n, -1).transpose(1, 2).contiguous()


def marlin_unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`marlin_repack`: uint8 codes ``[N, K]``."""
    stripes, kw, tile_n = words.shape
    return unpack_words(words.transpose(1, 2).reshape(stripes * tile_n, kw), bits)


def marlin_stripes(values: torch.Tensor, tile_n: int = MARLIN_TILE_N) -> torch.Tensor:
    """Per-group values ``[N, G]`` (scales, zero points) -> ``[N / tile_n, G, tile_n]``."""
    n, g = values.shape
    return values.reshape(n // tile_n, tile_n, g).transpose(1, 2).contiguous()


def act_order_permutation(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input features sorted by group (None: already in order), so act-order layers
    read whole groups contiguously; a ValueError when a group does not hold exactly
    ``group`` features (such a g_idx cannot be made contiguous)."""
    g_idx = g_idx.to(torch.int64)
    k = g_idx.numel()
    plain = torch.arange(k, device=g_idx.device) // group
    if bool((g_idx == plain).all()):
        return None
    counts = torch.bincount(g_idx, minlength=k // group)
    if counts.numel() != k // group or bool((counts != group).any()):
        raise ValueError(f"g_idx does not put {group} input features in each of "
                         f"{k // group} groups")
    return torch.argsort(g_idx, stable=True)


@dataclass(frozen=True)
class PackedIntWeight:
    """A layer's weights in one of the two layouts (what ``prepare`` keeps).

    ``words`` int32: plain ``[K / pack, N]``, tiled ``[N / 64, K / pack, 64]``;
    ``scales`` / ``zeros`` float32: plain ``[G, N]``, tiled ``[N / 64, G, 64]`` (zeros None:
    symmetric); ``perm`` int64 ``[K]`` (None: no act-order): x's columns are read in this
    order (the codes' columns already are)."""

    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group: int
    n: int
    k: int
    tiled: bool

    @property
    def num_groups(self) -> int:
        return self.k // self.group


def pack_int_weight(weights: QuantizedWeights, tiled: bool = False) -> PackedIntWeight:
    """Canonical int weights -> :class:`PackedIntWeight` (plain or Marlin-style)."""
    spec = weights.spec
    if spec.encoding != "int":
        raise ValueError(f"{spec.encoding} weights: these kernels take int codes")
    n, k = weights.codes.shape
    group = spec.group_size
    if k % group:
        raise ValueError(f"{k} input features are not whole groups of {group}")
    codes, perm = weights.codes, None
    if weights.g_idx is not None:
        perm = act_order_permutation(weights.g_idx, group)
        if perm is not None:
            codes = codes[:, perm]
    scales = weights.scales.float()
    zeros = None if weights.zeros is None else weights.zeros.float()
    if tiled:
        words = marlin_repack(codes, spec.weight_bits)
        scales = marlin_stripes(scales)
        zeros = None if zeros is None else marlin_stripes(zeros)
    else:
        words = pack_words(codes, spec.weight_bits).t().contiguous()
        scales = scales.t().contiguous()
        zeros = None if zeros is None else zeros.t().contiguous()
    return PackedIntWeight(words, scales, zeros, perm, spec.weight_bits, group, n, k, tiled)


# --------------------------------------------------------------------------- kernels


@optional_jit
def _unpack_tile(words, BITS: tl.constexpr, PACK: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """``[BLOCK_K / PACK, BLOCK_N]`` int32 words -> ``[BLOCK_K, BLOCK_N]`` codes, row
    ``word * PACK + j`` from bits ``BITS * j`` (an arithmetic shift: the mask drops the
    sign bits of a negative word)."""
    shifts = tl.arange(0, PACK) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@optional_jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m tile, n tile) of this program: GROUP_M m tiles sweep the n tiles together, so a
    weight tile is reused from L2 by the rows that need it (prefill)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@optional_jit
def _store_tile(acc, out_ptr, bias_ptr, rm, rn, M, N, pid_k, stride_os, stride_om,
                stride_on, HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr):
    """The float32 partial of split ``pid_k`` (SPLIT_OUT), or the finished tile."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    ptrs = out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on
    if SPLIT_OUT:
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@optional_jit
def _int_gemm_kernel(
    x_ptr,  # [M, K] activations (columns already in act-order)
    w_ptr,  # int32 [K / PACK, N]: codes packed along K
    s_ptr,  # float32 [G, N] scales
    z_ptr,  # float32 [G, N] zero points (read only when HAS_ZEROS)
    bias_ptr,  # [N] (read only when HAS_BIAS and not SPLIT_OUT)
    out_ptr,  # [M, N] output, or float32 [split_k, M, N] partials (SPLIT_OUT)
    M,
    N,
    K,
    group,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_sg,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    PACK: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    GROUP_MODE: tl.constexpr,  # 0: a K tile inside one group; 1: a group per tile row
    WIDE_LOAD: tl.constexpr,  # False: load each row's word (pack x redundant, cached)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile over the K range of split ``program_id(1)``."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // PACK)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if WIDE_LOAD:
            kw = k0 // PACK + rw
            words = tl.load(w_ptr + kw[:, None] * stride_wk + rn[None, :] * stride_wn,
                            mask=(kw < K // PACK)[:, None] & n_ok[None, :], other=0)
            codes = _unpack_tile(words, BITS, PACK, BLOCK_K, BLOCK_N)
        else:
            words = tl.load(w_ptr + (ks // PACK)[:, None] * stride_wk + rn[None, :] * stride_wn,
                            mask=k_ok[:, None] & n_ok[None, :], other=0)
            codes = (words >> ((ks % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
        if GROUP_MODE == 0:
            s_off = (k0 // group) * stride_sg + rn * stride_sn
            scale = tl.load(s_ptr + s_off, mask=n_ok, other=0.0)[None, :]
            if HAS_ZEROS:
                zero = tl.load(z_ptr + s_off, mask=n_ok, other=0.0)[None, :]
        else:
            s_off = (ks // group)[:, None] * stride_sg + rn[None, :] * stride_sn
            s_mask = k_ok[:, None] & n_ok[None, :]
            scale = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + s_off, mask=s_mask, other=0.0)
        if HAS_ZEROS:
            w = (codes.to(tl.float32) - zero) * scale
        else:
            w = (codes - (1 << (BITS - 1))).to(tl.float32) * scale
        # Cast right after the load: the interpreter cannot do arithmetic on bf16.
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_tile(acc, out_ptr, bias_ptr, rm, rn, M, N, pid_k, stride_os, stride_om, stride_on,
                HAS_BIAS, SPLIT_OUT)


@optional_jit
def _marlin_gemm_kernel(
    x_ptr,  # [M, K] activations (columns already in act-order)
    w_ptr,  # int32 [N / TILE_N, K / PACK, TILE_N]: one contiguous block per stripe
    s_ptr,  # float32 [N / TILE_N, G, TILE_N]
    z_ptr,  # float32 [N / TILE_N, G, TILE_N] (read only when HAS_ZEROS)
    bias_ptr,
    out_ptr,  # [M, N], or float32 [split_k, M, N] partials (SPLIT_OUT)
    M,
    N,
    K,  # a multiple of BLOCK_K
    group,
    num_groups,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_os,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    PACK: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One ``BLOCK_M x TILE_N`` output tile (one stripe) over split ``program_id(1)``'s K
    range, streaming the stripe's contiguous words front to back."""
    pid_m, stripe = _tile_ids(M, N, BLOCK_M, TILE_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, TILE_N)
    rn = stripe * TILE_N + cols
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // PACK)
    w_stripe = w_ptr + stripe.to(tl.int64) * (K // PACK) * TILE_N
    s_stripe = stripe.to(tl.int64) * num_groups * TILE_N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=m_ok[:, None], other=0.0)
        # the tile: words [k0 * TILE_N / PACK, (k0 + BLOCK_K) * TILE_N / PACK) of the
        # stripe, one contiguous range (constexpr strides), no mask
        tile = (k0 // PACK + rw)[:, None] * TILE_N + cols[None, :]
        codes = _unpack_tile(tl.load(w_stripe + tile), BITS, PACK, BLOCK_K, TILE_N)
        if GROUP_MODE == 0:
            s_off = s_stripe + (k0 // group) * TILE_N + cols
            scale = tl.load(s_ptr + s_off)[None, :]
            if HAS_ZEROS:
                zero = tl.load(z_ptr + s_off)[None, :]
        else:
            s_off = s_stripe + (ks // group)[:, None] * TILE_N + cols[None, :]
            scale = tl.load(s_ptr + s_off)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + s_off)
        if HAS_ZEROS:
            w = (codes.to(tl.float32) - zero) * scale
        else:
            w = (codes - (1 << (BITS - 1))).to(tl.float32) * scale
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_tile(acc, out_ptr, bias_ptr, rm, rn, M, N, pid_k, stride_os, stride_om, stride_on,
                HAS_BIAS, SPLIT_OUT)


@optional_jit
def _split_k_reduce_kernel(
    part_ptr,  # float32 [split_k, M, N]
    bias_ptr,
    out_ptr,  # [M, N]
    N,
    split_k,
    stride_ps,
    stride_pm,
    stride_pn,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[m] = sum_s part[s, m] (+ bias)``, the splits summed in order (deterministic)."""
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + rn * stride_pn, mask=n_ok,
                       other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + rn * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=n_ok)


# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class IntGemmConfig:
    """Tiles and split of one launch. ``block_n`` of the Marlin-style kernel is its stripe
    width (64); ``block_k`` must be a multiple of the pack factor (and, tiled, divide K);
    ``split_k`` is clamped to the K tiles; ``wide_load`` (plain layout only): one word
    tile load unpacked by reshape, else a word load per code row."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    wide_load: bool = True


def choose_config(m: int, packed: PackedIntWeight, dtype: torch.dtype,
                  units: int) -> IntGemmConfig:
    """Tiles from shapes only (untuned defaults in the spirit of vLLM's Triton GEMMs).

    Decode (``m <= 16``): 16-row tiles (tl.dot's minimum), 64-wide, long K steps and
    split-K to give the device ``~2 x units`` programs (at most 16 splits, each at least
    two K tiles). Prefill: 64 / 128-row tiles, 128 wide (64 for the Marlin-style stripes).
    float32 runs its dots on CUDA cores at IEEE precision, which needs small tiles.
    """
    fp32 = dtype == torch.float32
    if m <= SPLIT_K_MAX_M:
        block_m, block_n, block_k, warps, stages = 16, 64, 64 if fp32 else 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 32 if fp32 else 64, 64, 64, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = (32, 64, 32, 4, 2) if fp32 else (
            128, 128, 64, 8, 3)
    if packed.tiled:
        block_n = MARLIN_TILE_N
        warps = min(warps, 4)
    block_k = fit_block_k(block_k, packed)
    split = 1
    if m <= SPLIT_K_MAX_M:
        tiles = -(-m // block_m) * -(-packed.n // block_n)
        k_tiles = -(-packed.k // block_k)
        split = max(1, min((2 * units) // max(tiles, 1), k_tiles // 2, MAX_SPLIT_K))
    return IntGemmConfig(block_m, block_n, block_k, split, num_warps=warps, num_stages=stages)


def fit_block_k(block_k: int, packed: PackedIntWeight) -> int:
    """The largest K step <= ``block_k`` that keeps a tile inside one scale group where
    possible (a power-of-two group of at least 16 below it) and, tiled, divides K."""
    group = packed.group
    if packed.num_groups > 1 and group % block_k and group < block_k and group >= 16 and (
            group & (group - 1)) == 0:
        block_k = group
    if packed.tiled:
        while block_k > 16 and packed.k % block_k:
            block_k //= 2
    return block_k


def group_mode(block_k: int, packed: PackedIntWeight) -> int:
    """0: every K tile lies in one group (one scale row per tile); 1: rows gather."""
    return 0 if packed.num_groups == 1 or packed.group % block_k == 0 else 1


def _dot_types(dtype: torch.dtype) -> tuple[Any, str]:
    """The dtype fed to tl.dot (fp32 accumulation always) and its fp32 precision mode."""
    if INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "ieee"


def _new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Outputs and split-K workspaces (tests replace this to poison them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_config(config: IntGemmConfig, packed: PackedIntWeight) -> None:
    pack = 32 // packed.bits
    for tile in (config.block_m, config.block_n, config.block_k):
        if tile < 1 or tile & (tile - 1):
            raise ValueError(f"tile sizes must be powers of two, got {config}")
    if config.block_k % pack or config.block_k < pack:
        raise ValueError(f"block_k {config.block_k} is not whole int32 words of {pack} codes")
    if config.split_k < 1:
        raise ValueError(f"split_k must be positive, got {config.split_k}")
    if packed.tiled:
        if config.block_n != MARLIN_TILE_N:
            raise ValueError(f"the Marlin-style kernel's block_n is its stripe width "
                             f"{MARLIN_TILE_N}, not {config.block_n}")
        if packed.k % config.block_k:
            raise ValueError(f"block_k {config.block_k} does not divide K = {packed.k}")


def int_gemm(x: torch.Tensor, packed: PackedIntWeight, bias: torch.Tensor | None = None,
             config: IntGemmConfig | None = None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` in x's dtype: ``x @ dequant(W).T (+ bias)`` with the
    weights ``packed`` by :func:`pack_int_weight` (either layout).

    ``config``: override :func:`choose_config`'s tiles and split (tests). ``out``: a
    contiguous ``[M, N]`` tensor of x's dtype to write into (every element is written)."""
    require_triton()
    if x.shape[-1] != packed.k:
        raise ValueError(f"x has {x.shape[-1]} features; the layer takes {packed.k}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    m, n = x2.shape[0], packed.n
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    tensors = [x2, packed.words, packed.scales]
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        tensors.append(bias)
    if out is None:
        out = _new_buffer((m, n), x.dtype, x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_device(INTERPRETED, *tensors, out)
    result = out if x.dim() == 2 else out.view(*lead, n)
    if m == 0:
        return result
    if config is None:
        config = choose_config(m, packed, x.dtype, compute_units(x.device))
    _check_config(config, packed)
    block_n = config.block_n
    k_tiles = -(-packed.k // config.block_k)
    split = min(config.split_k, k_tiles)
    k_per_split = -(-k_tiles // split) * config.block_k
    split = -(-packed.k // k_per_split)  # no empty split
    if split > 1:
        target = _new_buffer((split, m, n), torch.float32, x.device)
    else:
        target = out.unsqueeze(0)
    dot_dtype, precision = _dot_types(x.dtype)
    zeros = packed.zeros if packed.zeros is not None else packed.scales
    bias_arg = bias if bias is not None else packed.scales
    pack = 32 // packed.bits
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n), split)
    common = {
        "BITS": packed.bits, "PACK": pack, "HAS_ZEROS": packed.zeros is not None,
        "HAS_BIAS": bias is not None, "SPLIT_OUT": split > 1,
        "GROUP_MODE": group_mode(config.block_k, packed), "BLOCK_M": config.block_m,
        "BLOCK_K": config.block_k, "GROUP_M": config.group_m, "DOT_DTYPE": dot_dtype,
        "DOT_PRECISION": precision, "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    if packed.tiled:
        _marlin_gemm_kernel[grid](
            x2, packed.words, packed.scales, zeros, bias_arg, target, m, n, packed.k,
            packed.group, packed.num_groups, k_per_split, *x2.stride(), *target.stride(),
            TILE_N=block_n, **common,
        )
        launches.marlin_gemm += 1
    else:
        _int_gemm_kernel[grid](
            x2, packed.words, packed.scales, zeros, bias_arg, target, m, n, packed.k,
            packed.group, k_per_split, *x2.stride(), *packed.words.stride(),
            *packed.scales.stride(), *target.stride(), BLOCK_N=block_n,
            WIDE_LOAD=config.wide_load, **common,
        )
        launches.int_gemm += 1
    if split > 1:
        reduce_n = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, reduce_n))](
            target, bias_arg, out, n, split, *target.stride(), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_N=reduce_n,
        )
        launches.split_k_reduce += 1
    return result


# --------------------------------------------------------------------------- interface


class _TritonIntKernel(QuantizedGemmKernel):
    """What both kernels share: refusals, device binding, prepare / apply."""

    name: ClassVar[str]
    family: ClassVar[str] = "triton"
    tiled: ClassVar[bool] = False
    # the platform's device this class is bound to (for_capability); None: unbound, which
    # runs only under TRITON_INTERPRET=1 (CPU tensors, tests)
    capability: ClassVar[DeviceCapability | None] = None

    def __init__(self) -> None:
        self.bits: int | None = None  # set by prepare

    @classmethod
    def for_capability(cls, capability: DeviceCapability | None) -> type[_TritonIntKernel]:
        """This kernel bound to a platform's device (the same class for the same
        capability, so kernel lists compare equal)."""
        return _bound(cls, capability)

    @classmethod
    def _device_refusal(cls, spec: QuantizedLayerSpec) -> str | None:
        if triton is None:
            return TRITON_MISSING_MESSAGE
        cap = cls.capability
        if cap is None:
            if INTERPRETED:
                return None
            return ("not bound to a GPU's capability (a GPU platform binds it: "
                    "for_capability); CPU tensors run only under TRITON_INTERPRET=1, set "
                    "before engine.kernels.quant_gemm_int is imported")
        if cap.vendor == "nvidia":
            if cap.major < 7:
                return f"{cap.arch}: Triton's tl.dot needs compute capability 7.0 or newer"
            if spec.act_dtype == torch.bfloat16 and cap.major < 8:
                return f"{cap.arch}: bfloat16 tl.dot needs compute capability 8.0 or newer"
        return None

    @classmethod
    def _shape_refusal(cls, spec: QuantizedLayerSpec) -> str | None:
        return None

    @classmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.encoding != "int":
            return f"{spec.encoding} weights (it takes int codes)"
        if spec.weight_bits not in (4, 8):
            return f"{spec.weight_bits}-bit int codes (it takes 4 and 8)"
        if spec.activation is not None:
            return (f"{spec.activation.encoding} activation quantization (a weight-only "
                    "kernel: W4A16 / W8A16)")
        if spec.act_dtype not in SUPPORTED_DTYPES:
            return f"activations in {spec.act_dtype} (it takes float16, bfloat16, float32)"
        if spec.group_size < 1 or spec.in_features % spec.group_size:
            return f"{spec.in_features} input features in groups of {spec.group_size}"
        pack = 32 // spec.weight_bits
        if spec.in_features % pack:
            return f"{spec.in_features} input features do not fill int32 words of {pack}"
        return cls._shape_refusal(spec) or cls._device_refusal(spec)

    @property
    def description(self) -> str:
        return self.name if self.bits is None else f"{self.name} (int{self.bits})"

    def prepare(self, layer: nn.Module, weights: QuantizedWeights) -> None:
        packed = pack_int_weight(weights, tiled=self.tiled)
        check_device(INTERPRETED, packed.words)
        layer.register_buffer("tq_words", packed.words, persistent=False)
        layer.register_buffer("tq_scales", packed.scales, persistent=False)
        layer.register_buffer("tq_zeros", packed.zeros, persistent=False)
        layer.register_buffer("tq_perm", packed.perm, persistent=False)
        layer.quant_spec = weights.spec
        self.bits = packed.bits
        self._meta = (packed.bits, packed.group, packed.n, packed.k)

    def packed(self, layer: nn.Module) -> PackedIntWeight:
        """The layer's weights (its current buffers: they follow ``layer.to``)."""
        bits, group, n, k = self._meta
        return PackedIntWeight(layer.tq_words, layer.tq_scales, layer.tq_zeros, layer.tq_perm,
                               bits, group, n, k, self.tiled)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        return int_gemm(x, self.packed(layer), bias)


class TritonW4A16Gemm(_TritonIntKernel):
    """W4A16 / W8A16 over the plain packed layout (any N; K in whole int32 words)."""

    name: ClassVar[str] = "triton_w4a16"


class TritonMarlinGemm(_TritonIntKernel):
    """W4A16 / W8A16 over the Marlin-style stripe layout (module docstring): the kernel
    of the "marlin" family (``--quantization gptq_marlin | awq_marlin | marlin``)."""

    name: ClassVar[str] = "triton_marlin"
    family: ClassVar[str] = "marlin"
    tiled: ClassVar[bool] = True

    @classmethod
    def _shape_refusal(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.out_features % MARLIN_TILE_N or spec.in_features % 64:
            return (f"a [{spec.out_features}, {spec.in_features}] layer is not whole "
                    f"{MARLIN_TILE_N}-wide stripes of whole 64-deep tiles (N and K must be "
                    "multiples of 64)")
        return None


@functools.cache
def _bound(cls: type[_TritonIntKernel], capability: DeviceCapability | None
           ) -> type[_TritonIntKernel]:
    if capability is None:
        return cls
    return type(cls.__name__, (cls,), {"capability": capability, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def int_gemm_kernels(capability: DeviceCapability | None) -> list[type[QuantizedGemmKernel]]:
    """The int kernels bound to ``capability``, preferred first: the Marlin-style one
    (where its shapes fit), then the plain one; ``$ENGINE_TRITON_INT_GEMM=plain`` puts
    the plain one first."""
    order = os.environ.get(ORDER_ENV, "auto").strip().lower() or "auto"
    if order not in ("auto", "plain"):
        raise ValueError(f"{ORDER_ENV}={order!r}: expected auto or plain")
    kernels = [TritonMarlinGemm, TritonW4A16Gemm]
    if order == "plain":
        kernels.reverse()
    return [k.for_capability(capability) for k in kernels]
