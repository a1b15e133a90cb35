"""Async scheduling against the serial loop: ``engine bench latency`` (one request, decode
ms per token) with and without ``--async-scheduling``, alternated round by round in fresh
processes (a machine's drift then hits both alike), medians and their ratio.

Usage::

    python ci/bench_async.py --model DIR [--rounds 6] [--num-threads N]
        [--input-len 128] [--output-len 256]

``--num-threads`` below the core count leaves the host thread a core of its own, the
configuration where async scheduling can pay on a CPU (README, async scheduling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

MODES = {"serial": [], "async": ["--async-scheduling"]}


def decode_ms(args: argparse.Namespace, extra: list[str]) -> float:
    """One ``engine bench latency`` run's median decode ms per token."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency.json"
        cmd = ["engine", "bench", "latency", "--model", args.model,
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--warmup", "1", "--repeats", str(args.repeats), "--json", str(out), *extra]
        if args.num_threads:
            cmd += ["--num-threads", str(args.num_threads)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())["results"]["decode_ms_per_token"]["median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per process")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
        for mode in order:
            runs[mode].append(decode_ms(args, MODES[mode]))
        print(f"round {round_index + 1}: " + ", ".join(
            f"{mode} {runs[mode][-1]:.3f} ms" for mode in MODES), flush=True)
    medians = {mode: statistics.median(values) for mode, values in runs.items()}
    for mode, values in runs.items():
        print(f"{mode:7s} median {medians[mode]:.3f} ms/token "
              f"({1000 / medians[mode]:.0f} tok/s), runs {sorted(values)}")
    print(f"async / serial tokens per second: {medians['serial'] / medians['async']:.3f}x")


if __name__ == "__main__":
    main()
