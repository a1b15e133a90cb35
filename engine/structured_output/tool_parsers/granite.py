"""``granite``: IBM Granite 3.x tool calls, a JSON list after a marker.

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

(Granite 3.1 writes ``<tool_call>`` instead of ``<|tool_call|>``.)
"""

from __future__ import annotations

from engine.structured_output.tool_parsers._common import (
    Location,
    RegionParse,
    RegionToolParser,
    json_list_region,
    locate_markers,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(RegionToolParser):
    name = "granite"

    def locate(self, text: str) -> Location:
        return locate_markers(text, MARKERS)

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        marker = next((m for m in MARKERS if region.startswith(m)), None)
        if marker is None:
            return None
        return json_list_region(region, len(marker), final)
