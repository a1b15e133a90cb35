"""How the decode GEMMs prefetch the weights they stream: chosen by timing, per machine.

A decode step reads every weight once, from memory; the kernels prefetch ahead of that
stream (``stream_prefetch`` in csrc/cpu_math.h) in one of three modes:

* ``nta``: the non-temporal hint. On Zen cores it streams at memory speed and keeps the
  step's other data (activations, KV cache, interpreter state) in the caches: llama-tiny's
  batch-1 step was 10-20% faster than with the ordinary hint.
* ``t0``: the ordinary hint, into every cache level.
* ``none``: no software prefetch; the hardware prefetchers alone.

Which is fastest depends on the core, and the wrong one is expensive: on cores whose NTA
fills bypass the L2 (Intel's server cores), a thread's stream is bounded by its line
fill buffers and runs at a fraction of the bandwidth the L2 streamer reaches with plain
loads (a Sapphire Rapids VM read a decode step's weights at ~12 of its ~28 GB/s). So
:func:`choose_stream_prefetch` times the level's own decode GEMM (M = 1, the activation
dtype ``--dtype auto`` uses there) over weights several times the L3, every mode in
turn, and keeps ``nta`` unless another mode is clearly faster (by ``MIN_GAIN``: the
timing is a few milliseconds, and a near tie is decided by the step-level measurement
above, which a GEMM timing cannot see). The choice is cached beside the library (keyed
by the library, which hashes sources and flags, and the CPU model), so only the first
load on a machine pays the ~0.1 s. ``ENGINE_CPU_STREAM_PREFETCH=nta|t0|none`` fixes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.plugins.cpu.native import CPUKernels

logger = logging.getLogger(__name__)

MODES = ("nta", "t0", "none")  # the STREAM_PREFETCH_* codes of csrc/cpu_math.h, in order
DEFAULT = "nta"
ENV = "ENGINE_CPU_STREAM_PREFETCH"
MIN_GAIN = 1.10  # another mode must stream this much faster than nta to be chosen
ROUNDS = 3  # timed passes per mode, interleaved; the best of each counts
WEIGHT_SHAPE = (4096, 1024)  # one timed weight: 8 MiB in bf16, a large decode linear
MIN_STREAM_BYTES, MAX_STREAM_BYTES = 64 << 20, 512 << 20
_FALLBACK_L3 = 32 << 20


@dataclass(frozen=True)
class StreamPrefetchChoice:
    """The mode the kernels use and, when it was timed, each mode's GB/s."""

    mode: str
    reason: str  # "timed", "cached", or the environment variable
    cpu_model: str = ""
    gb_s: dict[str, float] | None = None


def l3_bytes() -> int:
    """The largest cache's size (sysfs), or 32 MiB where it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or _FALLBACK_L3


def stream_bytes() -> int:
    """How many bytes of weights the timing streams: three L3s (so no pass finds its
    weights cached), at least ``MIN_STREAM_BYTES``, at most ``MAX_STREAM_BYTES`` and an
    eighth of the memory available now (a small container must not run out for it)."""
    wanted = min(MAX_STREAM_BYTES, max(MIN_STREAM_BYTES, 3 * l3_bytes()))
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return wanted
    return max(16 << 20, min(wanted, available // 8))


def stream_gb_s(kernels: "CPUKernels", modes: tuple[str, ...] = MODES,
                rounds: int = ROUNDS) -> dict[str, float]:
    """GB/s of the level's decode GEMM (one row of activations) over weights of several
    times the L3 in total, so each call reads its weight from memory, in each mode."""
    import torch

    n, k = WEIGHT_SHAPE
    count = max(2, stream_bytes() // (n * k * 2))
    act = torch.bfloat16 if kernels.has_bf16_dot else torch.float32
    # Packed weights are only streamed here: any finite bf16 values time the same.
    weights = [torch.full((n * k,), 0.01, dtype=torch.bfloat16) for _ in range(count)]
    x = torch.full((1, k), 0.5, dtype=act)
    best = dict.fromkeys(modes, float("inf"))
    previous = kernels.stream_prefetch
    try:
        for _ in range(rounds):
            for mode in modes:
                kernels.set_stream_prefetch(mode)
                kernels.gemm(weights[-1], x)  # warm the code path
                start = time.perf_counter()
                for w in weights:
                    kernels.gemm(w, x)
                best[mode] = min(best[mode], time.perf_counter() - start)
    finally:
        kernels.set_stream_prefetch(previous)
    nbytes = count * n * k * 2
    return {mode: round(nbytes / seconds / 1e9, 2) for mode, seconds in best.items()}


def pick(gb_s: dict[str, float]) -> str:
    """``nta`` unless another mode streams ``MIN_GAIN`` times faster (then the fastest)."""
    fastest = max(gb_s, key=gb_s.__getitem__)
    return fastest if gb_s[fastest] >= MIN_GAIN * gb_s.get(DEFAULT, 0.0) else DEFAULT


def _cache_file(kernels: "CPUKernels") -> Path:
    return kernels.path.with_name(kernels.path.stem + ".stream_prefetch.json")


def _read_cache(file: Path, cpu_model: str) -> StreamPrefetchChoice | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("cpu_model") != cpu_model or (
            data.get("mode") not in MODES):
        return None
    return StreamPrefetchChoice(data["mode"], "cached", cpu_model, data.get("gb_s"))


def _write_cache(file: Path, choice: StreamPrefetchChoice) -> None:
    partial = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps({**asdict(choice), "reason": "timed"}))
        os.replace(partial, file)
    except OSError as exc:  # a read-only cache: time again next process
        logger.debug("cannot cache the stream prefetch choice in %s: %s", file, exc)


def choose_stream_prefetch(kernels: "CPUKernels") -> StreamPrefetchChoice:
    """The mode for this machine (environment, cache, or timed now and cached), set on
    ``kernels``."""
    from engine.plugins.cpu import kernel_build

    cpu_model = kernel_build.cpu_model_name()
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted and wanted != "auto":
        if wanted not in MODES:
            raise ValueError(f"{ENV}={wanted!r}: expected auto or one of {', '.join(MODES)}")
        choice = StreamPrefetchChoice(wanted, ENV, cpu_model)
    else:
        file = _cache_file(kernels)
        choice = _read_cache(file, cpu_model)
        if choice is None:
            gb_s = stream_gb_s(kernels)
            choice = StreamPrefetchChoice(pick(gb_s), "timed", cpu_model, gb_s)
            _write_cache(file, choice)
            logger.info("%s kernels stream weights with prefetch mode %s (GB/s: %s)",
                        kernels.level, choice.mode, gb_s)
    kernels.set_stream_prefetch(choice.mode)
    return choice
