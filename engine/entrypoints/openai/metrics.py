"""Prometheus metrics of one server (its own registry, so several apps can coexist).

Two sources:

* The engine core's load (running / waiting requests, KV cache usage, prefix-cache
  counters) is fetched with ``AsyncLLM.get_stats()`` when ``/metrics`` is scraped and
  exposed through a custom collector: the core's cumulative counters become Prometheus
  counters directly, with no double counting.
* Speculative decoding, when it is on: draft and accepted token counters (one per draft
  position too) as vLLM names them, so its PromQL for acceptance rates carries over;
  absent altogether while it is off.
* Per-request latencies and token counts are observed by the serving layer when a request
  ends (:meth:`ServerMetrics.observe_request`), from the ``RequestMetrics`` timestamps the
  output processor records.
* Structured outputs: ``engine:structured_output_compile_seconds{stage}`` (a histogram)
  and ``engine:structured_output_cache_hits{stage}`` / ``..._cache_misses{stage}``, where
  stage ``check`` is this process's tokenizer-free compile of each distinct constraint
  (JSON Schema to grammar, checked by the backend; cached by the normalized constraint)
  and stage ``compile`` the engine core's tokenizer-bound compile and its grammar cache
  (exported when the core's stats carry them); ``engine:structured_output_requests
  {enforcement}`` (``full`` / ``relaxed``) and ``engine:structured_output_relaxed_keywords
  {keyword}`` count constrained requests and the JSON Schema keywords they relaxed.
* LoRA (with ``--enable-lora``): ``engine:lora_requests_info{max_lora,
  running_lora_adapters, waiting_lora_adapters}``, vLLM's ``vllm:lora_requests_info``: the
  adapter names with running / waiting requests (comma-joined) as labels, the scrape's
  Unix time as the value (the latest sample is the current state).

Names follow vLLM's with an ``engine:`` prefix (``engine:num_requests_running`` ...).
With data parallelism every series from the cores' stats carries an ``engine="<rank>"``
label too (vLLM's), one sample per core (a dead rank: zeros and ``engine_healthy`` 0); the
per-request metrics stay the front end's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.core_protocol import EngineCoreStats
from engine.core.outputs import RequestMetrics

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Set by the --api-server-count launcher (before prometheus_client is imported) to a
# directory the K server processes share: their counters live there (multiprocess mode).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATS_TIMEOUT_S = 5.0

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _CoreStatsCollector(Collector):
    """Exposes the last EngineCoreStats snapshot; ``ServerMetrics.refresh`` updates it.

    With data parallelism ``engines`` holds one (stats, healthy) per rank and every
    series gets an ``engine="<rank>"`` label (vLLM's); with one core the series carry
    ``model_name`` only, as they always have."""

    def __init__(self, model_name: str, max_loras: int = 0) -> None:
        self.model_name = model_name
        self.max_loras = max_loras  # 0: LoRA is off
        self.stats = EngineCoreStats()
        self.healthy = True
        self.engines: list[tuple[EngineCoreStats, bool]] | None = None

    def _samples(self) -> tuple[list[str], list[tuple[list[str], EngineCoreStats, bool]]]:
        """(label names, [(label values, stats, healthy)] one per engine core)."""
        if self.engines is None:
            return ["model_name"], [([self.model_name], self.stats, self.healthy)]
        return ["model_name", "engine"], [([self.model_name, str(rank)], stats, healthy)
                                          for rank, (stats, healthy) in enumerate(self.engines)]

    def collect(self) -> Iterable[Metric]:
        labels, samples = self._samples()
        gauges = (
            ("engine:num_requests_running", "Requests in the running batch.",
             lambda s, ok: s.num_running),
            ("engine:num_requests_waiting", "Requests waiting to be scheduled.",
             lambda s, ok: s.num_waiting),
            ("engine:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).",
             lambda s, ok: s.kv_cache_usage),
            ("engine:num_kv_blocks", "KV cache blocks in the pool.", lambda s, ok: s.num_kv_blocks),
            ("engine:prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens (0-1).",
             lambda s, ok: s.prefix_cache_hit_rate),
            ("engine:engine_healthy", "1 while the engine core is alive, else 0.",
             lambda s, ok: 1.0 if ok else 0.0),
        )
        for name, doc, read in gauges:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for values, stats, healthy in samples:
                family.add_metric(values, float(read(stats, healthy)))
            yield family
        counters = (
            ("engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries_total"),
            ("engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             "prefix_cache_hits_total"),
            ("engine:num_preemptions", "Requests preempted for lack of KV blocks.",
             "num_preemptions_total"),
            ("engine:prompt_tokens_computed", "Prompt tokens the model computed (not "
             "found in the prefix cache nor loaded by a KV connector).",
             "prompt_tokens_computed_total"),
        )
        yield from _counter_families(counters, labels, samples)
        spec = [sample for sample in samples if sample[1].spec_decoding_enabled]
        if spec:
            yield from self._spec_decoding(labels, spec)
        moe = [sample for sample in samples if sample[1].moe_expert_tokens_total]
        if moe:
            yield from self._expert_load(labels, moe)
        kv = [sample for sample in samples if sample[1].kv_transfer_enabled]
        if kv:
            yield from self._kv_transfer(labels, kv)
        if self.max_loras or any(getattr(s, "max_loras", 0) for _, s, _ in samples):
            yield self._lora_info(labels, samples)

    def _lora_info(self, labels: list[str], samples: list) -> Metric:
        """vLLM's lora_requests_info: which adapters have running and waiting requests."""
        family = GaugeMetricFamily(
            "engine:lora_requests_info",
            "Running stats on LoRA requests: the adapters with running and waiting requests "
            "(comma-joined names); the value is the time of the sample.",
            labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        for values, stats, _ in samples:
            running = getattr(stats, "running_lora_adapters", None) or {}
            waiting = getattr(stats, "waiting_lora_adapters", None) or {}
            max_lora = getattr(stats, "max_loras", 0) or self.max_loras
            family.add_metric([*values, str(max_lora), ",".join(running), ",".join(waiting)],
                              time.time())
        return family

    def _kv_transfer(self, labels: list[str], samples: list) -> Iterable[Metric]:
        """The KV connector's traffic (disaggregated prefill/decode, external caches)."""
        counters = (
            ("engine:kv_transfer_bytes_sent", "KV cache bytes sent (saved or pulled).",
             "kv_transfer_bytes_sent_total"),
            ("engine:kv_transfer_bytes_received", "KV cache bytes received (loaded).",
             "kv_transfer_bytes_received_total"),
            ("engine:kv_transfer_blocks_sent", "KV blocks sent.", "kv_transfer_blocks_sent_total"),
            ("engine:kv_transfer_blocks_received", "KV blocks received.",
             "kv_transfer_blocks_received_total"),
            ("engine:kv_transfer_seconds", "Seconds spent moving KV blocks.",
             "kv_transfer_seconds_total"),
            ("engine:kv_transfer_load_failures", "KV loads that failed (recomputed).",
             "kv_transfer_load_failures_total"),
            ("engine:kv_transfer_loaded_tokens", "Prompt tokens whose KV was loaded.",
             "kv_transfer_loaded_tokens_total"),
        )
        yield from _counter_families(counters, labels, samples)
        held = GaugeMetricFamily("engine:kv_transfer_requests_held",
                                 "Finished requests whose KV blocks wait for a consumer.",
                                 labels=labels)
        for values, stats, _ in samples:
            held.add_metric(values, float(stats.kv_transfer_blocks_held))
        yield held

    def _expert_load(self, labels: list[str], samples: list) -> Iterable[Metric]:
        """MoE load balance: routed (token, choice) pairs per expert, and per
        expert-parallel rank (only with --enable-expert-parallel)."""
        per_expert = CounterMetricFamily(
            "engine:moe_expert_tokens", "Tokens routed to each expert (summed over layers).",
            labels=[*labels, "expert"])
        for values, stats, _ in samples:
            for expert, count in enumerate(stats.moe_expert_tokens_total):
                per_expert.add_metric([*values, str(expert)], float(count))
        yield per_expert
        ranked = [(values, stats.moe_rank_tokens_total()) for values, stats, _ in samples]
        ranked = [(values, per_rank) for values, per_rank in ranked if per_rank]
        if ranked:
            family = CounterMetricFamily(
                "engine:moe_rank_tokens",
                "Tokens routed to the experts each expert-parallel rank holds.",
                labels=[*labels, "rank"])
            for values, per_rank in ranked:
                for rank, count in enumerate(per_rank):
                    family.add_metric([*values, str(rank)], float(count))
            yield family

    def _spec_decoding(self, labels: list[str], samples: list) -> Iterable[Metric]:
        """vLLM's spec_decode counters (rates are theirs to derive in PromQL; the gauge is
        the lifetime acceptance rate, for a glance without a query)."""
        counters = (
            ("engine:spec_decode_num_drafts", "Verifications that checked draft tokens.",
             "spec_num_drafts_total"),
            ("engine:spec_decode_num_draft_tokens", "Draft tokens proposed.",
             "spec_num_draft_tokens_total"),
            ("engine:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             "spec_num_accepted_tokens_total"),
        )
        yield from _counter_families(counters, labels, samples)
        per_pos = CounterMetricFamily(
            "engine:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            labels=[*labels, "position"])
        rate = GaugeMetricFamily(
            "engine:spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens since the engine started (0-1).", labels=labels)
        for values, stats, _ in samples:
            for position, accepted in enumerate(stats.spec_num_accepted_tokens_per_pos_total):
                per_pos.add_metric([*values, str(position)], float(accepted))
            spec = stats.spec_decoding_stats()
            rate.add_metric(values, spec.acceptance_rate if spec is not None else 0.0)
        yield per_pos
        yield rate


def _counter_families(counters: Iterable[tuple[str, str, str]], labels: list[str],
                      samples: list) -> Iterable[Metric]:
    """One counter family per (name, doc, EngineCoreStats field), a sample per core."""
    for name, doc, field in counters:
        family = CounterMetricFamily(name, doc, labels=labels)
        for values, stats, _ in samples:
            family.add_metric(values, float(getattr(stats, field)))
        yield family


class _StructuredOutputCollector(Collector):
    """Grammar compile time and cache counters: this process's (stage ``check``) and, when
    the engine core's stats carry a ``structured_output`` snapshot, the core's (stage
    ``compile``); both are :meth:`engine.structured_output.stats.CompileStats.snapshot`."""

    def __init__(self, model_name: str, core: _CoreStatsCollector) -> None:
        self.model_name = model_name
        self.core = core

    def snapshots(self) -> list[tuple[str, dict]]:
        from engine.structured_output.enforcement import CHECK_STATS

        found = [("check", CHECK_STATS.snapshot())]
        core = getattr(self.core.stats, "structured_output", None)
        if isinstance(core, dict) and core:
            found.append(("compile", core))
        return found

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "stage"]
        seconds = HistogramMetricFamily(
            "engine:structured_output_compile_seconds",
            "Time to compile a structured-output constraint (stage check: the server's "
            "tokenizer-free compile of a new constraint; compile: the engine core's).",
            labels=labels)
        hits = CounterMetricFamily(
            "engine:structured_output_cache_hits",
            "Structured-output constraints found compiled in the cache.", labels=labels)
        misses = CounterMetricFamily(
            "engine:structured_output_cache_misses",
            "Structured-output constraints compiled anew (not in the cache).", labels=labels)
        for stage, snap in self.snapshots():
            values = [self.model_name, stage]
            buckets = [(_le(le), float(n)) for le, n in snap.get("buckets", [])]
            buckets.append(("+Inf", float(snap.get("count", 0))))
            seconds.add_metric(values, buckets, float(snap.get("sum", 0.0)))
            hits.add_metric(values, float(snap.get("hits", 0)))
            misses.add_metric(values, float(snap.get("misses", 0)))
        yield seconds
        yield hits
        yield misses


def _le(bound: float) -> str:
    return repr(float(bound))


class ServerMetrics:
    """The registry of one app and the observations the serving layer makes."""

    def __init__(self, model_name: str, max_loras: int = 0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._core = _CoreStatsCollector(model_name, max_loras)
        self.registry.register(self._core)
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "engine:prompt_tokens", "Prompt tokens of finished requests.", labels,
            registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(
            "engine:generation_tokens", "Generated tokens of finished requests.", labels,
            registry=self.registry).labels(model_name)
        self.request_success = Counter(
            "engine:request_success", "Finished samples by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram(
            "engine:time_to_first_token_seconds", "Time from arrival to the first token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(
            "engine:inter_token_latency_seconds",
            "Time between consecutive steps that gave a request tokens (one per step).",
            labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(
            "engine:e2e_request_latency_seconds", "Time from arrival to the end of a request.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)  # export zeros from the start
        self._structured = _StructuredOutputCollector(model_name, self._core)
        self.registry.register(self._structured)
        self.structured_requests = Counter(
            "engine:structured_output_requests",
            "Constrained requests by how their constraint is enforced (full, or relaxed: "
            "JSON Schema keywords no backend enforces were left out).",
            ["model_name", "enforcement"], registry=self.registry)
        self.relaxed_keywords = Counter(
            "engine:structured_output_relaxed_keywords",
            "JSON Schema keywords relaxed in constrained requests (one per request).",
            ["model_name", "keyword"], registry=self.registry)
        for enforcement in ("full", "relaxed"):
            self.structured_requests.labels(model_name, enforcement)

    # -- per request ----------------------------------------------------------------------
    def observe_request(self, metrics: RequestMetrics | None, prompt_tokens: int,
                        finish_reasons: Iterable[str | None]) -> None:
        """Record one ended request (finished or aborted)."""
        self.prompt_tokens.inc(prompt_tokens)
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason or "abort").inc()
        if metrics is None:
            return
        self.generation_tokens.inc(metrics.num_generation_tokens)
        ttft = metrics.time_to_first_token
        if ttft is not None:
            self.ttft.observe(max(ttft, 0.0))
        if metrics.finished_time is not None:
            self.e2e.observe(max(metrics.finished_time - metrics.arrival_time, 0.0))
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)

    def observe_structured_output(self, relaxed: tuple[str, ...] | None) -> None:
        """Record one accepted constrained request (``relaxed``: the keywords its JSON
        schema was compiled without; empty: enforced in full; None: no constraint)."""
        if relaxed is None:
            return
        self.structured_requests.labels(self.model_name,
                                        "relaxed" if relaxed else "full").inc()
        for keyword in relaxed:
            self.relaxed_keywords.labels(self.model_name, keyword).inc()

    # -- scrape ---------------------------------------------------------------------------
    async def refresh(self, engine) -> None:
        """Fetch the core's stats (keeping the last snapshot if the core cannot answer);
        with data parallelism, each rank's (a dead rank: zeros, unhealthy)."""
        parallel = getattr(getattr(engine, "config", None), "parallel", None)
        if parallel is not None and parallel.data_parallel_size > 1 and not engine.errored:
            await self._refresh_ranks(engine)
            return
        if engine.errored:
            self._core.healthy = False
            self._core.stats = EngineCoreStats()
            if self._core.engines is not None:
                self._core.engines = [(EngineCoreStats(), False)] * len(self._core.engines)
            return
        try:
            self._core.stats = await asyncio.wait_for(engine.get_stats(), STATS_TIMEOUT_S)
            self._core.healthy = True
        except Exception as exc:  # noqa: BLE001 - a dead or stuck core must not break /metrics
            self._core.healthy = not engine.errored
            logger.warning("could not fetch engine stats for /metrics: %s", exc)

    async def _refresh_ranks(self, engine) -> None:
        try:
            ranks = await asyncio.wait_for(engine.get_engine_stats(), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck core must not break /metrics
            logger.warning("could not fetch engine stats for /metrics: %s", exc)
            return
        self._core.engines = [(stats, True) if stats is not None else (EngineCoreStats(), False)
                              for stats in ranks]
        self._core.stats = EngineCoreStats.merge([s for s in ranks if s is not None] or
                                                 [EngineCoreStats()])
        self._core.healthy = True

    def render(self) -> bytes:
        multiproc_dir = os.environ.get(MULTIPROC_ENV)
        if not multiproc_dir:
            return generate_latest(self.registry)
        # Several API servers (--api-server-count): the per-request counters and
        # histograms summed over every process's files, the cores' series once.
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, multiproc_dir)
        registry.register(self._core)
        registry.register(self._structured)
        return generate_latest(registry)
