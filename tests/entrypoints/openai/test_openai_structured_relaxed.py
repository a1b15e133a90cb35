"""JSON schemas a backend cannot enforce in full, through a real `engine serve` process:
``strict`` is a 400 naming the unsupported keyword, otherwise the response's
``x-structured-output-relaxed`` header names the relaxed keywords and the rest of the
schema holds; ECMA-262 regexes; the ``--structured-outputs-config`` defaults; the
structured-output families of ``/metrics``."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

from engine.structured_output.ecma_regex import schema_patterns_to_python
from tests.helpers.structured import UNIQUE

SERVED_NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Some data."}]
HEADER = "x-structured-output-relaxed"
# Object-rooted with an overlapping oneOf (both branches take {}).
OBJECT_ONE_OF = {
    "type": "object",
    "oneOf": [{"properties": {"a": {"type": "number"}}}, {"items": {"type": "number"}}],
    "maxProperties": 2,
}
NAMED_GROUPS = {"type": "object",
                "properties": {"d": {"type": "string", "pattern": r"^(?<y>\d{4})-(?<m>\d{2})$"}},
                "required": ["d"], "additionalProperties": False}


def _json_schema(schema, strict=None):
    spec = {"name": "data", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def _without(schema, *keywords):
    out = copy.deepcopy(schema)
    for node in [out, *out.get("properties", {}).values()]:
        for keyword in keywords:
            node.pop(keyword, None)
    return out


def _outside_strings(text: str) -> str:
    """``text`` (JSON) without the contents of its strings."""
    out, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                out.append(ch)
        else:
            if ch == '"':
                in_string = True
            out.append(ch)
    return "".join(out)


@pytest.fixture(scope="module")
def server(start_server):
    # Compact JSON for every request by default (vLLM's flag and name).
    return start_server("--max-num-seqs", "16", "--timeout-graceful-shutdown", "0",
                        "--structured-outputs-config", '{"disable_any_whitespace": true}')


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _chat(http, **body):
    return http.post("/v1/chat/completions",
                     json={"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 48,
                           "temperature": 1.0, **body})


def test_strict_schema_that_cannot_be_enforced_is_a_400(http):
    reply = _chat(http, response_format=_json_schema(UNIQUE, strict=True))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == "response_format"
    assert "uniqueItems" in error["message"] and "strict" in error["message"]
    # vLLM's structured_outputs takes the same flag.
    reply = http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "Data:", "max_tokens": 8,
        "structured_outputs": {"json": OBJECT_ONE_OF, "strict": True}})
    assert reply.status_code == 400 and "oneOf" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "structured_outputs"


def test_relaxed_schema_names_the_keywords_and_enforces_the_rest(http):
    reply = _chat(http, response_format=_json_schema(UNIQUE), n=4, seed=3)
    assert reply.status_code == 200, reply.text
    assert reply.headers[HEADER] == "uniqueItems"
    finished = [c["message"]["content"] for c in reply.json()["choices"]
                if c["finish_reason"] == "stop"]
    assert finished
    for text in finished:
        jsonschema.validate(json.loads(text), _without(UNIQUE, "uniqueItems"))
    # A schema enforced in full has no header.
    full = _chat(http, response_format=_json_schema(_without(UNIQUE, "uniqueItems"), True))
    assert full.status_code == 200 and HEADER not in full.headers


def test_object_rooted_one_of_is_reported_and_stays_an_object(http):
    reply = _chat(http, response_format=_json_schema(OBJECT_ONE_OF), n=4, seed=5)
    assert reply.status_code == 200, reply.text
    # Neither backend enforces this oneOf, nor maxProperties beside optional properties.
    assert reply.headers[HEADER] == "maxProperties,oneOf"
    for choice in reply.json()["choices"]:
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text  # never [1.0]
        else:
            assert text.startswith("{"), text


def test_relaxed_header_on_a_stream(http):
    with http.stream("POST", "/v1/completions", json={
            "model": SERVED_NAME, "prompt": "Data:", "max_tokens": 16, "stream": True,
            "response_format": _json_schema(UNIQUE)}) as reply:
        assert reply.status_code == 200
        assert reply.headers[HEADER] == "uniqueItems"
        body = "".join(reply.iter_text())
    assert body.rstrip().endswith("data: [DONE]")


def test_named_group_regex_is_accepted_and_enforced(http):
    reply = _chat(http, response_format=_json_schema(NAMED_GROUPS, strict=True), n=3, seed=7)
    assert reply.status_code == 200, reply.text
    assert HEADER not in reply.headers
    for choice in reply.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]),
                            schema_patterns_to_python(NAMED_GROUPS))
    regex = http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "Date:", "max_tokens": 12,
        "structured_outputs": {"regex": r"(?<y>\d{4})-(?<m>\d{2})"}})
    assert regex.status_code == 200, regex.text
    text = regex.json()["choices"][0]["text"]
    assert len(text) == 7 and text[4] == "-" and (text[:4] + text[5:]).isdigit(), text


def test_ecma_invalid_regex_is_a_400(http):
    python_style = {"type": "string", "pattern": r"^(?P<y>\d{4})$"}
    reply = _chat(http, response_format=_json_schema(python_style))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format" and "ECMA-262" in error["message"]
    reply = http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "x", "max_tokens": 4, "guided_regex": r"(?i)yes"})
    assert reply.status_code == 400 and "ECMA-262" in reply.json()["error"]["message"]


def test_server_default_disables_free_whitespace(http):
    # response_format would allow any whitespace; the server's default makes it compact.
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}}, "required": ["a"]}
    reply = _chat(http, response_format=_json_schema(schema), n=4, seed=11)
    assert reply.status_code == 200
    for choice in reply.json()["choices"]:
        skeleton = _outside_strings(choice["message"]["content"])
        assert "\n" not in skeleton and "\t" not in skeleton and "  " not in skeleton, skeleton
    # A request's own choice wins.
    assert _chat(http, structured_outputs={"json": schema, "disable_any_whitespace": False},
                 max_tokens=4).status_code == 200


def test_metrics_show_compile_time_cache_and_relaxed_keywords(http):
    for _ in range(2):  # the second is a cache hit
        assert _chat(http, response_format=_json_schema(UNIQUE), max_tokens=4).status_code == 200
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("engine:structured_output") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)

    def value(prefix: str) -> float:
        return sum(v for k, v in values.items() if k.startswith(prefix))

    assert value('engine:structured_output_compile_seconds_count{model_name="tiny",'
                 'stage="check"}') >= 1
    assert value('engine:structured_output_cache_misses_total{model_name="tiny",'
                 'stage="check"}') >= 1
    assert value('engine:structured_output_cache_hits_total{model_name="tiny",'
                 'stage="check"}') >= 1
    assert value('engine:structured_output_requests_total{enforcement="relaxed"') >= 2
    assert value('engine:structured_output_relaxed_keywords_total{keyword="uniqueItems"') >= 2
