"""Rotary position embedding (neox / rotate-half convention, as in HF Llama).

The inverse frequencies follow transformers' ``modeling_rope_utils`` formulas for the
``default``, ``linear``, ``dynamic`` (NTK) and ``llama3`` rope types, computed in float32
the same way, so cos/sin match transformers bit for bit within the trained context. A
``[max_positions, head_size]`` cos|sin table is built once and indexed by the flat
``positions`` of each step, then cast to the model dtype exactly where transformers casts.

Dynamic NTK: transformers recomputes the base from the current sequence length
``L = max(position) + 1`` of each forward call (and keeps the original base while
``L <= max_position_embeddings``). A paged engine cannot re-rotate cached keys, so each
position ``p`` is given the base transformers uses when ``p`` is the newest token
(``L = p + 1``): identical to transformers inside the trained context and to its
token-by-token decoding beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.core.interfaces import FusedOps

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """The rope parameters of one model, normalized across config versions."""

    rope_type: str
    theta: float
    max_position_embeddings: int
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN: the ramp between interpolated and extrapolated frequencies, and the factor
    # cos / sin are scaled by (from mscale / mscale_all_dim unless given).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # LongRoPE (Phi-3): per-frequency divisors inside / beyond the original context.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @property
    def max_positions(self) -> int:
        """Positions the table must cover (linear / dynamic stretch the context)."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        return self.max_position_embeddings


def rope_scaling_from_config(hf_config: Any, *, allow_partial: bool = False) -> RopeScaling:
    """Read rope settings from a transformers config (v5 ``rope_parameters`` or v4 fields).
    ``allow_partial``: the caller rotates only part of each head (see
    :func:`partial_rotary_factor`), so a partial factor is no error."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters ({sorted(params)}) are not supported")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0) and not allow_partial:
        raise ValueError(f"partial rotary embeddings (factor {partial}) are not supported")
    max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if max_pos <= 0:
        raise ValueError("the model config has no max_position_embeddings for rotary embeddings")
    theta = params.get("rope_theta")
    scaling = RopeScaling(
        rope_type=rope_type,
        theta=float(10000.0 if theta is None else theta),
        max_position_embeddings=max_pos,
    )
    if rope_type == "default":
        return scaling
    if rope_type == "longrope":
        return _longrope_scaling(scaling, params, hf_config)
    if params.get("factor") is None:
        raise ValueError(f"rope_type {rope_type!r} needs a 'factor' in the rope parameters")
    extra: dict[str, Any] = {"factor": float(params["factor"])}
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            raise ValueError(f"llama3 rope parameters lack {missing}")
        extra["low_freq_factor"] = float(params["low_freq_factor"])
        extra["high_freq_factor"] = float(params["high_freq_factor"])
        extra["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings")
            or getattr(hf_config, "original_max_position_embeddings", None)
            or max_pos
        )
    if rope_type == "yarn":
        extra.update(_yarn_parameters(params, hf_config, max_pos, extra["factor"]))
    return RopeScaling(**{**scaling.__dict__, **extra})


def partial_rotary_factor(hf_config: Any) -> float:
    """The fraction of each head's dims that RoPE rotates (1.0: all)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def _longrope_scaling(scaling: RopeScaling, params: dict[str, Any], hf_config: Any
                      ) -> RopeScaling:
    """LongRoPE as transformers' ``_compute_longrope_parameters`` reads it: the factor
    defaults to max / original positions, the attention factor to
    ``sqrt(1 + ln(factor) / ln(original))``."""
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    if missing:
        raise ValueError(f"longrope without its per-frequency factors is not supported "
                         f"(the rope parameters lack {missing})")
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", None)
                   or scaling.max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        factor = scaling.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return RopeScaling(**{
        **scaling.__dict__, "factor": float(factor), "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
        "short_factor": tuple(float(f) for f in params["short_factor"]),
        "long_factor": tuple(float(f) for f in params["long_factor"]),
    })


def _longrope_inv_freq(scaling: RopeScaling, dim: int) -> torch.Tensor:
    """``[max_positions, dim // 2]``: the short factors' frequencies for positions inside
    the original context, the long factors' beyond it. Transformers picks one set per
    forward call from its longest sequence; a paged engine cannot re-rotate cached keys,
    so position ``p`` gets the set transformers uses when ``p`` is the newest token (as
    for dynamic NTK above): identical to its model's token-by-token decoding, and to any
    forward that stays inside the original context. (Its Phi-3 ``generate`` also drops
    the cache once the sequence outgrows the original context, re-rotating the earlier
    keys with the long factors; see engine/model_executor/models/phi3.py.)"""
    for name in ("short_factor", "long_factor"):
        if len(getattr(scaling, name)) != dim // 2:
            raise ValueError(f"longrope {name} has {len(getattr(scaling, name))} entries, "
                             f"the rotary dims need {dim // 2}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32)
                   * scaling.theta**exponent)
    long = 1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32)
                  * scaling.theta**exponent)
    is_long = torch.arange(scaling.max_positions) >= scaling.original_max_position_embeddings
    return torch.where(is_long[:, None], long[None, :], short[None, :])


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context stretched by ``scale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_parameters(params: dict[str, Any], hf_config: Any, max_pos: int, factor: float
                     ) -> dict[str, Any]:
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", None) or max_pos)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return {
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }


