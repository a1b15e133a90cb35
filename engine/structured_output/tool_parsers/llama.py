"""``llama3_json``: Llama 3.1 / 3.2 JSON tool calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

``<|python_tag|>`` is optional when the output starts with the JSON object.
"""

from __future__ import annotations

from engine.structured_output.tool_parsers._common import (
    INCOMPLETE,
    MISMATCH,
    Location,
    RegionParse,
    RegionToolParser,
    json_call,
    locate_markers,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(RegionToolParser):
    name = "llama3_json"

    def locate(self, text: str) -> Location:
        first = skip_ws(text, 0)
        if text.startswith("{", first):
            return Location(first)
        return locate_markers(text, (PYTHON_TAG,))

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        pos = len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        parsed = RegionParse()
        while True:
            pos = skip_ws(region, pos)
            if pos >= len(region):
                return None if final and not parsed.calls else parsed
            if region[pos] != "{":
                return None
            call, end = json_call(region, pos, final)
            if end == MISMATCH:
                return None
            parsed.calls.append(call)
            if end == INCOMPLETE:
                return parsed
            pos = skip_ws(region, end)
            if region.startswith((";", ","), pos):
                pos += 1
                continue
            parsed.trailing = region[pos:]
            return parsed
