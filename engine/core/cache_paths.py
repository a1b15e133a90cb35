"""Where the engine keeps what it computes once per machine (built kernels, config
snapshots, tokenizer choices): ``$ENGINE_CACHE_DIR`` (default ``~/.cache/engine``), with
a per-user temporary directory behind it for read-only homes. Entries are written
whole (a temporary file renamed into place), so a reader never sees half of one."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path


def cache_dirs(kind: str) -> list[Path]:
    """The directories for ``kind`` (a sub-folder name), in order of preference."""
    root = os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine"
    fallback = Path(tempfile.gettempdir()) / f"engine-{os.getuid()}"
    return [Path(root) / kind, fallback / kind]


@functools.cache
def package_version(name: str) -> str:
    """An installed distribution's version ("none" when absent), for cache keys: read
    from its metadata, without importing it."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def entry_key(chunks: Iterable[bytes], fmt: int) -> str:
    """An entry's file stem: a digest of ``chunks`` (what the entry was computed from),
    the transformers version (whose classes the entries describe) and the entry format."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    digest.update(f"\0transformers={package_version('transformers')}\0format={fmt}".encode())
    return digest.hexdigest()[:32]


def read_entries(directories: list[Path], name: str) -> Iterator[str]:
    """The text of ``name`` in each directory that holds a readable one, in order."""
    for directory in directories:
        try:
            yield (directory / name).read_text()
        except OSError:
            continue


def write_entry(directories: list[Path], name: str, text: str) -> Path | None:
    """Write ``name`` into the first directory that can be written; its path, or None."""
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, directory / name)
            return directory / name
        except OSError:
            continue  # read-only: the next directory
    return None
