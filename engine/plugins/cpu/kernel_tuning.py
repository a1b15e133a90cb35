"""What the CPU kernels time on the machine at hand, once, before they compute: how the
decode GEMMs prefetch the weights they stream, and from how many rows the bf16 GEMM
takes AMX tiles.

**Stream prefetch.** A decode step reads every weight once, from memory; the kernels
prefetch ahead of that stream (``stream_prefetch`` in csrc/cpu_math.h) in one of three
modes:

* ``nta``: the non-temporal hint, which keeps the step's other data (activations, KV
  cache, interpreter state) in the caches;
* ``t0``: the ordinary hint, into every cache level;
* ``none``: no software prefetch; the hardware prefetchers alone.

Which streams fastest depends on the core, and the wrong one is expensive: on cores
whose NTA fills bypass the L2 (and so its streamer), a thread's stream is bounded by its
line fill buffers (a Sapphire Rapids VM read a decode step's weights at ~12 of its ~28
GB/s, with the same time on its AVX512-BF16 and AMX levels), while the same hint streams
at memory speed on Zen 3. On a quiet Zen 4 the bf16 kernel streamed at 33 GB/s with
``nta`` and 40 GB/s with ``none``. So :func:`stream_gb_s` times the level's own decode
GEMM (one row, the activation dtype ``--dtype auto`` uses there) over weights several
times the L3, every mode in turn, and ``nta`` stays unless another mode is faster by
``MIN_GAIN``.

**AMX crossover.** Tiles pay from some number of rows of activations: below it the
vdpbf16ps register blocks win (a tile step has a fixed cost and pads short row blocks to
16). :func:`amx_times_us` times both on weights streamed from memory over ``AMX_ROWS`` and
:func:`amx_crossover` takes the fewest rows from which the tiles win at every size
measured; the library's built-in 32 applies until then.

The result is cached beside the library (keyed by the library, which hashes sources and
flags, and by the CPU model), so only the first load on a machine pays its ~0.1-0.3 s
(~1 s more with AMX). ``ENGINE_CPU_STREAM_PREFETCH=nta|t0|none`` and
``ENGINE_CPU_AMX_MIN_ROWS=N`` fix either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.plugins.cpu.native import CPUKernels

logger = logging.getLogger(__name__)

MODES = ("nta", "t0", "none")  # the STREAM_PREFETCH_* codes of csrc/cpu_math.h, in order
DEFAULT_MODE = "nta"
STREAM_ENV = "ENGINE_CPU_STREAM_PREFETCH"
AMX_ENV = "ENGINE_CPU_AMX_MIN_ROWS"
MIN_GAIN = 1.10  # another mode must stream this much faster than nta to be chosen
ROUNDS = 3  # timed passes per mode, interleaved; the best of each counts
STREAM_SHAPE = (4096, 1024)  # one timed weight: 8 MiB in bf16, a large decode linear
MIN_STREAM_BYTES, MAX_STREAM_BYTES = 64 << 20, 512 << 20
AMX_SHAPE = (2048, 1024)  # the tiles' timed weight: 4 MiB in bf16
AMX_ROWS = (4, 8, 16, 32, 64, 128)  # decode batches to prefill chunks
AMX_MIN_ROWS = 32  # csrc/gemm_amx.h's crossover until one is measured
AMX_REPEATS = 3
NEVER = 1 << 30  # an AMX crossover no batch reaches: the tiles never won
_FALLBACK_L3 = 32 << 20
_CACHE_VERSION = 2


@dataclass(frozen=True)
class KernelTuning:
    """What the kernels use, and the timings it was chosen by."""

    stream_prefetch: str
    amx_min_rows: int | None  # None: the library has no AMX tiles
    reason: str  # "timed", "cached", "environment" or why it was not timed
    cpu_model: str = ""
    stream_gb_s: dict[str, float] | None = None  # mode -> GB/s
    amx_us: dict[int, tuple[float, float]] | None = None  # rows -> (tiles, vector) us

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.amx_us is not None:
            data["amx_us"] = {str(rows): list(times) for rows, times in self.amx_us.items()}
        return data


# -- stream prefetch -----------------------------------------------------------------------
def l3_bytes() -> int:
    """The largest cache's size (sysfs), or 32 MiB where it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
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


