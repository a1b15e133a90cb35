"""Media URLs -> PIL images, within the limits the operator set.

Chat content parts name images by URL; this module is the one place that reads them, so
every limit is enforced here and every failure is a :class:`MediaError` (a ValueError:
the server answers it with a 400):

- ``data:image/...;base64,...``: decoded in memory (the encoded size is checked first).
- ``http://`` / ``https://``: fetched with urllib, the size cap enforced while the body
  streams (a ``Content-Length`` over the cap is refused before reading) and every network
  wait bounded by ``timeout_s`` (the whole fetch too, checked between reads). As in vLLM,
  with ``allowed_media_domains`` set only those host names are fetched (redirects
  included); unset, any host is. A server reachable by untrusted clients should set it:
  otherwise clients can make the server fetch from any address it can reach.
- ``file://``: only under ``allowed_local_media_path`` (after resolving ``..`` and
  symlinks); refused when that is unset (vLLM's rule).

Decoding is guarded against decompression bombs: the image's declared size is checked
against ``max_image_pixels`` from its header, before any pixel is decoded, and again after
``load()``. Images are fully decoded here (``load()``) so corrupt data fails now, with a
clear message, rather than later inside a model's processor. Their mode is left alone:
converting (to RGB) is the model processor's business.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # encoded image size
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # ~67 MP: ~200 MB as RGB
_CHUNK = 64 * 1024
_URL_SHOWN = 80  # characters of a URL quoted in an error message


class MediaError(ValueError):
    """A media item that cannot be used: bad URL, refused source, too large, not an
    image, corrupt, or a failed fetch. The message says which, for the client."""


def _shown(url: str) -> str:
    """The URL as an error message quotes it (data URLs are long: cut)."""
    return repr(url if len(url) <= _URL_SHOWN else url[:_URL_SHOWN] + "...")


@dataclass(frozen=True)
class MediaConnector:
    """Loads the images chat messages name by URL (see the module docstring)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: Sequence[str] | None = None  # None: any http(s) host
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.allowed_media_domains is not None:
            if isinstance(self.allowed_media_domains, str):
                raise ValueError("allowed_media_domains must be a list of host names, not "
                                 "a string")
            domains = tuple(d.strip().lower() for d in self.allowed_media_domains)
            object.__setattr__(self, "allowed_media_domains", domains)

    # -- public ---------------------------------------------------------------------------
    def load_image(self, url: str) -> Image.Image:
        """The image ``url`` names, decoded (MediaError for anything wrong)."""
        return self.decode_image(self.load_bytes(url), url)

    async def aload_image(self, url: str) -> Image.Image:
        """:meth:`load_image` in a worker thread (fetching and decoding block)."""
        return await asyncio.to_thread(self.load_image, url)

    def load_bytes(self, url: str) -> bytes:
        """The encoded bytes ``url`` names, within ``max_bytes``."""
        if not isinstance(url, str) or not url:
            raise MediaError(f"a media URL must be a non-empty string, got {url!r}")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url_bytes(url)
        if scheme in ("http", "https"):
            return self._http_bytes(url)
        if scheme == "file":
            return self._file_bytes(url)
        raise MediaError(f"unsupported media URL {_shown(url)}: use a data: URL "
                         "(base64), http(s):// or file://")

    def decode_image(self, data: bytes, source: str = "image") -> Image.Image:
        """Decode ``data`` fully; its pixel count is checked before decoding."""
        try:
            with warnings.catch_warnings():
                # Our own pixel cap decides; PIL's bomb warning would only repeat it.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                self._check_pixels(image, source)
                image.load()
        except MediaError:
            raise
        except Image.DecompressionBombError as exc:
            raise MediaError(f"the image at {_shown(source)} has too many pixels "
                             f"(limit {self.max_image_pixels}): {exc}") from None
        except Image.UnidentifiedImageError:
            raise MediaError(f"the data at {_shown(source)} is not an image (or its header "
                             "is corrupt): no format this server reads (PNG, JPEG, WebP, "
                             "GIF, ...) matches it") from None
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for corrupt data
            raise MediaError(f"the image at {_shown(source)} is corrupt or truncated "
                             f"({type(exc).__name__}: {exc})") from None
        self._check_pixels(image, source)  # some formats pick their size at load()
        return image

    # -- sources --------------------------------------------------------------------------
    def _data_url_bytes(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep:
            raise MediaError(f"malformed data URL {_shown(url)}: no ',' before the data")
        params = header[len("data:"):].split(";")
        media_type = params[0].strip().lower()
        if "base64" not in (p.strip().lower() for p in params[1:]):
            raise MediaError(f"data URL {_shown(url)} must be base64 encoded "
                             "('data:image/png;base64,...')")
        if media_type and not media_type.startswith("image/"):
            raise MediaError(f"data URL media type {media_type!r} is not an image type "
                             "(image/png, image/jpeg, ...)")
        payload = "".join(payload.split())  # line breaks some encoders add
        if len(payload) // 4 * 3 > self.max_bytes + 3:
            raise MediaError(self._too_big(f"about {len(payload) // 4 * 3}"))
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"data URL {_shown(url)} holds invalid base64: {exc}") from None
        if len(data) > self.max_bytes:
            raise MediaError(self._too_big(str(len(data))))
        if not data:
            raise MediaError("data URL holds no data")
        return data

    def _http_bytes(self, url: str) -> bytes:
        self._check_http_url(url)
        opener = urllib.request.build_opener(_CheckedRedirects(self))
        request = urllib.request.Request(url, headers={"User-Agent": "engine-media/1"})
        deadline = time.monotonic() + self.timeout_s
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise MediaError(self._too_big(length, url))
                chunks, total = [], 0
                while True:
                    chunk = response.read1(_CHUNK)  # what has arrived: the deadline holds
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise MediaError(self._too_big(f"more than {self.max_bytes}", url))
                    if time.monotonic() > deadline:
                        raise MediaError(self._timed_out(url))
                    chunks.append(chunk)
        except MediaError:
            raise
        except urllib.error.HTTPError as exc:
            raise MediaError(f"fetching {_shown(url)} failed: HTTP {exc.code} "
                             f"{exc.reason}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise MediaError(self._timed_out(url)) from None
            raise MediaError(f"fetching {_shown(url)} failed: {exc.reason}") from None
        except TimeoutError:
            raise MediaError(self._timed_out(url)) from None
        except (OSError, ValueError) as exc:  # connection reset, bad chunking, ...
            raise MediaError(f"fetching {_shown(url)} failed: {type(exc).__name__}: "
                             f"{exc}") from None
        data = b"".join(chunks)
        if not data:
            raise MediaError(f"{_shown(url)} returned no data")
        return data

    def _check_http_url(self, url: str) -> None:
        """Refuse a URL whose scheme is not http(s) or whose host is not allowed."""
        try:
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname
        except ValueError as exc:
            raise MediaError(f"malformed URL {_shown(url)}: {exc}") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise MediaError(f"media URL {_shown(url)} must be http(s)")
        if not host:
            raise MediaError(f"media URL {_shown(url)} has no host")
        allowed = self.allowed_media_domains
        if allowed is not None and host.lower().rstrip(".") not in allowed:
            raise MediaError(f"the domain {host!r} of {_shown(url)} is not allowed "
                             "(--allowed-media-domains)")

    def _file_bytes(self, url: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaError(f"local files ({_shown(url)}) are not allowed: the server has "
                             "no --allowed-local-media-path")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {_shown(url)} names a remote host")
        path = Path(urllib.parse.unquote(parts.path))
        try:
            resolved = path.resolve(strict=True)
            base = Path(root).resolve(strict=True)
        except (OSError, RuntimeError):
            raise MediaError(f"no such file: {_shown(url)}") from None
        if not resolved.is_relative_to(base):
            raise MediaError(f"the file {_shown(url)} is outside the allowed local media "
                             "path (--allowed-local-media-path)")
        if not resolved.is_file():
            raise MediaError(f"{_shown(url)} is not a regular file")
        size = resolved.stat().st_size
        if size > self.max_bytes:
            raise MediaError(self._too_big(str(size), url))
        try:
            with open(resolved, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError as exc:
            raise MediaError(f"cannot read {_shown(url)}: {exc.strerror}") from None
        if len(data) > self.max_bytes:
            raise MediaError(self._too_big(f"more than {self.max_bytes}", url))
        return data

    # -- messages -------------------------------------------------------------------------
    def _check_pixels(self, image: Image.Image, source: str) -> None:
        width, height = image.size
        if width * height > self.max_image_pixels:
            raise MediaError(f"the image at {_shown(source)} is {width}x{height} = "
                             f"{width * height} pixels, more than the limit of "
                             f"{self.max_image_pixels}")

    def _too_big(self, size: str, url: str | None = None) -> str:
        where = f" at {_shown(url)}" if url else ""
        return (f"the media{where} is too large: {size} bytes, more than the limit of "
                f"{self.max_bytes} bytes")

    def _timed_out(self, url: str) -> str:
        return f"fetching {_shown(url)} timed out after {self.timeout_s:g} s"


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to a URL the connector would fetch itself (http(s), an
    allowed domain): the allow-list must not be bypassed by a redirect."""

    max_redirections = 5

    def __init__(self, connector: MediaConnector) -> None:
        self.connector = connector

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        self.connector._check_http_url(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def connector_from_config(model_config: Any, **overrides: Any) -> MediaConnector:
    """The connector an engine's ModelConfig asks for (its media fields may be absent)."""
    kwargs: dict[str, Any] = {
        "allowed_local_media_path": getattr(model_config, "allowed_local_media_path", None),
        "allowed_media_domains": getattr(model_config, "allowed_media_domains", None),
    }
    timeout = getattr(model_config, "media_io_timeout", None)
    if timeout is not None:
        kwargs["timeout_s"] = timeout
    kwargs.update(overrides)
    return MediaConnector(**kwargs)


__all__ = ["MediaConnector", "MediaError", "connector_from_config"]
