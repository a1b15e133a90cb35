"""Images through ``/v1/chat/completions`` with the ``openai`` client (a tiny LLaVA).

One LLaVA server (``--limit-mm-per-prompt '{"image": 2}'``, ``--allowed-media-domains
127.0.0.1`` for a local ``http.server``, ``--allowed-local-media-path``) and one text-only
server. A base64 PNG gives transformers' greedy tokens (the prompt rendered by the
server's chat template, the image by transformers' LlavaProcessor); every bad image is a
400 with an OpenAI error body, and a request running meanwhile is not disturbed.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess
from tests.helpers.vlm_llava import IMAGE_TOKEN, build_llava, hf_processor, random_image

MAX_TOKENS = 6
PROMPT = "Describe it."
OVERSIZE = 21 * 1024 * 1024  # over the connector's 20 MiB cap


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def header_only_png(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` with (almost) no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))


def image_message(*urls: str, text: str = PROMPT) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


IMAGE = random_image(42, 42, seed=5)
NOISE = png(random_image(40, 40, seed=9))


class _Media(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        try:
            if self.path == "/ok.png":
                body = png(IMAGE)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/huge.png":  # no Content-Length: capped while streaming
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(OVERSIZE // (1 << 20)):
                    self.wfile.write(b"\0" * (1 << 20))
            elif self.path == "/slow.png":
                time.sleep(3)
                self.send_response(200)
                self.end_headers()
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(http base URL, the allowed local media directory)."""
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png(IMAGE))
    (root / "secret.png").write_bytes(png(IMAGE))
    (allowed / "escape.png").symlink_to(root / "secret.png")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", allowed
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def servers(llama_dir, media, tmp_path_factory):
    """{"vlm": (server, model dir, transformers model), "text": (server, ...)}."""
    _, allowed = media
    model_dir = tmp_path_factory.mktemp("llava-server")
    reference = build_llava(model_dir)
    env_proxy = {k: os.environ.pop(k) for k in list(os.environ)
                 if k.lower() in ("http_proxy", "https_proxy", "all_proxy")}
    started: list[ServerProcess] = []
    try:
        vlm = ServerProcess(model_dir, tmp_path_factory.mktemp("vlm") / "server.log", [
            "--enforce-eager", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", str(allowed),
            "--allowed-media-domains", "127.0.0.1", "--media-io-timeout", "1"])
        started.append(vlm)
        text = ServerProcess(llama_dir, tmp_path_factory.mktemp("text") / "server.log",
                             ["--enforce-eager"])
        started.append(text)
        for server in started:
            server.wait_ready()
        yield {"vlm": (vlm, model_dir, reference), "text": (text, llama_dir, None)}
    finally:
        os.environ.update(env_proxy)
        for server in started:
            server.stop()
        for server in started:
            assert "Traceback" not in server.log(), server.log()


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(server: ServerProcess, messages: list[dict], **kwargs):
    max_tokens = kwargs.pop("max_tokens", MAX_TOKENS)  # EOS suppressed, as transformers'
    return client_for(server).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"min_tokens": max_tokens},
        **kwargs)


