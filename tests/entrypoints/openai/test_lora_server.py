"""Multi-LoRA over the OpenAI server: ``engine serve --enable-lora --lora-modules ...``.

One real `engine serve` subprocess (conftest's ``start_server``) on the tiny random Llama
serves the module with two startup adapters (``a``, ``b``), ``--max-loras 2`` and
``--allow-runtime-lora-updating``, driven by the ``openai`` client (and raw httpx where
status codes and bodies matter). The adapters are random PEFT adapters
(``tests.helpers.lora_models``); the reference tokens come from the offline
``LLM(enable_lora=True)`` (greedy, float32). The teardown checks that the server stops
cleanly and never logged a traceback (no adapter error crashed anything).

The option parsing, the registry's bookkeeping (ids, an unloaded adapter's running
requests) and the metrics gauge are also pinned without a server.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.lora import LoRARequest

SERVED_NAME = "tiny"  # conftest's ServerProcess serves under this name
MAX_MODEL_LEN = 256  # conftest's ServerProcess
PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
MAX_TOKENS = 12


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict:
    """``{name: dir}``: a, b (startup), c (loaded at runtime), and two the engine refuses
    (DoRA; rank 32 > --max-lora-rank 16)."""
    from tests.helpers.lora_models import ALL_TARGETS, AdapterSpec, build_adapter_set

    specs = [
        AdapterSpec("a", 8, 16, ALL_TARGETS, seed=11),
        AdapterSpec("b", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=12),
        AdapterSpec("c", 16, 32, ["gate_proj", "up_proj", "down_proj"], seed=13),
        AdapterSpec("dora", 8, 16, ["q_proj", "v_proj"], seed=21, kwargs={"use_dora": True}),
        AdapterSpec("rank32", 32, 16, ALL_TARGETS, seed=14),
    ]
    return {name: str(path) for name, path in
            build_adapter_set(llama_dir, tmp_path_factory.mktemp("adapters"), specs).items()}


@pytest.fixture(scope="module")
def server(start_server, adapters, monkeypatch_module):
    monkeypatch_module.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch_module.delenv("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    # vLLM's form: one flag, several name=path values (the JSON form: the slow test).
    return start_server("--enforce-eager", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "16", "--max-num-seqs", "8",
                        "--lora-modules", f"a={adapters['a']}",
                        f"b={adapters['b']}",
                        "--allow-runtime-lora-updating")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(llama_dir, adapters):
    """The offline engine's greedy outputs: ``reference(model, prompt=..., messages=...,
    max_tokens=...) -> text`` with ``model`` "tiny" or an adapter name."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(llama_dir), device="cpu", dtype="float32",
              max_model_len=MAX_MODEL_LEN, enforce_eager=True, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    ids = {"a": 1, "b": 2, "c": 3}
    cache: dict = {}

    def reference(model: str, *, prompt: str | None = None, messages: list | None = None,
                  max_tokens: int = MAX_TOKENS) -> str:
        key = (model, prompt, repr(messages), max_tokens)
        if key not in cache:
            lora = (None if model == SERVED_NAME else
                    LoRARequest(model, ids[model], adapters[model]))
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            if messages is not None:
                out = llm.chat(messages, params, use_tqdm=False, lora_request=lora)
            else:
                out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
            cache[key] = out[0].outputs[0].text
        return cache[key]

    def beam_texts(model: str, prompt: str, beam_width: int, max_tokens: int) -> list[str]:
        from engine import BeamSearchParams

        lora = LoRARequest(model, ids[model], adapters[model])
        params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens,
                                  ignore_eos=True)
        [out] = llm.beam_search([prompt], params, lora_request=lora)
        return [seq.text for seq in out.sequences]

    reference.beam_texts = beam_texts
    yield reference
    llm.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _complete(client, model, prompt=PROMPT, max_tokens=MAX_TOKENS, **kwargs):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}, **kwargs)


def _chat(client, model, max_tokens=MAX_TOKENS, **kwargs):
    return client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True},
                                          **kwargs)


