"""Tool-call parsing on hand-written model outputs, whole and streamed in pieces, and the
tool_choice schemas / forced-call conversions."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from engine.structured_output.tool_calls import (
    ToolCallStream,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from engine.structured_output.tool_choice import (
    ToolCallHandler,
    parse_tool_choice,
    tool_choice_schema,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]

TWO_CALLS = (
    "Let me check both.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}b\\"c</tool_call>"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i : i + n])
        i += n
    return out


def _run_stream(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict]]:
    """Assemble streamed deltas the way an OpenAI client does."""
    content, calls = "", {}
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            item = piece.to_openai()
            call = calls.setdefault(item["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in item:
                assert call["id"] is None, "id sent twice"
                call["id"] = item["id"]
            if "name" in item["function"]:
                call["name"] = item["function"]["name"]
            call["arguments"] += item["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_extracts_calls_and_content():
    result = get_tool_parser("hermes").extract_tool_calls(TWO_CALLS)
    assert result.tools_called and result.content == "Let me check both."
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(result.tool_calls[0].arguments) == {
        "city": "Paris",
        "note": 'a}b"c</tool_call>',
    }
    assert json.loads(result.tool_calls[1].arguments) == {}
    ids = [c.to_openai()["id"] for c in result.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no tools.",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_hermes_without_valid_calls_is_content(text):
    result = get_tool_parser("hermes").extract_tool_calls(text)
    assert not result.tools_called and result.content == text


def test_hermes_unterminated_final_call():
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'
    result = get_tool_parser("hermes").extract_tool_calls(text)
    assert result.content is None and json.loads(result.tool_calls[0].arguments) == {"tz": "UTC"}


@pytest.mark.parametrize("seed", range(6))
def test_hermes_stream_matches_whole_parse(seed):
    parser = get_tool_parser("hermes")
    content, calls = _run_stream(parser.stream(), _pieces(TWO_CALLS, seed))
    whole = parser.extract_tool_calls(TWO_CALLS)
    assert content == whole.content
    assert [c["name"] for c in calls] == [c.name for c in whole.tool_calls]
    for streamed, parsed in zip(calls, whole.tool_calls):
        assert json.loads(streamed["arguments"]) == json.loads(parsed.arguments)
        assert streamed["id"] is not None


def test_hermes_stream_sends_name_and_arguments_early():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Sure! <tool_").content == "Sure!"  # "<tool_" held back
    first = stream.feed('call>{"name": "get_weather", "arguments": {"ci')
    assert first.tool_calls[0].name == "get_weather" and first.tool_calls[0].id
    assert first.tool_calls[1].arguments == '{"ci'
    more = stream.feed('ty": "Rome"}}</tool_call>')
    assert "".join(d.arguments for d in more.tool_calls) == 'ty": "Rome"}'
    assert stream.tools_called and not stream.finish()


@pytest.mark.parametrize("text", ["plain answer < 3 and <tool", "<tool_call>oops"])
def test_hermes_stream_gives_back_non_calls_as_content(text):
    content, calls = _run_stream(get_tool_parser("hermes").stream(), _pieces(text, 1))
    assert content == text and calls == []


def test_registry():
    assert "hermes" in tool_parser_names()
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes")(type("Other", (get_tool_parser("hermes").__class__,), {}))


def test_required_schema_validates_calls_and_round_trips():
    schema = tool_choice_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "other", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)["maxItems"] == 1
    text = json.dumps(good)
    handler = ToolCallHandler.from_request(TOOLS, "required")
    whole = handler.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        (g["name"], g["arguments"]) for g in good
    ]
    content, calls = _run_stream(handler.stream(), _pieces(text, 3))
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (g["name"], g["arguments"]) for g in good
    ]


def test_named_function_schema_and_calls():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_schema(TOOLS, choice) == TOOLS[0]["function"]["parameters"]
    handler = ToolCallHandler.from_request(TOOLS, choice)
    text = '{"city": "Lima", "unit": "C"}'
    whole = handler.extract(text)
    assert whole.content is None and whole.tool_calls[0].name == "get_weather"
    assert json.loads(whole.tool_calls[0].arguments) == {"city": "Lima", "unit": "C"}
    content, calls = _run_stream(handler.stream(), _pieces(text, 4))
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Lima", "unit": "C"}


def test_auto_and_none_do_not_constrain():
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(TOOLS, None) is None
    assert tool_choice_schema(None, None) is None
    assert ToolCallHandler.from_request(TOOLS, "none").extract(TWO_CALLS).content == TWO_CALLS
    auto = ToolCallHandler.from_request(TOOLS, "auto").extract(TWO_CALLS)
    assert len(auto.tool_calls) == 2


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (None, "required", "needs a non-empty tools list"),
        (TOOLS, "sometimes", "must be 'none', 'auto', 'required'"),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "'nope', which is not in tools",
        ),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        ([{"type": "function", "function": {}}], "auto", r"tools\[0\].function"),
        ([{"type": "retrieval"}], "auto", r"tools\[0\] must be"),
        (TOOLS + TOOLS[:1], "auto", "appears twice"),
    ],
)
def test_bad_tool_requests(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        tool_choice_schema(tools, choice)


def test_parse_tool_choice_defaults():
    assert parse_tool_choice(None, TOOLS).mode == "auto"
    assert parse_tool_choice(None, None).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS)
    assert (named.mode, named.function) == ("named", "get_time")


def test_auto_keeps_special_tokens_for_the_parser():
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=5)
    assert not ToolCallHandler.from_request(TOOLS, "auto").adjust_params(params).skip_special_tokens
    assert ToolCallHandler.from_request(TOOLS, "required").adjust_params(params) is params
    assert ToolCallHandler.from_request(TOOLS, "none").adjust_params(params) is params
