#!/usr/bin/env python3
"""The reference workloads through this engine and through transformers, side by side.

Both run in this one process, on the same prompts (``engine.benchmarks.workload``: 64
prompts of 128 random ids, 128 greedy output tokens, EOS ignored), with the same number
of threads:

* engine: ``LLM(model, dtype=--dtype)`` (default ``auto``: the checkpoint's dtype, which on
  a CPU without bf16 dot products keeps bf16 weights and computes in float32) with every
  other setting at its default, all prompts submitted at once;
* transformers: ``generate`` on one batch (the prompts are equal in length, so the batch
  needs no padding), greedy, ``min_new_tokens = max_new_tokens`` (EOS ignored), in
  ``--hf-dtype`` (default: bfloat16 where the CPU has bf16 dot products, else float32,
  transformers' faster dtype there).

``--busy N``: the contention figure. Every measured round runs each side twice, on a quiet
machine and beside N busy single-threaded processes (a noisy neighbour: each spins on a
core until the round ends), and the report gives both medians and the share of quiet
throughput each side keeps under load.

``--latency``: the single-stream workload instead (the workload's prompt 0 alone, 128
in / 128 out): milliseconds per output token after the first, and time to first token.
The engine's come from its request metrics; transformers' from timing ``generate`` for
one token (TTFT) and for all of them: (t_all - t_one) / (output_len - 1) per token.

Each side gets ``--warmup`` unmeasured runs, then the measured runs alternate engine /
transformers ``--repeats`` times, so a burst of load from elsewhere hits both; the
figures are medians and the ratio is taken between the medians. The shared machine's
load average is printed with them: figures measured under load are not comparable.

    python tools/make_bench_models.py                       # once: /tmp/engine-bench-models
    python ci/bench_vs_transformers.py /tmp/engine-bench-models/llama-tiny --repeats 3
    python ci/bench_vs_transformers.py /tmp/engine-bench-models/llama-tiny --latency
    python ci/bench_vs_transformers.py /tmp/engine-bench-models/llama-tiny --busy 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

BUSY_LOOP = "while True: pass"


def _has_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as the engine's
    --dtype auto decides."""
    from engine.plugins.cpu import kernel_build

    return bool({"avx512_bf16", "amx_bf16"} & kernel_build.cpu_flags())


def _transformers_run(model, input_ids, output_len: int) -> tuple[float, int]:
    """One batched greedy ``generate``: (wall seconds, output tokens)."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=model.config.pad_token_id or 0,
        )
    wall = time.perf_counter() - start
    return wall, int(out[:, input_ids.shape[1]:].numel())


def _engine_run(llm, workload) -> tuple[float, int]:
    from engine.benchmarks.offline import run_throughput

    result = run_throughput(llm, workload, warmup=0, repeats=1)
    return result.elapsed_s.median, result.output_tokens


def _transformers_latency(model, input_ids, output_len: int) -> tuple[float, float]:
    """(decode ms per output token, TTFT ms) of one unbatched request."""
    first, tokens = _transformers_run(model, input_ids[:1], 1)
    whole, tokens = _transformers_run(model, input_ids[:1], output_len)
    if tokens != output_len:
        raise RuntimeError(f"transformers produced {tokens} tokens, expected {output_len}")
    return (whole - first) * 1e3 / (output_len - 1), first * 1e3


def _engine_latency(llm, workload) -> tuple[float, float]:
    from engine.benchmarks.offline import run_latency

    result = run_latency(llm, workload, warmup=0, repeats=1)
    return result.decode_ms_per_token.median, result.ttft_ms.median


@contextmanager
def _busy_neighbours(count: int):
    """``count`` single-threaded processes spinning on the CPU while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.2)  # let them reach their loop
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _with_neighbours(run: Callable, count: int) -> Callable:
    def busy_run():
        with _busy_neighbours(count):
            return run()

    return busy_run


