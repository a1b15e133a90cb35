"""Building the CPU plugin's C kernels: compiled on first use, cached per CPU and source.

The sources (``csrc/``) include no torch headers, so the C compiler builds them in well
under a second, for this CPU (``-march=native``). The library is cached under
``$ENGINE_CACHE_DIR`` (default ``~/.cache/engine``), named by a hash of the sources,
the compiler and flags and the CPU's feature flags, so later processes only load it and
a home directory shared between different machines keeps one library per CPU. The
parallel loops run on torch's OpenMP runtime: the library links ``libgomp.so.1``, which
the loader resolves to the copy torch already loaded, so torch's thread count applies
and no second thread pool competes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCES = ("paged_decode_attention.c", "elementwise.c", "gemm_bf16.c", "forward_graph.c")
HEADERS = ("cpu_math.h", "kernels.h")
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast",
)
LIBS = ("-lm",)


def source_dir() -> Path:
    return Path(__file__).with_name("csrc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cache_dirs() -> list[Path]:
    """Where built libraries are kept, in order of preference: ``$ENGINE_CACHE_DIR`` (or
    ``~/.cache/engine``), then a per-user temporary directory for read-only homes."""
    root = os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine"
    fallback = Path(tempfile.gettempdir()) / f"engine-{os.getuid()}"
    return [Path(root) / "cpu_kernels", fallback / "cpu_kernels"]


def library_name(compiler: str) -> str:
    """The library's file name: a hash of the sources, compiler, flags and CPU."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((source_dir() / name).read_bytes())
    digest.update(" ".join((compiler, *CFLAGS, *LIBS)).encode())
    digest.update(_cpu_flags().encode())
    return f"engine_cpu_kernels_{digest.hexdigest()[:16]}.so"


def built_library(compiler: str) -> Path:
    """The cached library, built first if no cache directory holds it yet (into the
    first directory that can be written)."""
    name = library_name(compiler)
    dirs = cache_dirs()
    for directory in dirs:
        if (directory / name).exists():
            return directory / name
    for directory in dirs[:-1]:
        try:
            compile_library(compiler, directory / name)
            return directory / name
        except PermissionError:
            continue  # a read-only home: the next directory
    compile_library(compiler, dirs[-1] / name)
    return dirs[-1] / name


def compile_library(compiler: str, target: Path) -> None:
    """Compile every source at once (one compiler process each: first use waits for the
    slowest file, not the sum), link, then rename into place, so concurrent builders
    never see half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects, jobs = [], []
        for source in SOURCES:
            obj = os.path.join(work, Path(source).with_suffix(".o").name)
            cmd = [compiler, *CFLAGS, "-c", str(source_dir() / source), "-o", obj]
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)))
            objects.append(obj)
        failures = []
        for cmd, job in jobs:  # wait for every job before anything is cleaned up
            _, err = job.communicate(timeout=120)
            if job.returncode != 0:
                failures.append(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
        if failures:
            raise RuntimeError("\n".join(failures))
        library = os.path.join(work, target.name)
        cmd = [compiler, *CFLAGS, *objects, "-o", library, *LIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(library, target)
