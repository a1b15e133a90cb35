"""Reasoning parsers (deepseek_r1, qwen3, granite, gpt_oss) on hand-written outputs of each family,
whole and streamed (one character at a time, markers split across pieces, and in token-like
chunks), the registry, the tokenizer lookups, and the structured-output manager's
reasoning gate (no mask and no matcher advance until the end-of-reasoning token)."""

from __future__ import annotations

import time

import pytest

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.structured_output.manager import StructuredOutputManager, reasoning_ended
from engine.structured_output.reasoning import (
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

# (parser, model output, expected (reasoning, content))
CASES = [
    # DeepSeek-R1: the template emits "<think>\n" in the prompt; the output has only </think>.
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.",
     ("Okay, 2+2 is 4.\n", "\n\nThe answer is 4.")),
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\n4", ("\nLet me see.\n", "\n\n4")),
    ("deepseek_r1", "<think>cut off while thinking", ("cut off while thinking", None)),
    ("deepseek_r1", "no end tag at all", ("no end tag at all", None)),
    ("deepseek_r1", "<think>only thinking</think>", ("only thinking", None)),
    ("deepseek_r1", "</think>just content", (None, "just content")),
    ("deepseek_r1", "a < b </think> x </think> y", ("a < b ", " x </think> y")),
    # Qwen3: <think>...</think> when thinking; none with enable_thinking=False.
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!",
     ("\nThe user greets me.\n", "\n\nHello!")),
    ("qwen3", "\n<think>x</think>y", ("x", "y")),
    ("qwen3", "Hello! How can I help?", (None, "Hello! How can I help?")),
    ("qwen3", "<thinking is a word", (None, "<thinking is a word")),
    ("qwen3", "a </think> b", (None, "a </think> b")),
    ("qwen3", "<think>truncated", ("truncated", None)),
    ("qwen3", "<think></think>\n\nDirect.", (None, "\n\nDirect.")),
    # Granite 3.x ("thinking": true).
    ("granite", "Here is my thought process:\nThe user wants a joke.\n"
                "Here is my response:\nWhy did the GPU cross the road?",
     ("\nThe user wants a joke.\n", "\nWhy did the GPU cross the road?")),
    ("granite", "Here's my thought process: short. Here's my response: done.",
     (" short. ", " done.")),
    ("granite", "Here is a plain answer.", (None, "Here is a plain answer.")),
    ("granite", "Here is my thought process: never answered", (" never answered", None)),
    # gpt-oss harmony channels (special tokens kept in the text).
    ("gpt_oss", "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>4<|return|>",
     ("User asks 2+2. Easy.", "4")),
    ("gpt_oss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}<|call|>',
     ("Need the weather.", "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                           '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')),
    ("gpt_oss", "<|channel|>final<|message|>Hi<|return|>", (None, "Hi")),
    ("gpt_oss", "<|channel|>analysis<|message|>cut off", ("cut off", None)),
    ("gpt_oss", "Not harmony at all.", (None, "Not harmony at all.")),
]


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    state = parser.stream()
    reasoning, content = [], []
    seen_content = False
    for piece in [*pieces, None]:
        r, c = state.feed(piece) if piece is not None else state.finish()
        if r is not None:
            assert not seen_content, "reasoning after content"
            reasoning.append(r)
        if c is not None:
            seen_content = True
            content.append(c)
    return "".join(reasoning) or None, "".join(content) or None


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_whole_and_streamed(name, text, expected):
    parser = get_reasoning_parser(name)
    assert parser.extract_reasoning(text) == expected
    assert _stream(parser, list(text)) == expected  # every marker split across pieces
    for size in (2, 3, 5):
        assert _stream(parser, _chunks(text, size)) == expected


def test_streamed_token_by_token_holds_back_only_marker_prefixes():
    parser = get_reasoning_parser("deepseek_r1")
    state = parser.stream()
    pieces = ["<th", "ink>", "Two", " plus", " two", "</", "thi", "nk>", "\n\n", "Four"]
    out = [state.feed(p) for p in pieces] + [state.finish()]
    assert out == [
        (None, None), (None, None), ("Two", None), (" plus", None), (" two", None),
        (None, None), (None, None), (None, None), (None, "\n\n"), (None, "Four"), (None, None),
    ]
    assert not state.in_reasoning
    # A held-back "</" that was not a marker goes out as reasoning on the next piece.
    state = parser.stream()
    assert state.feed("a </") == ("a ", None)
    assert state.feed("b>") == ("</b>", None)
    assert state.finish() == (None, None)
    # One piece holding the end of the reasoning and the start of the content.
    state = parser.stream()
    assert state.feed("x</think>y") == ("x", "y")


def test_registry_and_errors():
    assert {"deepseek_r1", "qwen3", "granite", "gpt_oss"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; available: .*qwen3"):
        get_reasoning_parser("nope")

    @register_reasoning_parser("test_brackets")
    class Brackets(ReasoningParser):
        start_markers = ("[[",)
        end_markers = ("]]",)
        start_required = True

    try:
        assert get_reasoning_parser("test_brackets").extract_reasoning("[[a]]b") == ("a", "b")
        with pytest.raises(ValueError, match="already registered"):
            register_reasoning_parser("test_brackets")(type("Other", (Brackets,), {}))
    finally:
        from engine.structured_output import reasoning

        reasoning._REASONING_PARSERS.pop("test_brackets")


@pytest.fixture(scope="module")
def think_tokenizer(llama_dir):
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    tok.add_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)],
                   special_tokens=True)
    return tok


