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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.scheduler.stats import SpecDecodingStats


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


def speculative_text(config: dict[str, Any] | None) -> str:
    """One line for the resolved speculative config (``SpeculativeConfig.model_dump()``,
    as the JSON report carries it): method, draft length, where drafts come from."""
    if config is None:
        return "off"
    text = f"{config['method']}, {config['num_speculative_tokens']} tokens per draft"
    if config["method"] == "ngram":
        return f"{text}, n-gram {config['prompt_lookup_min']}-{config['prompt_lookup_max']}"
    return f"{text}, draft {config['model']}" if config.get("model") else text


def spec_decoding_json(stats: SpecDecodingStats) -> dict[str, Any]:
    """Acceptance figures of measured rounds; per position, the share of drafts whose
    token at that position was accepted (accepted there / drafts)."""
    drafts = stats.num_drafts
    return {
        "num_drafts": drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        "acceptance_rate_per_pos": [
            round(n / drafts, 4) if drafts else 0.0 for n in stats.num_accepted_tokens_per_pos
        ],
    }


def spec_decoding_rows(spec_json: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Table rows for a ``spec_decoding_json`` dict (none when spec decoding was off)."""
    if spec_json is None:
        return []
    drafts = spec_json["num_drafts"]
    if not drafts:
        return [("draft / accepted tokens", "0 / 0 (no drafts in the measured rounds)")]
    per_pos = ", ".join(
        f"{pos}: {100 * rate:.1f}%" for pos, rate in enumerate(spec_json["acceptance_rate_per_pos"])
    )
    return [
        ("draft / accepted tokens",
         f"{spec_json['num_draft_tokens']} / {spec_json['num_accepted_tokens']} "
         f"({drafts} drafts)"),
        ("acceptance rate", f"{100 * spec_json['acceptance_rate']:.1f}%"),
        ("mean acceptance length",
         f"{spec_json['mean_acceptance_length']:.2f} tokens per verification"),
        ("acceptance by position", per_pos or "-"),
    ]


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
