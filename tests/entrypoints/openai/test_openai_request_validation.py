"""Request validation of the OpenAI server: no body is a 5xx, every 4xx is an OpenAI error.

One in-process app (``build_app`` over a real AsyncLLM and engine core on the tiny random
Llama) serves the module through Starlette's TestClient. Example tests pin each rule
(nesting depth, finite numbers, strict types, the OpenAPI document, /health); a
hypothesis property test then posts arbitrary JSON bodies to /v1/completions,
/v1/chat/completions, /tokenize and /detokenize and checks every answer.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import EngineArgs
from engine.entrypoints.async_llm import AsyncLLM
from engine.entrypoints.openai.api_server import build_app
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.request_body import (
    DEFAULT_MAX_JSON_DEPTH,
    json_nesting_depth,
    load_json_body,
)
from engine.entrypoints.openai.serving_base import ServerSettings

SERVED_NAME = "tiny"
MAX_MODEL_LEN = 128
MAX_TOKENS_LIMIT = 16  # the completions default (16) stays valid; generators ask for <= 4
MAX_NUM_SEQS = 8
# Examples per endpoint; raise it for a longer local hunt (ENGINE_FUZZ_EXAMPLES=2000).
FUZZ_EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "250"))
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(llama_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(llama_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS, enforce_eager=True))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    app = build_app(engine, ServerSettings(served_model_name=SERVED_NAME,
                                           max_tokens_limit=MAX_TOKENS_LIMIT),
                    shutdown_engine=False)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def assert_well_formed(response, path: str) -> None:
    """No 5xx; a 4xx has an OpenAI error body; a 200 is JSON or an SSE stream whose
    in-band errors are not server errors either."""
    status = response.status_code
    assert status < 500, f"{path}: {status} {response.text[:2000]}"
    content_type = response.headers.get("content-type", "")
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type)
        body = response.json()
        assert body.get("object") == "error", body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == status, error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["type"], error
        assert error["param"] is None or isinstance(error["param"], str), error
        return
    assert status == 200, (status, response.text[:500])
    if content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                assert payload["error"]["code"] < 500, payload
    else:
        assert content_type.startswith("application/json"), content_type
        response.json()


def post(client, path: str, body) -> dict:
    """POST ``body`` (an object, or JSON text as str/bytes); return the error object of
    the 400 it must get."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert_well_formed(response, path)
    assert response.status_code == 400, response.text[:500]
    return response.json()["error"]


def valid_body(path: str, **fields) -> dict:
    base = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
            "/tokenize": {"prompt": "hi"},
            "/detokenize": {"tokens": [1, 2]}}[path]
    return {"model": SERVED_NAME, **base, **fields}


def nested(depth: int, leaf: str = "1") -> str:
    """JSON text: objects and arrays ``depth`` levels deep."""
    return '{"a": [' * (depth // 2) + ("[" if depth % 2 else "") + leaf + (
        "]" if depth % 2 else "") + "]}" * (depth // 2)


# -- the body parser ------------------------------------------------------------------------
def test_nesting_depth_scan():
    assert json_nesting_depth(b'{"a": 1}') == 1
    assert json_nesting_depth(b"[[], [[]], {}]") == 3
    assert json_nesting_depth(nested(1000).encode()) == 1000
    # brackets inside strings (escaped quotes too) do not count; nor does an unclosed one
    assert json_nesting_depth(b'{"a": "[[[{{{", "b\\"[[[": ["\\\\", "]]]"]}') == 2
    assert json_nesting_depth(b'["\\"' + b"[" * 500) == 1
    assert json_nesting_depth(b"") == 0
    assert json_nesting_depth(b"]]]]") == 0
    # linear even for pathological strings (an unterminated string of escaped quotes)
    assert json_nesting_depth(b'\\"' * 500_000 + b"[") == 0


def test_load_json_body_limits():
    assert load_json_body(nested(DEFAULT_MAX_JSON_DEPTH).encode()) is not None
    with pytest.raises(APIError, match=f"deeper than {DEFAULT_MAX_JSON_DEPTH} levels"):
        load_json_body(nested(DEFAULT_MAX_JSON_DEPTH + 1).encode())
    assert load_json_body(nested(10).encode(), max_depth=10)
    with pytest.raises(APIError, match="deeper than 9 levels"):
        load_json_body(nested(10).encode(), max_depth=9)
    for text in ("1e309", "-1e309", "NaN", "Infinity", "-Infinity"):
        with pytest.raises(APIError, match="not a finite number") as info:
            load_json_body(f'{{"x": [1, {{"y": {text}}}]}}'.encode())
        assert info.value.status == 400 and info.value.param == "x"
    assert load_json_body(b'{"x": 1e308, "y": -0.0, "z": 5e-324}')["x"] == 1e308


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_deep_nesting_is_400(client, path):
    for deep in ("[" * 1000 + "]" * 1000, nested(1000), nested(DEFAULT_MAX_JSON_DEPTH + 5)):
        body = json.dumps(valid_body(path))[:-1] + ', "extra": ' + deep + "}"
        error = post(client, path, body)
        assert f"nesting deeper than {DEFAULT_MAX_JSON_DEPTH} levels" in error["message"]
    assert len(nested(1000)) < 8000  # a small body: the size limit is not what stops it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_schema_is_400(client, path):
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    body = valid_body(path, response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    assert "nesting deeper than" in post(client, path, body)["message"]


def _deep_schema_text(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"guided_json": _deep_schema_text(100)}),
    ("/v1/completions", {"guided_json": _deep_schema_text(2000)}),
    ("/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema_text(100)}}}),
    ("/v1/chat/completions", {"structured_outputs": {"json": _deep_schema_text(2000)}}),
    ("/v1/chat/completions", {"guided_regex": "(" * 2000 + "a" + ")" * 2000}),
    ("/v1/chat/completions", {"guided_grammar": "root ::= " + "(" * 2000 + '"a"' + ")" * 2000}),
], ids=["guided_json-100", "guided_json-2000", "response_format-100", "structured_outputs-2000",
        "regex-2000", "grammar-2000"])
