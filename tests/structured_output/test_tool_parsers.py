"""The tool-call parsers beside Hermes (engine.structured_output.tool_parsers) on
hand-written outputs of each family, whole and streamed in small pieces (markers split
across pieces), and their registration through the plugin registry."""

from __future__ import annotations

import json
import random
import types

import pytest
from click.testing import CliRunner

import engine.core.plugins as plugins_mod
from engine.cli.serve import _check_tool_call_parser, serve_cmd
from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins import (
    ALLOWLIST_ENV,
    PluginRegistry,
    PluginStatus,
    hookimpl,
    reset_plugin_registry,
)
from engine.structured_output.tool_calls import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    ToolParserRegistry,
    get_tool_parser,
    tool_parser_names,
)
from engine.structured_output.tool_choice import ToolCallHandler

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "temp": {"type": "number"}, "metric": {"type": "boolean"},
            "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"type": ["string", "null"]},
        },
    }}},
    {"type": "function", "function": {"name": "get_time"}},
]

W = {"city": "Paris", "days": 3}
NOTE = {"city": "São \"Paulo\"", "note": "a}b]c; d,e"}

# parser -> [(output, content, [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
         None, [("get_weather", W)]),
        ('{"name": "get_weather", "parameters": {"city": "São \\"Paulo\\"", '
         '"note": "a}b]c; d,e"}}; {"name": "get_time", "parameters": {}}',
         None, [("get_weather", NOTE), ("get_time", {})]),
        ('Let me look that up.\n<|python_tag|>{"name": "get_time", "parameters": {}};'
         '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
         "Let me look that up.", [("get_time", {}), ("get_weather", W)]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
         None, [("get_weather", W)]),
        ('Checking both. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
         '{"city": "São \\"Paulo\\"", "note": "a}b]c; d,e"}}, '
         '{"name": "get_time", "arguments": {}, "id": "abc123xyz"}]',
         "Checking both.", [("get_weather", NOTE), ("get_time", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', None,
         [("get_weather", W)]),
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "São \\"Paulo\\"", '
         '"note": "a}b]c; d,e"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}',
         "Sure.", [("get_weather", NOTE), ("get_time", {})]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', None, [("get_weather", W)]),
        ("I'll check.\n[get_weather(city='São \"Paulo\"', note=\"a}b]c; d,e\"), get_time()]",
         "I'll check.", [("get_weather", NOTE), ("get_time", {})]),
        ('<|python_start|>[get_weather(city="Paris", days=3, opts={"x": [1, 2.5, None]}, '
         'metric=True)]<|python_end|>', None,
         [("get_weather", {**W, "opts": {"x": [1, 2.5, None]}, "metric": True})]),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         None, [("get_weather", W)]),
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\n"
         "</parameter>\n<parameter=note>\na}b]c; d,e\n</parameter>\n</function>\n</tool_call>"
         "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         "Checking.", [("get_weather", NOTE), ("get_time", {})]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n  <b>x</b> \nline 3"
         "\n</parameter>\n<parameter=temp>\n-2.5\n</parameter>\n<parameter=metric>\nfalse\n"
         "</parameter>\n<parameter=opts>\n{\"a\": [1, {\"b\": null}]}\n</parameter>\n"
         "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
         "</function>\n</tool_call>",
         None, [("get_weather", {"city": "line 1\n  <b>x</b> \nline 3", "temp": -2.5,
                                 "metric": False, "opts": {"a": [1, {"b": None}]},
                                 "tags": ["x", "y"], "note": None})]),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
         None, [("get_weather", W)]),
        ('Both, then.<tool_call>[{"name": "get_weather", "arguments": {"city": '
         '"São \\"Paulo\\"", "note": "a}b]c; d,e"}}, {"name": "get_time", "arguments": {}}]',
         "Both, then.", [("get_weather", NOTE), ("get_time", {})]),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         None, [("get_weather", W)]),
        ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
         'get_weather\n```json\n{"city": "São \\"Paulo\\"", "note": "a}b]c; d,e"}\n```'
         "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}"
         "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Let me check.", [("get_weather", NOTE), ("get_time", {})]),
        # V3.1's form
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
         '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         None, [("get_weather", W)]),
    ],
    "openai": [
        ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
         '{"city": "Paris", "days": 3}<|call|>', None, [("get_weather", W)]),
        ("<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to="
         "functions.get_weather<|channel|>commentary json<|message|>"
         '{"city": "São \\"Paulo\\"", "note": "a}b]c; d,e"}<|call|><|start|>assistant'
         "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
         "Checking both.", [("get_weather", NOTE), ("get_time", {})]),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
         "<|message|>It is sunny in Paris.<|return|>", "It is sunny in Paris.", []),
    ],
}

