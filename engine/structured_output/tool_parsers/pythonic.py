"""``pythonic``: a Python list of calls with keyword arguments (Llama 3.2 / 4).

    [get_weather(city="San Francisco", unit="C"), get_time()]

optionally wrapped in ``<|python_start|>`` ... ``<|python_end|>``. Argument values are
Python literals (read with :func:`ast.literal_eval`); positional arguments are refused.
Arguments stream one whole keyword argument at a time.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from engine.structured_output.tool_parsers._common import (
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
    partial_suffix,
    skip_ws,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][\w.]*")
_CALL_LIST = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_CALL_LIST = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")
_PY_TOKEN = re.compile(
    r"""\s*(
        [rRbBuU]{0,2}(?:'''(?:[^\\]|\\.)*?'''|\"\"\"(?:[^\\]|\\.)*?\"\"\"
                       |'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | [()\[\]{},=:]
      | [^\s()\[\]{},=:'"]+
    )""",
    re.X | re.S,
)


class _Incomplete(Exception):
    pass


class _Malformed(Exception):
    pass


class PythonicToolParser(RegionToolParser):
    name = "pythonic"

    def locate(self, text: str) -> Location:
        starts = [m.start() for m in (_CALL_LIST.search(text),) if m]
        if (tag := text.find(PYTHON_START)) >= 0:
            starts.append(tag)
        if starts:
            return Location(min(starts))
        hold = partial_suffix(text, PYTHON_START)
        bracket = text.rfind("[")
        if bracket >= 0 and _MAYBE_CALL_LIST.match(text, bracket):
            hold = max(hold, len(text) - bracket)
        return Location(None, len(text) - hold)

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        parsed = RegionParse()
        try:
            self._parse(region, final, parsed)
        except _Incomplete:
            if final:
                return None
        except _Malformed:
            return None
        return parsed

    def _parse(self, text: str, final: bool, parsed: RegionParse) -> None:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_START, pos):
            pos = skip_ws(text, pos + len(PYTHON_START))
        pos = _literal(text, pos, "[")
        while True:
            pos = skip_ws(text, pos)
            name_match = _IDENT.match(text, pos)
            if name_match is None:
                raise _Incomplete if pos >= len(text) else _Malformed
            if name_match.end() == len(text):
                raise _Incomplete
            pos = _literal(text, skip_ws(text, name_match.end()), "(")
            # the name goes out with the first well-formed argument (or the closing
            # parenthesis), so a list that is not calls after all sends no name
            name, call = name_match.group(), PartialCall(None)
            parsed.calls.append(call)
            pairs: list[str] = []
            while True:
                pos = skip_ws(text, pos)
                if pos >= len(text):
                    raise _Incomplete
                if text[pos] == ")":
                    pos += 1
                    break
                key = _IDENT.match(text, pos)
                if key is None or "." in key.group():
                    raise _Malformed
                if key.end() == len(text):
                    raise _Incomplete
                pos = _literal(text, skip_ws(text, key.end()), "=")
                value, pos = _value(text, pos)
                pairs.append(_pair(key.group(), value))
                call.name = name
                call.arguments = "{" + ", ".join(pairs)
                if text[pos] == ",":
                    pos += 1
                    continue
                pos += 1  # ")"
                break
            call.name, call.arguments = name, "{" + ", ".join(pairs) + "}"
            call.complete = True
            pos = skip_ws(text, pos)
            if pos >= len(text):
                raise _Incomplete
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "]":
                raise _Malformed
            rest = text[pos + 1 :]
            stripped = rest.lstrip()
            if stripped.startswith(PYTHON_END):
                rest = stripped[len(PYTHON_END) :]
            elif not final and PYTHON_END.startswith(stripped):
                rest = ""
            parsed.trailing = rest
            return


def _literal(text: str, pos: int, literal: str) -> int:
    pos = skip_ws(text, pos)
    if pos >= len(text):
        raise _Incomplete
    if not text.startswith(literal, pos):
        raise _Malformed
    return pos + len(literal)


def _value(text: str, pos: int) -> tuple[Any, int]:
    """The literal at ``pos`` and the position of the ``,`` or ``)`` ending it."""
    start, depth = pos, 0
    while True:
        m = _PY_TOKEN.match(text, pos)
        if m is None:
            raise _Incomplete
        tok = m.group(1)
        if depth == 0 and tok in (",", ")"):
            end = m.start(1)
            try:
                value = ast.literal_eval(text[start:end].strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise _Malformed from None
            return value, end
        if tok in ("(", "[", "{"):
            depth += 1
        elif tok in (")", "]", "}"):
            depth -= 1
            if depth < 0:
                raise _Malformed
        pos = m.end()
        if pos >= len(text):
            raise _Incomplete


def _pair(key: str, value: Any) -> str:
    try:
        return f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False, allow_nan=False)}"
    except (TypeError, ValueError):
        raise _Malformed from None
