"""The serving-benchmark client without a server: SSE parsing, failures, pre-flight checks,
the concurrency cap, the prompts it sends and the plot, over ``httpx.MockTransport``."""

from __future__ import annotations

import asyncio
import json
import math
import sys

import httpx
import pytest
from click.testing import CliRunner

from engine.benchmarks.serve import (
    ServerError,
    ServeSettings,
    SweepPoint,
    parse_concurrencies,
    parse_rates,
    resolve_model,
    run_point,
    run_serve_benchmark,
    send_request,
)
from engine.benchmarks.serve_prompts import (
    PromptSpec,
    build_payloads,
    ids_to_words,
    load_vocab_high,
    word_list,
)
from engine.benchmarks.workload import Workload
from engine.cli import main


def _sse(*events) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _run_with(handler, coro_fn):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://bench.test") as client:
            return await coro_fn(client)

    return asyncio.run(go())


def _send(handler, timeout_s=5.0):
    return _run_with(handler, lambda c: send_request(c, "/v1/chat/completions", {}, timeout_s))


USAGE = {"usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
         "choices": []}


def test_stream_times_content_chunks_and_takes_tokens_from_usage():
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # no text
        {"choices": [{"index": 0, "delta": {"content": "a"}}]},
        {"choices": [{"index": 0, "delta": {"content": "bc"}}]},  # two tokens in one chunk
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        USAGE, "[DONE]",
    )
    record = _send(lambda request: httpx.Response(200, content=body))
    assert record.success and record.error is None
    assert len(record.chunk_times_s) == 2 and record.itl_s().size == 1
    assert (record.prompt_tokens, record.output_tokens) == (7, 3)
    assert record.start_s <= record.chunk_times_s[0] <= record.end_s


def test_completion_chunks_count_by_text():
    body = _sse({"choices": [{"index": 0, "text": "x"}]},
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                USAGE, "[DONE]")
    assert len(_send(lambda request: httpx.Response(200, content=body)).chunk_times_s) == 1


@pytest.mark.parametrize("response, expected", [
    (httpx.Response(400, json={"error": {"message": "prompt too long"}}),
     'HTTP 400: {"error":{"message":"prompt too long"}}'),
    (httpx.Response(200, content=_sse({"error": {"message": "core died"}}, "[DONE]")),
     "error in the stream"),
    (httpx.Response(200, content=_sse({"choices": [{"text": "x"}]}, "[DONE]")),
     "without usage"),
    (httpx.Response(200, content=b"data: {not json\n\n"), "unparsable"),
])
def test_failures_are_recorded_not_raised(response, expected):
    record = _send(lambda request: response)
    assert not record.success and expected in record.error


def test_transport_errors_and_timeouts_are_failures():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    assert _send(refuse).error == "ConnectError: connection refused"

    async def slow(request):
        await asyncio.sleep(5)

    record = _send(slow, timeout_s=0.05)
    assert record.error == "timed out after 0.05 s" and record.e2e_s < 2


def _models(status=200, ids=("tiny", "other")):
    return lambda request: httpx.Response(status, json={"data": [{"id": i} for i in ids]})


def test_resolve_model():
    assert _run_with(_models(), lambda c: resolve_model(c, None)) == "tiny"
    assert _run_with(_models(), lambda c: resolve_model(c, "other")) == "other"
    with pytest.raises(ServerError, match=r"'nope' is not served .*\(it serves: tiny, other\)"):
        _run_with(_models(), lambda c: resolve_model(c, "nope"))
    with pytest.raises(ServerError, match="--api-key"):
        _run_with(_models(401), lambda c: resolve_model(c, None))
    with pytest.raises(ServerError, match="lists no models"):
        _run_with(_models(ids=()), lambda c: resolve_model(c, None))


def test_every_sweep_point_sends_fresh_prompts(monkeypatch):
    """A server's prefix cache keeps the prompts of the previous sweep point: each point
    draws its own (seed + point index), the first one exactly the seed's."""
    from engine.benchmarks import serve as serve_module

    sent: list[list[int]] = []

    def handler(request):
        if request.url.path == "/v1/models":
            return _models()(request)
        sent.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, content=_sse({"choices": [{"text": "x"}]}, USAGE, "[DONE]"))

    real_client = httpx.AsyncClient
    monkeypatch.setattr(serve_module.httpx, "AsyncClient", lambda **kwargs: real_client(
        transport=httpx.MockTransport(handler), **kwargs))
    spec = PromptSpec("completions", num_prompts=3, input_len=6, output_len=2, seed=5,
                      vocab_high=300)
    settings = ServeSettings("http://bench.test/v1", spec, concurrencies=(1, 2))
    result = run_serve_benchmark(settings)
    assert len(result.points) == 2 and len(sent) == 6
    first = Workload(num_prompts=3, input_len=6, output_len=2, seed=5,
                     vocab_high=300).prompt_token_ids()
    assert sent[:3] == first  # concurrency 1: in order
    assert not {tuple(p) for p in sent[:3]} & {tuple(p) for p in sent[3:]}


