"""``engine bench serve`` end to end against a real ``engine serve`` on the tiny model.

One server for the module (the OpenAI tests' ``start_server`` fixture, max-model-len 256).
Timings are not asserted; what is checked is what the benchmark derives from the streams
(counts from usage, orderings every run must satisfy), the sweep layout of the JSON, the
PNG, and the errors a user meets before and during a run.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from click.testing import CliRunner

from engine.cli import main
from tests.entrypoints.openai.conftest import (  # noqa: F401 - start_server is a fixture
    SERVED_NAME,
    _free_port,
    start_server,
)

STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server(start_server):  # noqa: F811 - the imported fixture
    return start_server()


def _bench(*args: str):
    return CliRunner().invoke(main, ["bench", "serve", "--api-key", "", *args])


def _successes(url: str) -> float:
    """Requests the server counts as finished (all finish reasons)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^engine:request_success_total\{.*\} (\S+)$",
                                            text, flags=re.MULTILINE))


def test_sweep_writes_points_and_plot(server, llama_dir, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    before = _successes(server.url)
    result = _bench("--base-url", server.url, "--num-prompts", "6", "--input-len", "16",
                    "--output-len", "8", "--request-rate", "4,inf", "--max-concurrency", "2",
                    "--tokenizer", str(llama_dir), "--json", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert len(re.findall(r"successful / failed requests +6 / 0\n", result.output)) == 2
    report = json.loads(out.read_text())
    assert report["mode"] == "serve" and report["model"] == SERVED_NAME
    assert report["settings"]["request_rates"] == [4.0, "inf"]
    assert report["environment"]["cpu_count"] >= 1
    points = report["points"]
    assert [(p["request_rate"], p["max_concurrency"]) for p in points] == [(4.0, 2), ("inf", 2)]
    for point in points:
        assert (point["completed"], point["failed"], point["errors"]) == (6, 0, [])
        assert point["total_output_tokens"] == 6 * 8  # from usage, EOS ignored
        assert point["total_input_tokens"] == 6 * 16  # ids sent as they are
        assert 1 <= point["peak_concurrent_requests"] <= 2
        assert point["output_throughput"] > 0
        for key in STATS:
            stats = point[key]
            assert 0 <= stats["median"] <= stats["p99"], (key, stats)
            assert stats["p90"] <= stats["p99"]
        # every request's TTFT precedes its end, so the order statistics follow
        for stat in ("mean", "median", "p99"):
            assert point["ttft_ms"][stat] <= point["e2e_ms"][stat]
    assert _successes(server.url) - before == 2 * 6
    from matplotlib.image import imread

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).ndim == 3


def test_chat_endpoint(server, tmp_path):
    out = tmp_path / "chat.json"
    result = _bench("--base-url", server.url + "/v1", "--endpoint", "chat", "--num-prompts", "2",
                    "--input-len", "8", "--output-len", "4", "--json", str(out))
    assert result.exit_code == 0, result.output
    (point,) = json.loads(out.read_text())["points"]
    assert (point["completed"], point["failed"]) == (2, 0)
    assert point["total_output_tokens"] == 2 * 4
    assert point["total_input_tokens"] > 2 * 8  # the words plus the chat template
    assert point["request_rate"] == "inf" and point["max_concurrency"] is None


def test_unreachable_server_fails_fast():
    start = time.monotonic()
    result = _bench("--base-url", f"http://127.0.0.1:{_free_port()}", "--num-prompts", "2")
    assert result.exit_code == 1
    assert "cannot reach the server at http://127.0.0.1:" in result.output
    assert time.monotonic() - start < 10


def test_unknown_model(server):
    result = _bench("--base-url", server.url, "--model", "nope", "--num-prompts", "1")
    assert result.exit_code == 1
    assert f"model 'nope' is not served at {server.url} (it serves: {SERVED_NAME})" in (
        result.output)


def test_rejected_requests_are_counted_and_recorded(server, llama_dir, tmp_path):
    out = tmp_path / "rejected.json"
    result = _bench("--base-url", server.url, "--num-prompts", "2", "--input-len", "300",
                    "--output-len", "4", "--tokenizer", str(llama_dir), "--json", str(out))
    # every request failed: exit 1 with the first error, after the JSON is written
    assert result.exit_code == 1
    assert "every request failed; the first error: HTTP 400" in result.output
    (point,) = json.loads(out.read_text())["points"]
    assert (point["completed"], point["failed"]) == (0, 2)
    assert point["ttft_ms"]["median"] is None
    assert len(point["errors"]) == 2
    assert point["errors"][0].startswith("HTTP 400: ")
    assert "maximum context length is 256 tokens" in point["errors"][0]
