"""What every family's parser shares: finding where the calls start, the streaming
driver, and tolerant scanners for partial JSON.

A family implements two things (see :class:`RegionToolParser`):

- ``locate(text)``: where the tool-call region starts (a marker such as ``[TOOL_CALLS]``),
  or, while none is seen, how much of the text is surely content;
- ``parse_region(region, final)``: the calls of the region so far, each a
  :class:`PartialCall` whose ``arguments`` is a prefix of its final arguments JSON text,
  plus the content after the calls (``trailing``), or None when the region is malformed.

Non-streamed extraction parses the region once (``final=True``); the stream re-parses the
growing region on every delta and sends what is new: each call's name once it is complete,
then the part of its arguments not sent yet. Because a partial parse only ever reports a
prefix of what the final parse reports, the concatenated fragments are the arguments of
the non-streamed extraction.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output.tool_calls import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)

INCOMPLETE = -1  # a scanner ran out of text (more may come)
MISMATCH = -2  # a scanner found text that is not what the format allows


@dataclass
class PartialCall:
    """One call as far as it is written: ``name`` once complete (None before),
    ``arguments`` a prefix of its final arguments JSON, ``complete`` once it is whole."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class RegionParse:
    calls: list[PartialCall] = field(default_factory=list)
    trailing: str = ""  # content after the calls (only reported by a final parse)
    # content inside the region, streamed as it grows (each parse's is a prefix of the
    # final parse's, as arguments are): e.g. a harmony final-channel message
    content: str = ""


@dataclass
class Location:
    """``start``: where the tool-call region begins (None: not seen yet); ``safe``: while
    none is seen, the text before ``safe`` is surely content (the rest may start one)."""

    start: int | None
    safe: int = 0


class RegionToolParser(ToolParser):
    """A family whose calls form one region at the end of the output (possibly followed
    by content), after content the model writes first."""

    # whether a region without calls is still this syntax (its ``content`` the content)
    # rather than text that only looked like a call
    region_without_calls_ok = False

    @abstractmethod
    def locate(self, text: str) -> Location:
        """Where the calls start in ``text`` (a prefix of the output)."""

    @abstractmethod
    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        """The calls in ``region`` (text from the start on); None: malformed."""

    # -- whole outputs ------------------------------------------------------------------
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        try:
            return self._extract(text)
        except Exception:  # noqa: BLE001 - a parser bug on odd text: the text is content
            return ExtractedToolCalls(content=text)

    def _extract(self, text: str) -> ExtractedToolCalls:
        start = self.locate(text).start
        if start is None:
            return ExtractedToolCalls(content=text)
        parsed = self.parse_region(text[start:], final=True)
        if not self.valid(parsed):
            return ExtractedToolCalls(content=text)
        assert parsed is not None
        content = (text[:start] + parsed.content + parsed.trailing).strip()
        return ExtractedToolCalls(
            content=content or None,
            tool_calls=[ToolCall(call.name, call.arguments) for call in parsed.calls],
        )

    def stream(self) -> ToolCallStream:
        return RegionToolCallStream(self)

    def valid(self, parsed: RegionParse | None) -> bool:
        """A final parse that is calls (or, where allowed, content in this syntax)."""
        if parsed is None or not (parsed.calls or self.region_without_calls_ok):
            return False
        return all(call.complete and call.name and _is_json(call.arguments)
                   for call in parsed.calls)