def cold_copies(weight: "torch.Tensor") -> list["torch.Tensor"]:
    """Copies of a packed weight that together exceed the L3 (:func:`stream_bytes`): a
    pass over them reads each one from memory, as a model's linears are read."""
    count = max(2, stream_bytes() // (weight.numel() * weight.element_size()))
    return [weight.clone() for _ in range(count)]


def pass_seconds(kernels: "CPUKernels", weights: list["torch.Tensor"],
                 x: "torch.Tensor") -> float:
    """Seconds of one GEMM of ``x`` by every weight in turn."""
    start = time.perf_counter()
    for weight in weights:
        kernels.gemm(weight, x)
    return time.perf_counter() - start


def stream_gb_s(kernels: "CPUKernels", modes: tuple[str, ...] = MODES,
                rounds: int = ROUNDS) -> dict[str, float]:
    """GB/s of the level's decode GEMM (one row of activations) over :func:`cold_copies`
    of a weight, in each mode (the best of ``rounds`` interleaved passes)."""
    import torch

    n, k = STREAM_SHAPE
    act = torch.bfloat16 if kernels.has_bf16_dot else torch.float32
    # Packed weights are only streamed here: any finite bf16 values time the same.
    weights = cold_copies(torch.full((n * k,), 0.01, dtype=torch.bfloat16))
    x = torch.full((1, k), 0.5, dtype=act)
    best = dict.fromkeys(modes, float("inf"))
    previous = kernels.stream_prefetch
    try:
        for _ in range(rounds):
            for mode in modes:
                kernels.set_stream_prefetch(mode)
                kernels.gemm(weights[-1], x)  # warm the code path
                best[mode] = min(best[mode], pass_seconds(kernels, weights, x))
    finally:
        kernels.set_stream_prefetch(previous)
    nbytes = len(weights) * n * k * 2
    return {mode: round(nbytes / seconds / 1e9, 2) for mode, seconds in best.items()}


def pick_stream_prefetch(gb_s: dict[str, float]) -> str:
    """``nta`` unless another mode streams ``MIN_GAIN`` times faster (then the fastest)."""
    fastest = max(gb_s, key=gb_s.__getitem__)
    return fastest if gb_s[fastest] >= MIN_GAIN * gb_s.get(DEFAULT_MODE, 0.0) else DEFAULT_MODE


# -- AMX crossover -------------------------------------------------------------------------
def amx_times_us(kernels: "CPUKernels") -> dict[int, tuple[float, float]]:
    """Microseconds per ``AMX_SHAPE`` weight of the bf16 GEMM through the tiles and
    through vdpbf16ps, at each row count of ``AMX_ROWS`` (the best of ``AMX_REPEATS``
    passes over :func:`cold_copies`): weights come from memory at every batch size, and a
    crossover timed on a cached weight would favour the tiles at the small row counts
    where a step is bound by streaming its weights."""
    import torch

    n, k = AMX_SHAPE
    gen = torch.Generator().manual_seed(0)
    weights = cold_copies(kernels.pack(torch.randn(n, k, generator=gen).bfloat16(),
                                       torch.bfloat16))
    times: dict[int, tuple[float, float]] = {}
    previous = kernels.amx_min_rows
    try:
        for m in AMX_ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16()
            best = [float("inf"), float("inf")]
            for _ in range(AMX_REPEATS):
                for path, crossover in enumerate((1, NEVER)):  # tiles, then vdpbf16ps
                    kernels.set_amx_min_rows(crossover)
                    best[path] = min(best[path], pass_seconds(kernels, weights, x))
            times[m] = (round(best[0] / len(weights) * 1e6, 1),
                        round(best[1] / len(weights) * 1e6, 1))
    finally:
        kernels.set_amx_min_rows(previous)
    return times


def amx_crossover(times: dict[int, tuple[float, float]]) -> int:
    """The fewest rows from which the tiles are faster at every row count measured
    (``NEVER`` when they do not win even at the most rows)."""
    crossover = NEVER
    for m in sorted(times, reverse=True):
        tiles_us, vector_us = times[m]
        if tiles_us >= vector_us:
            break
        crossover = m
    return crossover


# -- choosing, caching, applying -----------------------------------------------------------
def _cache_file(kernels: "CPUKernels") -> Path:
    return kernels.path.with_name(kernels.path.stem + ".tuning.json")


def _read_cache(file: Path, cpu_model: str) -> KernelTuning | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(data, dict) or data.get("version") != _CACHE_VERSION
            or data.get("cpu_model") != cpu_model or data.get("stream_prefetch") not in MODES):
        return None
    amx_us = data.get("amx_us")
    return KernelTuning(
        data["stream_prefetch"], data.get("amx_min_rows"), "cached", cpu_model,
        data.get("stream_gb_s"),
        None if amx_us is None else {int(m): tuple(t) for m, t in amx_us.items()},
    )