def _assert_error(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body["object"] == "error", body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status, error
    for needle in needles:
        assert needle.lower() in error["message"].lower(), (needle, error)
    return error


def _lora_info(text: str) -> list[dict[str, str]]:
    """The label sets of every engine:lora_requests_info sample (and their values)."""
    found = []
    for line in text.splitlines():
        match = re.match(r"^engine:lora_requests_info\{([^}]*)\}\s+(\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            labels["value"] = match.group(2)
            found.append(labels)
    return found


# -- the served models ----------------------------------------------------------------------
def test_models_list_adapters_with_parent(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:3] == [SERVED_NAME, "a", "b"]
    assert models[SERVED_NAME].model_extra.get("parent") is None
    for name in ("a", "b"):
        extra = models[name].model_extra
        assert extra["parent"] == SERVED_NAME
        assert extra["root"] == adapters[name]
    card = client.models.retrieve("a")
    assert card.id == "a" and card.model_extra["parent"] == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completions_under_adapters_match_offline(client, offline):
    texts = {}
    for model in (SERVED_NAME, "a", "b"):
        response = _complete(client, model)
        assert response.model == model
        texts[model] = response.choices[0].text
        assert texts[model] == offline(model, prompt=PROMPT), model
    assert texts["a"] != texts[SERVED_NAME] and texts["b"] != texts[SERVED_NAME]
    assert texts["a"] != texts["b"]
    # Streamed, and mixed in one batch of concurrent requests (max_loras 2: base + a + b).
    streamed = "".join(c.choices[0].text for c in _complete(client, "a", stream=True)
                       if c.choices)
    assert streamed == texts["a"]

    async def concurrent():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="none", max_retries=0)
        order = [SERVED_NAME, "a", "b", "a", SERVED_NAME, "b"]
        results = await asyncio.gather(*[
            aclient.completions.create(model=m, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
            for m in order])
        await aclient.close()
        return [(m, r.choices[0].text) for m, r in zip(order, results)]

    for model, text in asyncio.run(concurrent()):
        assert text == texts[model], model


def test_chat_under_adapter_matches_offline(client, offline):
    base = _chat(client, SERVED_NAME).choices[0].message.content
    response = _chat(client, "a")
    assert response.model == "a"
    text = response.choices[0].message.content
    assert text != base
    assert text == offline("a", messages=CHAT)
    assert base == offline(SERVED_NAME, messages=CHAT)
    chunks = list(_chat(client, "a", stream=True))
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_responses_api_resolves_adapters(http, offline):
    body = {"model": "a", "input": CHAT[0]["content"], "max_output_tokens": MAX_TOKENS,
            "temperature": 0}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "a"
    _assert_error(http.post("/v1/responses", json={**body, "model": "nope"}), 404,
                  "does not exist")


def test_unknown_model_is_not_found(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "nope")
    assert info.value.status_code == 404
    assert info.value.body["message"] == "The model `nope` does not exist."
    error = _assert_error(http.post("/v1/chat/completions",
                                    json={"model": "nope", "messages": CHAT}), 404)
    assert error["param"] == "model"


def test_beam_search_under_an_adapter_equals_the_offline_beam_search(http, offline):
    response = http.post("/v1/completions", json={
        "model": "a", "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    expected = offline.beam_texts("a", PROMPT, beam_width=2, max_tokens=4)
    assert len(texts) == 2 and all(texts)
    assert all(full.endswith(text) for full, text in zip(expected, texts)), (expected, texts)


# -- runtime loading ------------------------------------------------------------------------
def test_runtime_load_use_unload_while_streaming(client, http, adapters, offline):
    response = http.post("/v1/load_lora_adapter",
                         json={"lora_name": "c", "lora_path": adapters["c"]})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'c' added successfully."
    models = {m.id: m for m in client.models.list().data}
    assert models["c"].model_extra["parent"] == SERVED_NAME
    assert models["c"].model_extra["root"] == adapters["c"]
    expected = offline("c", prompt=PROMPT)
    assert _complete(client, "c").choices[0].text == expected

    # A long stream under c; c is unloaded once the stream has started: the stream still
    # finishes under c (its tokens are the adapter's), new requests get model-not-found.
    long_tokens = 200
    full = offline("c", prompt=PROMPT, max_tokens=long_tokens)
    stream = _complete(client, "c", stream=True, max_tokens=long_tokens)
    pieces, finish = [], None
    for i, chunk in enumerate(stream):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if i == 0:
            unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
            assert unloaded.status_code == 200, unloaded.text
            assert unloaded.text == "Success: LoRA adapter 'c' removed successfully."
            with pytest.raises(openai.NotFoundError):
                _complete(client, "c")
    assert "".join(pieces) == full
    assert finish == "length"
    assert "c" not in {m.id for m in client.models.list().data}
    _assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404,
                  "cannot be found")

    # The same name again: a fresh id, the same adapter, the same tokens.
    again = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "c", "lora_path": adapters["c"]})
    assert again.status_code == 200, again.text
    assert _complete(client, "c").choices[0].text == expected
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    # Base and startup adapters are untouched.
    assert _complete(client, "a").choices[0].text == offline("a", prompt=PROMPT)


@pytest.mark.parametrize("body, needles", [
    ({"lora_name": "x"}, ["lora_name", "lora_path"]),
    ({"lora_path": "/tmp"}, ["lora_name", "lora_path"]),
    ({}, ["lora_name", "lora_path"]),
    ({"lora_name": "a", "@": "a"}, ["already been loaded"]),
    ({"lora_name": "d", "@": "dora"}, ["dora"]),
    ({"lora_name": "r", "@": "rank32"}, ["rank"]),
    ({"lora_name": "n", "lora_path": "/nonexistent/adapter"}, ["/nonexistent/adapter"]),
])
def test_bad_adapters_are_400(http, adapters, body, needles):
    body = dict(body)
    if "@" in body:
        body["lora_path"] = adapters[body.pop("@")]
    _assert_error(http.post("/v1/load_lora_adapter", json=body), 400, *needles)
    name = body.get("lora_name")
    if name and name != "a":  # a refused adapter is not served
        assert name not in {m["id"] for m in http.get("/v1/models").json()["data"]}
        _assert_error(http.post("/v1/completions", json={"model": name, "prompt": "x"}), 404)


def test_openapi_documents_the_runtime_routes(http):
    document = http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, model in (("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
                        ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest")):
        body = document["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and model in schemas


def test_unload_errors(http):
    _assert_error(http.post("/v1/unload_lora_adapter", json={}), 400, "lora_name")
    _assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "zzz"}), 404,
                  "cannot be found")
    _assert_error(http.post("/v1/unload_lora_adapter", json={"lora_int_id": 999}), 404)


# -- metrics --------------------------------------------------------------------------------
def test_metrics_lora_info_gauge(http, client):
    before = time.time()
    samples = _lora_info(http.get("/metrics").text)
    assert samples, "engine:lora_requests_info missing"
    sample = samples[-1]
    assert sample["max_lora"] == "2"
    assert sample["model_name"] == SERVED_NAME
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(sample)
    assert float(sample["value"]) >= before - 1


@pytest.mark.slow
def test_metrics_name_running_adapters(http, client):
    """While requests run under a and b, the gauge's labels name them."""
    done = threading.Event()

    def run(model):
        _complete(client, model, max_tokens=MAX_MODEL_LEN - 16)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("a", "b", "a", "b")]
    for thread in threads:
        thread.start()
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not seen >= {"a", "b"}:
            for sample in _lora_info(http.get("/metrics").text):
                for key in ("running_lora_adapters", "waiting_lora_adapters"):
                    seen.update(filter(None, sample[key].split(",")))
            if all(not t.is_alive() for t in threads):
                break
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert seen >= {"a", "b"}, seen


