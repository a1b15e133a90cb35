"""glibc heap settings for a process that runs models on the CPU.

glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with fresh
``mmap`` calls and returns them to the OS when freed, and trims the heap top above
128 KiB free. A prefill's activations (llama-tiny, 64 x 128 tokens: a 50 MB gate/up
output, 25 MB after the activation, per layer) are exactly such blocks, so every
forward paid page faults and the kernel's page zeroing for them again: ~6% of its
samples, and 1.6 -> 1.36 s for that prefill once the heap keeps them. This is the
effect vLLM's CPU docs get from tcmalloc, without a preloaded allocator.

A process whose environment already sets ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` keeps its own choice; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap and go back to it
TRIM_THRESHOLD = (1 << 31) - 1  # the heap top is returned to the OS above ~2 GiB free
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_blocks_in_heap() -> bool:
    """Apply the settings above through ``mallopt``; False where it does not apply."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not applied:
        logger.debug("mallopt refused the heap thresholds; keeping the C library's defaults")
    return applied


def trim_heap() -> bool:
    """Return the heap's free pages to the OS (glibc's ``malloc_trim``: the top of every
    arena and, with ``madvise``, free pages inside them); False where it does not apply.
    Sleep mode calls it after dropping the weights and caches."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
