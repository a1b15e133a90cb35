"""OpenAI / vLLM request fields -> StructuredOutputsParams."""

from __future__ import annotations

import pytest

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.openai_fields import structured_outputs_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA, strict=True),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": '{"type": "string"}'}, StructuredOutputsParams(json={"type": "string"})),
        (
            {"guided_regex": "a+", "guided_decoding_backend": "guidance"},
            StructuredOutputsParams(regex="a+", backend="llguidance"),
        ),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"structured_outputs": {"regex": "b+"}}, StructuredOutputsParams(regex="b+")),
        ({"tools": TOOLS}, None),
        ({"tools": TOOLS, "tool_choice": "none"}, None),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        (
            {"tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "json_object"}},
            StructuredOutputsParams(json_object=True),
        ),
    ],
)
def test_translation(body, expected):
    assert structured_outputs_from_request(body) == expected


def test_required_tool_choice_forces_an_array_of_calls():
    so = structured_outputs_from_request({"tools": TOOLS, "tool_choice": "required"})
    assert so.json["type"] == "array" and so.json["minItems"] == 1
    assert so.json["items"]["properties"]["name"] == {"type": "string", "enum": ["f"]}


def test_pydantic_request_with_extra_fields():
    from pydantic import BaseModel, ConfigDict

    class Request(BaseModel):
        model_config = ConfigDict(extra="allow")
        response_format: dict | None = None

    assert structured_outputs_from_request(Request(guided_regex="c+")) == (
        StructuredOutputsParams(regex="c+")
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ({"response_format": {"type": "xml"}}, "response_format type 'xml'"),
        ({"response_format": {"type": "json_schema"}}, "needs a 'json_schema' object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "'schema'"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one of"),
        ({"guided_json": {"type": "nope"}}, "not a valid JSON Schema"),
        ({"guided_choice": "a"}, "list of strings"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one way only"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "one way only"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " "}, "not supported"),
        ({"tool_choice": "required"}, "needs a non-empty tools list"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ],
)
def test_bad_requests_name_the_problem(body, message):
    with pytest.raises(ValueError, match=message):
        structured_outputs_from_request(body)
