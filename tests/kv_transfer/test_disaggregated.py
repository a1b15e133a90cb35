"""Disaggregated prefill/decode end to end: `engine proxy` in front of a producer and a
consumer `engine serve`, each connector; the outputs equal one instance's, the consumer
computes only each prompt's last token, and no KV block is left held on either side.
Also: a restarted server finds the prefixes it stored before (shared storage)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, _free_port

MAX_TOKENS = 8
# Different lengths, two sharing a 40-token prefix, all longer than the producer's chunk.
PROMPTS = [list(range(5, 5 + 40)) + [77, 78, 79], list(range(5, 5 + 40)) + [90] * 7,
           list(range(100, 100 + 57)), list(range(200, 200 + 33))]
SERVER_ARGS = ["--block-size", "16", "--max-num-batched-tokens", "24"]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def _reference(path: Path) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


class _Proxy:
    def __init__(self, prefill: str, decode: str, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - open while it runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "proxy", "--prefill", prefill, "--decode",
             decode, "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"proxy not ready: {log.read_text()}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(20)
        self._log.close()


def _connector_config(name: str, role: str, tmp: Path, port: int | None = None) -> str:
    config = {"kv_connector": name, "kv_role": role}
    if name == "SharedStorageConnector":
        config["kv_connector_extra_config"] = {"shared_storage_path": str(tmp / "kv")}
    if port is not None:
        config["kv_port"] = port
    return json.dumps(config)


def _need_nixl() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError as exc:
        if os.environ.get("ENGINE_CI") == "1":
            raise
        pytest.skip(f"nixl is not installed: {exc}")


@pytest.fixture
def ucx_over_loopback(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.mark.parametrize("connector", ["SharedStorageConnector", "NixlConnector"])
def test_proxy_producer_consumer_equal_one_instance(model_dir_factory, tmp_path, connector,
                                                    ucx_over_loopback):
    if connector == "NixlConnector":
        _need_nixl()
    path = model_dir_factory("llama-gqa")
    want = _reference(path)
    side_port = _free_port()
    producer = ServerProcess(path, tmp_path / "producer.log", [
        *SERVER_ARGS, "--kv-transfer-config",
        _connector_config(connector, "kv_producer", tmp_path, side_port)])
    consumer = ServerProcess(path, tmp_path / "consumer.log", [
        *SERVER_ARGS, "--kv-transfer-config",
        _connector_config(connector, "kv_consumer", tmp_path, _free_port())])
    proxy = None
    try:
        producer.wait_ready()
        consumer.wait_ready()
        proxy = _Proxy(producer.url, consumer.url, tmp_path / "proxy.log")
        got = []
        for prompt in PROMPTS:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            reply = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            got.append(reply.json()["choices"][0]["text"])
        assert got == want
        consumed = _metrics(consumer.url)
        # The consumer computed only each prompt's last token; the rest was loaded (or
        # found in its own prefix cache: the second prompt shares two blocks with the first).
        assert consumed["engine:prompt_tokens_computed_total"] == len(PROMPTS)
        assert (consumed["engine:kv_transfer_loaded_tokens_total"]
                + consumed["engine:prefix_cache_hits_total"]) == sum(len(p) - 1 for p in PROMPTS)
        assert consumed["engine:kv_transfer_loaded_tokens_total"] > 0
        assert consumed["engine:kv_transfer_load_failures_total"] == 0
        # Nothing is left allocated or held on either side once the pulls completed.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            produced = _metrics(producer.url)
            if produced["engine:kv_transfer_requests_held"] == 0:
                break
            time.sleep(0.2)
        for metrics in (produced, _metrics(consumer.url)):
            assert metrics["engine:kv_transfer_requests_held"] == 0
            assert metrics["engine:kv_cache_usage_perc"] == 0
    finally:
        if proxy is not None:
            proxy.stop()
        for server in (producer, consumer):
            server.stop()
            server.assert_no_orphans()


def _streamed_ttft(url: str, prompt: list[int]) -> tuple[float, str]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first, text = None, ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter() - start
                text += chunk["choices"][0]["text"]
    return first, text


def test_restarted_server_reuses_stored_prefix(model_dir_factory, tmp_path):
    path = model_dir_factory("llama-gqa")
    prompt = list(range(3, 3 + 200))
    config = _connector_config("SharedStorageConnector", "kv_both", tmp_path)
    runs = []
    for attempt in range(2):
        server = ServerProcess(path, tmp_path / f"server{attempt}.log",
                               ["--block-size", "16", "--kv-transfer-config", config])
        try:
            server.wait_ready()
            ttft, text = _streamed_ttft(server.url, prompt)
            runs.append((ttft, text, _metrics(server.url)))
        finally:
            server.stop()
            server.assert_no_orphans()
    (_, first_text, first), (_, second_text, second) = runs
    assert second_text == first_text
    assert first["engine:prompt_tokens_computed_total"] == len(prompt)
    assert second["engine:prompt_tokens_computed_total"] == 1  # only the last token
    assert second["engine:kv_transfer_loaded_tokens_total"] == len(prompt) - 1


def test_consumer_recomputes_when_the_producer_is_gone(model_dir_factory, tmp_path,
                                                       ucx_over_loopback):
    """The producer prefills and dies before the consumer pulls: the consumer's load
    fails, it prefills the prompt itself, the output is still right, and no block is
    left allocated on the consumer."""
    _need_nixl()
    path = model_dir_factory("llama-gqa")
    want = _reference(path)[2]
    prompt = PROMPTS[2]
    producer = ServerProcess(path, tmp_path / "producer.log", [
        *SERVER_ARGS, "--kv-transfer-config",
        _connector_config("NixlConnector", "kv_producer", tmp_path, _free_port())])
    consumer = ServerProcess(path, tmp_path / "consumer.log", [
        *SERVER_ARGS, "--kv-transfer-config",
        _connector_config("NixlConnector", "kv_consumer", tmp_path, _free_port())])
    try:
        producer.wait_ready()
        consumer.wait_ready()
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}
        reply = httpx.post(producer.url + "/v1/completions", json=body, timeout=120)
        params = reply.json()["kv_transfer_params"]
        assert params and params["remote_block_ids"], reply.text
        producer.proc.kill()  # gone before anyone pulls its blocks
        producer.proc.wait()
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "kv_transfer_params": params}
        reply = httpx.post(consumer.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        metrics = _metrics(consumer.url)
        assert metrics["engine:kv_transfer_load_failures_total"] >= 1
        assert metrics["engine:prompt_tokens_computed_total"] == len(prompt)
        assert metrics["engine:kv_cache_usage_perc"] == 0
    finally:
        producer.stop()
        consumer.stop()
        consumer.assert_no_orphans()