def _yarn_inv_freq(scaling: RopeScaling, dim: int) -> torch.Tensor:
    """Interpolated frequencies for the slow dims, extrapolated for the fast ones, a
    linear ramp between the dims that make ``beta_slow`` and ``beta_fast`` rotations over
    the original context (the YaRN paper's recipe, as transformers computes it)."""
    base, original = scaling.theta, scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs) * extrapolation


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (theta**exponent)


def compute_inv_freq(scaling: RopeScaling, head_size: int) -> torch.Tensor:
    """Inverse frequencies: ``[head_size // 2]``, or ``[max_positions, head_size // 2]``
    for dynamic NTK (one row per position, see the module docstring)."""
    dim = head_size
    if scaling.rope_type == "default":
        return _base_inv_freq(scaling.theta, dim)
    if scaling.rope_type == "linear":
        return _base_inv_freq(scaling.theta, dim) / scaling.factor
    if scaling.rope_type == "dynamic":
        max_pos, factor = scaling.max_position_embeddings, scaling.factor
        seq_len = torch.arange(1, scaling.max_positions + 1, dtype=torch.float64).clamp(min=max_pos)
        base = scaling.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        return 1.0 / (base.to(torch.float32)[:, None] ** exponent[None, :])
    if scaling.rope_type == "llama3":
        inv_freq = _base_inv_freq(scaling.theta, dim)
        factor = scaling.factor
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(scaling, dim)
    if scaling.rope_type == "longrope":
        return _longrope_inv_freq(scaling, dim)
    raise ValueError(f"rope_type {scaling.rope_type!r} is not supported")


