"""``tools`` + ``tool_choice``: the schema that enforces a forced choice, and turning the
constrained output back into ``tool_calls``.

- ``"none"``: no constraint, no parsing (the text is content).
- ``"auto"`` (the default when tools are given): no constraint; the model's own syntax is
  parsed by a registered tool-call parser (Hermes by default).
- ``"required"``: the output is forced to a JSON array of one or more
  ``{"name": <a tool>, "arguments": <its parameters>}`` objects (at most one when
  ``parallel_tool_calls`` is false); every element becomes a call.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  forced to that function's parameters object; the whole text is the call's arguments.

:class:`ToolCallHandler` is what a chat server holds per request: ``extract(text)`` for a
finished output, ``stream()`` for streamed deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.structured_output.tool_calls import (
    ExtractedToolCalls,
    JsonValueScanner,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    get_tool_parser,
    make_tool_call_id,
)

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """A validated ``tool_choice``: mode is none / auto / required / named."""

    mode: str
    function: str | None = None  # the forced function when mode == "named"


def function_specs(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: parameters schema}`` of the ``tools`` list; ValueError naming a bad entry."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', ...} objects")
    specs: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            why = "must be an object with a string 'name'"
            raise ValueError(f"tools[{i}].function {why}")  # noqa: TRY004
        name = function["name"]
        if not name:
            raise ValueError(f"tools[{i}].function.name must not be empty")
        if name in specs:
            raise ValueError(f"tools[{i}]: function name {name!r} appears twice")
        parameters = function.get("parameters") or _NO_PARAMETERS
        if not isinstance(parameters, Mapping):
            why = "must be a JSON Schema object"
            raise ValueError(f"tools[{i}].function.parameters {why}")  # noqa: TRY004
        specs[name] = dict(parameters)
    return specs


def parse_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """Validate ``tool_choice`` against ``tools`` (OpenAI's defaults when it is None)."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice={tool_choice!r} must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice={tool_choice!r} needs a non-empty tools list")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(  # noqa: TRY004 - bad request content, reported as a 400
            "tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}"
        )
    name = function["name"]
    if not tools or name not in function_specs(tools):
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return ToolChoice("named", name)


def tool_choice_schema(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None = True,
) -> dict[str, Any] | None:
    """The JSON schema that enforces ``tool_choice``, or None when it forces nothing."""
    specs = function_specs(tools) if tools else {}
    choice = parse_tool_choice(tool_choice, tools)
    if choice.mode in ("none", "auto"):
        return None
    if choice.mode == "named":
        return specs[choice.function]
    call_schemas = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": params},
            "required": ["name", "arguments"],
        }
        for name, params in specs.items()
    ]
    items = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class ToolCallHandler:
    """Per-request conversion of model text into content + tool calls."""

    def __init__(self, choice: ToolChoice, parser: str | None = "hermes",
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.choice = choice
        self.parser = (get_tool_parser(parser, tools) if choice.mode == "auto" and parser
                       else None)

    @classmethod
    def from_request(
        cls,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        parser: str | None = "hermes",
    ) -> ToolCallHandler:
        return cls(parse_tool_choice(tool_choice, tools), parser, tools)

    def adjust_params(self, params: SamplingParams) -> SamplingParams:
        """Keep special tokens in the text when a parser reads it: tool-call tags such as
        ``<tool_call>`` are special tokens in many tokenizers (the demo model's too)."""
        if self.parser is None or not params.skip_special_tokens:
            return params
        return params.clone(skip_special_tokens=False)

    def extract(self, text: str) -> ExtractedToolCalls:
        mode = self.choice.mode
        if mode == "named":
            assert self.choice.function is not None
            return ExtractedToolCalls(None, [ToolCall(self.choice.function, text.strip())])
        if mode == "required":
            return _extract_required(text)
        if self.parser is not None:
            return self.parser.extract_tool_calls(text)
        return ExtractedToolCalls(content=text)

    def stream(self) -> ToolCallStream:
        mode = self.choice.mode
        if mode == "named":
            assert self.choice.function is not None
            return _NamedCallStream(self.choice.function)
        if mode == "required":
            return _RequiredCallsStream()
        if self.parser is not None:
            return self.parser.stream()
        return _ContentStream()


def _extract_required(text: str) -> ExtractedToolCalls:
    """The forced JSON array -> calls; output that is not such an array stays content."""
    try:
        items = json.loads(text)
    except ValueError:
        return ExtractedToolCalls(content=text)
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    ):
        return ExtractedToolCalls(content=text)
    calls = [
        ToolCall(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False)) for i in items
    ]
    return ExtractedToolCalls(content=None, tool_calls=calls)


class _ContentStream(ToolCallStream):
    def feed(self, delta_text: str) -> StreamDelta:
        return StreamDelta(content=delta_text)

    def finish(self) -> StreamDelta:
        return StreamDelta()


class _NamedCallStream(ToolCallStream):
    """The whole output is the arguments of one known function: stream it as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, delta_text: str) -> StreamDelta:
        if self.num_calls == 0:
            self.num_calls = 1
            delta = ToolCallDelta(
                0, id=make_tool_call_id(), name=self.name, arguments=delta_text.lstrip()
            )
            return StreamDelta(tool_calls=[delta])
        return StreamDelta(
            tool_calls=[ToolCallDelta(0, arguments=delta_text)] if delta_text else []
        )

    def finish(self) -> StreamDelta:
        if self.num_calls == 0:  # empty output: still one call, with empty arguments
            return self.feed("")
        return StreamDelta()


class _RequiredCallsStream(ToolCallStream):
    """The output is a JSON array of calls: each call goes out whole once its element is
    complete (its name and arguments together)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_array = False
        self._scanner: JsonValueScanner | None = None
        self._element_start = 0

    def feed(self, delta_text: str) -> StreamDelta:
        out = StreamDelta()
        start = len(self._buf)
        self._buf += delta_text
        i = start
        while i < len(self._buf):
            if self._scanner is None:
                ch = self._buf[i]
                if not self._in_array:
                    self._in_array = ch == "["
                elif ch == "{":
                    self._scanner = JsonValueScanner()
                    self._element_start = i
                    continue  # the scanner consumes the "{" itself
                i += 1
                continue
            end = self._scanner.feed(self._buf[i:])
            if end is None:
                break
            self._emit(self._buf[self._element_start : i + end], out)
            self._scanner = None
            i += end
        return out

    def _emit(self, element: str, out: StreamDelta) -> None:
        try:
            item = json.loads(element)
        except ValueError:
            return
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return
        arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        out.tool_calls.append(
            ToolCallDelta(
                self.num_calls, id=make_tool_call_id(), name=item["name"], arguments=arguments
            )
        )
        self.num_calls += 1

    def finish(self) -> StreamDelta:
        return StreamDelta()