def _write_cache(file: Path, tuning: KernelTuning) -> None:
    partial = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps({**tuning.to_json(), "version": _CACHE_VERSION}))
        os.replace(partial, file)
    except OSError as exc:  # a read-only cache: time again next process
        logger.debug("cannot cache the kernel tuning in %s: %s", file, exc)


def _timed(kernels: "CPUKernels", cpu_model: str) -> KernelTuning:
    gb_s = stream_gb_s(kernels)
    amx_us = amx_times_us(kernels) if kernels.has_amx else None
    tuning = KernelTuning(pick_stream_prefetch(gb_s),
                          None if amx_us is None else amx_crossover(amx_us), "timed",
                          cpu_model, gb_s, amx_us)
    logger.info("%s kernels tuned on this CPU: stream prefetch %s (GB/s %s)%s", kernels.level,
                tuning.stream_prefetch, gb_s,
                "" if amx_us is None else
                f", AMX tiles from {tuning.amx_min_rows} rows (us tiles/vector {amx_us})")
    return tuning


def _env_overrides() -> dict[str, Any]:
    """What ``ENGINE_CPU_STREAM_PREFETCH`` / ``ENGINE_CPU_AMX_MIN_ROWS`` fix (ValueError
    when malformed)."""
    fixed: dict[str, Any] = {}
    mode = os.environ.get(STREAM_ENV, "").strip().lower()
    if mode and mode != "auto":
        if mode not in MODES:
            raise ValueError(f"{STREAM_ENV}={mode!r}: expected auto or one of {', '.join(MODES)}")
        fixed["stream_prefetch"] = mode
    rows = os.environ.get(AMX_ENV, "").strip().lower()
    if rows and rows != "auto":
        if not rows.isdigit() or int(rows) < 1:
            raise ValueError(f"{AMX_ENV}={rows!r}: expected auto or a row count >= 1")
        fixed["amx_min_rows"] = int(rows)
    return fixed


def tune_kernels(kernels: "CPUKernels") -> KernelTuning:
    """This machine's tuning (the environment's, the cache's, or timed now and cached),
    applied to ``kernels``."""
    from engine.plugins.cpu import kernel_build

    cpu_model = kernel_build.cpu_model_name()
    fixed = _env_overrides()
    if not kernels.has_amx:
        fixed.pop("amx_min_rows", None)
    if "stream_prefetch" in fixed and ("amx_min_rows" in fixed or not kernels.has_amx):
        tuning = KernelTuning(fixed["stream_prefetch"], fixed.get("amx_min_rows"),
                              "environment", cpu_model)
    else:
        file = _cache_file(kernels)
        tuning = _read_cache(file, cpu_model)
        if tuning is None:
            try:
                tuning = _timed(kernels, cpu_model)
                _write_cache(file, tuning)
            except (MemoryError, RuntimeError, ValueError) as exc:  # the kernels still run
                logger.warning("%s kernels not tuned (%s): built-in defaults", kernels.level, exc)
                tuning = KernelTuning(DEFAULT_MODE, kernels.amx_min_rows, f"not timed: {exc}",
                                      cpu_model)
        tuning = dataclasses.replace(tuning, **fixed)
    kernels.set_stream_prefetch(tuning.stream_prefetch)
    if kernels.has_amx and tuning.amx_min_rows is not None:
        kernels.set_amx_min_rows(tuning.amx_min_rows)
    return tuning