class RegionToolCallStream(ToolCallStream):
    """Streams a :class:`RegionToolParser`'s calls (see the module docstring)."""

    def __init__(self, parser: RegionToolParser) -> None:
        super().__init__()
        self.parser = parser
        self.text = ""
        self.content_sent = 0  # characters of text sent as content
        self.start: int | None = None  # where the region starts in text
        self.ids: list[str] = []
        self.args_sent: list[str] = []  # arguments sent so far, per call
        self.broken = False  # a parse contradicted what was sent: send no more pieces
        self.region_content_sent = ""

    def feed(self, delta_text: str) -> StreamDelta:
        self.text += delta_text
        out = StreamDelta()
        try:
            if self.start is None:
                where = self.parser.locate(self.text)
                if where.start is None:
                    sendable = len(self.text[: where.safe].rstrip())
                    if sendable > self.content_sent:
                        out.content = self.text[self.content_sent : sendable]
                        self.content_sent = sendable
                    return out
                self.start = where.start
                before = self.text[self.content_sent : where.start].rstrip()
                out.content = before
                self.content_sent += len(before)  # the whitespace is sent only if the
                # region turns out not to be calls
            self._send_calls(self.parser.parse_region(self.text[self.start :], False), out)
        except Exception:  # noqa: BLE001 - never break a stream on a parser bug
            self.broken = True
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.start is None:
            out.content = self.text[self.content_sent :]
            self.content_sent = len(self.text)
            return out
        region = self.text[self.start :]
        try:
            parsed = self.parser.parse_region(region, True)
        except Exception:  # noqa: BLE001
            parsed = None
        if not self.parser.valid(parsed):
            # not calls after all: the region is content (unless some already went out)
            if not self.tools_called and not self.region_content_sent:
                out.content = self.text[self.content_sent :]
                self.content_sent = len(self.text)
            return out
        assert parsed is not None
        self._send_calls(parsed, out)
        if parsed.trailing.strip():
            out.content += parsed.trailing
        return out

    def _send_calls(self, parsed: RegionParse | None, out: StreamDelta) -> None:
        if parsed is None or self.broken:
            return
        sent = self.region_content_sent
        if parsed.content.startswith(sent) and len(parsed.content) > len(sent):
            out.content += parsed.content[len(sent) :]
            self.region_content_sent = parsed.content
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                return  # later calls wait for this one's name
            if index == len(self.ids):
                self.ids.append(make_tool_call_id())
                self.args_sent.append("")
                self.num_calls += 1
                out.tool_calls.append(ToolCallDelta(index, id=self.ids[index], name=call.name))
            sent = self.args_sent[index]
            if not call.arguments.startswith(sent):
                self.broken = True  # cannot take back what was sent
                return
            if len(call.arguments) > len(sent):
                out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[len(sent) :]))
                self.args_sent[index] = call.arguments


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# -- markers --------------------------------------------------------------------------
def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def locate_markers(text: str, markers: tuple[str, ...]) -> Location:
    """The first of ``markers`` in ``text``; else hold back a possible partial marker."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return Location(min(found))
    hold = max(partial_suffix(text, m) for m in markers)
    return Location(None, len(text) - hold)


def expect(text: str, pos: int, literal: str) -> int:
    """Position after ``literal`` at ``pos``; INCOMPLETE if the text ends inside it;
    MISMATCH if something else is there."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
        return INCOMPLETE
    return MISMATCH


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def starts_any(text: str, pos: int, literals: tuple[str, ...], final: bool) -> int:
    """Index of the literal in ``literals`` at ``pos``; INCOMPLETE when (not final) the
    text ends inside one; MISMATCH otherwise."""
    rest = text[pos:]
    for i, literal in enumerate(literals):
        if rest.startswith(literal):
            return i
    if not final and rest and any(literal.startswith(rest) for literal in literals):
        return INCOMPLETE
    return MISMATCH


# -- partial JSON ----------------------------------------------------------------------
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+)')
_OPEN_STRING = re.compile(r'\s*"')


def scan_json_value(text: str, pos: int) -> int:
    """End of the JSON value at ``pos`` (whitespace first allowed); INCOMPLETE if the text
    ends inside it; MISMATCH if brackets do not pair up. Scalars are not validated here
    (the final ``json.loads`` does)."""
    depth, stack = 0, []
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            return INCOMPLETE if _OPEN_STRING.match(text, pos) or not text[pos:].strip() \
                else MISMATCH
        tok, pos = m.group(1), m.end()
        if tok in ("{", "["):
            stack.append(tok)
            depth += 1
        elif tok in ("}", "]"):
            if not stack or {"{": "}", "[": "]"}[stack.pop()] != tok:
                return MISMATCH
            depth -= 1
            if depth == 0:
                return pos
        elif depth == 0:
            if tok in (":", ","):
                return MISMATCH
            if tok[0] == '"' or pos < len(text):
                return pos
            return INCOMPLETE  # a number / literal the text may still extend


@dataclass
class JsonMember:
    key: str
    start: int  # where the value starts (after whitespace)
    end: int  # where it ends; INCOMPLETE while unfinished


