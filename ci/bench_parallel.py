"""Tensor / pipeline parallel throughput next to the single-rank run, and where the
collective time goes.

Runs ``engine bench throughput`` for each (tp, pp) in turn (interleaved rounds, medians),
(with ``--latency`` also ``engine bench latency``'s batch-1 decode ms per token),
then times the all-reduce of one decode step's activations ([batch, hidden]) on two
local ranks, through each communicator; a tensor-parallel Llama step does
``2 x layers + 1`` of them (after attention and MLP of every layer, and the
vocab-parallel embedding) plus an all-gather of the logits. Parallel configs run once per
``--communicators`` entry (the CPU platform's ``ENGINE_CPU_COMMUNICATOR``: shm, gloo).
Usage::

    python ci/bench_parallel.py --model DIR [--configs 1x1,2x1,1x2] [--rounds 3]
        [--latency] [--communicators shm,gloo] [--reduce-batches 1,8,64] [--reduce-hidden 4096]
        [--reduce-dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _engine_bench(mode: str, options: list[str], model: str, tp: int, pp: int,
                  args: argparse.Namespace, communicator: str | None) -> dict:
    """``engine bench MODE`` on ``tp x pp`` ranks (one warm-up round, one measured);
    its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = ["engine", "bench", mode, "--model", model, "--dtype", args.dtype,
               "-tp", str(tp), "-pp", str(pp), "--input-len", str(args.input_len), *options,
               "--warmup", "1", "--repeats", "1", "--json", str(out)]
        env = dict(os.environ)
        if communicator:
            env["ENGINE_CPU_COMMUNICATOR"] = communicator
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        return json.loads(out.read_text())


def _throughput(model: str, tp: int, pp: int, args: argparse.Namespace,
                communicator: str | None = None) -> dict:
    options = ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    return _engine_bench("throughput", options, model, tp, pp, args, communicator)


def _decode_ms(model: str, tp: int, pp: int, args: argparse.Namespace,
               communicator: str | None = None) -> float:
    """Batch-1 decode ms per token (``engine bench latency``, one request)."""
    result = _engine_bench("latency", ["--output-len", "128"], model, tp, pp, args,
                           communicator)
    return result["results"]["decode_ms_per_token"]["median"]


def _time_all_reduces(comm, shapes: list[list[int]], dtype: str) -> dict[str, float]:
    """Median microseconds of one all-reduce of each shape (200 calls after 20 warm-up
    calls)."""
    import torch

    result = {}
    for shape in shapes:
        x = torch.randn(shape).to(getattr(torch, dtype))
        for _ in range(20):
            comm.all_reduce(x)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[str(shape)] = statistics.median(times) * 1e6
    return result


def all_reduce_us(shapes: list[list[int]], dtype: str,
                  communicator: str = "gloo") -> dict[str, float]:
    from gloo_ranks import on_two_ranks

    return on_two_ranks(_time_all_reduces, shapes, dtype, communicator=communicator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="1x1,2x1,1x2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--latency", action="store_true",
                        help="also the batch-1 decode ms per token of each config")
    parser.add_argument("--communicators", default="shm,gloo",
                        help="ENGINE_CPU_COMMUNICATOR values the parallel configs run with")
    parser.add_argument("--reduce-batches", default=None,
                        help="all-reduce rows (default: 1, --num-prompts, --input-len)")
    parser.add_argument("--reduce-hidden", type=int, default=None,
                        help="all-reduce width (default: the model's hidden size)")
    parser.add_argument("--reduce-dtypes", default=None, help="default: --dtype")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    comms = [c for c in args.communicators.split(",") if c]
    runs_of = [(tp, pp, comm) for tp, pp in configs
               for comm in ([None] if tp * pp == 1 else comms)]
    runs: dict[str, list[float]] = {
        f"{t}x{p}" + (f"-{c}" if c else ""): [] for t, p, c in runs_of}
    decode: dict[str, list[float]] = {key: [] for key in runs} if args.latency else {}
    weights: dict[str, object] = {}
    for _ in range(args.rounds):
        for tp, pp, comm in runs_of:
            result = _throughput(args.model, tp, pp, args, comm)
            key = f"{tp}x{pp}" + (f"-{comm}" if comm else "")
            runs[key].append(result["results"]["output_tok_s"]["median"])
            if args.latency:
                decode[key].append(_decode_ms(args.model, tp, pp, args, comm))
                print(key, decode[key][-1], "ms/token at batch 1", file=sys.stderr)
            runtime = result.get("runtime", {})
            weights[key] = runtime.get("parallel", {}).get("weights_mib_per_rank",
                                                         [runtime.get("weights_mib")])
            print(key, runs[key][-1], "tok/s", file=sys.stderr)
    config = json.loads((Path(args.model) / "config.json").read_text())
    hidden = args.reduce_hidden or config["hidden_size"]
    batches = ([int(b) for b in args.reduce_batches.split(",")] if args.reduce_batches
               else [1, args.num_prompts, args.input_len])
    shapes = [[b, hidden] for b in batches]
    dtypes = (args.reduce_dtypes or args.dtype).split(",")
    layers = config["num_hidden_layers"]
    reduce = {comm: {dtype: all_reduce_us(shapes, dtype, comm) for dtype in dtypes}
              for comm in comms}
    report = {
        "model": args.model,
        "output_tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in runs.items()},
        "output_tokens_per_s_runs": runs,
        **({"batch1_decode_ms_median": {k: round(statistics.median(v), 2)
                                        for k, v in decode.items()},
            "batch1_decode_ms_runs": decode} if decode else {}),
        "weights_mib_per_rank": weights,
        "all_reduce_us": {comm: {dtype: {k: round(v, 1) for k, v in by_shape.items()}
                                 for dtype, by_shape in by_dtype.items()}
                          for comm, by_dtype in reduce.items()},
        "all_reduces_per_tp_step": 2 * layers + 1,
        "decode_step_all_reduce_ms_at_batch": {
            comm: {dtype: round((2 * layers + 1) * by_shape[str(shapes[1 if len(shapes) > 1
                                                                      else 0])] / 1000, 3)
                   for dtype, by_shape in by_dtype.items()}
            for comm, by_dtype in reduce.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
