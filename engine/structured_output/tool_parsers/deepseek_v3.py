"""``deepseek_v3``: DeepSeek V3 tool calls (and V3.1's shorter form).

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.
"""

from __future__ import annotations

from engine.structured_output.tool_parsers._common import (
    INCOMPLETE,
    MISMATCH,
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
    expect,
    locate_markers,
    skip_ws,
    starts_any,
    take_json_arguments,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3ToolParser(RegionToolParser):
    name = "deepseek_v3"

    def locate(self, text: str) -> Location:
        return locate_markers(text, (CALLS_BEGIN, CALL_BEGIN))

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        parsed = RegionParse()
        pos = len(CALLS_BEGIN) if region.startswith(CALLS_BEGIN) else 0
        while True:
            pos = skip_ws(region, pos)
            found = starts_any(region, pos, (CALL_BEGIN, CALLS_END), final)
            if found == INCOMPLETE or (pos >= len(region) and not final):
                return parsed
            if found == MISMATCH:
                if not parsed.calls:
                    return None
                parsed.trailing = region[pos:]  # the model forgot the closing marker
                return parsed
            if found == 1:
                parsed.trailing = region[pos + len(CALLS_END) :]
                return parsed
            pos = self._call(region, pos + len(CALL_BEGIN), final, parsed)
            if pos == MISMATCH:
                return None
            if pos == INCOMPLETE:
                return parsed

    def _call(self, region: str, pos: int, final: bool, parsed: RegionParse) -> int:
        sep = region.find(SEP, pos)
        if sep < 0:
            return MISMATCH if final else INCOMPLETE
        head = region[pos:sep].strip()
        after = skip_ws(region, sep + len(SEP))
        if after >= len(region) or (region[after] == "{" and "\n" not in region[sep:after]):
            if after >= len(region):
                return MISMATCH if final else INCOMPLETE
            name, start, fenced = head, after, False  # V3.1: NAME<sep>{...}
        else:
            newline = region.find("\n", sep)
            if newline < 0:
                return MISMATCH if final else INCOMPLETE
            name = region[sep + len(SEP) : newline].strip()
            start = expect(region, skip_ws(region, newline), FENCE_OPEN)
            if start < 0:
                return start if not final else MISMATCH
            start = skip_ws(region, start)
            fenced = True
        if not name:
            return MISMATCH
        call = PartialCall(name)
        parsed.calls.append(call)
        end = take_json_arguments(region, start, call, final)
        if end < 0:
            return end
        pos = skip_ws(region, end)
        if fenced:
            pos = expect(region, pos, FENCE_CLOSE)
            if pos < 0:
                return pos if not final else MISMATCH
            pos = skip_ws(region, pos)
        pos = expect(region, pos, CALL_END)
        if pos == INCOMPLETE and final:
            pos = len(region)  # the output ended before the call's end marker
        elif pos < 0:
            return pos
        call.complete = True
        return pos
