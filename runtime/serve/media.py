"""Image and video URLs of a chat request, to files the processors read.

- `data:<mime>;base64,<payload>`: decoded into a file of the request's own temporary
  folder (removed when the request ends).
- `file:///abs/path`: only with `--allowed-local-media-path DIR`, and only a regular file
  whose real path (symlinks and `..` resolved) lies under DIR's real path.
- `http://`, `https://` and anything else: refused; nothing is ever fetched.

Images are sized from their header before anything is decoded: more than
`max_image_pixels` is refused. No message shows the server's temporary paths: `scrub`
puts the URL's own parameter in their place.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import tempfile
import warnings
from pathlib import Path
from urllib.parse import unquote, urlparse

from runtime.serve.errors import ApiError, shown

DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024
SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/webp": ".webp",
            "image/gif": ".gif", "image/bmp": ".bmp", "video/mp4": ".mp4", "video/webm": ".webm",
            "video/x-matroska": ".mkv", "video/avi": ".avi", "video/x-msvideo": ".avi"}


class MediaFolder:
    """Where one request's decoded `data:` URLs live; `close()` removes them."""

    def __init__(self, allowed_local: str | None, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.allowed = Path(allowed_local).resolve() if allowed_local else None
        self.max_image_pixels = max_image_pixels
        self._dir: tempfile.TemporaryDirectory | None = None
        self._count = 0
        self._names: dict[str, str] = {}  # a written file's path: the parameter of its URL

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def scrub(self, error: ApiError) -> ApiError:
        """`error` with each file this folder wrote named by its URL's parameter instead."""
        message = error.message
        for path, param in self._names.items():
            message = message.replace(path, param)
        if message != error.message:
            error = ApiError(message, error.param, error.status, error.code, error.headers)
        return error

    def path(self, url: object, kind: str, param: str) -> str:
        """A local file holding the medium `url` names; ApiError (400) saying why not."""
        if not isinstance(url, str) or not url:
            raise ApiError(f"{param}: expected a URL string", param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            path = self._data(url, kind, param)
        elif scheme == "file":
            path = self._local(url, param)
        elif scheme in ("http", "https"):
            raise ApiError(f"{param}: {scheme}:// URLs are not fetched by this server; send the {kind} inline as a "
                           f"data:{kind}/...;base64, URL", param, code="url_not_allowed")
        else:
            raise ApiError(f"{param}: {shown(url)}: expected a data:{kind}/...;base64, URL (or file:// under "
                           "--allowed-local-media-path)", param)
        if kind == "image":
            self._check_image_header(path, param)
        return path

    def _data(self, url: str, kind: str, param: str) -> str:
        header, sep, payload = url.partition(",")
        mime = header[5:].split(";")[0].strip().lower()
        if not sep or ";base64" not in header.lower() or not mime.startswith(kind + "/"):
            raise ApiError(f"{param}: expected a data:{kind}/<type>;base64,<payload> URL, got {shown(header)}", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(f"{param}: the data URL's payload is not valid base64", param) from None
        if not data:
            raise ApiError(f"{param}: the data URL is empty", param)
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="qwen3vl-serve-")
        self._count += 1
        path = os.path.join(self._dir.name, f"{kind}{self._count}{SUFFIXES.get(mime, '')}")
        with open(path, "wb") as f:
            f.write(data)
        self._names[path] = param
        return path

    def _local(self, url: str, param: str) -> str:
        if self.allowed is None:
            raise ApiError(f"{param}: file:// URLs are refused: the server was started without "
                           "--allowed-local-media-path", param, code="url_not_allowed")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(f"{param}: file:// URL with host {shown(parsed.netloc)}: expected file:///absolute/path",
                           param)
        try:
            given = unquote(parsed.path, errors="strict")
            if "\0" in given:
                raise ValueError("it holds a NUL byte (%00)")
            real = Path(given).resolve()
            inside, exists = real.is_relative_to(self.allowed), real.is_file()
        except ValueError as e:  # UnicodeDecodeError too: %-escapes that are not UTF-8
            reason = ("its %-escapes are not UTF-8" if isinstance(e, UnicodeDecodeError) else
                      "it holds a lone surrogate" if isinstance(e, UnicodeEncodeError) else str(e))
            raise ApiError(f"{param}: the file:// URL's path is not a file name: {reason}", param) from None
        if not inside:
            raise ApiError(f"{param}: {shown(given)} is outside the allowed folder {self.allowed} (after "
                           "resolving symlinks and ..)", param, code="url_not_allowed")
        if not exists:
            raise ApiError(f"{param}: {shown(given)}: no such file", param)
        return str(real)

    def _check_image_header(self, path: str, param: str) -> None:
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(path) as im:
                    width, height = im.size
        except Image.DecompressionBombError as e:  # past twice PIL's own limit: sized, not opened
            pixels = re.search(r"\((\d+) pixels\)", str(e))
            self._too_large(f"{pixels.group(1)} pixels" if pixels else "more pixels than PIL opens", param)
        except Exception:  # noqa: BLE001 - PIL raises many types for a non-image
            raise ApiError(f"{param}: not an image PIL can read", param, code="invalid_image") from None
        if width * height > self.max_image_pixels:
            self._too_large(f"{width}x{height} pixels", param)

    def _too_large(self, size: str, param: str):
        raise ApiError(f"{param}: image of {size}: more than the {self.max_image_pixels} pixels this server "
                       "accepts", param, code="image_too_large")
