"""Building the CPU plugin's C kernels: one library per ISA level, compiled on first use.

The sources (``csrc/``) include no torch headers and are written once over vector types
(``simd.h``), so each ISA level is the same source compiled with that level's flags:

============  ============================  ===========================================
level         compiler flags                CPUs (the /proc/cpuinfo flags it needs)
============  ============================  ===========================================
sse2          -march=x86-64                 every x86-64 CPU
avx2          -march=x86-64-v3              Haswell, Zen 1 and later (avx2, fma, f16c, ...)
avx512        -march=x86-64-v4              Skylake-SP, Zen 4 and later (avx512f/bw/cd/dq/vl)
avx512_bf16   + -mavx512bf16 -mavx512vnni   Cooper Lake, Sapphire Rapids, Zen 4 (avx512_bf16,
                                            avx512_vnni: every CPU with the one has both)
amx           + -mamx-tile -mamx-bf16       Sapphire Rapids and later (amx_tile, amx_bf16)
neon          -march=armv8-a                every aarch64 CPU
generic       (none)                        any other architecture: plain C
============  ============================  ===========================================

:func:`select_level` picks the highest level this CPU runs (``$ENGINE_CPU_ISA`` may ask
for a lower one: an AVX-512 machine can run, and tests do run, the avx2 and sse2
builds too). A level never uses an instruction its flags do not allow, so a library
built on one machine runs on every CPU of its level.

Libraries are cached under ``$ENGINE_CACHE_DIR`` (default ``~/.cache/engine``), named by
the level and a hash of the sources, compiler and flags, so later processes only load
them. The parallel loops run on torch's OpenMP runtime: a library links
``libgomp.so.1``, which the loader resolves to the copy torch already loaded, so
torch's thread count applies and no second thread pool competes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from engine.core.cache_paths import cache_dirs as engine_cache_dirs

SOURCES = (
    "paged_decode_attention.c", "elementwise.c", "gemm.c", "forward_graph.c", "runtime.c",
    "lora.c", "shm_comm.c", "mla_decode.c",
)
HEADERS = ("cpu_math.h", "kernels.h", "simd.h", "gemm_bf16.h", "gemm_amx.h", "gemm_quant.h",
           "quant_act.h")
SELFTEST_SOURCE = "selftest_main.c"  # the driver of the cross-built (qemu) self-test
COMMON_FLAGS = (
    "-O3", "-fopenmp", "-std=gnu11", "-ffp-contract=fast", "-Wall", "-Wno-unused",
    # No FP traps or errno to preserve: lets the compiler if-convert (and so vectorize)
    # selects such as the sigmoid's on levels without masked vector ops.
    "-fno-trapping-math", "-fno-math-errno",
)
LIBRARY_FLAGS = ("-fPIC", "-shared")
LIBS = ("-lm",)
ISA_ENV = "ENGINE_CPU_ISA"

_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: the CPUs it runs on and the flags it is compiled with."""

    name: str
    arch: str  # platform.machine() it runs on; "" for any
    flags: tuple[str, ...]
    requires: frozenset[str]  # /proc/cpuinfo flags the CPU must have
    rank: int  # higher: faster, when the CPU runs it
    bf16_dot: bool = False  # multiplies bf16 natively (--dtype auto keeps bf16 activations)

    def runs_on(self, machine: str, cpu_flags: frozenset[str]) -> bool:
        if not self.arch:  # plain C: the architectures without levels of their own
            return machine not in _LEVEL_ARCHES
        return self.arch == machine and self.requires <= cpu_flags

    def missing(self, cpu_flags: frozenset[str]) -> list[str]:
        return sorted(self.requires - cpu_flags)


LEVELS: dict[str, IsaLevel] = {
    level.name: level
    for level in (
        IsaLevel("generic", "", (), frozenset(), 0),
        # Baseline x86-64 has no F16C: fp16 conversions use the integer code of cpu_math.h.
        IsaLevel("sse2", "x86_64", ("-march=x86-64", "-mtune=generic", "-DHAVE_FLOAT16=0"),
                 frozenset(), 1),
        IsaLevel("avx2", "x86_64", ("-march=x86-64-v3", "-mtune=generic"), _X86_V3, 2),
        IsaLevel("avx512", "x86_64", ("-march=x86-64-v4", "-mtune=generic"), _X86_V4, 3),
        IsaLevel("avx512_bf16", "x86_64",
                 ("-march=x86-64-v4", "-mtune=generic", "-mavx512bf16", "-mavx512vnni"),
                 _X86_V4 | {"avx512_bf16", "avx512_vnni"}, 4, bf16_dot=True),
        IsaLevel("amx", "x86_64",
                 ("-march=x86-64-v4", "-mtune=generic", "-mavx512bf16", "-mavx512vnni",
                  "-mamx-tile", "-mamx-bf16", "-DENGINE_AMX=1"),
                 _X86_V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}, 5,
                 bf16_dot=True),
        IsaLevel("neon", "aarch64", ("-march=armv8-a",), frozenset(), 1),
    )
}


_LEVEL_ARCHES = frozenset(level.arch for level in LEVELS.values() if level.arch)


def source_dir() -> Path:
    return Path(__file__).with_name("csrc")


