"""Rendering benchmark results: a plain-text table for people, JSON for machines.

Every report carries the conditions it was measured under (threads, load average,
memory read bandwidth, torch version), because on a shared machine a figure without
them cannot be compared: batch-1 decode streams every weight once per token, so its
speed follows the memory bandwidth a virtual machine gets at that moment.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the code."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(load[0], 2),
        "memory_read_gb_s": memory_read_gb_s(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def memory_read_gb_s(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """Median of ``repeats`` timed sums over ``nbytes`` of float32 (larger than the caches
    of the CPUs this runs on) with torch's threads: the read bandwidth available now."""
    import torch

    data = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return round(nbytes / sorted(times)[len(times) // 2] / 1e9, 1)


def format_table(rows: list[tuple[str, str]], title: str) -> str:
    """Two aligned columns under a title."""
    width = max((len(name) for name, _ in rows), default=0)
    lines = [title, "-" * max(len(title), width + 20)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def runs_text(json_runs: dict[str, Any], unit: str) -> str:
    """``median unit (runs: a, b, c)`` from a ``Runs.to_json()`` dict."""
    runs = json_runs["runs"]
    if len(runs) == 1:
        return f"{json_runs['median']} {unit}"
    return f"{json_runs['median']} {unit} (median of {', '.join(str(r) for r in runs)})"


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
