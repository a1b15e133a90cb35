"""``mistral``: Mistral tool calls, in either of the tokenizer generations' forms.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(the second, of tokenizers v11+, may carry ``[CALL_ID]id`` between the name and
``[ARGS]``; the id is not kept).
"""

from __future__ import annotations

import re

from engine.structured_output.tool_parsers._common import (
    INCOMPLETE,
    MISMATCH,
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
    json_list_region,
    locate_markers,
    partial_suffix,
    skip_ws,
    starts_any,
    take_json_arguments,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(RegionToolParser):
    name = "mistral"

    def locate(self, text: str) -> Location:
        return locate_markers(text, (TOOL_CALLS,))

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        pos = skip_ws(region, len(TOOL_CALLS))
        if pos >= len(region):
            return None if final else RegionParse()
        if region[pos] == "[" and not region.startswith((ARGS, CALL_ID), pos):
            return json_list_region(region, pos, final)
        return self._named_calls(region, final)

    def _named_calls(self, region: str, final: bool) -> RegionParse | None:
        parsed, pos = RegionParse(), 0
        while True:
            # [TOOL_CALLS] name ([CALL_ID] id)? [ARGS] {...}
            pos = skip_ws(region, pos + len(TOOL_CALLS))
            args_at = region.find(ARGS, pos)
            id_at = region.find(CALL_ID, pos)
            name_end = min(i for i in (args_at, id_at, len(region)) if i >= 0)
            if args_at < 0:
                # no [ARGS] yet: the name may still grow (hold back a partial marker)
                if final:
                    return None
                tail = region[pos:]
                tail = tail[: len(tail) - max(partial_suffix(tail, ARGS),
                                              partial_suffix(tail, CALL_ID))]
                if tail and not _NAME.fullmatch(tail.strip()) and id_at < 0:
                    return None
                parsed.calls.append(PartialCall(None))
                return parsed
            name = region[pos:name_end].strip()
            if not _NAME.fullmatch(name):
                return None
            start = skip_ws(region, args_at + len(ARGS))
            call = PartialCall(name)
            parsed.calls.append(call)
            end = take_json_arguments(region, start, call, final)
            if end == MISMATCH:
                return None
            if end == INCOMPLETE:
                return parsed
            call.complete = True
            pos = skip_ws(region, end)
            found = starts_any(region, pos, (TOOL_CALLS,), final)
            if found == INCOMPLETE:
                return parsed
            if found == MISMATCH:
                parsed.trailing = region[pos:]
                return parsed
