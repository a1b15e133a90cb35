"""Pydantic models of the OpenAI Responses API (``POST /v1/responses``).

The request is validated as strictly as the chat request (``protocol``): known fields
strictly typed, unknown ones kept and logged as ignored. ``input`` items are checked by the
serving layer (``serving_responses``), which turns them into chat messages, so a bad item
is a 400 naming it (``input[2]``). Field names and shapes follow OpenAI's (as the ``openai``
client's ``openai.types.responses`` reads them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    OpenAIRequestModel,
    PosInt,
    now_s,
)

_INPUT_ITEM_SCHEMA = {"type": "object", "description": (
    "A message {role: user|assistant|system|developer, content: string | [{type: "
    "input_text|output_text, text}]} (optionally type: message), a {type: function_call, "
    "call_id, name, arguments} or a {type: function_call_output, call_id, output}")}
_TOOL_SCHEMA = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "minLength": 1},
    "description": {"type": "string"},
    "parameters": {"description": "A JSON Schema object"}, "strict": {"type": "boolean"}}}
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "name"],
     "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
    {"type": "null"},
]}
_TEXT_SCHEMA = {"anyOf": [{"type": "object", "properties": {"format": {"oneOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "schema"],
     "properties": {"type": {"const": "json_schema"}, "name": {"type": "string"},
                    "schema": {"type": "object"}, "strict": {"type": "boolean"}}},
]}}}, {"type": "null"}]}


class ResponsesRequest(OpenAIRequestModel):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)] = Field(
        json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                          "items": _INPUT_ITEM_SCHEMA}]})
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra={
        "anyOf": [{"type": "array", "items": _TOOL_SCHEMA}, {"type": "null"}]})
    tool_choice: str | dict[str, Any] | None = Field(
        None, json_schema_extra=_TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = Field(None, json_schema_extra=_TEXT_SCHEMA)
    max_output_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = Field(None, description="Not supported: unset, null or false",
                                    json_schema_extra={"anyOf": [{"const": False},
                                                                 {"type": "null"}]})
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted (effort / summary are not applied)
    truncation: Literal["auto", "disabled"] | None = None  # accepted; never truncated


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class ResponseObject(OpenAIBaseModel):
    """A response as OpenAI's ``Response``; ``output`` items are plain dicts (message,
    function_call and reasoning items in OpenAI's shapes)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now_s)
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(OpenAIBaseModel):
    """One server-sent event of a streamed response (its other fields depend on ``type``:
    OpenAI's ``response.*`` events)."""

    type: str
    sequence_number: int


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