@dataclass(frozen=True)
class RopeInputs:
    """One forward's rotary inputs, prepared once and shared by every layer: the flat
    positions and, for the torch-op path, their gathered ``cos`` / ``sin``
    (``[T, 1, head_size // 2]`` each; None when a fused kernel reads the table itself)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat ``q [T, H*D]`` / ``k [T, Hkv*D]`` at ``positions [T]``."""

    def __init__(
        self,
        head_size: int,
        scaling: RopeScaling,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused_ops: FusedOps | None = None,
    ) -> None:
        super().__init__()
        # The platform's fused kernel rotates in place from the table, else torch ops.
        self.fused_ops = fused_ops if fused_ops is not None and fused_ops.supports(dtype) else None
        if head_size % 2:
            raise ValueError(f"rotary embeddings need an even head size, not {head_size}")
        self.head_size = head_size
        self.scaling = scaling
        self.max_positions = scaling.max_positions
        inv_freq = compute_inv_freq(scaling, head_size)
        t = torch.arange(self.max_positions, dtype=torch.int64).float()
        # float32 products as transformers computes them, then cos/sin, then the cast.
        freqs = t[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
        cos, sin = freqs.cos(), freqs.sin()
        if scaling.attention_factor != 1.0:  # YaRN and LongRoPE scale cos and sin
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        cache = torch.cat([cos, sin], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``q`` and ``k`` (the inputs are left as they are)."""
        rope = self.prepare(positions)
        return self.apply(q.clone(), rope), self.apply(k.clone(), rope)

    def prepare(self, positions: torch.Tensor) -> RopeInputs:
        """What :meth:`apply` needs for ``positions``; models build it once per forward."""
        if self.fused_ops is None:
            cos, sin = self.cos_sin(positions)
            return RopeInputs(positions, cos, sin)
        # The fused kernel refuses positions beyond the table itself (also in a graph).
        return RopeInputs(positions.to(torch.int64).contiguous())

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, head_size // 2]``, for the flat ``positions``.

        Models gather this once per forward and hand it to every layer.
        """
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]

    def apply(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """RoPE on flat ``x [T, n * head_size]``: any number of heads, so the q and k
        heads of a fused projection can be rotated in one pass. The fused kernel
        rotates ``x`` in place (and returns it); the torch ops return a new tensor."""
        if rope.cos is None:
            self.fused_ops.rotary_neox_(x, rope.positions, self.cos_sin_cache, self.head_size)
            return x
        cos, sin = rope.cos, rope.sin
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        # Same operations in the same dtype as HF's ``q * cos + rotate_half(q) * sin``.
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(shape)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, {self.scaling}"


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first ``rotary_dim`` dims of each ``head_size`` head (the rest pass
    through), optionally in the GPT-J ``interleaved`` convention (pairs ``(2i, 2i + 1)``
    rotate by frequency ``i``; GLM-4, Ernie 4.5).

    Interleaved pairs are gathered into NeoX halves before the rotation and left that
    way: q and k get the same permutation of their rotary dims, so every ``q . k`` (all
    attention reads of them) is unchanged, and the arithmetic per element is HF's.
    ``compute_dtype``: the table's and rotation's dtype when the model computes RoPE
    wider than its activations (Ernie 4.5 rotates in float32)."""

    def __init__(self, head_size: int, rotary_dim: int, scaling: RopeScaling, *,
                 dtype: torch.dtype, device: torch.device | str, interleaved: bool = False,
                 compute_dtype: torch.dtype | None = None) -> None:
        if not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary dims {rotary_dim} do not fit a head of {head_size}")
        super().__init__(rotary_dim, scaling, dtype=compute_dtype or dtype, device=device)
        self.full_head_size = head_size
        self.interleaved = interleaved
        self.compute_dtype = compute_dtype

    def apply(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        tokens, dim = x.shape[0], self.head_size
        heads = x.view(tokens, -1, self.full_head_size)
        rot = heads[..., :dim]
        if self.interleaved:
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        if self.compute_dtype is not None:
            rot = rot.to(self.compute_dtype)
        rot = super().apply(rot.reshape(tokens, -1), rope).view(tokens, -1, dim).to(x.dtype)
        if dim == self.full_head_size:
            return rot.reshape(x.shape)
        return torch.cat((rot, heads[..., dim:]), dim=-1).view(x.shape)

    def extra_repr(self) -> str:
        return (f"head_size={self.full_head_size}, rotary_dim={self.head_size}, "
                f"interleaved={self.interleaved}, {self.scaling}")


def rotary_for_config(hf_config: Any, head_size: int, *, dtype: torch.dtype,
                      device: torch.device | str, fused_ops: FusedOps | None = None,
                      interleaved: bool = False, compute_dtype: torch.dtype | None = None
                      ) -> RotaryEmbedding:
    """The rotary embedding a config asks for: :class:`RotaryEmbedding` when it rotates
    whole heads NeoX-style, else :class:`PartialRotaryEmbedding` (``partial_rotary_factor``
    < 1, ``interleaved`` pairs, or a wider ``compute_dtype``)."""
    scaling = rope_scaling_from_config(hf_config, allow_partial=True)
    rotary_dim = int(head_size * partial_rotary_factor(hf_config))
    if rotary_dim == head_size and not interleaved and compute_dtype in (None, dtype):
        return RotaryEmbedding(head_size, scaling, dtype=dtype, device=device,
                               fused_ops=fused_ops)
    return PartialRotaryEmbedding(head_size, rotary_dim, scaling, dtype=dtype, device=device,
                                  interleaved=interleaved, compute_dtype=compute_dtype)


def mrope_section_from_config(hf_config: Any) -> tuple[int, ...] | None:
    """Qwen2-VL's multimodal RoPE sections (rotary frequencies taken from the temporal,
    height and width position rows), or None for ordinary RoPE. Read from v5
    ``rope_parameters`` or the older ``rope_scaling`` (``{"type": "mrope", ...}``)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None) or {}
        if params.get("mrope_section"):
            return tuple(int(s) for s in params["mrope_section"])
    return None


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): positions ``[3, T]`` (temporal, height, width).

    The ``head_size // 2`` rotary frequencies are cut into ``mrope_section`` runs; run
    ``i`` takes its angle from position row ``i % 3`` (transformers'
    ``recomposition_frequencies``), then both halves rotate as in plain RoPE. Positions
    ``[T]`` (text-only prompts, decode steps at ``p + delta``: the three rows are equal
    there) are ordinary RoPE, so they may take the platform's fused kernel and run in
    forward graphs. The table is the parent's: same float32 angles as transformers."""

    def __init__(self, head_size: int, scaling: RopeScaling, mrope_section: tuple[int, ...], *,
                 dtype: torch.dtype, device: torch.device | str,
                 fused_ops: FusedOps | None = None) -> None:
        super().__init__(head_size, scaling, dtype=dtype, device=device, fused_ops=fused_ops)
        if sum(mrope_section) != head_size // 2 or any(s <= 0 for s in mrope_section):
            raise ValueError(f"mrope_section {list(mrope_section)} must be positive and sum "
                             f"to head_size // 2 = {head_size // 2}")
        self.mrope_section = tuple(mrope_section)
        # Which position row (0 temporal, 1 height, 2 width) each frequency reads.
        rows = torch.cat([torch.full((s,), i % 3, dtype=torch.int64)
                          for i, s in enumerate(self.mrope_section)])
        self.register_buffer("section_rows", rows.to(device), persistent=False)

    def prepare(self, positions: torch.Tensor) -> RopeInputs:
        if positions.dim() == 1:
            return super().prepare(positions)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [T] or [3, T], not {tuple(positions.shape)}")
        cos, sin = self.cos_sin(positions)
        return RopeInputs(positions, cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        tokens, half = positions.shape[1], self.head_size // 2
        table = self.cos_sin_cache.index_select(0, positions.reshape(-1)).view(3, tokens, -1)
        index = self.section_rows.view(1, 1, half).expand(1, tokens, half)
        cos = table[..., :half].gather(0, index)[0]
        sin = table[..., half:].gather(0, index)[0]
        return cos[:, None, :], sin[:, None, :]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}"
