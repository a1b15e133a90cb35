"""The OpenAI-compatible server, end to end: a real `engine serve` subprocess on the tiny
random Llama, driven by the `openai` client (and raw httpx where status codes and bodies
matter). One server (with an API key and a max_tokens limit) serves the whole module;
its teardown checks that SIGTERM stops it and its engine core.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

SERVED_NAME = "tiny"  # conftest's ServerProcess serves under this name
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
MAX_TOKENS_LIMIT = 100
BODY_LIMIT = 64 * 1024
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(start_server):
    # Eager steps (no forward graphs): the tiny model's graph replays finish 100 tokens in
    # ~30 ms, faster than the disconnect and SIGTERM tests can interrupt a request.
    return start_server("--api-key", API_KEY, "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
                        "--max-request-body-bytes", str(BODY_LIMIT), "--max-num-seqs", "128",
                        "--timeout-graceful-shutdown", "0", "--enforce-eager")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def _greedy(client, prompt, max_tokens=16, **kwargs):
    return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}, **kwargs)


def _metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"metric {name} {labels} not found")


# -- models, auth, health -------------------------------------------------------------------
def test_models_and_open_routes(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    for path in ("/health", "/metrics", "/version"):  # open even with an API key
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_api_key_required(server):
    keyless = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        keyless.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "AuthenticationError"
    for path in ("/v1/models", "/tokenize"):
        response = httpx.request("GET" if path == "/v1/models" else "POST", server.url + path,
                                 json={"prompt": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401


# -- completions ---------------------------------------------------------------------------
def test_completion_stream_equals_non_stream_and_usage(client, hf_tokenizer):
    full = _greedy(client, PROMPT)
    choice = full.choices[0]
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.model == SERVED_NAME and choice.finish_reason == "length"
    prompt_tokens = len(hf_tokenizer.encode(PROMPT))  # BOS + text
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 16
    assert full.usage.total_tokens == prompt_tokens + 16

    chunks = list(_greedy(client, PROMPT, stream=True,
                          stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices  # the usage chunk
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_prompt_forms_and_n(client, hf_tokenizer):
    first = _greedy(client, PROMPT, max_tokens=6).choices[0].text
    second = _greedy(client, "Once upon a time", max_tokens=6).choices[0].text
    ids = hf_tokenizer.encode(PROMPT)
    assert _greedy(client, ids, max_tokens=6).choices[0].text == first
    batch = _greedy(client, [PROMPT, "Once upon a time"], max_tokens=6, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [first, first, second, second]
    assert batch.usage.completion_tokens == 4 * 6
    batch_ids = _greedy(client, [ids, hf_tokenizer.encode("Once upon a time")], max_tokens=6)
    assert [c.text for c in batch_ids.choices] == [first, second]
    streamed = ["", "", "", ""]  # both prompts' streams interleave in one response
    for chunk in _greedy(client, [PROMPT, "Once upon a time"], max_tokens=6, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [first, first, second, second]


def test_completion_sampling_seed_and_n(client):
    def sample(seed):
        out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, n=3,
                                        temperature=1.0, top_p=0.9, seed=seed,
                                        extra_body={"top_k": 50, "ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    a, b = sample(1234), sample(1234)
    assert a == b and len(a) == 3
    assert len(set(a)) > 1  # the samples of one request differ (seed + index)


def test_completion_stop_string(client):
    text = _greedy(client, PROMPT, max_tokens=16).choices[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip())
    cut = text.find(stop)
    out = _greedy(client, PROMPT, max_tokens=16, stop=[stop]).choices[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop


def test_completion_logprobs_greedy(client):
    out = _greedy(client, PROMPT, max_tokens=8, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The top 3 and the chosen token, keyed by text (byte tokens may share "\ufffd").
        assert 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the best
        assert token in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


@torch.inference_mode()
def test_echo_logprobs_max_tokens_zero_match_transformers(client, hf_model, hf_tokenizer):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs, max_tokens=0."""
    ids = hf_tokenizer.encode("Paged attention keeps the KV cache in blocks")
    out = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == hf_tokenizer.decode(ids)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    expected = [float(want[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in ids]

    # With generated tokens too: prompt logprobs first, then one entry per new token.
    more = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=3, echo=True,
                                     logprobs=2, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert len(more.logprobs.tokens) == len(ids) + 3
    assert more.logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-3)
    assert more.text.startswith(hf_tokenizer.decode(ids))


def test_echo_streaming(client, hf_tokenizer):
    full = _greedy(client, PROMPT, max_tokens=5, echo=True).choices[0].text
    chunks = list(_greedy(client, PROMPT, max_tokens=5, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert full.startswith(PROMPT)


# -- chat ----------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Tell me about foxes."}]}]


def test_chat_completion_stream_and_usage(client, hf_tokenizer):
    kwargs = {"model": SERVED_NAME, "messages": MESSAGES, "max_completion_tokens": 12,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    flat = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about foxes."}]
    rendered = hf_tokenizer.apply_chat_template(flat, add_generation_prompt=True,
                                                tokenize=False)
    assert full.usage.prompt_tokens == len(hf_tokenizer.encode(rendered,
                                                               add_special_tokens=False))
    assert full.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert not finish[0].choices[0].delta.content  # a separate finish chunk
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_n_and_logprobs(client):
    out = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0, n=2,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-6)  # greedy picks the top
        assert entry.bytes == list(entry.token.encode("utf-8"))
    assert out.usage.completion_tokens == 12


def test_chat_legacy_functions_are_rejected(client):
    function = {"name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2,
                                       functions=[function])
    assert "not supported" in info.value.body["message"]
    assert info.value.body["param"] == "functions"


# -- errors --------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


def test_bad_requests(http):
    error = _error(http.post("/v1/completions", content=b"{not json"), 400)
    assert "not valid JSON" in error["message"]
    _error(http.post("/v1/completions", content=b"[1, 2]"), 400)

    def send(path="/v1/completions", **fields):
        body = {"model": SERVED_NAME, "prompt": "hello", **fields}
        return http.post(path, json=body)

    assert _error(send(temperature=-0.5), 400)["param"] == "temperature"
    assert _error(send(temperature="hot"), 400)["param"] == "temperature"
    assert _error(send(max_tokens="many"), 400)["param"] == "max_tokens"
    assert _error(send(top_p=0.0), 400)["param"] == "top_p"
    assert _error(send(stop=[""]), 400)["param"] == "stop"
    assert _error(send(logit_bias={"abc": 1}), 400)["param"] == "logit_bias"
    assert _error(send(prompt=[]), 400)["param"] == "prompt"
    assert _error(send(prompt=[1, 10**6]), 400)["param"] is None  # token id outside vocab
    assert _error(send(max_tokens=MAX_TOKENS_LIMIT + 1), 400)["param"] == "max_tokens"
    assert _error(send(max_tokens=-1), 400)["param"] == "max_tokens"
    assert _error(send(logprobs=21), 400)["param"] == "logprobs"
    assert _error(send(n=0), 400)["param"] == "n"
    assert _error(send(n=129), 400)["param"] == "n"  # over max_num_seqs
    assert _error(send(seed=2**70), 400)["param"] == "seed"  # beyond int64
    too_long = _error(send(prompt=[5] * 300), 400)
    assert "maximum context length is 256 tokens" in too_long["message"]
    over = _error(send(prompt=[5] * 200, max_tokens=90), 400)
    assert "you requested 290 tokens (200 in the messages, 90 in the completion)" in (
        over["message"])
    chat = _error(http.post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert chat["param"] == "messages"
    _error(http.post("/v1/chat/completions", json={"model": SERVED_NAME}), 400)
    # Streaming requests are validated before the stream starts.
    _error(send(stream=True, temperature=-1), 400)


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    assert info.value.body["message"] == "The model `gpt-9` does not exist."
    _error(http.get("/v1/models/gpt-9"), 404)


def test_oversized_body_is_413(http):
    body = json.dumps({"model": SERVED_NAME, "prompt": "a" * (2 * BODY_LIMIT)}).encode()
    assert _error(http.post("/v1/completions", content=body), 413)["type"]

    def chunked():  # no Content-Length: the limit applies to the bytes received
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    _error(http.post("/v1/completions", content=chunked()), 413)


# -- tokenize ------------------------------------------------------------------------------
def test_tokenize_round_trip(http, hf_tokenizer):
    text = "Café, naïve, über"
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == hf_tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert http.post("/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf_tokenizer.encode(rendered, add_special_tokens=False)
    _error(http.post("/detokenize", json={"tokens": [10**7]}), 400)


# -- metrics and concurrency ---------------------------------------------------------------
def test_beam_search_completions_and_chat(client, http, llama_dir, hf_tokenizer):
    """use_beam_search with n: n distinct choices, best first, equal to the offline
    LLM.beam_search sequences; streaming and sampling temperatures are 400s."""
    from engine import BeamSearchParams
    from tests.helpers.hf_reference import cpu_llm

    beam = {"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5}
    completion = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=3,
                                           max_tokens=6, extra_body=beam)
    texts = [c.text for c in completion.choices]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in completion.choices)
    assert completion.usage.completion_tokens == 18

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=messages, n=2,
                                          max_tokens=5, extra_body=beam)
    assert len({c.message.content for c in chat.choices}) == 2

    llm = cpu_llm(llama_dir, max_model_len=MAX_MODEL_LEN)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True,
                                  length_penalty=0.5)
        want = llm.beam_search(PROMPT, params)[0].sequences
        assert texts == [hf_tokenizer.decode(s.generated_tokens, skip_special_tokens=True)
                         for s in want]
        rendered = llm.llm_engine.processor.apply_chat_template(messages)
        ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
        params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True,
                                  length_penalty=0.5)
        want = llm.beam_search({"prompt_token_ids": ids}, params)[0].sequences
        assert [c.message.content for c in chat.choices] == [
            hf_tokenizer.decode(s.generated_tokens, skip_special_tokens=True) for s in want]
    finally:
        llm.shutdown()

    for path, body in [
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/completions", {"prompt": "hi", "temperature": 0.7}),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "[ab]+"}),
        ("/v1/chat/completions", {"messages": messages, "stream": True}),
    ]:
        response = http.post(path, json={"model": SERVED_NAME, "n": 2, "max_tokens": 3,
                                         "use_beam_search": True, **body})
        assert "use_beam_search" in _error(response, 400)["message"]


def test_metrics_after_requests(server, client):
    before = httpx.get(server.url + "/metrics").text
    prompts_before = _metric(before, "engine:prompt_tokens_total")
    gaps_before = _metric(before, "engine:inter_token_latency_seconds_count")
    out = _greedy(client, PROMPT, max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    # one inter-token latency per step after the first (a token per step here)
    assert _metric(text, "engine:inter_token_latency_seconds_count") == (
        gaps_before + out.usage.completion_tokens - 1)
    assert _metric(text, "engine:prompt_tokens_total") == prompts_before + out.usage.prompt_tokens
    assert _metric(text, "engine:generation_tokens_total") >= 4
    assert _metric(text, "engine:request_success_total", finished_reason="length") >= 1
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert _metric(text, f"engine:{name}_seconds_count") >= 1
    assert _metric(text, "engine:num_requests_running") == 0
    assert _metric(text, "engine:kv_cache_usage_perc") == 0
    assert _metric(text, "engine:num_kv_blocks") > 0
    assert _metric(text, "engine:prefix_cache_queries_total") > 0
    assert _metric(text, "engine:engine_healthy") == 1


async def _stream_one(http: httpx.AsyncClient, prompt: str, disconnect_after: int | None
                      ) -> tuple[str, str | None]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, finish, seen = "", None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            seen += 1
            if disconnect_after is not None and seen >= disconnect_after:
                return text, "disconnected"  # leaving the block closes the connection
    return text, finish


def test_64_concurrent_streams_with_disconnects(server, client):
    prompts = [f"request number {i} says" for i in range(8)]
    expected = dict(zip(prompts, (c.text for c in _greedy(client, prompts).choices)))
    aborted_before = _metric(httpx.get(server.url + "/metrics").text,
                             "engine:request_success_total", finished_reason="abort")

    async def run() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            return await asyncio.gather(*(
                _stream_one(http, prompts[i % 8], 2 if i % 4 == 0 else None)
                for i in range(64)))

    results = asyncio.run(run())
    for i, (text, finish) in enumerate(results):
        if i % 4 == 0:
            assert finish == "disconnected"
        else:
            assert (text, finish) == (expected[prompts[i % 8]], "length"), i

    # Every request is gone from the engine and every KV block is free again.
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.url + "/metrics").text
        state = [_metric(text, f"engine:{name}") for name in
                 ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if state == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state == [0, 0, 0]
    aborted = _metric(text, "engine:request_success_total", finished_reason="abort")
    assert aborted > aborted_before  # disconnected streams were aborted, not run to the end


def test_non_streaming_client_disconnect_aborts(server):
    """A client that gives up on a non-streaming request frees its engine requests."""
    url = server.url + "/metrics"
    aborted_before = _metric(httpx.get(url).text, "engine:request_success_total",
                             finished_reason="abort")
    # 32 samples x 100 tokens take ~100 ms of eager steps here: 10x the client's patience.
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS_LIMIT, "n": 32,
            "temperature": 1.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.01),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(url).text
        aborted = _metric(text, "engine:request_success_total", finished_reason="abort")
        if aborted == aborted_before + 32 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert aborted == aborted_before + 32  # every sample aborted, none ran to max_tokens
    assert _metric(text, "engine:num_requests_running") == 0
    assert _metric(text, "engine:kv_cache_usage_perc") == 0


def test_generation_config_fills_unset_fields(start_server, tmp_path_factory):
    """--generation-config DIR: its values stand in for fields a request leaves unset
    (temperature 0 here, so the reply is greedy) and max_new_tokens caps max_tokens."""
    defaults = tmp_path_factory.mktemp("generation-config")
    (defaults / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    server = start_server("--generation-config", str(defaults))
    with_defaults = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60)
    kwargs = {"model": SERVED_NAME, "messages": MESSAGES, "extra_body": {"ignore_eos": True}}
    reply = with_defaults.chat.completions.create(**kwargs)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    greedy = with_defaults.chat.completions.create(temperature=0, max_completion_tokens=5,
                                                   **kwargs)
    assert reply.choices[0].message.content == greedy.choices[0].message.content
    longer = with_defaults.chat.completions.create(max_completion_tokens=7, **kwargs)
    assert longer.usage.completion_tokens == 7  # a request's own max_tokens wins


def test_sigterm_ends_in_flight_stream_cleanly(server):
    """Runs last (it stops the server). With a 0 s grace period, SIGTERM aborts the
    in-flight stream through the engine: it still ends with finish chunks and [DONE], and
    the server and its engine core exit. Three more streams keep the batch at 128
    sequences, so 100 tokens take longer than the signal takes to land."""
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS_LIMIT, "n": 32,
            "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def drain() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                          timeout=30) as other:
            for _ in other.iter_lines():
                pass

    load = [threading.Thread(target=drain, daemon=True) for _ in range(3)]
    for thread in load:
        thread.start()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=30) as response:
        lines = (line[len("data: "):] for line in response.iter_lines()
                 if line.startswith("data: "))
        data = [next(lines)]
        server.proc.send_signal(signal.SIGTERM)
        data += list(lines)
    for thread in load:
        thread.join(30)
    assert data[-1] == "[DONE]"
    finishes = {c["index"]: c["finish_reason"] for chunk in data[:-1]
                for c in json.loads(chunk)["choices"] if c["finish_reason"]}
    assert finishes == {i: "abort" for i in range(32)}
    server.proc.wait(30)
    server.assert_no_orphans()

