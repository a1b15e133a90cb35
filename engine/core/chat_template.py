"""Chat messages -> prompt text, through the model's Jinja chat template.

Rendering is delegated to ``tokenizer.apply_chat_template`` so the text is exactly what
transformers produces for the same template. Message parts that are lists of
``{"type": "text", "text": ...}`` (OpenAI style) are joined with newlines first, since
most templates expect ``content`` to be a string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation shape; return plain dicts with text content flattened."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(
                f"messages[{i}]['role'] must be one of {', '.join(ROLES)}, got {role!r}"
            )
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] has no 'content'")
        item = dict(message)
        item["content"] = _flatten_content(message.get("content"), i)
        checked.append(item)
    return checked


def _flatten_content(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"messages[{i}]['content'] parts must be "
                    f"{{'type': 'text', 'text': str}}; got {part!r}"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"messages[{i}]['content'] must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def resolve_chat_template(
    tokenizer: PreTrainedTokenizerBase | None, chat_template: str | None
) -> str | None:
    """The template given (Jinja text or a file path), or None to use the model's own.

    Raises ValueError when neither exists.
    """
    if chat_template is not None:
        if "{" not in chat_template and Path(chat_template).is_file():
            return Path(chat_template).read_text()
        return chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model's tokenizer has no chat template; pass chat_template= (Jinja text or a "
            "file path) or use a plain text prompt"
        )
    return None  # transformers picks the model's (or the named one matching `tools`)


def render_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render a conversation to prompt text (tokenize it with ``add_special_tokens=False``)."""
    conversation = validate_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    template = resolve_chat_template(tokenizer, chat_template)
    return tokenizer.apply_chat_template(
        conversation,
        chat_template=template,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **template_kwargs,
    )