def machine() -> str:
    """This machine's architecture as the levels name it (``x86_64``, ``aarch64``)."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


@cache
def _cpu_flags_line() -> str:
    """The flags line of /proc/cpuinfo, read once (it is long on many-core machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


@cache
def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the processor type elsewhere):
    what every reported figure names."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or machine()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    line = _cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def runnable_levels(flags: frozenset[str] | None = None, arch: str | None = None) -> list[IsaLevel]:
    """Every level this CPU executes, lowest first (never empty: the plain C build runs
    where an architecture has no levels of its own)."""
    flags = cpu_flags() if flags is None else flags
    arch = machine() if arch is None else arch
    return sorted((lv for lv in LEVELS.values() if lv.runs_on(arch, flags)), key=lambda lv: lv.rank)


def select_level(flags: frozenset[str] | None = None, arch: str | None = None) -> IsaLevel:
    """The level the plugin loads: ``$ENGINE_CPU_ISA`` when set (it must run here), else
    the highest this CPU runs."""
    flags = cpu_flags() if flags is None else flags
    arch = machine() if arch is None else arch
    runnable = runnable_levels(flags, arch)
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted or wanted == "auto":
        return runnable[-1]
    level = LEVELS.get(wanted)
    if level is None:
        raise ValueError(f"{ISA_ENV}={wanted!r}: expected auto or one of {', '.join(LEVELS)}")
    if level not in runnable:
        why = (f"it is built for {level.arch}, this machine is {arch}" if level.arch
               and level.arch != arch else f"this CPU lacks {', '.join(level.missing(flags))}")
        raise ValueError(f"{ISA_ENV}={wanted!r} cannot run here: {why}; this CPU runs "
                         + ", ".join(lv.name for lv in runnable))
    return level


def cache_dirs() -> list[Path]:
    """Where built libraries are kept, in order of preference: ``$ENGINE_CACHE_DIR`` (or
    ``~/.cache/engine``), then a per-user temporary directory for read-only homes."""
    return engine_cache_dirs("cpu_kernels")


def level_flags(level: IsaLevel) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *level.flags, f'-DENGINE_ISA_LEVEL="{level.name}"')


def library_name(compiler: str, level: IsaLevel) -> str:
    """The library's file name: the level and a hash of the sources, compiler and flags."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((source_dir() / name).read_bytes())
    digest.update(" ".join((compiler, *level_flags(level), *LIBRARY_FLAGS, *LIBS)).encode())
    return f"engine_cpu_{level.name}_{digest.hexdigest()[:16]}.so"


def built_library(compiler: str, level: IsaLevel) -> Path:
    """The cached library of ``level``, built first if no cache directory holds it yet
    (into the first directory that can be written)."""
    name = library_name(compiler, level)
    dirs = cache_dirs()
    for directory in dirs:
        if (directory / name).exists():
            return directory / name
    for directory in dirs[:-1]:
        try:
            compile_library(compiler, level, directory / name)
            return directory / name
        except PermissionError:
            continue  # a read-only home: the next directory
    compile_library(compiler, level, dirs[-1] / name)
    return dirs[-1] / name


def _compile_objects(compiler: str, flags: tuple[str, ...], sources: tuple[str, ...],
                     work: str) -> list[str]:
    """Compile every source at once (one compiler process each: the build waits for the
    slowest file, not the sum); the object paths, or RuntimeError with the errors."""
    objects, jobs = [], []
    for source in sources:
        obj = os.path.join(work, Path(source).with_suffix(".o").name)
        cmd = [compiler, *flags, "-c", str(source_dir() / source), "-o", obj]
        jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)))
        objects.append(obj)
    failures = []
    for cmd, job in jobs:  # wait for every job before anything is cleaned up
        _, err = job.communicate(timeout=300)
        if job.returncode != 0:
            failures.append(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    if failures:
        raise RuntimeError("\n".join(failures))
    return objects


def _link(compiler: str, flags: tuple[str, ...], objects: list[str], target: Path) -> None:
    """Link into a temporary name beside ``target``, then rename into place, so
    concurrent builders never see half a file."""
    partial = str(target) + f".{os.getpid()}.tmp"
    cmd = [compiler, *flags, *objects, "-o", partial, *LIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    os.replace(partial, target)


def compile_library(compiler: str, level: IsaLevel, target: Path) -> None:
    """Build the shared library of ``level`` at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = (*level_flags(level), *LIBRARY_FLAGS)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        _link(compiler, flags, _compile_objects(compiler, flags, SOURCES, work), target)


def compile_selftest(compiler: str, level: IsaLevel, target: Path) -> None:
    """Build the kernels of ``level`` and the self-test driver (csrc/selftest_main.c)
    into one static executable: for another architecture, run it under qemu-user."""
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = (*level_flags(level), "-static")
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = _compile_objects(compiler, flags, (*SOURCES, SELFTEST_SOURCE), work)
        _link(compiler, flags, objects, target)


def link_selftest(compiler: str, library: Path, target: Path) -> None:
    """The self-test driver linked against an already built library of this machine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = ("-O2", "-fopenmp", "-std=gnu11")
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = _compile_objects(compiler, flags, (SELFTEST_SOURCE,), work)
        _link(compiler, (*flags, f"-Wl,-rpath,{library.parent}"), [*objects, str(library)],
              target)
