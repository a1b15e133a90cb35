"""``POST /v1/responses`` (OpenAI's Responses API) with the real openai client against one
`engine serve` subprocess on the tiny random Llama (conftest's ``start_server``).

The Responses API runs through the chat pipeline, so its greedy outputs are compared with
chat completions over the same conversation: plain input, instructions + items, a
previous_response_id chain, function calls and their outputs. Also: the streamed event
order, forced tool calls as function_call items, text.format json_schema, the
max_output_tokens cut (status "incomplete"), the store (GET / DELETE) and the 400s / 404s
in OpenAI's error shape.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.conftest import SERVED_NAME

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--timeout-graceful-shutdown", "0", "--max-stored-responses", "4")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _chat_text(client, messages, max_tokens) -> tuple[str, str]:
    out = client.chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0,
                                         max_completion_tokens=max_tokens)
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def test_plain_input_equals_chat(client):
    resp = client.responses.create(model=SERVED_NAME, input="Tell me a story.",
                                   temperature=0, max_output_tokens=12)
    text, finish = _chat_text(client, [{"role": "user", "content": "Tell me a story."}], 12)
    assert resp.output_text == text
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == SERVED_NAME and resp.error is None
    assert resp.status == ("incomplete" if finish == "length" else "completed")
    message = resp.output[-1]
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    usage = resp.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the request's settings are echoed
    assert resp.temperature == 0 and resp.max_output_tokens == 12 and resp.store is True
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.parallel_tool_calls
    assert resp.text.format.type == "text" and resp.previous_response_id is None


def test_instructions_and_items_equal_chat(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "Be short."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                          {"type": "input_text", "text": "colour."}]}]
    resp = client.responses.create(model=SERVED_NAME, input=items, instructions="You help.",
                                   temperature=0, max_output_tokens=10,
                                   metadata={"k": "v"}, user="u1")
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "developer", "content": "Be short."},
                {"role": "user", "content": "Name a colour."}]
    assert resp.output_text == _chat_text(client, messages, 10)[0]
    assert resp.instructions == "You help." and resp.metadata == {"k": "v"}


def test_function_call_output_items_equal_chat(client):
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    resp = client.responses.create(model=SERVED_NAME, input=items, tools=TOOLS,
                                   tool_choice="none", temperature=0, max_output_tokens=8)
    chat = client.chat.completions.create(
        model=SERVED_NAME, temperature=0, max_completion_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in TOOLS],
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "rain"}])
    assert resp.output_text == (chat.choices[0].message.content or "")


def test_stream_events(client):
    stream = client.responses.create(model=SERVED_NAME, input="Tell me a story.",
                                     temperature=0, max_output_tokens=12, stream=True)
    events = list(stream)
    types = [e.type for e in events]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    final = events[-1]
    assert types[-1] in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # streamed as generated
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", types[-1]]
    text = "".join(deltas)
    assert events[4 + len(deltas)].text == text
    assert final.response.output_text == text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    # the same as the non-streamed response
    again = client.responses.create(model=SERVED_NAME, input="Tell me a story.",
                                    temperature=0, max_output_tokens=12)
    assert again.output_text == text and again.status == final.response.status
    assert again.usage.output_tokens == final.response.usage.output_tokens


def _check_call(item, allowed: set[str]) -> None:
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id
    assert item.name in allowed
    jsonschema.validate(json.loads(item.arguments), PARAMS[item.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_calls(client, tool_choice):
    allowed = set(PARAMS) if tool_choice == "required" else {"get_time"}
    resp = client.responses.create(model=SERVED_NAME, input="What now?", tools=TOOLS,
                                   tool_choice=tool_choice, temperature=0,
                                   max_output_tokens=96, parallel_tool_calls=False)
    assert resp.status == "completed", resp
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and len(resp.output) == 1
    _check_call(calls[0], allowed)
    assert resp.tools[0].name == "get_weather"
    # streamed: the arguments arrive in pieces and join to the final item's
    events = list(client.responses.create(model=SERVED_NAME, input="What now?", tools=TOOLS,
                                          tool_choice=tool_choice, temperature=0,
                                          max_output_tokens=96, parallel_tool_calls=False,
                                          stream=True))
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(pieces) == done.arguments == calls[0].arguments
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    _check_call(events[-1].response.output[0], allowed)
    with client.responses.stream(model=SERVED_NAME, input="What now?", tools=TOOLS,
                                 tool_choice=tool_choice, temperature=0, max_output_tokens=96,
                                 parallel_tool_calls=False) as helper:
        accumulated = helper.get_final_response()  # the client's helper accumulates events
    assert accumulated.output[0].arguments == calls[0].arguments


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]},
                                               "ok": {"type": "boolean"}},
              "required": ["zone", "ok"], "additionalProperties": False}
    resp = client.responses.create(
        model=SERVED_NAME, input="Describe.", temperature=0, max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                         "strict": True}})
    if resp.status == "completed":
        jsonschema.validate(json.loads(resp.output_text), schema)
    else:  # free JSON whitespace: a random model may pad until the limit
        assert resp.output_text.startswith("{")
    assert resp.text.format.type == "json_schema"
    # the client's parse helper (a pydantic model as the schema)
    import pydantic

    class Thing(pydantic.BaseModel):
        zone: Literal["utc", "cet"]
        ok: bool

    parsed = client.responses.parse(model=SERVED_NAME, input="Describe.", temperature=0,
                                    max_output_tokens=64, text_format=Thing)
    if parsed.status == "completed":
        assert isinstance(parsed.output_parsed, Thing)


def test_max_output_tokens_cut_is_incomplete(client):
    resp = client.responses.create(model=SERVED_NAME, input="Tell me a long story.",
                                   temperature=0, max_output_tokens=2)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 2


def test_previous_response_id_chains_the_conversation(client, server):
    first = client.responses.create(model=SERVED_NAME, input="Hi there", temperature=0,
                                    max_output_tokens=6, instructions="Only here.")
    second = client.responses.create(model=SERVED_NAME, input="And then?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # instructions are not carried over (OpenAI's rule)
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    assert second.output_text == _chat_text(client, messages, 6)[0]
    third = client.responses.create(model=SERVED_NAME, input="Why?", temperature=0,
                                    max_output_tokens=6, previous_response_id=second.id)
    messages += [{"role": "assistant", "content": second.output_text},
                 {"role": "user", "content": "Why?"}]
    assert third.output_text == _chat_text(client, messages, 6)[0]
    # stored responses: GET returns them, DELETE drops them
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=SERVED_NAME, input="x", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    # store=false keeps nothing
    unstored = client.responses.create(model=SERVED_NAME, input="x", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # the store is bounded (--max-stored-responses 4): the least recently used go first
    client.responses.retrieve(second.id)  # now more recent than third
    for _ in range(3):
        client.responses.create(model=SERVED_NAME, input="x", max_output_tokens=1)
    client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)


def test_bad_requests_are_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=SERVED_NAME, input="x", background=True)
    assert info.value.body["param"] == "background"
    assert "background" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    url = server.url + "/v1/responses"
    cases = [
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),
        ({"input": "hello " * 400}, "input"),  # longer than --max-model-len 256
    ]
    for body, param in cases:
        error = _error(httpx.post(url, json={"model": SERVED_NAME, **body}), 400, param)
        assert error["type"] == "BadRequestError" and error["code"] == 400
    _error(httpx.get(url + "/resp_unknown"), 404)
    _error(httpx.delete(url + "/resp_unknown"), 404)