def test_deep_constraints_given_as_text_are_400(client, path, fields):
    """A schema sent as JSON text (or a regex / grammar) nests inside a string, out of the
    body check's sight: whoever parses it must refuse deep nesting with a 400 too."""
    post(client, path, valid_body(path, **fields))


@pytest.mark.parametrize("literal", ["1e309", "-1e309", "NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_numbers_are_400(client, literal, field):
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = json.dumps(valid_body(path))[:-1] + f', "{field}": {literal}}}'
        error = post(client, path, body)
        assert error["param"] == field and "not a finite number" in error["message"], error


def test_non_finite_number_inside_a_free_form_field_is_400(client):
    body = json.dumps(valid_body("/v1/chat/completions"))[:-1] + (
        ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        '"schema": {"type": "number", "maximum": 1e999}}}}')
    assert post(client, "/v1/chat/completions", body)["param"] == "response_format"


def test_huge_integers_in_float_fields_are_400(client):
    for value in (10**400, -(10**400)):
        error = post(client, "/v1/completions", valid_body("/v1/completions", temperature=value))
        assert error["param"] == "temperature"


def test_integers_past_64_bits_inside_a_schema_are_400(client):
    """msgpack (the front end -> core wire) carries 64-bit integers only: a schema's
    bigger enum value is the client's error, not a 500."""
    body = json.dumps(valid_body("/v1/chat/completions"))[:-1] + (
        ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        '"schema": {"type": "integer", "enum": [18446744073709551616]}}}}')
    error = post(client, "/v1/chat/completions", body)
    assert "cannot carry" in error["message"]


# -- strict types and ranges -----------------------------------------------------------------
def test_detokenize_takes_only_integer_token_ids(client, engine):
    for tokens in ([False], [True], [1, False], [1.5], ["1"], [None], [-1],
                   [engine.processor.vocab_size], [2**63]):
        error = post(client, "/detokenize", {"tokens": tokens})
        assert error["param"] == "tokens", (tokens, error)
    assert "got a boolean" in post(client, "/detokenize", {"tokens": [False]})["message"]
    ok = client.post("/detokenize", json={"tokens": [1, engine.processor.vocab_size - 1]})
    assert ok.status_code == 200, ok.text


def test_booleans_are_strict(client):
    for value in (0, 1, "true", "yes", "1", 1.0):
        error = post(client, "/tokenize", {"prompt": "hi", "add_special_tokens": value})
        assert error["param"] == "add_special_tokens", error
    error = post(client, "/v1/completions", valid_body("/v1/completions", echo=1))
    assert error["param"] == "echo"
    error = post(client, "/v1/chat/completions", valid_body("/v1/chat/completions", stream=0))
    assert error["param"] == "stream"
    for value in (True, False):
        ok = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": value})
        assert ok.status_code == 200, ok.text


def test_integers_are_strict(client):
    for field, value in [("max_tokens", True), ("max_tokens", 2.5), ("n", "1"), ("seed", 1.5),
                         ("top_k", False), ("max_tokens", 1e300)]:
        error = post(client, "/v1/completions", valid_body("/v1/completions", **{field: value}))
        assert error["param"] == field, (field, value, error)
    # an integral number is an integer, as JSON Schema (and so the OpenAPI document) says
    ok = client.post("/v1/completions", json=valid_body("/v1/completions", max_tokens=2.0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2, ok.text
    assert client.post("/detokenize", json={"tokens": [1.0, 2]}).status_code == 200
    error = post(client, "/v1/completions", valid_body("/v1/completions", prompt=[1, True]))
    assert error["param"] == "prompt"
    error = post(client, "/v1/chat/completions",
                 valid_body("/v1/chat/completions", stop_token_ids=[False]))
    assert error["param"] == "stop_token_ids"


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.5), ("min_p", 2.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("top_k", -2), ("n", 0), ("n", MAX_NUM_SEQS + 1), ("min_tokens", -1),
    ("logit_bias", {"1": 101}), ("logit_bias", {"-1": 1}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"999999": 1}), ("stop", ""), ("stop", ["a", ""]),
    ("stop_token_ids", [-1]), ("allowed_token_ids", [10**6]), ("prompt_logprobs", -1),
    ("truncate_prompt_tokens", 0), ("seed", 2**64), ("priority", -(2**64)),
])
def test_out_of_range_fields_are_400(client, field, value):
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = post(client, path, valid_body(path, **{field: value}))
        assert error["param"] == field, (path, error)


def test_out_of_range_max_tokens_are_400(client):
    assert post(client, "/v1/completions",
                valid_body("/v1/completions", max_tokens=-1))["param"] == "max_tokens"
    for field in ("max_tokens", "max_completion_tokens"):
        for value in (0, MAX_TOKENS_LIMIT + 1, 2**63):
            error = post(client, "/v1/chat/completions",
                         valid_body("/v1/chat/completions", **{field: value}))
            assert error["param"] == field, error
    error = post(client, "/v1/completions", valid_body("/v1/completions", logprobs=-1))
    assert error["param"] == "logprobs"


# -- the OpenAPI document and /health ---------------------------------------------------------
def _resolve(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_openapi_documents_every_request_body_and_response(client, engine):
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    want = {"/v1/completions": "CompletionRequest",
            "/v1/chat/completions": "ChatCompletionRequest",
            "/v1/responses": "ResponsesRequest", "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert set(posts) == set(want)
    for path, operation in posts.items():
        body = operation["requestBody"]
        assert body["required"] is True
        schema = body["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{want[path]}"}
        assert _resolve(document, schema)["type"] == "object"
        responses = operation["responses"]
        assert {"200", "400", "401", "404", "413", "422"} <= set(responses), path
        for status, answer in responses.items():
            if status != "200":
                error_schema = answer["content"]["application/json"]["schema"]
                assert error_schema == {"$ref": "#/components/schemas/ErrorResponse"}
        ok = responses["200"]["content"]["application/json"]["schema"]
        assert _resolve(document, ok)["type"] == "object"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = posts[path]["responses"]
        assert {"429", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert "prompt" in completion["required"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    # the server's own bounds are in the schema
    max_tokens = completion["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens == {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS_LIMIT}
    token = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token == {"type": "integer", "minimum": 0,
                     "maximum": engine.processor.vocab_size - 1}
    temperature = completion["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"type": "number", "minimum": 0.0}
    logit_bias = completion["properties"]["logit_bias"]["anyOf"][0]
    assert logit_bias["propertyNames"] == {"pattern": "^[0-9]+$"}
    assert document["paths"]["/health"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"] == {"$ref": "#/components/schemas/HealthResponse"}
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_health_is_json(client):
    for path in ("/health", "/ping"):
        response = client.get(path)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {"status": "ok"}


# -- the property test ------------------------------------------------------------------------
FINITE = st.floats(allow_nan=False, allow_infinity=False)
NUMBERS = (st.integers(-(2**70), 2**70) | st.floats() | FINITE
           | st.sampled_from([0, 1, -1, 2**63, 2**64, -(2**63) - 1, 0.5, 1e308, 10**30]))
# Number literals json.dumps cannot write, swapped in for their placeholders; all but the
# last must make the whole body a 400.
RAW = {f"@raw{i}@": text for i, text in enumerate(
    ["1e309", "-1e400", "NaN", "Infinity", "-Infinity", "1" * 5000, "1E+99999", "-0"])}
REFUSED = set(list(RAW)[:-1])
LEAVES = (st.none() | st.booleans() | NUMBERS | st.text(max_size=12)
          | st.sampled_from(list(RAW)))
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

TEXT = st.text(max_size=24)
TOKEN = st.integers(-2, 400)
PROMPT = TEXT | st.lists(TEXT, max_size=3) | st.lists(TOKEN, max_size=6) | st.lists(
    st.lists(TOKEN, min_size=1, max_size=4), max_size=2)
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean",
                                                    "null", "bogus"])},
                          optional={"minimum": NUMBERS, "maxLength": NUMBERS,
                                    "pattern": TEXT, "enum": st.lists(LEAVES, max_size=3)}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(TEXT, inner, max_size=3)},
        optional={"required": st.lists(TEXT, max_size=2)})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                            optional={"minItems": NUMBERS, "maxItems": NUMBERS}),
    max_leaves=6)
CONSTRAINT = st.one_of(
    st.fixed_dictionaries({"response_format": st.sampled_from([{"type": "json_object"},
                                                               {"type": "text"}])}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries({
        "type": st.just("json_schema"),
        "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})})}),
    st.fixed_dictionaries({"guided_choice": st.lists(TEXT, max_size=3)}),
    st.fixed_dictionaries({"guided_regex": TEXT | st.sampled_from(["[a-z]{1,3}", "(", "a**"])}),
    st.fixed_dictionaries({"guided_json": SCHEMA | SCHEMA.map(json.dumps) | TEXT}),
    st.fixed_dictionaries({"structured_outputs": JSON}),
)
SAMPLING = {
    "model": st.sampled_from([SERVED_NAME, SERVED_NAME, "other", ""]) | TEXT,
    "n": st.integers(-1, MAX_NUM_SEQS + 1), "temperature": NUMBERS, "top_p": NUMBERS,
    "top_k": st.integers(-3, 500), "min_p": NUMBERS, "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS, "repetition_penalty": NUMBERS, "seed": NUMBERS,
    "stop": TEXT | st.lists(TEXT, max_size=3), "stop_token_ids": st.lists(TOKEN, max_size=3),
    "logit_bias": st.dictionaries(TEXT | TOKEN.map(str), NUMBERS, max_size=3),
    "min_tokens": st.integers(-1, 6), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "ignore_eos": st.booleans(), "prompt_logprobs": st.integers(-1, 25),
    "truncate_prompt_tokens": st.integers(-1, 200),
    "allowed_token_ids": st.lists(TOKEN, max_size=3),
    "bad_words": st.lists(TEXT, max_size=2), "priority": st.integers(-2, 2),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "wizard"]),
     "content": st.none() | TEXT | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)},
    optional={"name": TEXT})
