"""Offline benchmarks through the ``LLM`` API: throughput, single-stream latency, prefix cache.

Each one runs ``warmup`` unmeasured rounds and then ``repeats`` measured ones, and
reports the median with every run kept, because the machines these run on are shared
and noisy: a single figure hides that, a median with its runs does not.

* throughput: every prompt submitted at once (one ``generate`` call); output tokens per
  wall second of that call. Each round starts with an empty prefix cache (throughput
  and latency), so rounds after the first compute their whole prompts, as a peer's
  benchmark on fresh prompts does.
* latency: one request; time to first token and milliseconds per output token after it,
  both from the engine's own ``RequestOutput.metrics`` timestamps.
* speculative decoding, when on (throughput and latency): draft and accepted token
  counts of the measured rounds together, from the engine's own counters.
* prefix: time to first token of a prompt that shares its first ``prefix_len`` tokens
  with an earlier one, with prefix caching on and off (two engines, built in turn).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from engine.benchmarks.report import spec_decoding_json
from engine.benchmarks.workload import LOWEST_TOKEN_ID, Workload
from engine.core.scheduler.stats import SpecDecodingStats


@dataclass
class Runs:
    """Measured values of the repeats and their median."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def to_json(self, digits: int = 3) -> dict[str, Any]:
        return {"median": round(self.median, digits), "runs": [round(v, digits) for v in self.values]}


@dataclass
class ThroughputResult:
    output_tok_s: Runs
    elapsed_s: Runs
    output_tokens: int  # generated per run (num_prompts * output_len when EOS is ignored)
    prompt_tokens: int
    spec: SpecDecodingStats | None = None  # the measured rounds'; None: spec decoding off

    def to_json(self) -> dict[str, Any]:
        return {
            "output_tok_s": self.output_tok_s.to_json(1),
            "total_tok_s": round(
                (self.output_tokens + self.prompt_tokens) / self.elapsed_s.median, 1
            ),
            "elapsed_s": self.elapsed_s.to_json(3),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            **_spec_json(self.spec),
        }


@dataclass
class LatencyResult:
    ttft_ms: Runs
    decode_ms_per_token: Runs
    e2e_s: Runs
    spec: SpecDecodingStats | None = None  # the measured rounds'; None: spec decoding off

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms.to_json(2),
            "decode_ms_per_token": self.decode_ms_per_token.to_json(3),
            "e2e_s": self.e2e_s.to_json(3),
            **_spec_json(self.spec),
        }


def _spec_json(spec: SpecDecodingStats | None) -> dict[str, Any]:
    """The ``spec_decoding`` results entry, present only when speculative decoding ran."""
    return {} if spec is None else {"spec_decoding": spec_decoding_json(spec)}


@dataclass
class PrefixResult:
    ttft_cached_ms: Runs
    ttft_uncached_ms: Runs
    num_cached_tokens: int  # prompt tokens served from the cache (caching on)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.ttft_uncached_ms.median / self.ttft_cached_ms.median

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_cached_ms": self.ttft_cached_ms.to_json(2),
            "ttft_uncached_ms": self.ttft_uncached_ms.to_json(2),
            "speedup": round(self.speedup, 2),
            "num_cached_tokens": self.num_cached_tokens,
            **self.extra,
        }


