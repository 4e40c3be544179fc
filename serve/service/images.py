"""Image parts of a chat request → files the engine can open.

Data URLs are decoded into private temp files that live exactly as long as
the request. Each image is measured (the engine's header reader, which needs
no context) and its pixels checked (image_check.py) before the request waits
for the engine: one that no engine could decode is a 400 at once. Remote URLs
are refused outright: fetching them would let any client make the server issue
requests on its network (SSRF). Local paths would let any client read the
server's files, so they need an opt-in naming one directory; anything else is
refused with one message, whatever the reason, so that a client cannot learn
which paths exist.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import tempfile
from typing import Callable, Optional

from serve.core.errors import ApiError, invalid
from serve.core.request import IMAGE_PARTS, image_url
from serve.engine.types import WasteError
from serve.service.image_check import check_pixels, Undecodable

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_CHECKED_FILE_BYTES = 64 * 1024 * 1024   # a larger local file is the engine's to judge
LOCAL_REFUSED = "image path is not a readable image in the allowed directory"
DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|gif|webp);base64,(.*)", re.DOTALL | re.IGNORECASE)


def image_parts(messages: list[dict]) -> list[tuple[str, str]]:
    """(param, url) of every image part, in prompt order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") in IMAGE_PARTS:
                found.append((f"messages[{i}].content[{j}]", image_url(part)))
    return found


class StagedImages:
    """Temp files for one request's images; use as a context manager so they are always removed."""

    def __init__(self, local_dir: Optional[str]):
        self._local_dir = os.path.realpath(local_dir) if local_dir else None
        self._temp_paths: list[str] = []
        self._unchecked: dict[str, bytes] = {}   # a data URL's bytes, until measure() checks them
        self._local_paths: set[str] = set()

    def __enter__(self) -> "StagedImages":
        return self

    def __exit__(self, *exc: object) -> None:
        for path in self._temp_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._temp_paths.clear()
        self._unchecked.clear()

    def stage(self, url: str, param: str) -> str:
        """A readable path for the image at `url`, or ApiError naming `param`."""
        data = DATA_URL.fullmatch(url.strip())
        if data:
            return self._write_temp(self._decode(data.group(2), param), data.group(1).lower())
        lowered = url.lower()
        if lowered.startswith(("http://", "https://")):
            raise invalid(param, "remote image URLs are not fetched (that would be a server-side "
                                 "request forgery); send the image as a base64 data: URL")
        if lowered.startswith("data:"):
            raise invalid(param, "image data URLs must be data:image/(png|jpeg|gif|webp);base64,...")
        if self._local_dir is None:
            raise invalid(param, "local image paths are disabled; start the server with "
                                 "--allow-local-images DIR, or send a base64 data: URL")
        path = url[len("file://"):] if lowered.startswith("file://") else url
        if "://" in path or "\0" in path:
            raise invalid(param, LOCAL_REFUSED)
        real = os.path.realpath(os.path.join(self._local_dir, path))  # symlinks and .. resolved
        if os.path.commonpath([real, self._local_dir]) != self._local_dir or not os.path.isfile(real):
            raise invalid(param, LOCAL_REFUSED)
        self._local_paths.add(real)
        return real

    def measure(self, dimensions: Callable[[str], tuple[int, int]], path: str, param: str,
                max_pixels: Optional[int] = None) -> tuple[int, int]:
        """`measure`, then the size against what the engine decodes (`max_pixels`, when
        known) and the pixels checked; a local file that is no image gets the one refusal
        message."""
        try:
            width, height = measure(dimensions, path, param)
            if max_pixels is not None and width * height > max_pixels:
                raise invalid(param, f"image is {width}x{height}; this engine decodes at most "
                                     f"{max_pixels} pixels")
            self._check(path, param)
            return width, height
        except ApiError:
            if path in self._local_paths:
                raise invalid(param, LOCAL_REFUSED) from None
            raise

    def _check(self, path: str, param: str) -> None:
        try:
            data = self._unchecked.pop(path, None)
            if data is None and os.path.getsize(path) <= MAX_CHECKED_FILE_BYTES:
                with open(path, "rb") as f:
                    data = f.read()
            if data is not None:
                check_pixels(data)
        except OSError as e:
            raise invalid(param, f"image could not be read: {e.strerror or e}") from None
        except Undecodable as e:
            raise invalid(param, f"image cannot be decoded: {e}") from None

    @staticmethod
    def _decode(payload: str, param: str) -> bytes:
        # Checked on the encoded length first, so an oversized image is never decoded.
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ApiError(413, f"image is larger than {MAX_IMAGE_BYTES >> 20} MB", param=param,
                           code="image_too_large")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(param, "image data is not valid base64") from None
        if not raw:
            raise invalid(param, "image data is empty")
        return raw

    def _write_temp(self, raw: bytes, kind: str) -> str:
        fd, path = tempfile.mkstemp(prefix="serve-image-", suffix="." + kind)  # mode 0600
        self._temp_paths.append(path)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        self._unchecked[path] = raw
        return path


def measure(dimensions: Callable[[str], tuple[int, int]], path: str, param: str) -> tuple[int, int]:
    """Image width and height via the engine's header reader; a bad image is the client's error."""
    try:
        width, height = dimensions(path)
    except WasteError as e:
        raise invalid(param, f"image could not be read: {e}") from None
    if width <= 0 or height <= 0:
        raise invalid(param, "image has no pixels")
    return width, height