MESSAGES = st.lists(MESSAGE, max_size=3)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT}, optional={"parameters": SCHEMA, "description": TEXT})})
FIELDS = {
    "/v1/completions": {**SAMPLING, "prompt": PROMPT, "max_tokens": st.integers(-1, 4),
                        "logprobs": st.integers(-1, 25), "echo": st.booleans(),
                        "best_of": st.integers(0, 3), "add_special_tokens": st.booleans()},
    "/v1/chat/completions": {
        **SAMPLING, "messages": MESSAGES, "max_tokens": st.integers(-1, 4),
        "max_completion_tokens": st.integers(-1, 4), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 25), "tools": st.lists(TOOL, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}),
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=2),
    },
    "/tokenize": {"model": SAMPLING["model"], "prompt": TEXT, "messages": MESSAGES,
                  "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                  "continue_final_message": st.booleans(), "return_token_strs": st.booleans()},
    "/detokenize": {"model": SAMPLING["model"], "tokens": st.lists(TOKEN, max_size=8)},
}
# Values every server accepts, so that requests get past validation into generation,
# structured outputs and the chat template.
VALID_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=16)
VALID_SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(VALID_TEXT, inner, max_size=2)})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
    max_leaves=4)
VALID_SAMPLING = {
    "model": st.just(SERVED_NAME), "n": st.integers(1, 2),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.lists(VALID_TEXT, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=2),
    "logit_bias": st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100),
                                  max_size=2),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "prompt_logprobs": st.integers(0, 3),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "guided_choice": st.lists(VALID_TEXT, min_size=1, max_size=3),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])
    | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.just("s"), "schema": VALID_SCHEMA})}),
}
VALID_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": VALID_TEXT}),
    min_size=1, max_size=2).map(lambda m: [*m[:-1], {"role": "user", "content": m[-1]["content"]}])
