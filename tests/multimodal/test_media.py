"""MediaConnector: every source and every limit, each failure a MediaError (a 400).

http(s) cases run against a local ``http.server`` on 127.0.0.1 (no network needed).
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from engine.multimodal.media import MediaConnector, MediaError


def png_bytes(size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 10, 30)
              ) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` but holds almost no data (a bomb's
    header): only the header may be read before refusing it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))


def noise_png(size: int = 32) -> bytes:
    """A PNG whose pixel data is large (random), so cutting it leaves a valid header."""
    import os

    buffer = io.BytesIO()
    Image.frombytes("RGB", (size, size), os.urandom(size * size * 3)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# -- data: URLs -------------------------------------------------------------------------------
def test_data_url_decodes_the_image():
    image = MediaConnector().load_image(data_url(png_bytes((8, 6))))
    assert image.size == (8, 6) and image.mode == "RGB"
    assert image.getpixel((0, 0)) == (200, 10, 30)


def test_data_url_keeps_the_mode():
    buffer = io.BytesIO()
    Image.new("L", (4, 4), 7).save(buffer, format="PNG")
    assert MediaConnector().load_image(data_url(buffer.getvalue())).mode == "L"


def test_data_url_with_line_breaks_in_base64():
    encoded = base64.encodebytes(png_bytes()).decode()  # 76-column lines
    assert "\n" in encoded
    assert MediaConnector().load_image("data:image/png;base64," + encoded).size == (8, 6)


@pytest.mark.parametrize("url, message", [
    (data_url(noise_png()[:2000]), "corrupt or truncated"),
    (data_url(png_bytes()[:40]), "not an image .or its header is corrupt"),
    (data_url(b"hello, world: not an image", "image/png"), "not an image"),
    (data_url(png_bytes(), "text/plain"), "not an image type"),
    ("data:image/png;base64,%%%not-base64%%%", "invalid base64"),
    ("data:image/png," + "abc", "base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png;base64,", "no data"),
])
def test_bad_data_urls(url, message):
    with pytest.raises(MediaError, match=message):
        MediaConnector().load_image(url)


def test_media_error_is_a_value_error():
    assert issubclass(MediaError, ValueError)


def test_too_many_bytes_is_refused_before_decoding():
    data = png_bytes((64, 64))
    with pytest.raises(MediaError, match="too large"):
        MediaConnector(max_bytes=len(data) // 2).load_image(data_url(data))
    assert MediaConnector(max_bytes=len(data)).load_image(data_url(data)).size == (64, 64)


def test_too_many_pixels():
    url = data_url(png_bytes((20, 20)))
    with pytest.raises(MediaError, match="400 pixels, more than the limit of 399"):
        MediaConnector(max_image_pixels=399).load_image(url)
    assert MediaConnector(max_image_pixels=400).load_image(url).size == (20, 20)


@pytest.mark.parametrize("width, height", [(9000, 9000), (100_000, 100_000)])
def test_decompression_bomb_is_refused_from_its_header(width, height):
    # 9000^2 is over the default cap (8192^2); 100000^2 is over PIL's own bomb limit too.
    start = time.perf_counter()
    with pytest.raises(MediaError, match="too many pixels|more than the limit"):
        MediaConnector().load_image(data_url(png_header_only(width, height)))
    assert time.perf_counter() - start < 1.0  # nothing was decoded


def test_unsupported_schemes():
    for url in ("ftp://example.com/a.png", "/etc/passwd", "image.png", "gopher://x"):
        with pytest.raises(MediaError, match="unsupported media URL"):
            MediaConnector().load_image(url)
    with pytest.raises(MediaError, match="non-empty string"):
        MediaConnector().load_image("")


def test_async_variant():
    image = asyncio.run(MediaConnector().aload_image(data_url(png_bytes((3, 5)))))
    assert image.size == (3, 5)
    with pytest.raises(MediaError):
        asyncio.run(MediaConnector().aload_image(data_url(b"nope")))


def test_bad_settings():
    with pytest.raises(ValueError):
        MediaConnector(max_bytes=0)
    with pytest.raises(ValueError):
        MediaConnector(timeout_s=0)
    with pytest.raises(ValueError, match="list of host names"):
        MediaConnector(allowed_media_domains="example.com")


# -- http(s) ----------------------------------------------------------------------------------
PNG = png_bytes((10, 7))
NOISE = noise_png()
BIG = 50_000  # bytes the oversize routes send; tests cap max_bytes below it


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        try:
            self._route(self.path)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeouts, size caps): expected

    def _route(self, route: str) -> None:
        if route == "/ok.png":
            self._send(200, PNG, "image/png")
        elif route == "/text":
            self._send(200, b"just text", "text/plain")
        elif route == "/corrupt.png":
            self._send(200, NOISE[: len(NOISE) // 2], "image/png")
        elif route == "/slow.png":
            time.sleep(1.5)
            self._send(200, PNG, "image/png")
        elif route == "/drip.png":  # headers at once, then the body slowly
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for byte in PNG:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)
        elif route == "/big-declared.png":
            self._send(200, b"\0" * BIG, "image/png")
        elif route == "/big-streamed.png":  # no Content-Length: the cap applies while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(BIG // 1000):
                self.wfile.write(b"\0" * 1000)
        elif route == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def http_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_http_fetch_allowed(http_base):
    for domains in (None, ["127.0.0.1"], ["example.com", "127.0.0.1"]):
        image = MediaConnector(allowed_media_domains=domains).load_image(http_base + "/ok.png")
        assert image.size == (10, 7)


def test_http_disallowed_domain_is_not_fetched(http_base):
    connector = MediaConnector(allowed_media_domains=["example.com"])
    with pytest.raises(MediaError, match="domain '127.0.0.1' .* is not allowed"):
        connector.load_image(http_base + "/ok.png")


def test_redirect_to_a_disallowed_domain_is_refused(http_base):
    with pytest.raises(MediaError, match="domain 'localhost' .* is not allowed"):
        MediaConnector(allowed_media_domains=["127.0.0.1"]).load_image(http_base + "/redirect")
    image = MediaConnector(allowed_media_domains=["127.0.0.1", "localhost"]).load_image(
        http_base + "/redirect")
    assert image.size == (10, 7)


@pytest.mark.parametrize("route, message", [
    ("/missing.png", "HTTP 404"),
    ("/text", "not an image"),
    ("/corrupt.png", "corrupt"),
])
def test_http_failures(http_base, route, message):
    with pytest.raises(MediaError, match=message):
        MediaConnector().load_image(http_base + route)


def test_http_timeout(http_base):
    start = time.perf_counter()
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        MediaConnector(timeout_s=0.5).load_image(http_base + "/slow.png")
    assert time.perf_counter() - start < 1.4


def test_http_deadline_covers_a_dripping_body(http_base):
    # Each byte comes within the socket timeout, the whole body does not.
    start = time.perf_counter()
    with pytest.raises(MediaError, match="timed out"):
        MediaConnector(timeout_s=0.5).load_image(http_base + "/drip.png")
    assert time.perf_counter() - start < 1.6


@pytest.mark.parametrize("route", ["/big-declared.png", "/big-streamed.png"])
def test_http_oversize(http_base, route):
    with pytest.raises(MediaError, match="too large"):
        MediaConnector(max_bytes=BIG // 2).load_image(http_base + route)


def test_http_connection_refused():
    with pytest.raises(MediaError, match="fetching .* failed"):
        MediaConnector(timeout_s=2).load_image("http://127.0.0.1:9/none.png")


# -- file:// ----------------------------------------------------------------------------------
@pytest.fixture()
def media_dirs(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "sub" / "in.png").write_bytes(png_bytes((4, 3)))
    (outside / "secret.png").write_bytes(png_bytes((5, 5)))
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "link-in.png").symlink_to(allowed / "sub" / "in.png")
    return allowed, outside


def test_file_inside_the_allowed_path(media_dirs):
    allowed, _ = media_dirs
    connector = MediaConnector(allowed_local_media_path=str(allowed))
    assert connector.load_image(f"file://{allowed}/sub/in.png").size == (4, 3)
    assert connector.load_image(f"file://{allowed}/link-in.png").size == (4, 3)


def test_files_outside_are_refused(media_dirs):
    allowed, outside = media_dirs
    connector = MediaConnector(allowed_local_media_path=str(allowed))
    for url in (f"file://{outside}/secret.png",
                f"file://{allowed}/sub/../../outside/secret.png",
                f"file://{allowed}/escape.png"):  # a symlink out of the allowed path
        with pytest.raises(MediaError, match="outside the allowed local media path"):
            connector.load_image(url)
    with pytest.raises(MediaError, match="no such file"):
        connector.load_image(f"file://{allowed}/nope.png")
    with pytest.raises(MediaError, match="not a regular file"):
        connector.load_image(f"file://{allowed}/sub")
    with pytest.raises(MediaError, match="remote host"):
        connector.load_image(f"file://example.com{allowed}/sub/in.png")


def test_files_are_refused_without_an_allowed_path(media_dirs):
    allowed, _ = media_dirs
    with pytest.raises(MediaError, match="no --allowed-local-media-path"):
        MediaConnector().load_image(f"file://{allowed}/sub/in.png")


def test_file_size_limit(media_dirs):
    allowed, _ = media_dirs
    connector = MediaConnector(allowed_local_media_path=str(allowed), max_bytes=10)
    with pytest.raises(MediaError, match="too large"):
        connector.load_image(f"file://{allowed}/sub/in.png")
