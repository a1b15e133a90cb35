"""Why speculative decoding pays or not on a model: its two cost ratios, at batch 1.

Speculation pays when scoring K + 1 tokens costs about one decode step and a draft pass
costs a small fraction of it. This runs one greedy request through the engine with the
given speculative config, times the model runner's phases and prints, as JSON:

- ``scoring_ratio``: the target's forward over a verification step's rows / its forward
  over one decode row (per row count seen);
- ``draft_pass_ratio``: one draft pass (the proposer's time / K) / a target decode
  forward;
- the median milliseconds of the target decode forward, the proposer, the verification
  (logits and rejection sampling), and of a whole step, with the acceptance figures.

The tokens/s speed-up itself is ``engine bench latency`` with and without
``--speculative-config``, side by side::

    python ci/bench_spec_decode.py --speculative-config '{"method": "eagle", "num_speculative_tokens": 3}'
    python ci/bench_spec_decode.py --model /tmp/engine-bench-models/llama-small \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from engine.benchmarks.report import environment

DEFAULT_PROMPT = "The hacker is a person who"


class PhaseTimer:
    """Wall time of the runner methods it wraps, per call (by row count for _forward)."""

    def __init__(self) -> None:
        self.forward: dict[int, list[float]] = defaultdict(list)
        self.calls: dict[str, list[float]] = defaultdict(list)

    def wrap(self, cls: type, name: str) -> None:
        original: Callable = getattr(cls, name)
        timer = self

        def timed(runner, *args, **kwargs):
            start = time.perf_counter()
            out = original(runner, *args, **kwargs)
            elapsed = time.perf_counter() - start
            if name == "_forward":
                timer.forward[len(args[0].step.input_ids)].append(elapsed)
            else:
                timer.calls[name].append(elapsed)
            return out

        setattr(cls, name, timed)


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target directory (default: the demo)")
    parser.add_argument("--speculative-config", required=True, help="vLLM's JSON")
    parser.add_argument("--prompt", default=None, help="text (default: a fixed demo prompt; "
                        "for other models: 128 repeating token ids)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.model_executor.model_runner import ModelRunner

    spec = json.loads(args.speculative_config)
    timer = PhaseTimer()
    for name in ("_forward", "_propose", "_verify", "execute_model"):
        timer.wrap(ModelRunner, name)
    llm = LLM(model=args.model, speculative_config=spec)
    prompt = args.prompt
    if prompt is None:
        prompt = DEFAULT_PROMPT if args.model is None else {
            "prompt_token_ids": list(range(100, 164)) * 2}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm up: graphs, caches
    llm.get_spec_decoding_stats()
    timer.forward.clear()
    timer.calls.clear()
    for _ in range(args.rounds):
        llm.generate([prompt], params, use_tqdm=False)
    stats = llm.get_spec_decoding_stats()
    decode = _median_ms(timer.forward.get(1, []))
    k = llm.llm_engine.config.speculative.num_speculative_tokens
    propose = _median_ms(timer.calls["_propose"])
    report = {
        "model": llm.llm_engine.config.model.model,
        "speculative_config": llm.llm_engine.config.speculative.model_dump(),
        "decode_forward_ms": decode,
        "scoring_ratio": {
            rows: round(_median_ms(times) / decode, 3)
            for rows, times in sorted(timer.forward.items()) if rows > 1 and decode
        },
        "propose_ms": propose,
        "draft_pass_ratio": round(propose / k / decode, 3) if decode and propose else None,
        "verify_ms": _median_ms(timer.calls["_verify"]),
        "step_ms": _median_ms(timer.calls["execute_model"]),
        "acceptance_rate": round(stats.acceptance_rate, 4) if stats else None,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3) if stats else None,
        "environment": environment(),
    }
    core = getattr(llm.llm_engine.client, "core", None)
    if core is not None:  # the CPU model and ISA level every figure needs beside it
        runtime = core.executor.runtime_info()
        report["runtime"] = {key: runtime.get(key) for key in
                             ("platform", "cpu_model", "isa_level", "weight_dtype",
                              "forward_graphs")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