def test_run_point_honours_the_concurrency_cap():
    in_flight, peak = 0, 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return httpx.Response(200, content=_sse({"choices": [{"text": "x"}]}, USAGE, "[DONE]"))

    records, duration = _run_with(handler, lambda c: run_point(
        c, "/v1/completions", [{}] * 6, SweepPoint(math.inf, 2), seed=0, timeout_s=5))
    assert len(records) == 6 and all(r.success for r in records)
    assert peak == 2 and duration >= 3 * 0.02


def test_parse_sweep_options():
    assert parse_rates("4, inf") == [4.0, math.inf]
    assert parse_concurrencies(None) == [None] and parse_concurrencies("1,8") == [1, 8]
    for bad in ("0", "-2", "nan", "fast", "4,,8"):
        with pytest.raises(ValueError, match="request rate"):
            parse_rates(bad)
    for bad in ("0", "2.5", "x"):
        with pytest.raises(ValueError, match="max concurrency"):
            parse_concurrencies(bad)


def test_settings_sweep_is_the_cartesian_product():
    spec = PromptSpec("completions", 2, 4, 4)
    settings = ServeSettings("http://h:1/v1/", spec, rates=(1.0, math.inf), concurrencies=(2, 4))
    assert settings.api_root == "http://h:1"
    assert [(p.request_rate, p.max_concurrency) for p in settings.points()] == [
        (1.0, 2), (1.0, 4), (math.inf, 2), (math.inf, 4)]
    assert settings.to_json()["request_rates"] == [1.0, "inf"]
    with pytest.raises(ValueError, match="endpoint"):
        PromptSpec("embeddings", 2, 4, 4)
    for url in ("localhost:8000", "http://", "http://[::1"):
        with pytest.raises(ValueError, match="base URL"):
            ServeSettings(url, spec)


def test_completion_payloads_carry_the_reference_ids():
    spec = PromptSpec("completions", num_prompts=3, input_len=5, output_len=2, seed=1,
                      vocab_high=300)
    payloads = build_payloads(spec, "tiny")
    expected = Workload(num_prompts=3, input_len=5, output_len=2, seed=1,
                        vocab_high=300).prompt_token_ids()
    assert [p["prompt"] for p in payloads] == expected
    assert payloads[0] | {"prompt": None} == {
        "model": "tiny", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "prompt": None}


def test_temperature_reaches_every_payload():
    spec = PromptSpec("completions", num_prompts=2, input_len=3, output_len=2, temperature=0.7)
    assert {p["temperature"] for p in build_payloads(spec, "tiny")} == {0.7}
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            PromptSpec("completions", 2, 3, 2, temperature=bad)


def test_chat_payloads_are_text(llama_dir):
    spec = PromptSpec("chat", num_prompts=2, input_len=6, output_len=3)
    ids = spec.workload().prompt_token_ids()
    words = word_list()
    assert len(set(words)) == len(words) == 4900
    assert ids_to_words([0, 4901]) == f"{words[0]} {words[1]}"
    plain = build_payloads(spec, "tiny")
    assert plain[1]["messages"] == [{"role": "user", "content": ids_to_words(ids[1])}]
    assert len(plain[1]["messages"][0]["content"].split()) == 6
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    decoded = build_payloads(spec, "tiny", tokenizer_path=llama_dir)
    assert decoded[0]["messages"][0]["content"] == tokenizer.decode(ids[0])
    assert load_vocab_high(llama_dir) == len(tokenizer) == 384


def test_plot_of_a_single_point(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from engine.benchmarks.serve import PointResult
    from engine.benchmarks.serve_metrics import RequestRecord, point_metrics
    from engine.benchmarks.serve_plot import plot_sweep, sweep_axes

    record = RequestRecord(0.0, 1.0, True, [0.2, 0.5, 0.9], prompt_tokens=4, output_tokens=3)
    result = PointResult(SweepPoint(math.inf, None), point_metrics([record], 1.0))
    path = tmp_path / "one.png"
    plot_sweep([result], path, "one point")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and imread(path).ndim == 3
    assert sweep_axes([SweepPoint(1.0, 2), SweepPoint(1.0, 4)]) == (
        "max concurrency", ["2", "4"], [("", [0, 1])])
    assert sweep_axes([SweepPoint(1.0, None), SweepPoint(math.inf, None)]) == (
        "request rate (req/s)", ["1", "inf"], [("", [0, 1])])
    # both varied: rates on the axis, one line per cap (points come rates outermost)
    both = [SweepPoint(r, c) for r in (1.0, 2.0) for c in (2, 4)]
    assert sweep_axes(both) == ("request rate (req/s)", ["1", "2"],
                                [(", c=2", [0, 2]), (", c=4", [1, 3])])


def test_plot_without_matplotlib_fails_before_contacting_the_server(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = CliRunner().invoke(main, [
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1
    assert "pip install 'engine[bench]'" in result.output and "reach" not in result.output
