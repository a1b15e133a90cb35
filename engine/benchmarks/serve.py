"""``engine bench serve``: load an OpenAI-compatible server and time what its clients see.

Each sweep point (a request rate x a concurrency cap) sends the same prompts as
streamed, greedy requests: arrivals follow a seeded Poisson schedule, a semaphore caps
the requests in flight, and every request's chunk times and final usage are recorded
(:mod:`engine.benchmarks.serve_metrics` turns them into figures). A failing request is
counted, its error kept, and the run goes on; only an unreachable server, a rejected API
key or an unknown model stop the benchmark, and they do so before any load is sent
(:class:`ServerError`), with short connect timeouts so nothing hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from engine.benchmarks.serve_metrics import RequestRecord, arrival_offsets, point_metrics
from engine.benchmarks.serve_prompts import ENDPOINTS, PromptSpec, build_payloads

CONNECT_TIMEOUT_S = 5.0
PREFLIGHT_TIMEOUT_S = 30.0
MAX_ERROR_CHARS = 500


class ServerError(Exception):
    """The server cannot be benchmarked (unreachable, unauthorized, model not served)."""


def parse_rates(text: str) -> list[float]:
    """``"4,inf"`` -> ``[4.0, inf]``; every rate must be > 0."""
    rates = []
    for part in _parts(text, "request rate"):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"request rate {part!r} is not a number (or inf)") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def parse_concurrencies(text: str | None) -> list[int | None]:
    """``"1,4"`` -> ``[1, 4]``; None (no cap) when not given."""
    if text is None:
        return [None]
    caps = []
    for part in _parts(text, "max concurrency"):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"max concurrency must be an integer >= 1, got {part!r}")
        caps.append(int(part))
    return caps


def _parts(text: str, what: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ValueError(f"empty {what} in {text!r}")
    return parts


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


@dataclass(frozen=True)
class SweepPoint:
    request_rate: float  # requests/s; inf: all at once
    max_concurrency: int | None  # None: no cap

    def label(self) -> str:
        cap = "none" if self.max_concurrency is None else str(self.max_concurrency)
        return f"rate {rate_text(self.request_rate)} req/s, max concurrency {cap}"

    def to_json(self) -> dict[str, Any]:
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {"request_rate": rate, "max_concurrency": self.max_concurrency}


@dataclass(frozen=True)
class ServeSettings:
    base_url: str
    spec: PromptSpec
    rates: tuple[float, ...] = (math.inf,)
    concurrencies: tuple[int | None, ...] = (None,)
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    tokenizer: str | None = None  # local dir: chat prompts are the ids decoded
    timeout_s: float = 3600.0  # per request, from send to the end of its stream

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout_s}")
        if not self.rates or not self.concurrencies:
            raise ValueError("a sweep needs at least one request rate and one concurrency")
        try:
            url = httpx.URL(self.base_url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"base URL {self.base_url!r} is not a URL: {exc}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base URL {self.base_url!r} must look like http://host:port")

    @property
    def api_root(self) -> str:
        """The server root, whether the URL was given with or without ``/v1``."""
        root = self.base_url.rstrip("/")
        return root.removesuffix("/v1")

    def points(self) -> list[SweepPoint]:
        """Every rate with every concurrency cap, rates outermost."""
        return [SweepPoint(r, c) for r, c in itertools.product(self.rates, self.concurrencies)]

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "base_url": self.api_root, "endpoint": spec.endpoint,
            "num_prompts": spec.num_prompts, "input_len": spec.input_len,
            "output_len": spec.output_len, "ignore_eos": spec.ignore_eos, "seed": spec.seed,
            "vocab_high": spec.vocab_high, "temperature": spec.temperature,
            "tokenizer": self.tokenizer,
            "request_rates": [rate_text(r) if math.isinf(r) else r for r in self.rates],
            "max_concurrencies": list(self.concurrencies), "timeout_s": self.timeout_s,
        }


@dataclass
class PointResult:
    point: SweepPoint
    metrics: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {**self.point.to_json(), **self.metrics}


@dataclass
class ServeResult:
    model: str
    points: list[PointResult] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        return all(p.metrics["completed"] == 0 for p in self.points)


def run_serve_benchmark(settings: ServeSettings,
                        on_point: Callable[[str, PointResult], None] | None = None
                        ) -> ServeResult:
    """Check the server, then run every sweep point in turn; ``on_point(model, result)``
    is called as each finishes (to print it while the sweep goes on)."""
    return asyncio.run(_run(settings, on_point))


async def _run(settings: ServeSettings, on_point: Callable | None) -> ServeResult:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    timeout = httpx.Timeout(settings.timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=settings.api_root, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        model = await resolve_model(client, settings.model)
        result = ServeResult(model)
        for index, point in enumerate(settings.points()):
            # Fresh prompts for every point (seed + its index): the server's prefix cache
            # still holds the previous point's, which would turn its prefills into hits.
            spec = replace(settings.spec, seed=settings.spec.seed + index)
            payloads = build_payloads(spec, model, settings.tokenizer)
            records, duration_s = await run_point(
                client, ENDPOINTS[settings.spec.endpoint], payloads, point,
                settings.spec.seed, settings.timeout_s)
            point_result = PointResult(point, point_metrics(records, duration_s))
            result.points.append(point_result)
            if on_point is not None:
                on_point(model, point_result)
    return result


async def resolve_model(client: httpx.AsyncClient, model: str | None) -> str:
    """``model`` checked against ``GET /v1/models`` (or the first one listed)."""
    where = str(client.base_url).rstrip("/")
    try:
        response = await client.get(
            "/v1/models", timeout=httpx.Timeout(PREFLIGHT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach the server at {where}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if response.status_code == 401:
        raise ServerError(f"the server at {where} rejected the API key (HTTP 401): pass "
                          "--api-key or set ENGINE_API_KEY / OPENAI_API_KEY")
    if response.status_code != 200:
        raise ServerError(f"GET {where}/v1/models returned HTTP {response.status_code}: "
                          f"{response.text[:MAX_ERROR_CHARS]}")
    try:
        served = [card["id"] for card in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerError(f"GET {where}/v1/models is not an OpenAI model list: {exc}") from exc
    if not served:
        raise ServerError(f"the server at {where} lists no models")
    if model is None:
        return served[0]
    if model not in served:
        raise ServerError(f"model {model!r} is not served at {where} "
                          f"(it serves: {', '.join(served)})")
    return model


async def run_point(client: httpx.AsyncClient, path: str, payloads: list[dict[str, Any]],
                    point: SweepPoint, seed: int, timeout_s: float
                    ) -> tuple[list[RequestRecord], float]:
    """Every payload sent on the Poisson schedule under the concurrency cap; returns the
    records and the wall time from the first send to the last end."""
    offsets = arrival_offsets(len(payloads), point.request_rate, seed)
    gate = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    start = time.perf_counter()

    async def one(offset: float, payload: dict[str, Any]) -> RequestRecord:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            return await send_request(client, path, payload, timeout_s)
        async with gate:
            return await send_request(client, path, payload, timeout_s)

    records = await asyncio.gather(*(one(o, p) for o, p in zip(offsets.tolist(), payloads)))
    return list(records), time.perf_counter() - start


async def send_request(client: httpx.AsyncClient, path: str, payload: dict[str, Any],
                       timeout_s: float) -> RequestRecord:
    """One streamed request; any failure ends up in ``record.error``, never raised."""
    record = RequestRecord(start_s=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(client, path, payload, record), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    record.end_s = time.perf_counter()
    record.success = record.error is None
    return record


async def _stream(client: httpx.AsyncClient, path: str, payload: dict[str, Any],
                  record: RequestRecord) -> None:
    """Read the SSE stream into ``record``: content chunk times, then the final usage."""
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}"
            return
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments
            now = time.perf_counter()
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:
                record.error = f"unparsable stream event: {data[:MAX_ERROR_CHARS]}"
                return
            if "error" in event:
                record.error = f"error in the stream: {json.dumps(event['error'])}"[
                    :MAX_ERROR_CHARS]
                return
            if event.get("usage"):
                usage = event["usage"]
            if _has_content(event):
                record.chunk_times_s.append(now)
    if usage is None:
        record.error = ("the stream ended without usage (the server must honour "
                        "stream_options.include_usage)")
        return
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)


def _has_content(event: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text (completions ``text``, chat ``delta``)."""
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def point_rows(result: PointResult) -> list[tuple[str, str]]:
    """The table of one sweep point, in the order vLLM's ``bench serve`` prints it."""
    m = result.metrics
    rows = [
        ("successful / failed requests", f"{m['completed']} / {m['failed']}"),
        ("benchmark duration", f"{m['duration_s']:.2f} s"),
        ("total input / generated tokens",
         f"{m['total_input_tokens']} / {m['total_output_tokens']}"),
        ("request throughput", f"{m['request_throughput']:.2f} req/s"),
        ("output token throughput", f"{m['output_throughput']:.1f} tok/s"),
        ("total token throughput", f"{m['total_token_throughput']:.1f} tok/s"),
        ("peak concurrent requests", str(m["peak_concurrent_requests"])),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E latency", "e2e_ms")):
        rows.append((f"{name} mean / median / p90 / p99", _stats_text(m[key])))
    if m["errors"]:
        rows.append(("first error", m["errors"][0]))
    return rows


def _stats_text(stats: dict[str, float | None]) -> str:
    if stats["mean"] is None:
        return "n/a"
    return (f"{stats['mean']:.2f} / {stats['median']:.2f} / {stats['p90']:.2f} / "
            f"{stats['p99']:.2f} ms (std {stats['std']:.2f})")


def serve_report(settings: ServeSettings, result: ServeResult, environment: dict[str, Any]
                 ) -> dict[str, Any]:
    """The ``--json`` document: one entry per sweep point."""
    return {"mode": "serve", "model": result.model, "settings": settings.to_json(),
            "points": [p.to_json() for p in result.points], "environment": environment}