def _check_rounds(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def _cold_round(llm) -> None:
    """Every round computes its prompts: the same prompts again would hit the prefix cache
    the previous round filled (all but each prompt's last partial block), timing a
    fraction of the prefill a peer engine measured on fresh prompts does."""
    gc.collect()
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset between benchmark rounds")


def run_throughput(llm, workload: Workload, warmup: int = 1, repeats: int = 1) -> ThroughputResult:
    """Submit every prompt at once, ``warmup + repeats`` times; time the measured calls."""
    _check_rounds(warmup, repeats)
    prompts, params = workload.prompts(), workload.sampling_params()
    tok_s, elapsed = [], []
    output_tokens = 0
    for i in range(warmup + repeats):
        if i == warmup:
            llm.get_spec_decoding_stats()  # the warmup's drafts are not measured
        _cold_round(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        if i >= warmup:
            elapsed.append(wall)
            tok_s.append(output_tokens / wall)
    return ThroughputResult(
        output_tok_s=Runs(tok_s),
        elapsed_s=Runs(elapsed),
        output_tokens=output_tokens,
        prompt_tokens=workload.num_prompts * workload.input_len,
        spec=llm.get_spec_decoding_stats(),
    )


def run_latency(llm, workload: Workload, warmup: int = 1, repeats: int = 1) -> LatencyResult:
    """One request (the workload's prompt 0): TTFT and decode time per output token."""
    _check_rounds(warmup, repeats)
    prompt = workload.prompts()[0]
    params = workload.sampling_params()
    ttft, per_token, e2e = [], [], []
    for i in range(warmup + repeats):
        if i == warmup:
            llm.get_spec_decoding_stats()  # the warmup's drafts are not measured
        _cold_round(llm)
        start = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None:
            raise RuntimeError("the engine reported no first-token time for the request")
        if i < warmup:
            continue
        ttft.append(metrics.time_to_first_token * 1e3)
        n = metrics.num_generation_tokens
        decode = (metrics.last_token_time - metrics.first_token_time) * 1e3
        per_token.append(decode / (n - 1) if n > 1 else float("nan"))
        e2e.append(wall)
    return LatencyResult(Runs(ttft), Runs(per_token), Runs(e2e), llm.get_spec_decoding_stats())


def prefix_prompts(
    rng: random.Random, input_len: int, prefix_len: int, vocab_high: int
) -> tuple[list[int], list[int]]:
    """Two prompts of ``input_len`` ids that share exactly their first ``prefix_len``."""
    if not 0 < prefix_len < input_len:
        raise ValueError(f"prefix_len must be in (0, input_len={input_len}), got {prefix_len}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(LOWEST_TOKEN_ID, vocab_high) for _ in range(n)]

    shared = draw(prefix_len)
    first = shared + draw(input_len - prefix_len)
    second = shared + draw(input_len - prefix_len)
    while second[prefix_len] == first[prefix_len]:  # the shared part must end at prefix_len
        second[prefix_len] = rng.randrange(LOWEST_TOKEN_ID, vocab_high)
    return first, second


def _ttft_of_second_prompt(llm, pair: tuple[list[int], list[int]],
                           between: list[list[int]] = ()) -> tuple[float, int]:
    """Run the earlier prompt, then the ``between`` prompts (a working set that pushes its
    blocks out of the KV cache), then the later one; the later one's TTFT (ms) and cached
    token count."""
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": pair[0]}], params, use_tqdm=False)
    for prompt in between:  # one at a time: each evicts what the cache cannot keep
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    gc.collect()
    (output,) = llm.generate([{"prompt_token_ids": pair[1]}], params, use_tqdm=False)
    return output.metrics.time_to_first_token * 1e3, output.num_cached_tokens


def run_prefix(
    make_llm,
    input_len: int = 1024,
    prefix_len: int = 960,
    vocab_high: int = 16000,
    warmup: int = 1,
    repeats: int = 1,
    seed: int = 0,
    working_set: int = 0,
) -> PrefixResult:
    """TTFT of a prompt sharing ``prefix_len`` tokens with an earlier one, cache on vs off.

    ``make_llm(enable_prefix_caching)`` builds an engine; the two are built one after
    the other (never both alive) and see the same prompt pairs, fresh for every round
    so no round finds the previous round's blocks. ``working_set``: that many other
    prompts of ``input_len`` run between the two, so a KV cache smaller than them has
    evicted the prefix by the revisit (what a KV offloading tier brings back).
    """
    _check_rounds(warmup, repeats)
    rng = random.Random(seed)
    pairs = [prefix_prompts(rng, input_len, prefix_len, vocab_high) for _ in range(warmup + repeats)]
    between = [[rng.randrange(LOWEST_TOKEN_ID, vocab_high) for _ in range(input_len)]
               for _ in range(working_set)]
    ttft: dict[bool, list[float]] = {True: [], False: []}
    cached_tokens = 0
    for caching in (True, False):
        llm = make_llm(caching)
        try:
            for i, pair in enumerate(pairs):
                ms, cached = _ttft_of_second_prompt(llm, pair, between)
                if i >= warmup:
                    ttft[caching].append(ms)
                    if caching:
                        cached_tokens = cached
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
    return PrefixResult(
        ttft_cached_ms=Runs(ttft[True]),
        ttft_uncached_ms=Runs(ttft[False]),
        num_cached_tokens=cached_tokens,
        extra={"input_len": input_len, "prefix_len": prefix_len, "working_set": working_set},
    )

