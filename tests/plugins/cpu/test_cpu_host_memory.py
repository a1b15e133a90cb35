"""glibc heap settings of CPU worker processes (cpu.host_memory)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine.plugins.cpu import host_memory

_PROBE = """
import sys, torch
from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap
applied = keep_freed_blocks_in_heap()
block = torch.empty(50 << 20, dtype=torch.uint8)  # a prefill-sized activation
address = block.data_ptr()
heap = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
start, end = (int(x, 16) for x in heap.split()[0].split("-"))
print(applied, start <= address < end)
"""


def _probe(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, check=True, timeout=120).stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_large_blocks_come_from_the_heap_once_applied():
    env = {k: v for k, v in os.environ.items() if k not in host_memory._USER_SETTINGS}
    assert _probe(env) == ["True", "True"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_users_own_malloc_settings_are_kept():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    assert _probe(env) == ["False", "False"]  # 50 MB: glibc's mmap, as the user chose
