"""Random inputs for each op, how to call it, and its float64 reference per request."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import ssm_reference as ref
import torch

from engine.kernels import ssm


@dataclass
class Op:
    name: str
    make: Callable[..., dict]  # (dims, num_tokens, num_slots, dtype, gen) -> tensors
    token_keys: tuple[str, ...]  # per-token inputs, sliced per request / step
    prefill: Callable[..., torch.Tensor]  # (inputs, qsl, idx, has_init, backend, chunk)
    decode: Callable[..., torch.Tensor]  # (inputs, idx, backend)
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (inputs, init state)
    state_key: str


def _state_dtype(dtype):
    """float32 state caches, float64 for the exact (float64) checks."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _r(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------- conv1d
def _conv_make(d, T, S, dtype, gen):
    dim, W = d.get("dim", 6), d.get("width", 4)
    return {
        "x": _r(gen, T, dim).to(dtype),
        "weight": (_r(gen, dim, W) * 0.5).to(dtype),
        "bias": (_r(gen, dim) * 0.3).to(dtype),
        "conv_state": _r(gen, S, dim, W - 1).to(dtype),
    }


CONV = Op(
    "conv1d",
    _conv_make,
    ("x",),
    lambda i, qsl, idx, hi, be, chunk: ssm.causal_conv1d_prefill(
        i["x"], i["weight"], i["conv_state"], qsl, idx, hi, bias=i["bias"],
        activation="silu", backend=be,
    ),
    lambda i, idx, be: ssm.causal_conv1d_decode(
        i["x"], i["weight"], i["conv_state"], idx, bias=i["bias"], activation="silu",
        backend=be,
    ),
    lambda i, s0: ref.conv1d(i["x"], i["weight"], i["bias"], s0, "silu"),
    "conv_state",
)


# ---------------------------------------------------------------------------- mamba2
def _ssd_make(d, T, S, dtype, gen):
    H, G, P, N = d.get("H", 4), d.get("G", 2), d.get("P", 8), d.get("N", 16)
    return {
        "x": _r(gen, T, H, P).to(dtype),
        "dt": (_r(gen, T, H) * 0.7 - 1.0).to(dtype),
        "A": -torch.exp(_r(gen, H) * 0.5).float(),
        "B": _r(gen, T, G, N).to(dtype),
        "C": _r(gen, T, G, N).to(dtype),
        "D": _r(gen, H).float(),
        "dt_bias": (_r(gen, H) * 0.2).float(),
        "ssm_state": _r(gen, S, H, P, N).to(_state_dtype(dtype)),
    }


def _ssd_kw(i):
    return {"D": i["D"], "dt_bias": i["dt_bias"], "dt_softplus": True, "dt_limit": (0.0, 5.0)}


SSD = Op(
    "mamba2",
    _ssd_make,
    ("x", "dt", "B", "C"),
    lambda i, qsl, idx, hi, be, chunk: ssm.mamba2_ssd_prefill(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], qsl, idx, hi,
        chunk_size=chunk, backend=be, **_ssd_kw(i),
    ),
    lambda i, idx, be: ssm.mamba2_ssd_decode(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], idx, backend=be, **_ssd_kw(i)
    ),
    lambda i, s0: ref.mamba2(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], s0, (0.0, 5.0)
    ),
    "ssm_state",
)


# ---------------------------------------------------------------------------- mamba1
def _sel_make(d, T, S, dtype, gen):
    dim, N = d.get("dim", 8), d.get("N", 16)
    return {
        "x": _r(gen, T, dim).to(dtype),
        "dt": (_r(gen, T, dim) * 0.7 - 1.0).to(dtype),
        "A": -torch.exp(_r(gen, dim, N) * 0.5).float(),
        "B": _r(gen, T, N).to(dtype),
        "C": _r(gen, T, N).to(dtype),
        "D": _r(gen, dim).float(),
        "z": _r(gen, T, dim).to(dtype),
        "dt_bias": (_r(gen, dim) * 0.2).float(),
        "ssm_state": _r(gen, S, dim, N).to(_state_dtype(dtype)),
    }


SEL = Op(
    "mamba1",
    _sel_make,
    ("x", "dt", "B", "C", "z"),
    lambda i, qsl, idx, hi, be, chunk: ssm.selective_scan_prefill(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], qsl, idx, hi, D=i["D"],
        z=i["z"], dt_bias=i["dt_bias"], backend=be,
        **({"block_tokens": chunk} if be == "torch" else {}),
    ),
    lambda i, idx, be: ssm.selective_scan_decode(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], idx, D=i["D"], z=i["z"],
        dt_bias=i["dt_bias"], backend=be,
    ),
    lambda i, s0: ref.mamba1(
        i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["z"], i["dt_bias"], s0
    ),
    "ssm_state",
)


# ---------------------------------------------------------------------------- deltanet
def _gdn_make(d, T, S, dtype, gen):
    Hk, Hv, K, V = d.get("Hk", 2), d.get("Hv", 4), d.get("K", 16), d.get("V", 8)
    return {
        "q": _r(gen, T, Hk, K).to(dtype),
        "k": _r(gen, T, Hk, K).to(dtype),
        "v": _r(gen, T, Hv, V).to(dtype),
        "g": (-torch.nn.functional.softplus(_r(gen, T, Hv)) * 0.5).to(dtype),
        "beta": torch.sigmoid(_r(gen, T, Hv)).to(dtype),
        "ssm_state": (_r(gen, S, Hv, K, V) * 0.5).to(_state_dtype(dtype)),
    }


GDN = Op(
    "deltanet",
    _gdn_make,
    ("q", "k", "v", "g", "beta"),
    lambda i, qsl, idx, hi, be, chunk: ssm.gated_delta_prefill(
        i["q"], i["k"], i["v"], i["g"], i["beta"], i["ssm_state"], qsl, idx, hi,
        use_qk_l2norm=True, chunk_size=chunk, backend=be,
    ),
    lambda i, idx, be: ssm.gated_delta_decode(
        i["q"], i["k"], i["v"], i["g"], i["beta"], i["ssm_state"], idx, use_qk_l2norm=True,
        backend=be,
    ),
    lambda i, s0: ref.gated_delta(i["q"], i["k"], i["v"], i["g"], i["beta"], s0, True),
    "ssm_state",
)

OPS = {op.name: op for op in (CONV, SSD, SEL, GDN)}


def tolerance(dtype: torch.dtype) -> float:
    """Relative to the reference's magnitude; holds for any accumulation order."""
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = tolerance(dtype)
    scale = max(1.0, float(want.abs().max()))
    err = float((out.to(torch.float64) - want).abs().max())
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"
    assert not math.isnan(err)
