"""Tool-call parsers: model text -> OpenAI ``tool_calls`` (whole, or streamed in pieces).

A parser knows one model family's tool-call syntax. Parsers live in a registry
(:class:`ToolParserRegistry`, filled by the plugins' ``engine_register_tool_parsers`` hook;
:func:`get_tool_parser`) so a model's syntax is picked by name (``--tool-call-parser
hermes``), as in vLLM. The other families live in :mod:`engine.structured_output.tool_parsers`.
Hermes-style is here:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Streaming (:class:`ToolCallStream`): text outside the tags goes out as content at once,
except a tail that might be the start of ``<tool_call>``; inside a call the name goes out
as soon as it is complete and the arguments stream as the model writes them, so the
client's concatenated ``arguments`` is the JSON text of the arguments object.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
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
    """One model family's tool-call syntax.

    ``tools``: the request's ``tools`` list (OpenAI format), for parsers whose syntax
    needs the functions' schemas (e.g. qwen3_coder converts XML parameter text to the
    schema's types); parsers that do not need them ignore it.
    """

    name: ClassVar[str]

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = list(tools or [])

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Split a finished output; malformed calls leave the whole text as content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """Fresh streaming state for one output."""


class PluginToolParserRegistry:
    """What one plugin's ``engine_register_tool_parsers`` hook is handed: the registry,
    with that plugin's name attached to every registration."""

    def __init__(self, registry: ToolParserRegistry, plugin: str) -> None:
        self._registry = registry
        self.plugin = plugin

    def register(self, name: str, parser: type[ToolParser] | str) -> None:
        self._registry.register(name, parser, plugin=self.plugin)

    def names(self) -> list[str]:
        return self._registry.names()


class ToolParserRegistry:
    """Parser name -> parser class (or a lazy ``"module:Class"`` path).

    Every name comes from a plugin's ``engine_register_tool_parsers(registry)`` hook -- the
    built-ins from the in-tree ``tool_parsers`` plugin
    (:mod:`engine.structured_output.tool_parsers.plugin`), exactly as a third party's -- or
    from a direct :func:`register_tool_parser`. The plugins are asked once, lazily; a name
    claimed twice (two plugins, or a plugin and a direct registration) is refused, naming
    both.

    ``plugins``: the plugin registry to ask (or a callable returning it); None: only what
    is registered directly.
    """

    def __init__(self, plugins: Any = None) -> None:
        self._entries: dict[str, type[ToolParser] | str] = {}
        self._owners: dict[str, str | None] = {}  # name -> plugin (None: direct)
        self._plugins = plugins
        self._asked: Any = None

    def for_plugin(self, plugin: str) -> PluginToolParserRegistry:
        return PluginToolParserRegistry(self, plugin)

    def register(self, name: str, parser: type[ToolParser] | str,
                 plugin: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool-call parser needs a non-empty name, got {name!r}")
        if isinstance(parser, str) and ":" not in parser:
            raise ValueError(f"lazy tool-call parser path {parser!r} for {name!r} must be "
                             "'module:Class'")
        if plugin is None:
            self._ensure_plugins()
        if name in self._entries and self._entries[name] is not parser:
            old = self._owners.get(name)
            if plugin is not None and old is not None and old != plugin:
                raise ValueError(f"tool-call parser {name!r} is contributed by both plugin "
                                 f"{old!r} and plugin {plugin!r}")
            if plugin is None or old is None:
                by = f"plugin {old!r}" if old is not None else "a direct registration"
                new = f"plugin {plugin!r}" if plugin is not None else "a direct registration"
                raise ValueError(f"a tool-call parser named {name!r} is already registered "
                                 f"(by {by}); {new} may not replace it")
        self._entries[name] = parser
        self._owners[name] = plugin

    def _plugin_registry(self) -> Any:
        source = self._plugins
        if source is None:
            return None
        if callable(source) and not hasattr(source, "register_tool_parsers"):
            return source()
        return source

    def _ensure_plugins(self) -> None:
        """Ask every plugin once (again when the process's plugin registry was rebuilt)."""
        plugins = self._plugin_registry()
        if plugins is None or plugins is self._asked:
            return
        for name in [n for n, owner in self._owners.items() if owner is not None]:
            del self._entries[name], self._owners[name]
        self._asked = plugins
        try:
            plugins.register_tool_parsers(self)
        except Exception:
            self._asked = None
            for name in [n for n, owner in self._owners.items() if owner is not None]:
                del self._entries[name], self._owners[name]
            raise

    def names(self) -> list[str]:
        self._ensure_plugins()
        return sorted(self._entries)

    def contributions(self) -> list[tuple[str, str | None]]:
        """``(name, plugin)`` for every parser (plugin None: registered directly)."""
        self._ensure_plugins()
        return [(name, self._owners[name]) for name in sorted(self._entries)]

    def parser_class(self, name: str) -> type[ToolParser]:
        self._ensure_plugins()
        entry = self._entries.get(name)
        if entry is None:
            hint = ""
            if self._plugins is not None and os.environ.get("ENGINE_PLUGINS"):
                hint = (f" (ENGINE_PLUGINS={os.environ['ENGINE_PLUGINS']} limits the plugins "
                        "loaded; the built-in parsers come from plugin 'tool_parsers')")
            raise ValueError(f"unknown tool-call parser {name!r}; available: "
                             f"{', '.join(sorted(self._entries)) or '(none)'}{hint}")
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        if not getattr(entry, "name", None):
            entry.name = name
        return entry

    def create(self, name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolParser:
        cls = self.parser_class(name)
        return cls(tools) if tools else cls()


def _process_plugins() -> Any:
    from engine.core.plugins import get_plugin_registry

    return get_plugin_registry()


TOOL_PARSERS = ToolParserRegistry(plugins=_process_plugins)


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a parser available by ``name`` (a direct registration; a
    plugin contributes through ``engine_register_tool_parsers`` instead)."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        TOOL_PARSERS.register(name, cls)
        cls.name = name
        return cls

    return register


def get_tool_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolParser:
    """A fresh parser called ``name`` (ValueError listing the registered names if none),
    given the request's ``tools`` when there are any."""
    return TOOL_PARSERS.create(name, tools)


def tool_parser_names() -> list[str]:
    return TOOL_PARSERS.names()


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


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5+)."""

    name = "hermes"

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
