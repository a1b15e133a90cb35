"""Chat content parts with images: placeholders (vLLM's "string" format), typed parts (the
"openai" format for templates that iterate them), prompt order, limits and loading."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from engine.frontend.chat_template import render_chat_template, validate_messages
from engine.multimodal.chat import (
    chat_prompt,
    chat_template_source,
    check_media_limits,
    content_format_for,
    extract_chat_media,
    has_media_parts,
    load_chat_media,
    template_takes_parts,
)
from engine.multimodal.media import MediaConnector, MediaError
from tests.helpers.vlm_llava import LLAVA_HF_CHAT_TEMPLATE as LLAVA_TEMPLATE

PLACEHOLDERS = {"image": "<image>", "video": "<video>"}
placeholder = PLACEHOLDERS.__getitem__

# LLaVA-1.5's template (llava-hf): iterates content parts and selects them by type.
# Qwen2-VL-like: string content or parts, in order.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


def png_url(size=(4, 4), color=(1, 2, 3)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# -- "string" format ----------------------------------------------------------------------------
def test_placeholders_go_before_the_text_one_per_line():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in"}, image_part("u1"),
        {"type": "text", "text": "these?"}, image_part("u2")]}]
    out, items = extract_chat_media(messages, placeholder, template_takes_parts=False)
    assert out == [{"role": "user", "content": "<image>\n<image>\nWhat is in\nthese?"}]
    assert items == [("image", "u1"), ("image", "u2")]
    assert messages[0]["content"][1] == image_part("u1")  # the input is not changed


def test_an_image_without_text():
    out, items = extract_chat_media([{"role": "user", "content": [image_part("u")]}],
                                    placeholder, False)
    assert out[0]["content"] == "<image>\n" and items == [("image", "u")]


def test_placeholders_the_user_wrote_are_kept_in_place():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "left <image> right"}, image_part("a"), image_part("b")]}]
    out, _ = extract_chat_media(messages, placeholder, False)
    assert out[0]["content"] == "<image>\nleft <image> right"  # one more was needed


def test_order_across_messages_and_text_only_messages_untouched():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image_part("first"), {"type": "text", "text": "A?"}]},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": [{"type": "text", "text": "and"}]},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": "second"},  # vLLM's plain-string form
            {"type": "input_image", "image_url": "third"},
            {"type": "input_image", "image_url": {"url": "fourth"}}]},
    ]
    out, items = extract_chat_media(messages, placeholder, False)
    assert [source for _, source in items] == ["first", "second", "third", "fourth"]
    assert out[0] == messages[0] and out[2] == messages[2]
    assert out[3] == messages[3]  # no media: left for validate_messages to flatten
    assert out[1]["content"] == "<image>\nA?"
    assert out[4]["content"] == "<image>\n<image>\n<image>\n"
    assert validate_messages(out)[3]["content"] == "and"


def test_pil_and_transformers_style_parts():
    image = Image.new("RGB", (2, 2))
    frames = [Image.new("RGB", (2, 2)) for _ in range(3)]
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image},
        {"type": "image", "image": image},
        {"type": "image", "url": "u"},
        {"type": "video", "video": frames},
        {"type": "text", "text": "hi"}]}]
    out, items = extract_chat_media(messages, placeholder, False)
    assert items == [("image", image), ("image", image), ("image", "u"), ("video", frames)]
    assert out[0]["content"] == "<image>\n<image>\n<image>\n<video>\nhi"


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url"}, "needs 'image_url'"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "needs 'image_url'"),
    ({"type": "image_url", "image_url": ""}, "needs 'image_url'"),
    ({"type": "image_pil", "image_pil": "not a PIL image"}, "PIL image"),
    ({"type": "image"}, "needs 'image'"),
    ({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}, "videos by URL"),
    ({"type": "video", "video": "http://x/v.mp4"}, "videos by URL"),
    ({"type": "video", "video": []}, "non-empty list of PIL"),
])
def test_malformed_media_parts(part, message):
    with pytest.raises(ValueError, match=message):
        extract_chat_media([{"role": "user", "content": [part]}], placeholder, False)


def test_unknown_parts_beside_media_are_refused():
    messages = [{"role": "user", "content": [image_part("u"), {"type": "audio_url"}]}]
    with pytest.raises(ValueError, match=r"content'\]\[1\].*'audio_url'"):
        extract_chat_media(messages, placeholder, False)


# -- "openai" format ----------------------------------------------------------------------------
def test_typed_parts_keep_their_order():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"}, image_part("a"),
            {"type": "text", "text": "with"}, image_part("b")]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
    ]
    out, items = extract_chat_media(messages, placeholder, template_takes_parts=True)
    assert items == [("image", "a"), ("image", "b")]
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert out[1]["content"] == [
        {"type": "text", "text": "Compare"}, {"type": "image"},
        {"type": "text", "text": "with"}, {"type": "image"}]
    assert out[2]["content"] is None
    assert validate_messages(out, "openai")[1]["content"] == out[1]["content"]


def test_validate_messages_formats():
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ValueError, match="parts must be"):
        validate_messages(typed)  # the string format takes text parts only, as before
    assert validate_messages(typed, "openai") == typed
    assert validate_messages([{"role": "user", "content": "hi"}], "openai")[0]["content"] == [
        {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError, match="parts must be"):
        validate_messages([{"role": "user", "content": [{"type": "image_url"}]}], "openai")
    with pytest.raises(ValueError, match="content_format"):
        validate_messages(typed, "dicts")


def test_templates_render_the_placeholders(tmp_path):
    from tests.helpers.hf_models import build_tokenizer

    tokenizer = build_tokenizer(tmp_path, chat_template=LLAVA_TEMPLATE)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What?"}, image_part("a")]}]
    source = chat_template_source(tokenizer)
    assert source == LLAVA_TEMPLATE and content_format_for(source) == "openai"
    out, _ = extract_chat_media(messages, placeholder, True)
    text = render_chat_template(tokenizer, out, content_format="openai")
    assert text == "USER: <image>\nWhat? ASSISTANT:"
    out, _ = extract_chat_media(messages, placeholder, True)
    text = render_chat_template(tokenizer, out, chat_template=QWEN_TEMPLATE,
                                content_format="openai")
    assert text == ("<|im_start|>user\nWhat?<|vision_start|><|image_pad|><|vision_end|>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    out, _ = extract_chat_media(messages, placeholder, False)
    text = render_chat_template(tokenizer, out, chat_template=STRING_TEMPLATE,
                                add_generation_prompt=False)
    assert text == "<|im_start|>user\n<image>\nWhat?<|im_end|>\n"


def test_template_detection(tmp_path):
    assert template_takes_parts(LLAVA_TEMPLATE)
    assert template_takes_parts(QWEN_TEMPLATE)
    assert template_takes_parts(
        "{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.type }}"
        "{% endfor %}{% endfor %}")
    assert not template_takes_parts(STRING_TEMPLATE)
    assert not template_takes_parts(  # looping over the text's lines is not parts
        "{% for m in messages %}{% for l in m['content'].split('\n') %}{{ l }}{% endfor %}"
        "{% endfor %}")
    assert not template_takes_parts(None)
    assert not template_takes_parts("{% for %}")  # a syntax error: the string format
    path = tmp_path / "t.jinja"
    path.write_text(LLAVA_TEMPLATE)
    assert chat_template_source(None, str(path)) == LLAVA_TEMPLATE
    assert chat_template_source(None, STRING_TEMPLATE) == STRING_TEMPLATE

    named = SimpleNamespace(chat_template={"default": LLAVA_TEMPLATE,
                                           "tool_use": STRING_TEMPLATE})
    assert chat_template_source(named) == LLAVA_TEMPLATE


# -- limits, loading ----------------------------------------------------------------------------
def test_has_media_parts():
    assert not has_media_parts([{"role": "user", "content": "hi"}])
    assert not has_media_parts([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert has_media_parts([{"role": "user", "content": "x"},
                            {"role": "user", "content": [image_part("u")]}])
    assert not has_media_parts("not messages")


def test_limits():
    items = [("image", "a"), ("image", "b")]
    check_media_limits(items, None)
    check_media_limits(items, {"image": 2})
    with pytest.raises(ValueError, match=r"at most 1 image\(s\) per prompt.*got 2"):
        check_media_limits(items, {"image": 1, "video": 4})
    with pytest.raises(ValueError, match="takes image input, not 'video'"):
        check_media_limits([("video", [])], None, modalities=("image",))


def test_load_chat_media():
    pil = Image.new("RGB", (3, 3), (9, 9, 9))
    messages = [{"role": "user", "content": [
        image_part(png_url((5, 4))), {"type": "image_pil", "image_pil": pil},
        {"type": "text", "text": "two"}]}]
    out, data = load_chat_media(messages, MediaConnector(), placeholder, False)
    assert out[0]["content"] == "<image>\n<image>\ntwo"
    assert list(data) == ["image"] and data["image"][1] is pil
    assert data["image"][0].size == (5, 4)
    out, data = load_chat_media([{"role": "user", "content": "no images"}], MediaConnector(),
                                placeholder, False)
    assert data == {} and out[0]["content"] == "no images"
    with pytest.raises(MediaError, match="local files"):
        load_chat_media([{"role": "user", "content": [image_part("file:///etc/hosts")]}],
                        MediaConnector(), placeholder, False)


def test_chat_prompt_for_llm_chat(tmp_path):
    """LLM.chat's step: text alone, or vLLM's prompt dict with the loaded images."""
    from tests.helpers.hf_models import build_tokenizer

    tokenizer = build_tokenizer(tmp_path, chat_template=STRING_TEMPLATE)

    def apply(messages, chat_template=None, **kwargs):
        return render_chat_template(tokenizer, messages, chat_template, **kwargs)

    mm = SimpleNamespace(mm_processor=SimpleNamespace(placeholder=placeholder))
    processor = SimpleNamespace(tokenizer=tokenizer, apply_chat_template=apply, multimodal=mm)
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert chat_prompt(processor, text_only, MediaConnector(), add_generation_prompt=False
                       ) == "<|im_start|>user\nhi<|im_end|>\n"
    messages = [{"role": "user", "content": [image_part(png_url((6, 5))),
                                             {"type": "text", "text": "hi"}]}]
    prompt = chat_prompt(processor, messages, MediaConnector(), add_generation_prompt=False)
    assert prompt["prompt"] == "<|im_start|>user\n<image>\nhi<|im_end|>\n"
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(6, 5)]
    prompt = chat_prompt(processor, messages, MediaConnector(), chat_template=LLAVA_TEMPLATE)
    assert prompt["prompt"] == "USER: <image>\nhi ASSISTANT:"
    processor.multimodal = None
    with pytest.raises(ValueError, match="does not accept images"):
        chat_prompt(processor, messages, MediaConnector())
