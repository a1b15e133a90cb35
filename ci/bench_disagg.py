"""TTFT of one long prompt: plain local prefill vs disaggregated through each KV connector.

Starts (per connector) a producer and a consumer `engine serve` and an `engine proxy`,
sends a ``--prompt-len``-token prompt through the proxy (streaming, max_tokens 8), and
reports the client's time to first token, the consumer's KV bytes received and transfer
seconds (bandwidth), next to the same prompt's TTFT on one plain instance. Every request
uses a fresh prompt (no prefix-cache hit). Usage::

    python ci/bench_disagg.py --model DIR [--prompt-len 2048] [--connectors NixlConnector,SharedStorageConnector]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *args, "--port", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{args[0]} not ready")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM if proc.args[3] == "serve" else signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _ttft(url: str, prompt: list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    return time.perf_counter() - start
    raise RuntimeError("no token came back")


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connectors", default="NixlConnector,SharedStorageConnector")
    args = parser.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rng = random.Random(0)
    common = ["--model", args.model, "--served-model-name", "m", "--max-model-len",
              str(args.prompt_len + 16), "--disable-uvicorn-access-log"]
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, url = _start(["serve", *common], tmp / "local.log")
        try:
            times = [_ttft(url, [rng.randrange(5, 1000) for _ in range(args.prompt_len)])
                     for _ in range(args.rounds)]
            report["local prefill"] = {"ttft_s": [round(t, 3) for t in times]}
        finally:
            _stop(proc)
        for connector in [c for c in args.connectors.split(",") if c]:
            extra = {"shared_storage_path": str(tmp / f"kv-{connector}")}
            procs = []
            try:
                roles = {}
                for role in ("kv_producer", "kv_consumer"):
                    config = {"kv_connector": connector, "kv_role": role, "kv_port": _port(),
                              "kv_connector_extra_config": extra}
                    proc, url = _start(["serve", *common, "--kv-transfer-config",
                                        json.dumps(config)], tmp / f"{connector}-{role}.log")
                    procs.append(proc)
                    roles[role] = url
                proxy, proxy_url = _start(["proxy", "--prefill", roles["kv_producer"],
                                           "--decode", roles["kv_consumer"]],
                                          tmp / f"{connector}-proxy.log")
                procs.append(proxy)
                times = [_ttft(proxy_url, [rng.randrange(5, 1000)
                                           for _ in range(args.prompt_len)])
                         for _ in range(args.rounds)]
                received = _metric(roles["kv_consumer"], "engine:kv_transfer_bytes_received_total")
                seconds = _metric(roles["kv_consumer"], "engine:kv_transfer_seconds_total")
                report[connector] = {
                    "ttft_s": [round(t, 3) for t in times],
                    "kv_mib_per_request": round(received / args.rounds / 2**20, 2),
                    "consumer_transfer_gb_per_s": round(received / seconds / 1e9, 2)
                    if seconds else None,
                    "consumer_prompt_tokens_computed": _metric(
                        roles["kv_consumer"], "engine:prompt_tokens_computed_total"),
                }
            finally:
                for proc in reversed(procs):
                    _stop(proc)
    print(json.dumps({"model": args.model, "prompt_len": args.prompt_len, **report}, indent=2))


if __name__ == "__main__":
    main()