@torch.inference_mode()
def transformers_tokens(model_dir: Path, model, prompt_text: str, images: list) -> list[int]:
    processor = hf_processor(model_dir)
    inputs = processor(text=[prompt_text], images=images, return_tensors="pt",
                       add_special_tokens=False)  # the chat template holds the specials
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, pad_token_id=model.config.text_config.pad_token_id)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def rendered(model_dir: Path, n_images: int) -> str:
    """What the server's chat template makes of ``image_message`` (the "string" format:
    one placeholder per image, each on its own line, before the text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    content = "\n".join([IMAGE_TOKEN] * n_images + [PROMPT])
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)


# -- the good path --------------------------------------------------------------------------
def test_base64_png_gives_transformers_tokens(servers):
    server, model_dir, reference = servers["vlm"]
    response = chat(server, image_message(data_url(png(IMAGE))), logprobs=True)
    choice = response.choices[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    want = transformers_tokens(model_dir, reference, rendered(model_dir, 1), [IMAGE])
    assert [t.token for t in choice.logprobs.content] == [
        tok.decode([t]) for t in want]
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert response.usage.completion_tokens == MAX_TOKENS
    # The prompt's tokens count the image's embedding tokens (3x3 patches of 14 px).
    ids = hf_processor(model_dir)(text=[rendered(model_dir, 1)], images=[IMAGE],
                                  add_special_tokens=False)["input_ids"][0]
    assert response.usage.prompt_tokens == len(ids)
    # /tokenize expands the image the same way.
    tokens = httpx.post(server.url + "/tokenize", json={
        "model": SERVED_NAME, "messages": image_message(data_url(png(IMAGE)))}).json()
    assert tokens["tokens"] == list(ids)


def test_responses_api_input_image_equals_chat(servers):
    """/v1/responses takes ``input_image`` parts (an image_url string) like chat's."""
    server, _, _ = servers["vlm"]
    url = data_url(png(IMAGE))
    client = client_for(server)
    want = client.chat.completions.create(
        model=SERVED_NAME, messages=image_message(url), max_tokens=MAX_TOKENS,
        temperature=0).choices[0].message.content
    response = client.responses.create(
        model=SERVED_NAME, temperature=0, max_output_tokens=MAX_TOKENS,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                            {"type": "input_text", "text": PROMPT}]}])
    assert response.output_text == want
    text_only = servers["text"][0]
    with pytest.raises(openai.BadRequestError, match="does not accept images"):
        client_for(text_only).responses.create(
            model=SERVED_NAME, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": url}]}])


def test_http_and_file_urls_and_two_images(servers, media):
    server, model_dir, reference = servers["vlm"]
    base, allowed = media
    first = chat(server, image_message(data_url(png(IMAGE)))).choices[0].message.content
    for url in (base + "/ok.png", f"file://{allowed}/ok.png"):
        assert chat(server, image_message(url)).choices[0].message.content == first
    other = random_image(42, 42, seed=6)
    response = chat(server, image_message(data_url(png(IMAGE)), data_url(png(other))),
                    logprobs=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    want = transformers_tokens(model_dir, reference, rendered(model_dir, 2), [IMAGE, other])
    assert [t.token for t in response.choices[0].logprobs.content] == [
        tok.decode([t]) for t in want]


def test_streaming_with_an_image(servers):
    server, _, _ = servers["vlm"]
    whole = chat(server, image_message(data_url(png(IMAGE)))).choices[0].message.content
    stream = chat(server, image_message(data_url(png(IMAGE))), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


# -- bad input: 400s, and a running request is not disturbed -------------------------------------
def bad_cases(base: str, allowed: Path) -> list[tuple[str, list[dict], str]]:
    ok = data_url(png(IMAGE))
    return [
        ("corrupt", image_message(data_url(NOISE[: len(NOISE) // 2])), "corrupt or truncated"),
        ("not an image", image_message(data_url(b"plain text, not pixels")), "not an image"),
        ("text media type", image_message(data_url(png(IMAGE), "text/plain")),
         "not an image type"),
        ("bad base64", image_message("data:image/png;base64,@@@@"), "invalid base64"),
        ("too many images", image_message(ok, ok, ok), r"at most 2 image\(s\) per prompt"),
        ("too many pixels", image_message(data_url(header_only_png(9000, 9000))),
         "more than the limit"),
        ("bomb", image_message(data_url(header_only_png(100_000, 100_000))),
         "too many pixels"),
        ("too many bytes", image_message(base + "/huge.png"), "too large"),
        ("disallowed domain", image_message(base.replace("127.0.0.1", "localhost") + "/ok.png"),
         "domain 'localhost' .* is not allowed"),
        ("remote domain", image_message("https://example.com/cat.png"),
         "domain 'example.com' .* is not allowed"),
        ("http 404", image_message(base + "/missing.png"), "HTTP 404"),
        ("timeout", image_message(base + "/slow.png"), "timed out after 1 s"),
        ("outside path", image_message(f"file://{allowed}/../secret.png"),
         "outside the allowed local media path"),
        ("symlink escape", image_message(f"file://{allowed}/escape.png"),
         "outside the allowed local media path"),
        ("bad scheme", image_message("ftp://127.0.0.1/x.png"), "unsupported media URL"),
        ("video url", [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": base + "/v.mp4"}}]}], None),
    ]


def test_bad_images_are_400s_and_a_running_request_completes(servers, media):
    server, _, _ = servers["vlm"]
    base, allowed = media
    client = client_for(server)
    expected = chat(server, image_message(data_url(png(IMAGE))),
                    max_tokens=24).choices[0].message.content
    result: dict = {}

    def long_request() -> None:
        result["response"] = chat(server, image_message(data_url(png(IMAGE))), max_tokens=24)

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        for name, messages, message in bad_cases(base, allowed):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                               max_tokens=2)
            body = info.value.body
            assert body["type"] == "BadRequestError" and body["code"] == 400, (name, body)
            if message is not None:
                import re

                assert re.search(message, body["message"]), (name, body["message"])
                assert body["param"] == "messages", (name, body)
    finally:
        runner.join(120)
    assert result["response"].choices[0].message.content == expected
    assert result["response"].choices[0].finish_reason == "length"
    # The raw body is OpenAI's error shape.
    raw = httpx.post(server.url + "/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": image_message(data_url(b"nope"))})
    assert raw.status_code == 400
    assert raw.json()["object"] == "error" and set(raw.json()["error"]) == {
        "message", "type", "param", "code"}
    # Still serving images.
    assert chat(server, image_message(data_url(png(IMAGE))),
                max_tokens=24).choices[0].message.content == expected


def test_image_to_a_text_only_model(servers):
    server, _, _ = servers["text"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, image_message(data_url(png(IMAGE))))
    assert f"model '{SERVED_NAME}' does not accept images" in info.value.body["message"]
    # Text parts alone still work there.
    response = chat(server, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert response.choices[0].finish_reason == "length"
