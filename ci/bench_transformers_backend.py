"""Offline throughput of one Llama checkpoint through the engine's native Llama and through
the Transformers modeling backend (``model_impl="transformers"``), side by side.

Both runs use the same prompts (random token ids), greedy sampling with a fixed output
length (EOS ignored), on the same platform; the script prints generated tokens/s for
each implementation and the backend's ratio to the native class, plus JSON with
``--json``. Default model: the demo Llama shipped in the package. Usage::

    python ci/bench_transformers_backend.py [--model DIR] [--device auto] [--num-prompts 32]
        [--prompt-len 128] [--output-len 64] [--dtype auto] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def run(model: str | None, impl: str, args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    with LLM(model, model_impl=impl, device=args.device, dtype=args.dtype,
             max_model_len=args.prompt_len + args.output_len + 8) as llm:
        vocab = llm.llm_engine.processor.vocab_size
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab)
                                         for _ in range(args.prompt_len)]}
                   for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                min_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up (graphs, kernels)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        info = llm.llm_engine.client.core.executor.runtime_info()
    gc.collect()
    return {"model_impl": info.get("model_impl", impl), "platform": info["platform"],
            "seconds": round(seconds, 3), "generated_tokens": generated,
            "tokens_per_s": round(generated / seconds, 1),
            "first_tokens": list(outputs[0].outputs[0].token_ids[:8])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a Llama directory (default: demo)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    native = run(args.model, "engine", args)
    backend = run(args.model, "transformers", args)
    ratio = backend["tokens_per_s"] / native["tokens_per_s"]
    report = {"engine": native, "transformers": backend, "ratio": round(ratio, 3),
              "same_first_tokens": native["first_tokens"] == backend["first_tokens"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for row in (native, backend):
        print(f"{row['model_impl']:<40} {row['tokens_per_s']:>10.1f} tok/s "
              f"({row['generated_tokens']} tokens in {row['seconds']:.2f} s on "
              f"{row['platform']})")
    print(f"transformers backend / native: {ratio:.2f}x; greedy first tokens "
          f"{'equal' if report['same_first_tokens'] else 'differ'}")


if __name__ == "__main__":
    main()
