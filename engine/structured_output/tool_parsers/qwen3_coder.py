"""``qwen3_coder``: Qwen3-Coder's XML tool calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text (one newline after the opening tag and one before the closing tag are not
part of it), converted by the parameter's type in the request's tool schema: integer,
number, boolean, null, object / array (JSON, else a Python literal); a string when the
schema says string, does not know the parameter, or the conversion fails. String values
stream as they are written; others once complete.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from engine.structured_output.tool_parsers._common import (
    INCOMPLETE,
    MISMATCH,
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
    expect,
    locate_markers,
    partial_suffix,
    skip_ws,
    starts_any,
)

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(RegionToolParser):
    name = "qwen3_coder"

    def locate(self, text: str) -> Location:
        return locate_markers(text, (TOOL_CALL, FUNCTION))

    def _schemas(self) -> dict[str, Mapping[str, Any]]:
        out = {}
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                params = function.get("parameters")
                props = params.get("properties") if isinstance(params, Mapping) else None
                out[function["name"]] = props if isinstance(props, Mapping) else {}
        return out

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        parsed, pos = RegionParse(), 0
        schemas = self._schemas()
        while True:
            pos = skip_ws(region, pos)
            found = starts_any(region, pos, (TOOL_CALL, FUNCTION), final)
            if found == INCOMPLETE or (pos >= len(region) and not final):
                return parsed
            if found == MISMATCH:
                if not parsed.calls:
                    return None
                parsed.trailing = region[pos:]
                return parsed
            if found == 0:
                pos = expect(region, skip_ws(region, pos + len(TOOL_CALL)), FUNCTION)
                if pos == INCOMPLETE:
                    return None if final else parsed
                if pos == MISMATCH:
                    return None
            else:
                pos += len(FUNCTION)
            pos = self._function(region, pos, final, parsed, schemas)
            if pos == MISMATCH:
                return None
            if pos == INCOMPLETE:
                return None if final else parsed

    def _function(self, text: str, pos: int, final: bool, parsed: RegionParse,
                  schemas: dict[str, Mapping[str, Any]]) -> int:
        gt = text.find(">", pos)
        if gt < 0:
            return INCOMPLETE
        name = text[pos:gt].strip()
        if not name or "<" in name:
            return MISMATCH
        call = PartialCall(name)
        parsed.calls.append(call)
        props = schemas.get(name, {})
        pairs: list[str] = []
        pos = gt + 1
        while True:
            pos = skip_ws(text, pos)
            found = starts_any(text, pos, (PARAMETER, FUNCTION_END), final)
            if found == INCOMPLETE or (pos >= len(text) and not final):
                return INCOMPLETE
            if found == MISMATCH:
                return MISMATCH
            if found == 1:
                break
            pos += len(PARAMETER)
            gt = text.find(">", pos)
            if gt < 0:
                return INCOMPLETE
            key = text[pos:gt].strip()
            if not key or "<" in key:
                return MISMATCH
            schema = props.get(key)
            end = text.find(PARAMETER_END, gt + 1)
            if end < 0:
                if final:
                    return MISMATCH
                raw = text[gt + 1 :]
                raw = raw[: len(raw) - partial_suffix(raw, PARAMETER_END)]
                if _is_string(schema):  # stream the string as far as it is written
                    value = _trim(raw, partial=True)
                    head = "{" + "".join(p + ", " for p in pairs)
                    call.arguments = head + json.dumps(key, ensure_ascii=False) + ": " + \
                        json.dumps(value, ensure_ascii=False)[:-1]
                return INCOMPLETE
            value = convert(_trim(text[gt + 1 : end], partial=False), schema)
            try:
                pairs.append(json.dumps(key, ensure_ascii=False) + ": "
                             + json.dumps(value, ensure_ascii=False, allow_nan=False))
            except (TypeError, ValueError):
                return MISMATCH
            call.arguments = "{" + ", ".join(pairs)
            pos = end + len(PARAMETER_END)
        call.arguments = "{" + ", ".join(pairs) + "}"
        call.complete = True
        pos = skip_ws(text, pos + len(FUNCTION_END))
        closing = expect(text, pos, TOOL_CALL_END)
        if closing >= 0:
            return closing
        if closing == INCOMPLETE and pos < len(text) and not final:
            return INCOMPLETE
        return pos  # no </tool_call>: tolerated


def _trim(raw: str, partial: bool) -> str:
    """The value inside the tags: one leading and one trailing newline are layout."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):  # partial: it may be the layout newline before the end tag
        raw = raw[:-1]
    return raw


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return []


def _is_string(schema: Any) -> bool:
    """The value is surely kept as a string: a string-typed (or unknown) parameter."""
    if schema is None:
        return True
    types = _types(schema)
    return types in (["string"], ["str"], ["text"])


def convert(value: str, schema: Any) -> Any:
    """``value`` (text) as the type ``schema`` names; the text itself when unsure."""
    if schema is None:
        return value
    types = _types(schema)
    if value.strip().lower() == "null" and ("null" in types or not types):
        return None
    types = [t for t in types if t != "null"]
    kind = types[0] if types else None
    text = value.strip()
    if kind in ("string", "str", "text"):
        return value
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return value
        if number != number or number in (float("inf"), float("-inf")):
            return value
        return int(number) if number.is_integer() and "." not in text and "e" not in \
            text.lower() else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), value)
    # object, array, or no type given: JSON, else a Python literal, else the text
    try:
        return json.loads(text)
    except ValueError:
        pass
    if kind in ("object", "array"):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return value
