"""``openai``: GPT-OSS's harmony format, read from text with its special tokens kept.

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location": "Paris"}<|call|>

A message is a header (``<|start|>role``, ``<|channel|>name``, an optional recipient
``to=functions.NAME`` in the role or channel part, ``<|constrain|>json``) and a body up to
``<|end|>``, ``<|call|>`` or ``<|return|>`` (or the end of the output: ``<|call|>`` and
``<|return|>`` are stop tokens, often absent from the text). A message to
``functions.NAME`` is a call whose body is its arguments JSON; ``final`` (and
``commentary`` without a recipient: a preamble to the user) is content, streamed as it
comes; ``analysis`` is reasoning, not content (a reasoning parser reports it).
"""

from __future__ import annotations

import re

from engine.structured_output.tool_parsers._common import (
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
    locate_markers,
    partial_suffix,
    skip_ws,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class OpenAIToolParser(RegionToolParser):
    name = "openai"
    region_without_calls_ok = True  # a harmony answer without calls is its final text

    def locate(self, text: str) -> Location:
        return locate_markers(text, (START, CHANNEL))

    def parse_region(self, region: str, final: bool) -> RegionParse | None:
        parsed, pos = RegionParse(), 0
        contents: list[str] = []
        while (pos := skip_ws(region, pos)) < len(region):
            if region.startswith(START, pos):
                pos += len(START)
            elif not region.startswith(CHANNEL, pos):
                if final or not any(m.startswith(region[pos:]) for m in (START, CHANNEL)):
                    return None  # text between messages: not harmony after all
                break
            msg = region.find(MESSAGE, pos)
            if msg < 0:
                if final:
                    return None
                break  # the header is still being written
            header = region[pos:msg]
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            body_start = msg + len(MESSAGE)
            ends = [(i, m) for m in ENDS if (i := region.find(m, body_start)) >= 0]
            if ends:
                end, marker = min(ends)
                body, pos, complete = region[body_start:end], end + len(marker), True
            else:
                body = region[body_start:]
                if not final:
                    body = body[: len(body) - max(partial_suffix(body, m) for m in ENDS)]
                pos, complete = len(region), final
            if recipient is not None:
                target = recipient.group(1)
                if not target.startswith("functions.") or len(target) == len("functions."):
                    return None  # a built-in tool (browser, python): not a function call
                # stripped while partial too: a prefix of the final stripped body
                parsed.calls.append(PartialCall(target[len("functions."):], body.strip(),
                                                complete))
            elif channel is None or channel.group(1) in ("final", "commentary"):
                contents.append(body)
        parsed.content = "".join(contents)
        return parsed