VALID = {
    "/v1/completions": {**VALID_SAMPLING, "logprobs": st.integers(0, 3), "echo": st.booleans(),
                        "prompt": VALID_TEXT | st.lists(st.integers(0, 383), min_size=1,
                                                        max_size=8)},
    "/v1/chat/completions": {**VALID_SAMPLING, "messages": VALID_MESSAGES,
                             "logprobs": st.just(True), "top_logprobs": st.integers(0, 3)},
    "/tokenize": {"model": st.just(SERVED_NAME), "prompt": VALID_TEXT,
                  "return_token_strs": st.booleans(), "add_special_tokens": st.booleans()},
    "/detokenize": {"model": st.just(SERVED_NAME),
                    "tokens": st.lists(st.integers(0, 383), max_size=8)},
}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages",
            "/tokenize": "prompt", "/detokenize": "tokens"}


def _has_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    return isinstance(value, list) and any(_has_non_finite(v) for v in value)


def _encode(value) -> tuple[str, bool]:
    """JSON text of ``value`` with the RAW literals swapped in, and whether one of those
    the server must refuse is in it (``allow_nan``: NaN and inf floats become literals)."""
    text = json.dumps(value, allow_nan=True)
    refused = _has_non_finite(value)
    for placeholder, raw in RAW.items():
        quoted = f'"{placeholder}"'
        if quoted in text:
            refused |= placeholder in REFUSED
            text = text.replace(quoted, raw)
    return text, refused


