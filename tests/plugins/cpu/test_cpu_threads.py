"""The CPU platform's default thread count: one per physical core the process may use."""

from __future__ import annotations

import os
import re

import pytest

from engine.plugins.cpu import platform as cpu_platform


def _fake_topology(monkeypatch, affinity: set[int], cores: dict[int, tuple[int, int]] | None):
    """Pretend the process may run on ``affinity``, CPU -> (package, core) per ``cores``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity))

    def read_int(path: str):
        if cores is None:
            return None
        cpu = int(re.search(r"/cpu(\d+)/topology/", path).group(1))
        package, core = cores[cpu]
        return package if path.endswith("physical_package_id") else core

    monkeypatch.setattr(cpu_platform, "_read_int", read_int)


def test_smt_siblings_count_once(monkeypatch):
    # Two cores with two hardware threads each, all four CPUs allowed.
    _fake_topology(monkeypatch, {0, 1, 2, 3}, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert cpu_platform.usable_core_count() == 2


def test_only_cpus_in_the_affinity_mask_count(monkeypatch):
    # Pinned to one thread of each of two cores on two sockets.
    _fake_topology(monkeypatch, {1, 6}, {1: (0, 1), 6: (1, 1)})
    assert cpu_platform.usable_core_count() == 2


def test_without_topology_every_allowed_cpu_counts(monkeypatch):
    _fake_topology(monkeypatch, {0, 1, 2}, None)
    assert cpu_platform.usable_core_count() == 3


def test_this_machine():
    count = cpu_platform.usable_core_count()
    assert 1 <= count <= len(os.sched_getaffinity(0))


def test_default_threads_follow_the_core_count(monkeypatch):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    _fake_topology(monkeypatch, {0, 1, 2, 3}, {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (0, 0)})
    try:
        cpu_platform.CPUPlatform().set_num_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
