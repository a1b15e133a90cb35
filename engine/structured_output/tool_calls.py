"""Tool-call parsers: model text -> OpenAI ``tool_calls`` (whole, or streamed in pieces).

A parser knows one model family's tool-call syntax. Parsers live in a registry
(:func:`register_tool_parser`, :func:`get_tool_parser`) so a model's syntax is picked by
name (``--tool-call-parser hermes``), as in vLLM. Hermes-style comes first:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Streaming (:class:`ToolCallStream`): text outside the tags goes out as content at once,
except a tail that might be the start of ``<tool_call>``; inside a call the name goes out
as soon as it is complete and the arguments stream as the model writes them, so the
client's concatenated ``arguments`` is the JSON text of the arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def make_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is JSON text, as in the OpenAI API."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """A finished output split into its text content and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: its first piece carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The ``choices[].delta.tool_calls[]`` item of a chat completion chunk."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    """What one piece of model text adds: content and/or tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ToolCallStream(ABC):
    """Per-request streaming state; feed it each new piece of text, then ``finish()``."""

    def __init__(self) -> None:
        self.num_calls = 0

    @property
    def tools_called(self) -> bool:
        """True once a call has started (the choice then finishes with "tool_calls")."""
        return self.num_calls > 0

    @abstractmethod
    def feed(self, delta_text: str) -> StreamDelta:
        """The content and call pieces ``delta_text`` completes."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """Flush what was held back, at the end of the output."""


class ToolParser(ABC):
    """One model family's tool-call syntax."""

    name: ClassVar[str]

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Split a finished output; malformed calls leave the whole text as content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """Fresh streaming state for one output."""


_TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a parser available by ``name``."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if name in _TOOL_PARSERS and _TOOL_PARSERS[name] is not cls:
            raise ValueError(f"a tool-call parser named {name!r} is already registered")
        cls.name = name
        _TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> ToolParser:
    cls = _TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool-call parser {name!r}; available: {', '.join(sorted(_TOOL_PARSERS))}"
        )
    return cls()


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


