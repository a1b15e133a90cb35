"""Chat messages -> prompt text, through the model's Jinja chat template.

Rendering is delegated to ``tokenizer.apply_chat_template`` so the text is exactly what
transformers produces for the same template. Message parts that are lists of
``{"type": "text", "text": ...}`` (OpenAI style) are joined with newlines first, since
most templates expect ``content`` to be a string.

Messages with images or videos (``engine.multimodal.chat``) come either as strings that
hold the model's placeholders (``content_format="string"``) or, for templates that iterate
typed parts, as lists of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` /
``{"type": "video"}`` parts that are passed through as they are (``content_format=
"openai"``, vLLM's name; string content then becomes one text part).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


ROLES = ("system", "user", "assistant", "tool", "developer", "function")
CONTENT_FORMATS = ("string", "openai")
_MEDIA_PART_TYPES = ("image", "video")  # typed parts a parts-iterating template renders


def validate_messages(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """Check the conversation shape; return plain dicts with text content flattened
    (``content_format="string"``) or as typed parts (``"openai"``)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                         f"got {content_format!r}")
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
        if content_format == "openai":
            item["content"] = _typed_parts(message.get("content"), i)
        else:
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


def _typed_parts(content: Any, i: int) -> list[dict[str, Any]] | None:
    """Content as a list of typed parts, for templates that iterate them."""
    if content is None:
        return None
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in _MEDIA_PART_TYPES:
                parts.append(dict(part))
            elif (isinstance(part, Mapping) and part.get("type") == "text"
                  and isinstance(part.get("text"), str)):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(
                    f"messages[{i}]['content'] parts must be {{'type': 'text', 'text': str}}, "
                    f"{{'type': 'image'}} or {{'type': 'video'}}; got {part!r}"
                )
        return parts
    raise ValueError(
        f"messages[{i}]['content'] must be a string or a list of parts, "
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
    content_format: str = "string",
    **template_kwargs: Any,
) -> str:
    """Render a conversation to prompt text (tokenize it with ``add_special_tokens=False``).

    ``content_format``: "string" (list content flattened to text) or "openai" (content as
    typed parts, for templates that iterate them; see the module docstring)."""
    conversation = validate_messages(messages, content_format)
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
