"""Reasoning parsers: a thinking model's text -> ``(reasoning, content)``, whole or streamed.

A parser knows one model family's reasoning markers. Parsers live in a registry
(:func:`register_reasoning_parser`, :func:`get_reasoning_parser`) so a model's syntax is
picked by name (``--reasoning-parser deepseek_r1``), with vLLM's names and semantics:

- ``deepseek_r1``: everything up to ``</think>`` is reasoning; a leading ``<think>`` is
  dropped (the chat template often emits it in the prompt instead); with no ``</think>``
  at all the whole output is reasoning (the model was cut off while thinking).
- ``qwen3``: ``<think>...</think>`` at the start of the output is reasoning; an output that
  does not start with ``<think>`` is all content (Qwen3 with thinking disabled). A
  ``<think>`` never closed leaves the rest as reasoning.
- ``granite``: ``Here is my thought process:`` (or ``Here's ...``) at the start opens the
  reasoning, ``Here is my response:`` (or ``Here's ...``) opens the content; without the
  first marker the output is all content.
- ``gpt_oss``: OpenAI harmony messages (``<|channel|>analysis<|message|>...<|end|>``): the
  ``analysis`` channel is reasoning, the ``final`` channel content; a ``commentary``
  message (a tool call) stays in the content as written, for the tool-call parser. Text
  that is not harmony at all is content.

Markers are kept out of both parts. As in vLLM, no whitespace is stripped around them,
and an empty part is ``None``. The whole-text form runs the streaming state machine over
the text, so streamed pieces always concatenate to what the whole-text form returns.

Streaming (:class:`ReasoningStream`): each piece of text is split into its reasoning and
content parts at once, except a tail that might be the start of a marker split across
pieces (held back until the next piece or :meth:`ReasoningStream.finish`).

The engine core needs to know when reasoning has ended (structured outputs constrain only
the tokens after it): :meth:`ReasoningParser.end_token_id` is the end marker's token id
when the marker is one token of the tokenizer (``</think>``), and
:meth:`ReasoningParser.is_reasoning_end` reads a token sequence (vLLM's rule: the last of
the start / end tokens in it is the end token).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

# -- the streaming state machine ------------------------------------------------------------
_PRE, _REASONING, _CONTENT = "pre", "reasoning", "content"


class ReasoningStream:
    """Per-output state: feed it each new piece of text, then call :meth:`finish`.

    Modes: ``pre`` (at the start, looking for a start marker after optional whitespace),
    ``reasoning`` (looking for an end marker) and ``content``.
    """

    def __init__(self, start_markers: Sequence[str], end_markers: Sequence[str],
                 start_required: bool) -> None:
        self.start_markers = tuple(start_markers)
        self.end_markers = tuple(end_markers)
        self.start_required = start_required
        self.mode = _PRE if self.start_markers else _REASONING
        self._buf = ""  # held-back text: a possible marker prefix

    @property
    def in_reasoning(self) -> bool:
        """True until the output is known to be past its reasoning (or to have none)."""
        return self.mode != _CONTENT

    def feed(self, delta_text: str) -> tuple[str | None, str | None]:
        """``(reasoning_delta, content_delta)`` that ``delta_text`` completes (None: none)."""
        reasoning, content = [], []
        text = self._buf + delta_text
        self._buf = ""
        if self.mode == _PRE:
            stripped = text.lstrip()
            marker = next((m for m in self.start_markers if stripped.startswith(m)), None)
            if marker is not None:
                text = stripped[len(marker):]
                self.mode = _REASONING
            elif any(m.startswith(stripped) for m in self.start_markers):
                self._buf = text  # all whitespace, or a start marker's beginning
                return None, None
            else:
                self.mode = _CONTENT if self.start_required else _REASONING
        if self.mode == _REASONING:
            found = _find_first(text, self.end_markers)
            if found is None:
                keep = max((_partial_suffix(text, m) for m in self.end_markers), default=0)
                reasoning.append(text[: len(text) - keep])
                self._buf = text[len(text) - keep:]
                text = ""
            else:
                at, marker = found
                reasoning.append(text[:at])
                text = text[at + len(marker):]
                self.mode = _CONTENT
        if self.mode == _CONTENT:
            content.append(text)
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        """Flush the held-back tail at the end of the output."""
        text, self._buf = self._buf, ""
        if not text:
            return None, None
        if self.mode == _PRE:
            if self.start_required:
                return None, text
            return text.lstrip() or None, None  # whitespace before a possible <think>
        if self.mode == _REASONING:
            return text, None
        return None, text


def _find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# -- parsers ------------------------------------------------------------------------------
class ReasoningParser(ABC):
    """One model family's reasoning markers."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]] = ()
    end_markers: ClassVar[tuple[str, ...]] = ()
    start_required: ClassVar[bool] = False  # no start marker: all content (else reasoning)

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.start_token_id = self._single_token_id(self.start_markers)
        self.end_token_id = self._single_token_id(self.end_markers)

    def _single_token_id(self, markers: Sequence[str]) -> int | None:
        """The id of the marker when it is one token of the tokenizer (else None)."""
        if self.tokenizer is None or len(markers) != 1:
            return None
        vocab = self.tokenizer.get_vocab()
        token_id = vocab.get(markers[0])
        return int(token_id) if token_id is not None else None

    @property
    def marker_tokens_special(self) -> bool:
        """True when a marker is a special token (dropped by skip_special_tokens)."""
        if self.tokenizer is None:
            return False
        ids = [i for i in (self.start_token_id, self.end_token_id) if i is not None]
        return any(not self.tokenizer.decode([i], skip_special_tokens=True) for i in ids)

    def stream(self) -> ReasoningStream:
        """Fresh streaming state for one output."""
        return ReasoningStream(self.start_markers, self.end_markers, self.start_required)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A finished output -> ``(reasoning, content)``; an empty part is None."""
        stream = self.stream()
        reasoning, content = [], []
        for r, c in (stream.feed(text), stream.finish()):
            reasoning.append(r or "")
            content.append(c or "")
        return "".join(reasoning) or None, "".join(content) or None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when ``token_ids`` ends past a reasoning part: the last start or end
        token in it is the end token (False when the end marker is not one token)."""
        if self.end_token_id is None:
            return False
        for token in reversed(token_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False


_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(
    name: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator: make a parser available by ``name``."""

    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        if name in _REASONING_PARSERS and _REASONING_PARSERS[name] is not cls:
            raise ValueError(f"a reasoning parser named {name!r} is already registered")
        cls.name = name
        _REASONING_PARSERS[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str, tokenizer: Any = None) -> ReasoningParser:
    cls = _REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; available: "
                         f"{', '.join(reasoning_parser_names())}")
    return cls(tokenizer)


def reasoning_parser_names() -> list[str]:
    return sorted(_REASONING_PARSERS)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """``[<think>]reasoning</think>content``; no ``</think>``: all reasoning."""

    start_markers = ("<think>",)
    end_markers = ("</think>",)
    start_required = False


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """``<think>reasoning</think>content``; no leading ``<think>``: all content."""

    start_markers = ("<think>",)
    end_markers = ("</think>",)
    start_required = True


@register_reasoning_parser("granite")
class GraniteReasoningParser(ReasoningParser):
    """IBM Granite 3.x: ``Here is my thought process: ... Here is my response: ...``."""

    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    start_required = True


# -- gpt_oss (harmony) --------------------------------------------------------------------
_H_MESSAGE, _H_CHANNEL = "<|message|>", "<|channel|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")


class HarmonyStream(ReasoningStream):
    """Harmony messages, one after another: ``[<|start|>assistant]<|channel|>NAME[ ...]
    <|message|>TEXT<|end|>`` (``<|return|>`` ends the last, ``<|call|>`` a tool call)."""

    def __init__(self) -> None:
        super().__init__((), (), True)
        self.mode = _PRE
        self._channel: str | None = None  # inside a message: its channel
        self._header = ""  # the message's header, as written (for commentary)
        self._plain = False  # not harmony: everything is content

    def feed(self, delta_text: str) -> tuple[str | None, str | None]:
        text = self._buf + delta_text
        self._buf = ""
        reasoning, content = [], []
        while text:
            if self._plain:
                content.append(text)
                break
            if self._channel is None:  # between messages: reading a header
                at = text.find(_H_MESSAGE)
                if at < 0:
                    head = text.lstrip()[:2]
                    if self.mode == _PRE and head and head != "<|" and head != "<":
                        self._plain = True  # not harmony: all content
                        continue
                    self._buf = text
                    break
                header, text = text[:at], text[at + len(_H_MESSAGE):]
                channel = header.split(_H_CHANNEL, 1)[1] if _H_CHANNEL in header else ""
                self._channel = channel.split()[0].split("<|")[0] if channel.split() else ""
                self._header = header + _H_MESSAGE
                if self._channel not in ("analysis", "final"):
                    content.append(self._header)
                if self._channel == "final":
                    self.mode = _CONTENT
                elif self.mode == _PRE:
                    self.mode = _REASONING
                continue
            found = _find_first(text, _H_ENDS)
            if found is None:
                keep = max(_partial_suffix(text, m) for m in _H_ENDS)
                body, self._buf, text = text[: len(text) - keep], text[len(text) - keep:], ""
                end = ""
            else:
                at, end = found
                body, text = text[:at], text[at + len(end):]
            if self._channel == "analysis":
                reasoning.append(body)
            elif self._channel == "final":
                content.append(body)
            else:
                content.append(body + end)
            if found is not None:
                self._channel = None
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        text, self._buf = self._buf, ""
        if not text:
            return None, None
        if self._channel == "analysis":
            return text, None
        if self._channel is None and self.mode != _PRE and not self._plain:
            return None, None  # an unfinished header: nothing to show
        return None, text


@register_reasoning_parser("gpt_oss")
class GptOssReasoningParser(ReasoningParser):
    """OpenAI gpt-oss harmony channels: ``analysis`` is reasoning, ``final`` content."""

    start_markers = ("<|channel|>analysis<|message|>",)
    end_markers = ("<|channel|>final<|message|>",)

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        # The markers span several tokens; <|channel|> tells whether they are special.
        self.start_token_id = self.end_token_id = None
        self._channel_id = self._single_token_id((_H_CHANNEL,))

    @property
    def marker_tokens_special(self) -> bool:
        return self._channel_id is not None and not self.tokenizer.decode(
            [self._channel_id], skip_special_tokens=True)

    def stream(self) -> ReasoningStream:
        return HarmonyStream()
