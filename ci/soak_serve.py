"""Soak `engine serve` with many concurrent, varied, sometimes abandoned requests.

N clients loop for T minutes (or until --max-requests) against a server this script
starts (or --base-url), each request drawn at random: completions or chat, streamed or
not, prompt lengths, max_tokens, sampling parameters (temperature, top-p/k, min-p,
penalties, seeds, logprobs, stop strings), structured outputs (JSON schema, regex,
choice) and, for a share of them, a client that disconnects mid-way. At the end it
checks what a production server must keep:

- no 5xx and no transport error other than the disconnects it made itself;
- every request answered (2xx, or a 4xx with an OpenAI error body) or cleanly cancelled;
- once idle, no request running or waiting and KV usage back to 0 (from /metrics);
- the resident memory of the server and its engine core grew less than --rss-growth-mib
  between the warm-up and the end. The KV cache's pages count when first touched (the
  pool is cycled through, least recently freed first, so the cache keeps recent
  prefixes), so the server gets a small pool (--kv-cache-space 0.25 unless the extra
  serve flags set one) and the bound covers it: growth past it is a leak.

It prints a JSON summary (requests by outcome, p50 / p99 latency, errors by kind, KV
blocks in use at the end, RSS at start and end) and exits 1 when a check fails. Not in
the default test run::

    python ci/soak_serve.py --clients 64 --minutes 10
    python ci/soak_serve.py --clients 8 --minutes 1 -- --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("the hacker wrote a kernel for the engine while the cache warmed and every block "
         "of tokens found its place in the paged memory of a small machine").split()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age"],
}


@dataclass
class Outcome:
    kind: str  # ok, client_error, server_error, cancelled, transport_error
    status: int | None
    latency_s: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def summary(self) -> dict:
        kinds = Counter(o.kind for o in self.outcomes)
        statuses = Counter(str(o.status) for o in self.outcomes if o.status is not None)
        latencies = sorted(o.latency_s for o in self.outcomes if o.kind == "ok")
        errors = Counter(o.detail[:80] for o in self.outcomes
                         if o.kind in ("server_error", "transport_error"))

        def pct(q: float) -> float | None:
            if not latencies:
                return None
            return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3)

        return {"requests": len(self.outcomes), "by_outcome": dict(kinds),
                "by_status": dict(statuses), "latency_p50_s": pct(0.5),
                "latency_p99_s": pct(0.99),
                "latency_mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
                "errors": dict(errors)}


def random_request(rng: random.Random, model: str) -> tuple[str, dict, bool]:
    """(path, body, abandon): a random completion or chat request."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 48),
                  "stream": rng.random() < 0.6}
    if rng.random() < 0.7:
        body["temperature"] = round(rng.uniform(0.0, 1.5), 2)
    if rng.random() < 0.3:
        body["top_p"] = round(rng.uniform(0.1, 1.0), 2)
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        body["frequency_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(WORDS)]
    roll = rng.random()
    chat = rng.random() < 0.5
    if roll < 0.1:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": SCHEMA}}
    elif roll < 0.15:
        body["structured_outputs"] = {"regex": r"[a-z]{2,8}( [a-z]{2,8}){1,3}"}
    elif roll < 0.2:
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        path = "/v1/completions"
    return path, body, rng.random() < 0.15


def _is_error_body(text: str) -> bool:
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str) -> Outcome:
    path, body, abandon = random_request(rng, model)
    start = time.perf_counter()
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    return _classify(response.status_code, text, start)
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"error"' in line[:40]:
                        return Outcome("server_error", 200, time.perf_counter() - start, line)
                    chunks += 1
                    if abandon and chunks >= 3:
                        return Outcome("cancelled", None, time.perf_counter() - start)
            return Outcome("ok", 200, time.perf_counter() - start)
        if abandon:
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            if not task.done():
                task.cancel()
                return Outcome("cancelled", None, time.perf_counter() - start)
            response = task.result()
        else:
            response = await client.post(path, json=body)
        return _classify(response.status_code, response.text, start)
    except asyncio.CancelledError:
        raise
    except httpx.HTTPError as exc:
        return Outcome("transport_error", None, time.perf_counter() - start, repr(exc))


def _classify(status: int, text: str, start: float) -> Outcome:
    elapsed = time.perf_counter() - start
    if status >= 500:
        return Outcome("server_error", status, elapsed, text[:200])
    if status >= 400:
        kind = "client_error" if _is_error_body(text) else "server_error"
        return Outcome(kind, status, elapsed, text[:200])
    return Outcome("ok", status, elapsed)


