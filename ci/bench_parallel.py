"""Tensor / pipeline parallel throughput next to the single-rank run, and where the
collective time goes.

Runs ``engine bench throughput`` for each (tp, pp) in turn (interleaved rounds, medians),
then times the gloo all-reduce of one decode step's activations ([batch, hidden] in the
model dtype) on two local ranks; a tensor-parallel Llama step does ``2 x layers + 1`` of
them (after attention and MLP of every layer, and the vocab-parallel embedding) plus an
all-gather of the logits. Usage::

    python ci/bench_parallel.py --model DIR [--configs 1x1,2x1,1x2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _throughput(model: str, tp: int, pp: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = ["engine", "bench", "throughput", "--model", model, "--dtype", args.dtype,
               "-tp", str(tp), "-pp", str(pp), "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--warmup", "1", "--repeats", "1", "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def _time_all_reduces(comm, shapes: list[list[int]], dtype: str) -> dict[str, float]:
    """Median microseconds of one all-reduce of each shape (after 5 warm-up calls)."""
    import torch

    result = {}
    for shape in shapes:
        x = torch.randn(shape).to(getattr(torch, dtype))
        for _ in range(5):
            comm.all_reduce(x)
        times = []
        for _ in range(50):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[str(shape)] = statistics.median(times) * 1e6
    return result


def all_reduce_us(shapes: list[list[int]], dtype: str) -> dict[str, float]:
    from gloo_ranks import on_two_ranks

    return on_two_ranks(_time_all_reduces, shapes, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="1x1,2x1,1x2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    runs: dict[str, list[float]] = {f"{t}x{p}": [] for t, p in configs}
    weights: dict[str, object] = {}
    for _ in range(args.rounds):
        for tp, pp in configs:
            result = _throughput(args.model, tp, pp, args)
            key = f"{tp}x{pp}"
            runs[key].append(result["results"]["output_tok_s"]["median"])
            runtime = result.get("runtime", {})
            weights[key] = runtime.get("parallel", {}).get("weights_mib_per_rank",
                                                         [runtime.get("weights_mib")])
            print(key, runs[key][-1], "tok/s", file=sys.stderr)
    config = json.loads((Path(args.model) / "config.json").read_text())
    hidden = config["hidden_size"]
    shapes = [[b, hidden] for b in (1, args.num_prompts)] + [[args.input_len, hidden]]
    reduce = all_reduce_us(shapes, args.dtype)
    layers = config["num_hidden_layers"]
    report = {
        "model": args.model,
        "output_tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in runs.items()},
        "weights_mib_per_rank": weights,
        "gloo_all_reduce_us": {k: round(v, 1) for k, v in reduce.items()},
        "all_reduces_per_tp_step": 2 * layers + 1,
        "decode_step_all_reduce_ms_at_batch": round(
            (2 * layers + 1) * reduce[str([args.num_prompts, hidden])] / 1000, 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
