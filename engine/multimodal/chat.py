"""Images in chat messages: OpenAI content parts -> placeholders + the items to load.

A chat message's content may hold media parts besides text:

- ``{"type": "image_url", "image_url": {"url": URL}}`` (OpenAI; also ``"image_url": URL``)
- ``{"type": "input_image", "image_url": URL}`` (the Responses API's spelling)
- ``{"type": "image", "image": PIL image or URL}`` (transformers' spelling; also ``"url"``)
- ``{"type": "image_pil", "image_pil": PIL image}`` (offline only, vLLM's)
- ``{"type": "video", "video": [PIL frames]}`` (offline only: frames, not URLs)

URLs are ``data:`` (base64), ``http(s)://`` or ``file://`` (see
:class:`~engine.multimodal.media.MediaConnector` for what is allowed). Video URLs
(``video_url``) are refused: pass decoded frames instead.

Each media part is taken out of the message and the items are returned in prompt order
(message by message, part by part), which is the order the model's processor pairs them
with the placeholders. What stands in the message instead follows vLLM's two content
formats, chosen by the chat template:

- "string" (most templates: ``content`` is text): the model's placeholder for each item,
  each on its own line before the message's text (``"<image>\\n<image>\\ntext"``); a
  placeholder the text already holds counts as one of them (the user placed it).
- "openai" (templates that iterate ``message['content']`` parts and read their
  ``type``): the parts stay in order as ``{"type": "image"}`` / ``{"type": "video"}`` /
  ``{"type": "text", "text": ...}``, and the template writes the placeholders.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes

from engine.multimodal.media import MediaConnector, MediaError

Placeholder = Callable[[str], str]  # modality -> its placeholder text
MediaItem = tuple[str, Any]  # (modality, URL string | PIL image | list of PIL frames)

_IMAGE_PARTS = ("image_url", "input_image", "image", "image_pil")
_VIDEO_PARTS = ("video", "video_url", "input_video")
MEDIA_PART_TYPES = _IMAGE_PARTS + _VIDEO_PARTS


def has_media_parts(messages: Any) -> bool:
    """Whether any message's content holds a media part (cheap: no validation)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if (isinstance(content, Sequence) and not isinstance(content, (str, bytes))
                and any(_is_media(part) for part in content)):
            return True
    return False


def extract_chat_media(messages: Sequence[Mapping[str, Any]], placeholder: Placeholder,
                       template_takes_parts: bool
                       ) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """(the messages with their media parts replaced, the media items in prompt order).

    Messages without media parts are returned as they are (copied) in the "string"
    format; in the "openai" format (``template_takes_parts``) every message's content is
    a list of typed parts. Raises ValueError for a malformed media part.
    """
    out: list[dict[str, Any]] = []
    items: list[MediaItem] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            out.append(message)  # validate_messages names the problem
            continue
        item = dict(message)
        content = message.get("content")
        if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            parts = list(content)
            if any(_is_media(part) for part in parts) or template_takes_parts:
                found, item["content"] = _rewrite(parts, i, placeholder, template_takes_parts)
                items.extend(found)
        elif isinstance(content, str) and template_takes_parts:
            item["content"] = [{"type": "text", "text": content}]
        out.append(item)
    return out, items