def _measure(runners: dict, rounds: int, warmup: int, unit: str, check) -> dict[str, list]:
    """Alternate the runners ``rounds`` times; keep the results after ``warmup`` rounds."""
    runs: dict[str, list] = {name: [] for name in runners}
    for i in range(rounds):
        for name, run in runners.items():
            result = check(name, run())
            if i >= warmup:
                runs[name].append(result)
            print(f"{'warmup' if i < warmup else 'run'} {name}: {result[0]:.2f} {unit}",
                  file=sys.stderr, flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF model directory (e.g. from tools/make_bench_models.py)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None,
                        help="Threads for both (default: the CPUs this process may use).")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--latency", action="store_true",
                        help="Single-stream decode ms/token and TTFT instead of throughput.")
    parser.add_argument("--busy", type=int, default=0,
                        help="Also measure each side beside this many busy processes.")
    parser.add_argument("--dtype", default="auto", help="The engine's --dtype (default auto).")
    parser.add_argument("--hf-dtype", default=None, choices=["bfloat16", "float32"],
                        help="transformers' dtype (default: bfloat16 with bf16 dot products, "
                             "else float32).")
    args = parser.parse_args(argv)
    if args.latency and args.output_len < 2:
        parser.error("--latency needs --output-len >= 2")

    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.benchmarks.report import environment, format_table
    from engine.benchmarks.workload import Workload, vocab_high_for
    from engine.plugins.cpu.threads import usable_core_count

    threads = args.threads or usable_core_count()
    torch.set_num_threads(threads)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=threads)
    runtime = llm.llm_engine.client.core.executor.runtime_info()
    hf_dtype = args.hf_dtype or ("bfloat16" if _has_bf16_dot() else "float32")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, hf_dtype)).eval()
    workload = Workload(
        num_prompts=1 if args.latency else args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_high=vocab_high_for(hf.config.vocab_size),
    )
    input_ids = torch.tensor(workload.prompt_token_ids())

    env_threads = f"{threads} threads"
    if args.latency:
        runs = _measure(
            {"engine": lambda: _engine_latency(llm, workload),
             "transformers": lambda: _transformers_latency(hf, input_ids, args.output_len)},
            args.warmup + args.repeats, args.warmup, "ms/token", lambda name, r: r,
        )
        decode = {name: statistics.median(r[0] for r in values) for name, values in runs.items()}
        ttft = {name: statistics.median(r[1] for r in values) for name, values in runs.items()}
        rows = [(name, f"{decode[name]:.2f} ms/token decode (runs: "
                       f"{', '.join(f'{r[0]:.2f}' for r in values)}), TTFT {ttft[name]:.1f} ms")
                for name, values in runs.items()]
        speedup = decode["transformers"] / decode["engine"]
        rows.append(("engine speedup", f"{speedup:.2f}x (transformers ms/token / engine's)"))
        shape = f"1 request ({workload.input_len} in, {workload.output_len} out)"
        payload = {"decode_ms_per_token": decode, "ttft_ms": ttft,
                   "runs": {n: [list(r) for r in v] for n, v in runs.items()},
                   "speedup": speedup}
        title = f"engine vs transformers, single stream: {Path(args.model).name}"
    else:
        def check(name: str, result: tuple[float, int]) -> tuple[float]:
            wall, tokens = result
            if tokens != workload.expected_output_tokens:
                raise RuntimeError(f"{name} produced {tokens} tokens, "
                                   f"expected {workload.expected_output_tokens}")
            return (tokens / wall,)

        runners = {"engine": lambda: _engine_run(llm, workload),
                   "transformers": lambda: _transformers_run(hf, input_ids, args.output_len)}
        if args.busy:
            for name in list(runners):
                runners[f"{name} busy"] = _with_neighbours(runners[name], args.busy)
        runs = _measure(runners, args.warmup + args.repeats, args.warmup, "tok/s", check)
        median = {name: statistics.median(r[0] for r in values) for name, values in runs.items()}
        ratio = median["engine"] / median["transformers"]
        rows = [(name, f"{median[name]:.1f} output tok/s "
                       f"(runs: {', '.join(f'{r[0]:.1f}' for r in values)})")
                for name, values in runs.items()]
        rows.append(("engine / transformers", f"{ratio:.2f}x"))
        if args.busy:
            kept = {name: median[f"{name} busy"] / median[name] for name in ("engine", "transformers")}
            rows.append((f"kept beside {args.busy} busy", ", ".join(
                f"{name} {share:.0%}" for name, share in kept.items())))
        shape = f"{workload.num_prompts} x ({workload.input_len} in, {workload.output_len} out)"
        payload = {"runs_tok_s": {n: [r[0] for r in v] for n, v in runs.items()},
                   "median_tok_s": median, "ratio": ratio, "busy_neighbours": args.busy}
        title = f"engine vs transformers: {Path(args.model).name}"
    env = environment()
    rows += [("engine runs", f"{runtime.get('isa_level')} kernels, {runtime['weight_dtype']} "
                             f"weights, {runtime['activation_dtype']} activations"),
             ("transformers runs", hf_dtype),
             ("workload", f"{shape}, {env_threads}"),
             ("load avg (1 min)", str(env["load_avg_1m"])),
             ("memory read", f"{env['memory_read_gb_s']} GB/s")]
    print(format_table(rows, title))
    if args.json_path:
        payload = {"model": args.model, "threads": threads, "engine_runtime": runtime,
                   "transformers_dtype": hf_dtype, **payload, "environment": env}
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