# -- startup --------------------------------------------------------------------------------
@pytest.mark.slow
def test_startup_with_bad_adapter_fails_clearly(llama_dir, adapters):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", str(llama_dir), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "128", "--kv-cache-space", "0.05",
         "--enforce-eager", "--enable-lora", "--lora-modules", f"good={adapters['a']}",
         f"bad={adapters['dora']}", "--port", str(_free_port())],
        check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "--lora-modules" in result.stderr and "'bad'" in result.stderr
    assert "dora" in result.stderr.lower()
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_no_runtime_routes_without_the_flag(start_server, adapters, monkeypatch_module):
    monkeypatch_module.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch_module.delenv("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    other = start_server("--enforce-eager", "--enable-lora",
                         "--lora-modules", f'{{"name": "j", "path": "{adapters["b"]}", '
                                           '"base_model_name": "tiny"}')
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = httpx.post(other.url + path, json={"lora_name": "j", "lora_path": "/x"})
        assert response.status_code == 404, response.text
    served = {m["id"]: m for m in httpx.get(other.url + "/v1/models").json()["data"]}
    assert served["j"]["parent"] == "tiny" and served["j"]["root"] == adapters["b"]


# -- without a server -----------------------------------------------------------------------
def test_parse_lora_modules():
    from engine.entrypoints.openai.serving_lora import LoRAModulePath, parse_lora_modules

    json_form = ' {"name": "b", "path": "/q", "base_model_name": "m"}'
    assert parse_lora_modules(["a=/p", json_form, ""]) == [
        LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q", "m")]
    assert parse_lora_modules(["a=/p=q"]) == [LoRAModulePath("a", "/p=q")]
    for bad, needle in [(["/just/a/path"], "name=path"), (["a=/p", "a=/q"], "twice"),
                        (['{"name": "a"}'], "path"), (['{"name": "a", "path": "/p", "x": 1}'],
                                                       "unknown"),
                        (["{not json"], "JSON"), (["=/p"], "name=path")]:
        with pytest.raises(ValueError, match=needle):
            parse_lora_modules(bad)
    with pytest.raises(ValueError, match="base model"):
        parse_lora_modules(["tiny=/p"], base_model_name="tiny")


def test_serve_options_parse_like_vllm(monkeypatch):
    from click.testing import CliRunner

    from engine.cli.serve import _lora_settings, serve_cmd

    ctx = serve_cmd.make_context("serve", [
        "m", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2",
        "--lora-modules", '{"name": "c", "path": "/z"}', "--allow-runtime-lora-updating"])
    params = ctx.params
    assert params["lora_modules"] == ("a=/x", "b=/y", '{"name": "c", "path": "/z"}')
    assert params["model_arg"] == "m" and params["max_loras"] == 2
    modules, runtime = _lora_settings(params["lora_modules"], False, {"enable_lora": True})
    assert [m.name for m in modules] == ["a", "b", "c"] and not runtime
    for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "ENGINE_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.setenv(name, "True")
        assert _lora_settings((), False, {"enable_lora": True})[1]
        monkeypatch.setenv(name, "0")
        assert not _lora_settings((), False, {"enable_lora": True})[1]
        monkeypatch.delenv(name)

    runner = CliRunner()
    result = runner.invoke(serve_cmd, ["m", "--lora-modules", "a=/x"])
    assert result.exit_code == 2 and "--lora-modules needs --enable-lora" in result.output
    result = runner.invoke(serve_cmd, ["m", "--allow-runtime-lora-updating"])
    assert result.exit_code == 2 and "needs --enable-lora" in result.output
    result = runner.invoke(serve_cmd, ["--enable-lora", "--lora-modules", "a=/x", "m"])
    assert result.exit_code == 2 and "give MODEL before --lora-modules" in result.output


class _FakeEngine:
    """What ServedLoRAs uses of AsyncLLM."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(lora=SimpleNamespace(max_loras=2))
        self.loaded: dict[int, LoRARequest] = {}
        self.removed: list[int] = []
        self.num_core_restarts = 0

    async def add_lora(self, lora: LoRARequest) -> bool:
        if "bad" in lora.lora_path:
            raise ValueError(f"LoRA adapter {lora.lora_path!r} has no adapter_config.json")
        self.loaded[lora.lora_int_id] = lora
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.removed.append(lora_int_id)
        return self.loaded.pop(lora_int_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loaded)


def test_registry_ids_and_deferred_removal():
    from engine.entrypoints.openai.errors import APIError
    from engine.entrypoints.openai.serving_lora import ServedLoRAs, lora_requests_for

    async def scenario() -> None:
        engine = _FakeEngine()
        static = lora_requests_for([SimpleNamespace(name="a", path="/a", base_model_name=None)],
                                   base_model_name="tiny")
        loras = ServedLoRAs(engine, "tiny", static)
        await loras.load_all_missing()
        assert set(engine.loaded) == {1}
        assert loras.resolve(None) is None and loras.resolve("tiny") is None
        assert loras.resolve("a").lora_int_id == 1
        with pytest.raises(APIError) as info:
            loras.resolve("zz")
        assert info.value.status == 404

        c = await loras.load("c", "/c")
        assert c.lora_int_id == 2 and c.base_model_name == "tiny"
        with pytest.raises(APIError, match="already been loaded"):
            await loras.load("c", "/c")
        with pytest.raises(APIError, match="adapter_config"):
            await loras.load("d", "/bad")
        assert "d" not in loras.by_name

        # c runs; unloading it hides the name at once, the engine drops it at the end.
        await loras.acquire(c)
        await loras.unload("c")
        with pytest.raises(APIError):
            loras.resolve("c")
        with pytest.raises(APIError):
            await loras.acquire(c)  # a request that resolved c before the unload
        assert engine.removed == []
        loras.release(c)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert engine.removed == [2]

        # An idle adapter goes at once; ids are never reused.
        c2 = await loras.load("c", "/c")
        assert c2.lora_int_id == 4  # 3 went to the refused "d"
        await loras.unload(None, lora_int_id=4)
        assert engine.removed == [2, 4]

        # load_inplace (vLLM's): the name now serves the new adapter, the old one goes.
        await loras.load("e", "/e")
        replaced = await loras.load("e", "/e2", load_inplace=True)
        assert loras.resolve("e") == replaced and replaced.lora_path == "/e2"
        assert engine.removed == [2, 4, 5]

        # A restarted core gets the adapters again before the next request under one.
        engine.loaded.clear()
        engine.num_core_restarts = 1
        await loras.acquire(loras.resolve("a"))
        assert set(engine.loaded) == {1, 6}

    asyncio.run(scenario())


def test_metrics_gauge_without_server():
    from engine.core.core_protocol import EngineCoreStats
    from engine.entrypoints.openai.metrics import ServerMetrics

    assert "lora_requests_info" not in ServerMetrics("tiny").render().decode()
    metrics = ServerMetrics("tiny", max_loras=3)
    metrics._core.stats = EngineCoreStats(max_loras=3, running_lora_adapters={"x": 2, "y": 1},
                                          waiting_lora_adapters={"z": 1})
    (sample,) = _lora_info(metrics.render().decode())
    assert sample["max_lora"] == "3"
    assert sample["running_lora_adapters"] == "x,y"
    assert sample["waiting_lora_adapters"] == "z"
    assert abs(float(sample["value"]) - time.time()) < 60