def test_token_ids_and_is_reasoning_end(think_tokenizer):
    start, end = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    for name in ("deepseek_r1", "qwen3"):
        parser = get_reasoning_parser(name, think_tokenizer)
        assert (parser.start_token_id, parser.end_token_id) == (start, end)
        assert parser.marker_tokens_special
        assert not parser.is_reasoning_end([5, start, 7])
        assert parser.is_reasoning_end([5, start, 7, end, 9])
        assert not parser.is_reasoning_end([end, 3, start, 4])  # a later turn reopened it
        assert not parser.is_reasoning_end([])
    for name in ("granite", "gpt_oss"):  # multi-token markers: no end token for the core
        parser = get_reasoning_parser(name, think_tokenizer)
        assert parser.end_token_id is None and not parser.is_reasoning_end([end])
    assert get_reasoning_parser("deepseek_r1").end_token_id is None  # no tokenizer
    assert reasoning_ended([1, start, 2, end], end, start)
    assert not reasoning_ended([1, end, start], end, start)


def test_manager_gates_the_grammar_until_reasoning_ends(think_tokenizer):
    start, end = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    vocab = len(think_tokenizer)
    mgr = StructuredOutputManager.from_tokenizer(
        think_tokenizer, vocab, num_threads=1, reasoning_end_token_id=end,
        reasoning_start_token_id=start)
    try:
        params = StructuredOutputsParams(choice=["yes"])
        mgr.add_request("think", params, prompt_token_ids=[1, 2, start])
        mgr.add_request("closed", params, prompt_token_ids=[1, start, end])  # thinking off
        deadline = time.monotonic() + 30
        while not all(mgr.is_ready(Request(r, [1], SamplingParams())) for r in ("think",
                                                                                  "closed")):
            assert time.monotonic() < deadline and not mgr.pop_failures()
            mgr.wait_for_compiles(0.05)
        assert mgr.in_reasoning("think") and not mgr.in_reasoning("closed")
        no = think_tokenizer.encode("no", add_special_tokens=False)
        # In the reasoning anything goes and nothing reaches the matcher.
        assert mgr.accept_tokens("think", no) and mgr.in_reasoning("think")
        # The end token ends it; the tokens after it are the grammar's.
        yes = think_tokenizer.encode("yes", add_special_tokens=False)
        assert mgr.accept_tokens("think", [end, *yes])
        assert not mgr.in_reasoning("think") and not mgr.is_terminated("think")
        assert mgr.accept_tokens("think", [think_tokenizer.eos_token_id])
        assert mgr.is_terminated("think")
        assert not mgr.accept_tokens("closed", no)  # constrained from the first token
    finally:
        mgr.shutdown()


def test_chat_tool_calls_read_only_after_the_reasoning():
    """serving_chat: a <tool_call> inside the reasoning is reasoning; the one after it is a
    call (hermes), whole and streamed token by token."""
    from engine.core.outputs import CompletionOutput
    from engine.entrypoints.openai.serving_chat import OpenAIServingChat, _delta, _Options
    from engine.structured_output.tool_choice import ToolCallHandler

    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = f"maybe {call}?</think>ok {call}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    parser = get_reasoning_parser("deepseek_r1")
    options = _Options("id", 0, 1, None, ToolCallHandler.from_request(tools, "auto"), parser)
    serving = object.__new__(OpenAIServingChat)
    choice = serving._choice(CompletionOutput(0, text, [], finish_reason="stop"), options)
    assert choice.message.reasoning_content == choice.message.reasoning == f"maybe {call}?"
    assert choice.message.content == "ok"
    assert [c["function"] for c in choice.message.tool_calls] == [
        {"name": "f", "arguments": '{"x": 1}'}]
    assert choice.finish_reason == "tool_calls"

    tool_stream, reasoning_stream = options.tools.stream(), parser.stream()
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    reasoning, content, args, names = "", "", "", []
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        delta = _delta(tool_stream, reasoning_stream,
                       CompletionOutput(0, piece, [], finish_reason=finish))
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for t in delta.tool_calls or ():
            names += [t["function"]["name"]] if "name" in t["function"] else []
            args += t["function"]["arguments"]
    assert (reasoning, content, names, args) == (f"maybe {call}?", "ok", ["f"], '{"x": 1}')
