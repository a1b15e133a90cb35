"""Tool calling on the embedded demo model (ChatML + Hermes ``<tool_call>``, tools in its
chat template): unconstrained, it writes tool calls of its own invention; with
``tool_choice`` "required" or a named function every finished output is a valid call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured_output.openai_fields import structured_outputs_from_request
from engine.structured_output.tool_choice import ToolCallHandler

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
]
QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?"]


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu")


def _chat(demo, params):
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [o.outputs[0] for o in demo.chat(messages, params, tools=TOOLS, use_tqdm=False)]


def _assert_valid_calls(calls) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_choice_gives_valid_calls(demo, tool_choice):
    body = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    so = structured_outputs_from_request(body)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    handler = ToolCallHandler.from_request(TOOLS, tool_choice)
    finished = [c for c in _chat(demo, params) if c.finish_reason == "stop"]
    assert finished
    for completion in finished:
        extracted = handler.extract(completion.text)
        assert extracted.content is None
        _assert_valid_calls(extracted.tool_calls)
        if isinstance(tool_choice, dict):
            assert [c.name for c in extracted.tool_calls] == ["get_time"]


def test_auto_tool_calls_parse_whole_and_streamed(demo):
    """The <tool_call> tags are special tokens of the demo tokenizer: keep them in the text."""
    handler = ToolCallHandler.from_request(TOOLS, "auto")
    params = handler.adjust_params(SamplingParams(temperature=0.0, max_tokens=80))
    assert not params.skip_special_tokens
    parser = handler.parser
    tokenizer = demo.get_tokenizer()
    for completion in _chat(demo, params):
        # The demo model answers tool questions with a call (of its own invention).
        assert completion.text.startswith("<tool_call>")
        whole = parser.extract_tool_calls(completion.text)
        stream, content, names, arguments = parser.stream(), "", [], {}
        for token in completion.token_ids:  # the text as a server would stream it
            delta = stream.feed(tokenizer.decode([token], skip_special_tokens=False))
            content += delta.content
            for piece in delta.tool_calls:
                names += [piece.name] if piece.name else []
                arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
        content += stream.finish().content
        if not whole.tools_called:  # e.g. cut off inside its call: no sound call to compare
            continue
        assert names == [c.name for c in whole.tool_calls]
        for i, call in enumerate(whole.tool_calls):
            assert json.loads(arguments[i]) == json.loads(call.arguments)