async def client_loop(base_url: str, model: str, seed: int, deadline: float, budget: list[int],
                      tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            tally.add(await one_request(client, rng, model))


def scrape(base_url: str) -> dict[str, float]:
    """The unlabelled-or-model-labelled gauges of /metrics, by name."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        values[name.split("{")[0]] = float(value)
    return values


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (from /proc)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            pending.extend(int(c) for c in task.read_text().split())
    return round(total, 1)


class _RssSampler:
    """RSS of the server tree every ``every_s`` seconds, on a thread (a growth curve:
    warming caches flatten out, a leak keeps climbing)."""

    def __init__(self, pid: int, samples: list[float], every_s: float = 10.0) -> None:
        import threading

        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(every_s):
                samples.append(rss_mib(pid))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port),
           "--disable-uvicorn-access-log", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"engine serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("engine serve did not become healthy in 300 s")


def wait_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (or after the timeout)."""
    end = time.monotonic() + timeout_s
    while True:
        metrics = scrape(base_url)
        idle = (metrics.get("engine:num_requests_running", 1) == 0
                and metrics.get("engine:num_requests_waiting", 1) == 0)
        if idle or time.monotonic() > end:
            return metrics
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--base-url", default=None, help="an already running server")
    parser.add_argument("--model", default="engine-demo", help="the served model name")
    parser.add_argument("--rss-growth-mib", type=float, default=384.0,
                        help="the KV pool (256 MiB by default) plus allocator slack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="after --: extra `engine serve` flags")
    args = parser.parse_args()

    proc = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        serve_args = list(args.serve_args)
        if "--kv-cache-space" not in serve_args:
            serve_args += ["--kv-cache-space", "0.25"]
        proc = start_server(port, serve_args)
        base_url = f"http://127.0.0.1:{port}"
    try:
        warm = Tally()  # one round first, so caches and graphs exist before RSS is taken
        asyncio.run(client_loop(base_url, args.model, -1, time.monotonic() + 60, [8], warm))
        rss_start = rss_mib(proc.pid) if proc else None
        tally = Tally()
        deadline = time.monotonic() + args.minutes * 60
        budget = [args.max_requests]

        async def run_all() -> None:
            await asyncio.gather(*(
                client_loop(base_url, args.model, args.seed * 1000 + i, deadline, budget, tally)
                for i in range(args.clients)))

        samples: list[float] = []
        sampler = _RssSampler(proc.pid, samples) if proc else None
        started = time.perf_counter()
        asyncio.run(run_all())
        wall = time.perf_counter() - started
        if sampler is not None:
            sampler.stop()
        metrics = wait_idle(base_url)
        rss_end = rss_mib(proc.pid) if proc else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)

    summary = tally.summary()
    kv_blocks = metrics.get("engine:num_kv_blocks", 0)
    usage = metrics.get("engine:kv_cache_usage_perc", -1)
    summary.update({
        "clients": args.clients, "wall_s": round(wall, 1),
        "requests_per_s": round(summary["requests"] / wall, 2) if wall else None,
        "kv_usage_at_end": usage, "kv_blocks_in_use_at_end": round(usage * kv_blocks),
        "running_at_end": metrics.get("engine:num_requests_running"),
        "waiting_at_end": metrics.get("engine:num_requests_waiting"),
        "rss_mib_start": rss_start, "rss_mib_end": rss_end,
        "rss_mib_every_10s": samples if proc else None,
        "cpu": _cpu_model(), "server_exit_status": proc.returncode if proc else None,
    })
    failures = []
    by_outcome = summary["by_outcome"]
    if by_outcome.get("server_error") or by_outcome.get("transport_error"):
        failures.append("5xx or transport errors")
    if usage != 0 or summary["running_at_end"] or summary["waiting_at_end"]:
        failures.append("not idle at the end (KV blocks or requests left)")
    if rss_start is not None and rss_end - rss_start > args.rss_growth_mib:
        failures.append(f"RSS grew {rss_end - rss_start:.0f} MiB > {args.rss_growth_mib}")
    summary["failures"] = failures
    print(json.dumps(summary, indent=2))
    return 1 if failures else 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


if __name__ == "__main__":
    sys.exit(main())