# -- Hermes ---------------------------------------------------------------------------------
_START, _END = "<tool_call>", "</tool_call>"
_NAME_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def parse_call_json(text: str) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` -> ToolCall (arguments re-serialized), or None
    if the text is not such an object."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5+)."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls, content, pos = [], [], 0
        while (start := text.find(_START, pos)) >= 0:
            content.append(text[pos:start])
            body_start = start + len(_START)
            end = _find_end(text, body_start)
            call = parse_call_json(text[body_start : end if end >= 0 else None].strip())
            if call is None:
                return ExtractedToolCalls(content=text)
            calls.append(call)
            if end < 0:  # the output ended inside the call
                break
            pos = end + len(_END)
        else:
            content.append(text[pos:])
        joined = "".join(content).strip()
        return ExtractedToolCalls(content=(joined or None) if calls else text, tool_calls=calls)

    def stream(self) -> ToolCallStream:
        return HermesToolCallStream()


class HermesToolCallStream(ToolCallStream):
    """Two modes: text (looking for ``<tool_call>``) and call (looking for its end)."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""  # held-back content (a possible prefix of <tool_call>)
        self._call: _StreamedCall | None = None

    def feed(self, delta_text: str) -> StreamDelta:
        out = StreamDelta()
        pending = delta_text
        while True:
            if self._call is None:
                self._text += pending
                start = self._text.find(_START)
                if start < 0:
                    # Hold back a possible "<tool_c" and trailing whitespace (dropped if a
                    # call follows it).
                    body = self._text[: len(self._text) - _partial_suffix(self._text, _START)]
                    sendable = len(body.rstrip())
                    out.content += self._text[:sendable]
                    self._text = self._text[sendable:]
                    return out
                out.content += self._text[:start].rstrip()
                pending = self._text[start + len(_START) :]
                self._text = ""
                self._call = _StreamedCall(self.num_calls)
                self.num_calls += 1
            end = self._call.feed(pending, out)
            if end is None:
                return out
            self._call.close(out)
            self._call = None
            pending = end  # text after </tool_call>

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._call is not None:  # the model stopped inside a call without closing it
            self._call.close(out)
            self._call = None
        if self._text.strip() or not self.tools_called:
            out.content += self._text
        self._text = ""
        return out


class _StreamedCall:
    """The text of one call between the tags, streamed as name + argument pieces."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buf = ""
        self.id = make_tool_call_id()
        self.name_sent = False
        self.args_start: int | None = None  # where the arguments value starts in buf
        self.args_scanner: JsonValueScanner | None = None
        self.args_sent = 0  # characters of the arguments value sent so far
        # The call's JSON object: </tool_call> only counts once it is complete.
        self.outer: JsonValueScanner | None = None
        self.outer_seen = 0  # characters of buf fed to the outer scanner
        self.outer_end = 0  # where </tool_call> may start

    def feed(self, text: str, out: StreamDelta) -> str | None:
        """Take ``text``; return what follows ``</tool_call>`` once it is seen, else None."""
        self.buf += text
        self._scan_outer()
        end = self.buf.find(_END, self.outer_end)
        if end >= 0:
            rest = self.buf[end + len(_END) :]
            self.buf = self.buf[:end]
            self._stream(len(self.buf), out)
            return rest
        self._stream(len(self.buf) - _partial_suffix(self.buf, _END), out)
        return None

    def _scan_outer(self) -> None:
        if self.outer is None:
            stripped = self.buf.lstrip()
            if not stripped.startswith("{"):
                return  # not (yet) a JSON object: the first </tool_call> ends the call
            self.outer = JsonValueScanner()
            self.outer_seen = len(self.buf) - len(stripped)
            self.outer_end = len(self.buf)  # no end tag before the object completes
        if self.outer.complete:
            return
        done = self.outer.feed(self.buf[self.outer_seen :])
        if done is None:
            self.outer_seen = self.outer_end = len(self.buf)
        else:
            self.outer_end = self.outer_seen + done

    def _stream(self, visible: int, out: StreamDelta) -> None:
        if not self.name_sent:
            match = _NAME_RE.match(self.buf)
            if match is None:
                return
            name = json.loads(f'"{match.group(1)}"')
            out.tool_calls.append(ToolCallDelta(self.index, id=self.id, name=name))
            self.name_sent = True
            self.args_start = match.end()
        assert self.args_start is not None
        if self.args_scanner is None:
            if visible <= self.args_start or self.buf[self.args_start] != "{":
                return  # not started, or not an object: sent whole at close
            self.args_scanner = JsonValueScanner()
        start = self.args_start + self.args_sent
        piece = self.buf[start:visible]
        complete_at = self.args_scanner.feed(piece)
        if complete_at is not None:
            piece = piece[:complete_at]
        if piece:
            self.args_sent += len(piece)
            out.tool_calls.append(ToolCallDelta(self.index, arguments=piece))

    def close(self, out: StreamDelta) -> None:
        """The call's text is complete (or the output ended): send what is unsent."""
        self._stream(len(self.buf), out)
        call = parse_call_json(self.buf.strip())
        if call is None:
            if not self.name_sent:  # not a call after all: give the text back as content
                out.content += _START + self.buf
            return  # else malformed after its name went out: nothing sound to add
        if not self.name_sent:
            out.tool_calls.append(ToolCallDelta(self.index, id=self.id, name=call.name))
            self.name_sent = True
        if self.args_scanner is None:  # arguments were not an object streamed piecewise
            out.tool_calls.append(ToolCallDelta(self.index, arguments=call.arguments))


class JsonValueScanner:
    """Finds where a JSON object or array ends, fed piece by piece (strings aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.complete = False

    def feed(self, text: str) -> int | None:
        """Consume ``text``; the index just past the value's end if it ends inside it."""
        if self.complete:
            return 0
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.complete = True
                    return i + 1
        return None


def _find_end(text: str, start: int) -> int:
    """Index of the ``</tool_call>`` closing the call whose text begins at ``start`` (one
    inside a JSON string of the call does not count); -1 if there is none."""
    body = text[start:]
    stripped = body.lstrip()
    search_from = start
    if stripped.startswith("{"):
        offset = len(body) - len(stripped)
        complete_at = JsonValueScanner().feed(stripped)
        if complete_at is not None:
            search_from = start + offset + complete_at
    return text.find(_END, search_from)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