@st.composite
def bodies(draw, path: str) -> tuple[str, bool]:
    """JSON text for ``path`` (and whether it must be refused for a number in it):
    valid-shaped requests with random values (mostly), wrong types for known fields,
    random fields, deep nesting, or any JSON at all."""
    kind = draw(st.sampled_from(["valid"] * 3 + ["shaped"] * 3
                                + ["wrong_types", "deep", "anything"]))
    if kind == "anything":
        return _encode(draw(JSON))
    if kind == "valid":
        fields = VALID[path]
        names = sorted(set(fields) - {"guided_choice", "response_format"})
        body = {name: draw(fields[name]) for name in draw(
            st.lists(st.sampled_from(names), max_size=5, unique=True))}
        body[REQUIRED[path]] = draw(fields[REQUIRED[path]])
        if path in ("/v1/completions", "/v1/chat/completions"):
            body["max_tokens"] = draw(st.integers(1, 4))
            if draw(st.integers(0, 2)) == 0:
                constraint = draw(st.sampled_from(["guided_choice", "response_format"]))
                body[constraint] = draw(fields[constraint])
        return _encode(body)
    fields = FIELDS[path]
    names = sorted(fields)
    chosen = draw(st.lists(st.sampled_from(names), max_size=6, unique=True))
    body = {name: draw(fields[name]) for name in chosen}
    required = REQUIRED[path]
    if required not in body and draw(st.integers(0, 9)) > 0:
        body[required] = draw(fields[required])
    if "max_tokens" in fields and "max_tokens" not in body:
        body["max_tokens"] = draw(st.integers(0, 4))  # keep generation short
    if path in ("/v1/completions", "/v1/chat/completions") and draw(st.integers(0, 3)) == 0:
        body.update(draw(CONSTRAINT))
    if kind == "wrong_types":
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3)):
            body[name] = draw(JSON)
    body.update(draw(st.dictionaries(st.text(max_size=10), JSON, max_size=2)))
    text, refused = _encode(body)
    if kind == "deep":
        depth = draw(st.integers(DEFAULT_MAX_JSON_DEPTH - 3, 3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"k":', "}"), ('[{"k":', "}]")]))
        deep = opener * depth + draw(st.sampled_from(["1", "[]", "{}", '"s"'])) + closer * depth
        text = text[:-1] + (", " if len(body) else "") + f'"deep": {deep}}}'
        refused |= depth > DEFAULT_MAX_JSON_DEPTH
    return text, refused


@pytest.mark.parametrize("path", POST_PATHS)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_any_body_gets_a_well_formed_answer(client, path, data):
    body, refused = data.draw(bodies(path))
    response = client.post(path, content=body.encode(),
                           headers={"content-type": "application/json"})
    event(f"status {response.status_code}")  # pytest --hypothesis-show-statistics
    assert_well_formed(response, path)
    if refused:  # a non-finite number or too deep nesting anywhere is a 400
        assert response.status_code == 400, (response.text[:300], body[:300])
