#!/usr/bin/env python3
"""The reference throughput workload through this engine and through transformers, side by side.

Both run in this one process, on the same prompts (``engine.benchmarks.workload``: 64
prompts of 128 random ids, 128 greedy output tokens, EOS ignored), in bfloat16, with the
same number of threads:

* engine: ``LLM(model, dtype="bfloat16")`` with every other setting at its default, all
  prompts submitted at once;
* transformers: ``generate`` on one batch (the prompts are equal in length, so the batch
  needs no padding), greedy, ``min_new_tokens = max_new_tokens`` (EOS ignored).

Each side gets ``--warmup`` unmeasured runs, then the measured runs alternate engine /
transformers ``--repeats`` times, so a burst of load from elsewhere hits both; the
figures are medians and the ratio is taken between the medians. The shared machine's
load average is printed with them: figures measured under load are not comparable.

    python tools/make_bench_models.py                       # once: /tmp/engine-bench-models
    python ci/bench_vs_transformers.py /tmp/engine-bench-models/llama-tiny --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


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
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.benchmarks.report import environment, format_table
    from engine.benchmarks.workload import Workload, vocab_high_for
    from engine.plugins.cpu.platform import usable_core_count

    threads = args.threads or usable_core_count()
    torch.set_num_threads(threads)
    llm = LLM(model=args.model, dtype="bfloat16", num_threads=threads)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    workload = Workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_high=vocab_high_for(hf.config.vocab_size),
    )
    input_ids = torch.tensor(workload.prompt_token_ids())

    runners = {
        "engine": lambda: _engine_run(llm, workload),
        "transformers": lambda: _transformers_run(hf, input_ids, args.output_len),
    }
    runs: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(args.warmup + args.repeats):
        for name, run in runners.items():
            wall, tokens = run()
            if tokens != workload.expected_output_tokens:
                raise RuntimeError(f"{name} produced {tokens} tokens, "
                                   f"expected {workload.expected_output_tokens}")
            if i >= args.warmup:
                runs[name].append(tokens / wall)
            print(f"{'warmup' if i < args.warmup else 'run'} {name}: {tokens / wall:.1f} tok/s",
                  file=sys.stderr, flush=True)

    median = {name: statistics.median(values) for name, values in runs.items()}
    ratio = median["engine"] / median["transformers"]
    env = environment()
    rows = [
        (name, f"{median[name]:.1f} output tok/s (runs: {', '.join(f'{v:.1f}' for v in values)})")
        for name, values in runs.items()
    ]
    shape = f"{workload.num_prompts} x ({workload.input_len} in, {workload.output_len} out)"
    rows += [("engine / transformers", f"{ratio:.2f}x"),
             ("workload", f"{shape}, bf16, {threads} threads"),
             ("load avg (1 min)", str(env["load_avg_1m"]))]
    print(format_table(rows, f"engine vs transformers: {Path(args.model).name}"))
    if args.json_path:
        payload = {"model": args.model, "threads": threads, "runs_tok_s": runs,
                   "median_tok_s": median, "ratio": ratio, "environment": env}
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
