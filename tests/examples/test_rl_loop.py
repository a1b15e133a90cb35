"""examples/rl_loop.py runs end to end (the demo model, a trainer process, one iteration)
and prints its per-iteration times, bytes and bandwidths."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
LINE = re.compile(r"iter 0: reward [\d.]+ \| generate [\d.]+ s \| sleep [\d.]+ s \| train "
                  r"[\d.]+ s \| update [\d.]+ s \(([\d.]+) MiB, [\d.]+ GB/s; gloo broadcast "
                  r"[\d.]+ GB/s\) \| wake_up [\d.]+ s")


def test_rl_loop_smoke():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--iterations", "1", "--prompts", "2",
         "--max-tokens", "4", "--kv-cache-gib", "0.05"],
        capture_output=True, text=True, timeout=120, cwd=SCRIPT.parents[1], check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    match = LINE.search(result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) > 20  # the demo: 26 MiB of bf16 weights