def scan_json_object(text: str, pos: int) -> tuple[list[JsonMember], int]:
    """The members of the JSON object at ``pos`` (``text[pos]`` is ``{``) as far as it is
    written, and the object's end (INCOMPLETE / MISMATCH)."""
    members: list[JsonMember] = []
    pos += 1
    expecting_key = True
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            return members, INCOMPLETE if not text[pos:].strip() or _OPEN_STRING.match(
                text, pos) else MISMATCH
        tok, after = m.group(1), m.end()
        if tok == "}" and (expecting_key and not members or not expecting_key):
            return members, after
        if not expecting_key:
            if tok != ",":
                return members, MISMATCH
            expecting_key, pos = True, after
            continue
        if tok[0] != '"':
            return members, MISMATCH
        try:
            key = json.loads(tok)
        except ValueError:
            return members, MISMATCH
        colon = _TOKEN.match(text, after)
        if colon is None:
            return members, INCOMPLETE if not text[after:].strip() else MISMATCH
        if colon.group(1) != ":":
            return members, MISMATCH
        start = skip_ws(text, colon.end())
        end = scan_json_value(text, start)
        members.append(JsonMember(key, start, end))
        if end < 0:
            return members, end
        pos, expecting_key = end, False


def json_call(text: str, pos: int, final: bool,
              arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[PartialCall, int]:
    """The ``{"name": ..., "arguments": {...}}`` object at ``pos`` as a partial call (the
    arguments are the object's raw JSON text) and the object's end (or INCOMPLETE /
    MISMATCH)."""
    members, end = scan_json_object(text, pos)
    if end == MISMATCH or (end == INCOMPLETE and final):
        return PartialCall(None), MISMATCH
    by_key = {m.key: m for m in members}
    name_member = by_key.get("name")
    name = None
    if name_member is not None and name_member.end >= 0:
        value = _loads(text[name_member.start : name_member.end])
        if not isinstance(value, str):
            return PartialCall(None), MISMATCH
        name = value
    call = PartialCall(name, complete=end >= 0)
    args = next((by_key[k] for k in arg_keys if k in by_key), None)
    if name is None:
        if end >= 0:
            return call, MISMATCH  # an object without a name
        return call, end
    if args is None:
        call.arguments = "{}" if end >= 0 else ""
    elif text.startswith("{", args.start):
        call.arguments = text[args.start : args.end if args.end >= 0 else None]
    elif args.end >= 0:  # a string holding the JSON text, or null
        value = _loads(text[args.start : args.end])
        if isinstance(value, str):
            call.arguments = value
        elif value is None:
            call.arguments = "{}"
        else:
            return call, MISMATCH
    return call, end


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _BAD


_BAD = object()


def json_call_list(text: str, pos: int, final: bool) -> tuple[list[PartialCall], int]:
    """The JSON list of call objects at ``pos`` (``text[pos]`` is ``[``): its calls so far
    and its end (INCOMPLETE / MISMATCH)."""
    calls: list[PartialCall] = []
    pos = skip_ws(text, pos + 1)
    if text.startswith("]", pos):
        return calls, MISMATCH  # an empty list calls nothing
    while True:
        if pos >= len(text):
            return calls, MISMATCH if final else INCOMPLETE
        if text[pos] != "{":
            return calls, MISMATCH
        call, end = json_call(text, pos, final)
        if end == MISMATCH:
            return calls, MISMATCH
        calls.append(call)
        if end == INCOMPLETE:
            return calls, INCOMPLETE
        pos = skip_ws(text, end)
        if pos >= len(text):
            return calls, MISMATCH if final else INCOMPLETE
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != ",":
            return calls, MISMATCH
        pos = skip_ws(text, pos + 1)


def json_list_region(region: str, pos: int, final: bool) -> RegionParse | None:
    """A region holding one JSON list of calls at ``pos`` (after its marker), content
    after it."""
    pos = skip_ws(region, pos)
    if pos >= len(region):
        return None if final else RegionParse()
    if region[pos] != "[":
        return None
    calls, end = json_call_list(region, pos, final)
    if end == MISMATCH:
        return None
    return RegionParse(calls, region[end:] if end >= 0 else "")


def take_json_arguments(region: str, start: int, call: PartialCall, final: bool) -> int:
    """Read ``call``'s arguments, a JSON object starting at ``start``: set
    ``call.arguments`` to as much of it as the region holds and return its end, or
    INCOMPLETE (more text may finish it) or MISMATCH (not an object, or cut off in the
    ``final`` text)."""
    if start >= len(region):
        return MISMATCH if final else INCOMPLETE
    if region[start] != "{":
        return MISMATCH
    end = scan_json_value(region, start)
    if end == MISMATCH or (end == INCOMPLETE and final):
        return MISMATCH
    call.arguments = region[start : end if end >= 0 else None]
    return end