def _is_media(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in MEDIA_PART_TYPES


def _rewrite(parts: list[Any], i: int, placeholder: Placeholder, typed: bool
             ) -> tuple[list[MediaItem], str | list[dict[str, Any]]]:
    """One message's parts -> (its media items, its new content)."""
    items: list[MediaItem] = []
    typed_parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, part in enumerate(parts):
        where = f"messages[{i}]['content'][{j}]"
        if _is_media(part):
            modality, source = media_source(part, where)
            items.append((modality, source))
            typed_parts.append({"type": modality})
        elif (isinstance(part, Mapping) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
            texts.append(part["text"])
            typed_parts.append({"type": "text", "text": part["text"]})
        else:
            raise ValueError(f"{where} must be a text part {{'type': 'text', 'text': str}} "
                             "or an image part {'type': 'image_url', 'image_url': "
                             f"{{'url': ...}}}}; got {_describe(part)}")
    if typed:
        return items, typed_parts
    return items, _string_content(texts, [m for m, _ in items], placeholder)


def _string_content(texts: list[str], modalities: list[str], placeholder: Placeholder) -> str:
    """vLLM's "string" format: the placeholders the text lacks, one per line, first."""
    text = "\n".join(texts)
    missing: list[str] = []
    counts: dict[str, int] = {}
    for modality in modalities:
        counts[placeholder(modality)] = counts.get(placeholder(modality), 0) + 1
    for mark, count in counts.items():
        missing.extend([mark] * max(0, count - text.count(mark)))
    return "\n".join([*missing, text])


def media_source(part: Mapping[str, Any], where: str = "content part") -> MediaItem:
    """(modality, source) of one media part; ValueError when malformed or unsupported."""
    kind = part.get("type")
    if kind in ("video_url", "input_video") or (kind == "video" and _is_url(part.get("video"))):
        raise ValueError(f"{where}: videos by URL are not supported; pass the decoded frames "
                         "(LLM.generate(..., multi_modal_data={'video': [frames]}) or an "
                         "offline {'type': 'video', 'video': [PIL images]} part)")
    if kind == "video":
        frames = part.get("video")
        if (not isinstance(frames, Sequence) or isinstance(frames, (str, bytes)) or not frames
                or not all(_is_pil(f) for f in frames)):
            raise ValueError(f"{where}: a video part needs 'video': a non-empty list of PIL "
                             "images (frames)")
        return "video", list(frames)
    if kind == "image_pil":
        image = part.get("image_pil")
        if not _is_pil(image):
            raise ValueError(f"{where}: an image_pil part needs 'image_pil': a PIL image, got "
                             f"{type(image).__name__}")
        return "image", image
    if kind == "image":
        value = part.get("image", part.get("url"))
        if _is_pil(value) or _is_url(value):
            return "image", value
        raise ValueError(f"{where}: an image part needs 'image' (a PIL image or a URL) or "
                         "'url'")
    value = part.get("image_url")  # image_url / input_image
    if isinstance(value, Mapping):
        value = value.get("url")
    if not _is_url(value):
        raise ValueError(f"{where}: an {kind} part needs 'image_url': {{'url': URL}} or a URL "
                         "string (data:image/...;base64,..., http(s)://..., file://...)")
    return "image", value


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_pil(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image)


def _describe(part: Any) -> str:
    if isinstance(part, Mapping):
        return f"a part of type {part.get('type')!r}"
    return type(part).__name__


# -- limits and loading ---------------------------------------------------------------------
def check_media_limits(items: Sequence[MediaItem], limits: Mapping[str, int] | None,
                       modalities: Sequence[str] | None = None) -> None:
    """Refuse more items per prompt than ``limits`` allow (before anything is fetched),
    and modalities the model does not take."""
    counts: dict[str, int] = {}
    for modality, _ in items:
        counts[modality] = counts.get(modality, 0) + 1
    for modality, count in counts.items():
        if modalities is not None and modality not in modalities:
            raise ValueError(f"this model takes {' and '.join(modalities)} input, not "
                             f"{modality!r}")
        limit = (limits or {}).get(modality)
        if limit is not None and count > limit:
            raise ValueError(f"at most {limit} {modality}(s) per prompt are allowed "
                             f"(--limit-mm-per-prompt), got {count}")


def _load_one(connector: MediaConnector, modality: str, source: Any) -> Any:
    if modality == "image" and isinstance(source, str):
        return connector.load_image(source)
    return source  # PIL images and frame lists are taken as given


def load_media_items(items: Sequence[MediaItem], connector: MediaConnector
                     ) -> dict[str, list[Any]]:
    """Load every item (URLs fetched and decoded) -> ``{"image": [...], "video": [...]}``
    (only the modalities present), in order. MediaError for a bad item."""
    data: dict[str, list[Any]] = {}
    for modality, source in items:
        data.setdefault(modality, []).append(_load_one(connector, modality, source))
    return data


async def aload_media_items(items: Sequence[MediaItem], connector: MediaConnector
                            ) -> dict[str, list[Any]]:
    """:func:`load_media_items` with the items fetched concurrently, each in a thread."""

    async def one(modality: str, source: Any) -> Any:
        if modality == "image" and isinstance(source, str):
            return await connector.aload_image(source)
        return source

    loaded = await asyncio.gather(*(one(m, s) for m, s in items))
    data: dict[str, list[Any]] = {}
    for (modality, _), value in zip(items, loaded):
        data.setdefault(modality, []).append(value)
    return data


def load_chat_media(messages: Sequence[Mapping[str, Any]], connector: MediaConnector,
                    placeholder: Placeholder, template_takes_parts: bool
                    ) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The offline path (``LLM.chat``): (messages with placeholders, ``multi_modal_data``).

    Render the messages with ``content_format="openai"`` when ``template_takes_parts``.
    """
    rewritten, items = extract_chat_media(messages, placeholder, template_takes_parts)
    return rewritten, load_media_items(items, connector)


def chat_prompt(processor: Any, messages: Sequence[Mapping[str, Any]],
                connector: MediaConnector, chat_template: str | None = None,
                **render_kwargs: Any) -> str | dict[str, Any]:
    """One conversation as ``LLM.chat``'s prompt: its rendered text, or with images,
    vLLM's ``{"prompt": text, "multi_modal_data": {"image": [...]}}``.

    ``processor`` is the engine's front-end Processor (``apply_chat_template``,
    ``tokenizer``, ``multimodal``); ``render_kwargs`` go to ``apply_chat_template``
    (add_generation_prompt, tools, template variables). Images are loaded with
    ``connector`` (:func:`engine.multimodal.media.connector_from_config`); the per-prompt
    limits are the processor's to enforce. ValueError (MediaError) for bad input.
    """
    if not has_media_parts(messages):
        return processor.apply_chat_template(messages, chat_template=chat_template,
                                             **render_kwargs)
    mm_processor = getattr(getattr(processor, "multimodal", None), "mm_processor", None)
    if mm_processor is None:
        raise ValueError("this model does not accept images (it takes text only)")
    content_format = content_format_for(chat_template_source(processor.tokenizer,
                                                             chat_template))
    rewritten, data = load_chat_media(messages, connector, mm_processor.placeholder,
                                      content_format == "openai")
    text = processor.apply_chat_template(rewritten, chat_template=chat_template,
                                         content_format=content_format, **render_kwargs)
    return {"prompt": text, "multi_modal_data": data}


# -- the chat template's content format -----------------------------------------------------
def chat_template_source(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The Jinja text a conversation will be rendered with (the given template, a file's
    text, or the tokenizer's default); None when there is none."""
    from engine.frontend.chat_template import resolve_chat_template

    if chat_template is not None:
        return resolve_chat_template(tokenizer, chat_template)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: transformers uses "default"
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def content_format_for(template_source: str | None) -> str:
    """"openai" when the template iterates typed content parts, else "string"."""
    return "openai" if template_takes_parts(template_source) else "string"


@functools.lru_cache(maxsize=32)
def template_takes_parts(template_source: str | None) -> bool:
    """Whether the template loops over a message's ``content`` (vLLM's content-format
    detection): such templates read each part's ``type`` and write the placeholders
    themselves, so media parts must reach them as ``{"type": "image"}`` parts."""
    if not template_source:
        return False
    try:
        ast = _PARSER.parse(template_source)
    except jinja2.TemplateSyntaxError:
        return False
    content_names: set[str] = set()  # {% set c = message['content'] %}
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content(assign.node, set()):
            content_names.add(assign.target.name)
    return any(_is_content(loop.iter, content_names) for loop in ast.find_all(nodes.For))


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %} ... {% endgeneration %}`` (it marks the assistant's
    tokens for training masks): parsed as its body, so templates using it (LLaVA's) are
    understood rather than taken for unparsable."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# Parses (never renders) templates with the tags transformers' chat environment knows.
_PARSER = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationBlock])


def _is_content(node: nodes.Node, names: set[str]) -> bool:
    """Whether ``node`` is ``x['content']`` / ``x.content`` / a name bound to it, possibly
    through filters (``message['content'] | selectattr(...)``); ``.split()`` and other
    calls on string content do not count."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in names


__all__ = [
    "MEDIA_PART_TYPES", "MediaError", "aload_media_items", "chat_prompt", "chat_template_source",
    "check_media_limits", "content_format_for", "extract_chat_media", "has_media_parts",
    "load_chat_media", "load_media_items", "media_source", "template_takes_parts",
]
