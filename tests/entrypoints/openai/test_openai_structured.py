"""Structured outputs and tool calling through the OpenAI-compatible server, end to end:
one real `engine serve` subprocess on the tiny random Llama, driven by the `openai`
client. Random weights produce garbage, which is what the constraints must fix: every
output that finishes with "stop" must validate against its schema (jsonschema), fullmatch
its regex or be one of its choices; forced tool calls must carry arguments that validate
against the function's parameters.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine.core.outputs import CompletionOutput
from engine.entrypoints.openai.serving_base import structured_output_failure
from tests.helpers.hf_models import TOOLS_CHAT_TEMPLATE

SERVED_NAME = "tiny"  # conftest's ServerProcess serves under this name
MESSAGES = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
PARAMS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "it depends"]
# Forces the model into Hermes syntax, so tool_choice "auto" has a call to parse.
HERMES_REGEX = (r'<tool_call>\{"name": "get_weather", "arguments": '
                r'\{"city": "[a-z]{1,5}", "days": [1-7]\}\}</tool_call>')


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-num-seqs", "32", "--timeout-graceful-shutdown", "0")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                              timeout=120)


def _valid(instance_text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(instance_text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _check_calls(tool_calls, allowed: set[str]) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        assert _valid(call.function.arguments, PARAMS_BY_NAME[call.function.name]), call


# -- response_format / guided_* ------------------------------------------------------------
def test_json_schema_outputs_validate(client):
    # OpenAI's response_format: JSON whitespace is free, so a random model may pad until
    # max_tokens; what finishes must validate, what does not is a JSON prefix.
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=24, n=3, seed=1, temperature=0.8,
        response_format=response_format)
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert _valid(choice.message.content, SCHEMA), choice.message.content
        else:
            assert choice.message.content.startswith("{")
    # vLLM's structured_outputs with compact JSON: outputs finish, and validate.
    out = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=64, n=3, seed=2, temperature=0.7,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    stopped = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 2, out.choices
    for text in stopped:
        assert _valid(text, SCHEMA), text


def test_json_object_on_completions(client):
    out = client.completions.create(model=SERVED_NAME, prompt="Data:", max_tokens=40, n=3,
                                    temperature=0.9, seed=3,
                                    extra_body={"response_format": {"type": "json_object"}})
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice.text
        else:
            assert choice.text.lstrip().startswith("{")


def test_guided_regex_and_choice(client):
    out = client.completions.create(model=SERVED_NAME, prompt="Code:", max_tokens=16, n=3,
                                    temperature=1.0, seed=4,
                                    extra_body={"guided_regex": REGEX})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(REGEX, choice.text), choice.text
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8,
                                          n=3, temperature=1.0, seed=5,
                                          extra_body={"guided_choice": CHOICES})
    for choice in chat.choices:
        assert choice.finish_reason == "stop" and choice.message.content in CHOICES


def test_streamed_json_schema_validates(client):
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=48, temperature=0.0, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    assert _valid(text, SCHEMA), text


# -- tools ---------------------------------------------------------------------------------
def test_required_and_named_tool_calls(client):
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", max_tokens=96, n=2,
                                         temperature=0.7, seed=6, parallel_tool_calls=False)
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
            _check_calls(choice.message.tool_calls, set(PARAMS_BY_NAME))
    assert any(c.finish_reason == "tool_calls" for c in out.choices)

    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                         tool_choice=named, max_tokens=32, temperature=0.0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # a forced function keeps "stop", as OpenAI does
    _check_calls(choice.message.tool_calls, {"get_time"})
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_accumulate(client, tool_choice):
    with client.chat.completions.stream(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                        tool_choice=tool_choice, max_tokens=96,
                                        temperature=0.0, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    expected = "tool_calls" if tool_choice == "required" else "stop"
    assert choice.finish_reason == expected, choice
    allowed = set(PARAMS_BY_NAME) if tool_choice == "required" else {"get_weather"}
    _check_calls(choice.message.tool_calls, allowed)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False


def test_auto_tool_choice_parses_hermes_calls(client):
    # Unforced, the random model writes text: a well-formed plain answer.
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=12, temperature=0.0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and not choice.message.tool_calls
    # Forced into Hermes syntax by a regex, the call is parsed out of the text.
    extra = {"guided_regex": HERMES_REGEX}
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="auto", max_tokens=120, temperature=0.0,
                                         extra_body=extra)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _check_calls(choice.message.tool_calls, {"get_weather"})
    with client.chat.completions.stream(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                        max_tokens=120, temperature=0.0,
                                        extra_body=extra) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_tools_reach_the_chat_template(client):
    def prompt_tokens(tool_choice: str) -> int:
        out = client.chat.completions.create(
            model=SERVED_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=1, extra_body={"chat_template": TOOLS_CHAT_TEMPLATE})
        return out.usage.prompt_tokens

    assert prompt_tokens("auto") > prompt_tokens("none")  # "none": no tools rendered


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "not a valid JSON Schema"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "at most one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "one way only"),
])
def test_bad_constraints_are_400s(server, body, param, words):
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4, "stream": stream,
            **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert error["param"] == param, error
        assert words in error["message"], error


def test_bad_constraint_on_completions_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "xml"}})
    assert "response_format" in info.value.body["message"]


def test_core_side_failure_is_a_400():
    """What the engine core reports when a grammar fails mid-request."""
    failed = CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort",
                              stop_reason="structured output error: could not compile")
    error = structured_output_failure(failed)
    assert error is not None and error.status == 400
    assert error.body()["error"]["message"] == failed.stop_reason
    plain_abort = CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")
    assert structured_output_failure(plain_abort) is None


# -- concurrency ---------------------------------------------------------------------------
def test_constrained_and_unconstrained_concurrently(aclient):
    def plain_request():
        return aclient.completions.create(model=SERVED_NAME, prompt="Hello there",
                                          max_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True})

    async def run():
        alone = await plain_request()
        constrained = aclient.chat.completions.create(
            model=SERVED_NAME, messages=MESSAGES, max_tokens=48, temperature=0.0,
            extra_body={"structured_outputs": {"json": SCHEMA,
                                               "disable_any_whitespace": True}})
        return alone, *await asyncio.gather(constrained, plain_request())

    alone, constrained, plain = asyncio.run(run())
    assert plain.choices[0].text == alone.choices[0].text
    assert plain.choices[0].finish_reason == "length"
    choice = constrained.choices[0]
    assert choice.finish_reason == "stop"
    assert _valid(choice.message.content, SCHEMA), choice.message.content


# -- --tool-call-parser --------------------------------------------------------------------
def test_unknown_tool_call_parser_is_rejected():
    from click.testing import CliRunner

    from engine.cli.serve import serve_cmd
    from engine.entrypoints.openai.api_server import build_app
    from engine.entrypoints.openai.serving_base import ServerSettings

    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        build_app(object(), ServerSettings(tool_call_parser="nope"))
    result = CliRunner().invoke(serve_cmd, ["--tool-call-parser", "nope"])
    assert result.exit_code == 2 and "hermes" in result.output  # a usage error, at once