# parser -> outputs that are not (well-formed) calls: the whole text is content
MALFORMED = {
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"',
                    "<|python_tag|>print('hi')", "{not json at all}",
                    '{"parameters": {"city": "Paris"}}'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ',
                "[TOOL_CALLS] nothing useful here", "[TOOL_CALLS][]",
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"'],
    "pythonic": ["[get_weather(city=Paris)]", "[get_weather('Paris')]",
                 '[get_weather(city="Paris"', "[get_weather(city=open('x'))]"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n",
                    "<tool_call>\nhello\n</tool_call>"],
    "granite": ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}',
                "<|tool_call|> no list", '<tool_call>{"name": "get_time"}'],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                    '\n```json\n{"city": ', "<｜tool▁calls▁begin｜>garbage"],
    "openai": ["<|channel|>commentary to=functions.get_weather<|message|>{\"city\": ",
               "<|start|>assistant<|channel|>commentary to=browser.search<|message|>{}"],
}

PLAIN = "Paris is sunny today [citation needed]; {ok} <tool> [x] f(x) <|python"


def _pieces(text: str, seed: int | None) -> list[str]:
    if seed is None:
        return list(text)
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def _run_stream(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict]]:
    """Assemble streamed deltas as an OpenAI client does, checking each call's id and name
    come once, in its first piece."""
    content, calls = "", {}
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for delta in deltas:
        assert isinstance(delta, StreamDelta)
        content += delta.content
        for piece in delta.tool_calls:
            item = piece.to_openai()
            if item["index"] not in calls:
                assert "id" in item and item["function"].get("name"), item
                calls[item["index"]] = {"id": item["id"], "name": item["function"]["name"],
                                        "arguments": ""}
            else:
                assert "id" not in item and "name" not in item["function"], "sent twice"
            calls[item["index"]]["arguments"] += item["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert stream.tools_called == bool(calls)
    return content, [calls[i] for i in sorted(calls)]


CASE_IDS = [(name, i) for name, cases in CASES.items() for i in range(len(cases))]


@pytest.mark.parametrize(("parser", "i"), CASE_IDS)
def test_extract(parser: str, i: int) -> None:
    text, content, expected = CASES[parser][i]
    result = get_tool_parser(parser, TOOLS).extract_tool_calls(text)
    assert isinstance(result, ExtractedToolCalls)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
@pytest.mark.parametrize(("parser", "i"), CASE_IDS)
def test_stream_equals_extract(parser: str, i: int, seed: int | None) -> None:
    text = CASES[parser][i][0]
    whole = get_tool_parser(parser, TOOLS).extract_tool_calls(text)
    content, calls = _run_stream(get_tool_parser(parser, TOOLS).stream(), _pieces(text, seed))
    assert content.strip() == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("parser", sorted(MALFORMED))
def test_malformed_is_content(parser: str) -> None:
    for text in [*MALFORMED[parser], PLAIN]:
        result = get_tool_parser(parser, TOOLS).extract_tool_calls(text)
        assert result.content == text and result.tool_calls == [], text


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("parser", sorted(MALFORMED))
def test_malformed_streamed_before_any_name_is_content(parser: str, seed: int | None) -> None:
    cases = {  # the stream learns these are not calls before a name could go out
        "llama3_json": "Hi <|python_tag|>print('hi')",
        "mistral": "Hi [TOOL_CALLS] nothing useful here",
        "pythonic": "Hi [get_weather('Paris')]",
        "qwen3_coder": "Hi <tool_call>\nhello\n</tool_call>",
        "granite": "Hi <|tool_call|> no list",
        "deepseek_v3": "Hi <｜tool▁calls▁begin｜>garbage",
        "openai": "Hi <|channel|>commentary to=browser.search<|message|>x",
    }
    for text in (cases[parser], PLAIN):
        content, calls = _run_stream(get_tool_parser(parser).stream(), _pieces(text, seed))
        assert content == text and calls == []


def test_streamed_arguments_grow_as_written() -> None:
    """Long arguments do not wait for the end of the call."""
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "' + "x" * 200
            + '"}}]')
    stream = get_tool_parser("mistral").stream()
    pieces = _pieces(text, 0)
    half = "".join(
        t.arguments for p in pieces[: len(pieces) // 2] for t in stream.feed(p).tool_calls)
    assert half.startswith('{"city": "xxx')
    qwen = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n" + "y" * 100
            + "\n</parameter>\n</function>\n</tool_call>")
    stream = get_tool_parser("qwen3_coder", TOOLS).stream()
    sent = "".join(t.arguments for ch in qwen[:-60] for t in stream.feed(ch).tool_calls)
    assert sent.startswith('{"city": "yyyy')


def test_qwen3_coder_without_schema_keeps_strings() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
    assert get_tool_parser("qwen3_coder").extract_tool_calls(text).tool_calls[0].arguments \
        == '{"days": "3"}'
    typed = ToolCallHandler.from_request(TOOLS, "auto", parser="qwen3_coder").extract(text)
    assert typed.tool_calls[0].arguments == '{"days": 3}'


@pytest.mark.parametrize("parser", sorted(CASES))
def test_tool_choice_modes_with_each_parser(parser: str) -> None:
    auto = ToolCallHandler.from_request(TOOLS, "auto", parser=parser)
    text, _, expected = CASES[parser][0]
    assert [(c.name, json.loads(c.arguments)) for c in auto.extract(text).tool_calls] == expected
    required = ToolCallHandler.from_request(TOOLS, "required", parser=parser)
    forced = required.extract('[{"name": "get_time", "arguments": {}}]')
    assert [c.name for c in forced.tool_calls] == ["get_time"]
    named = ToolCallHandler.from_request(
        TOOLS, {"type": "function", "function": {"name": "get_weather"}}, parser=parser)
    assert named.extract('{"city": "Paris"}').tool_calls[0].name == "get_weather"


# -- registration -----------------------------------------------------------------------
class EchoParser(ToolParser):
    """A third party's parser: ``CALL name args`` lines."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        from engine.structured_output.tool_calls import ToolCall

        if not text.startswith("CALL "):
            return ExtractedToolCalls(content=text)
        _, name, args = text.split(" ", 2)
        return ExtractedToolCalls(None, [ToolCall(name, args)])

    def stream(self) -> ToolCallStream:
        raise NotImplementedError


def _plugin(tag: str, names: dict[str, object]) -> types.ModuleType:
    mod = types.ModuleType(f"tool_parser_plugin_{tag}")

    @hookimpl
    def engine_plugin_api_version():
        return PLUGIN_API_VERSION

    @hookimpl
    def engine_register_tool_parsers(registry):
        for name, parser in names.items():
            registry.register(name, parser)

    mod.engine_plugin_api_version = engine_plugin_api_version
    mod.engine_register_tool_parsers = engine_register_tool_parsers
    return mod


@pytest.fixture
def plugin_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)

    def install(*extra):
        registry = PluginRegistry(allowlist=["tool_parsers"])
        for name, plugin in extra:
            info = registry.add_plugin(plugin, name)
            assert info.status is PluginStatus.OK, info.reason
        monkeypatch.setattr(plugins_mod, "_registry", registry)
        return registry

    yield install
    reset_plugin_registry()


def test_builtins_come_from_the_tool_parsers_plugin(plugin_registry) -> None:
    plugin_registry()
    owners = dict(TOOL_PARSERS.contributions())
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite",
                 "deepseek_v3", "openai"):
        assert owners[name] == "tool_parsers"


def test_plugin_parser_usable_by_name(plugin_registry) -> None:
    plugin_registry(("echo_plugin", _plugin("a", {"echo": EchoParser})))
    assert "echo" in tool_parser_names() and "hermes" in tool_parser_names()
    assert dict(TOOL_PARSERS.contributions())["echo"] == "echo_plugin"
    handler = ToolCallHandler.from_request(TOOLS, "auto", parser="echo")
    assert handler.extract('CALL get_time {}').tool_calls[0].name == "get_time"
    assert _check_tool_call_parser("echo") == "echo"
    # lazy "module:Class" paths work for third parties too
    plugin_registry(("lazy", _plugin("b", {"lazy_echo": f"{__name__}:EchoParser"})))
    assert isinstance(get_tool_parser("lazy_echo"), EchoParser)


def test_name_clash_between_plugins_is_refused(plugin_registry) -> None:
    plugin_registry(("first", _plugin("a", {"echo": EchoParser})),
                    ("second", _plugin("b", {"echo": type("Other", (EchoParser,), {})})))
    with pytest.raises(RuntimeError, match="'echo' is contributed by both plugin 'first' "
                                           "and plugin 'second'"):
        tool_parser_names()
    plugin_registry(("thief", _plugin("c", {"hermes": EchoParser})))
    with pytest.raises(RuntimeError, match="'hermes' is contributed by both plugin "
                                           "'thief' and plugin 'tool_parsers'|"
                                           "'hermes' is contributed by both plugin "
                                           "'tool_parsers' and plugin 'thief'"):
        get_tool_parser("hermes")


def test_registry_without_plugins() -> None:
    registry = ToolParserRegistry()
    registry.register("echo", EchoParser)
    assert registry.names() == ["echo"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register("echo", type("Other", (EchoParser,), {}))
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; available: echo"):
        registry.create("nope")


def test_serve_accepts_every_registered_name_and_lists_them() -> None:
    reset_plugin_registry()
    for name in tool_parser_names():
        assert _check_tool_call_parser(name) == name
    result = CliRunner().invoke(serve_cmd, ["--tool-call-parser", "nope"])
    assert result.exit_code == 2
    assert "registered: deepseek_v3, granite, hermes, llama3_json, mistral, openai, " \
        "pythonic, qwen3_coder" in result.output.replace("\n", " ")
