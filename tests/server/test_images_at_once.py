"""An image refusal comes at once, however busy the engine: pixels that do not decode, and a
prompt that fits only until its images' positions are counted.

`python3 -m serve --vision` on the reference engine at a scaled clock (the busy server of
test_refused_at_once.py: a streamed request prefilling for some 54 s). While it runs, in
every dialect that takes images, blocking and streamed, each bad case gets its 400 as a
real status line (never an error inside a 200 stream) before the prefill ends; and
count_tokens counts a request with images without waiting for the engine.
"""
from __future__ import annotations

import base64
import json
import re
import time

import pytest

from fuzz_bodies import COUNT, MESSAGES, RESPONSES, CHAT, exchange
from image_files import (corrupt_zlib_png, flat_png, gif_without_lzw, jpeg_without_scan,
                         truncated_png, webp_vp8)
from busy import BOUND, CTX, busy_server

IMAGES = {
    "truncated png": ("image/png", truncated_png()),
    "corrupt zlib": ("image/png", corrupt_zlib_png()),
    "jpeg without scan": ("image/jpeg", jpeg_without_scan()),
    "gif without lzw": ("image/gif", gif_without_lzw()),
    "webp": ("image/webp", webp_vp8(16, 16)),   # its header reads; neither engine decodes it
    "too many pixels": ("image/png", flat_png(4097, 4097)),   # the reference decodes 4096^2
}
FULL = flat_png(256, 256)           # 256 positions on the test container (max_tokens 256)
OVERFLOW = CTX // 256 + 1           # that many images: the few words fit, their images do not
CASES = [*IMAGES, "overflow"]


def images_of(case: str) -> list[tuple[str, bytes]]:
    return [("image/png", FULL)] * OVERFLOW if case == "overflow" else [IMAGES[case]]


def url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def body(path: str, case: str) -> dict:
    images = images_of(case)
    if path == CHAT:
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what are these?"},
            *({"type": "image_url", "image_url": {"url": url(*image)}} for image in images)]}]}
    if path == RESPONSES:
        return {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what are these?"},
            *({"type": "input_image", "image_url": url(*image)} for image in images)]}]}
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": kind,
                                           "data": base64.b64encode(data).decode()}}
              for kind, data in images]
    return {"model": "m", **({} if path == COUNT else {"max_tokens": 8}),
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, *blocks]}]}


PARAMS = [(path, case, stream) for path in (CHAT, RESPONSES, MESSAGES, COUNT) for case in CASES
          for stream in ((False,) if path == COUNT else (False, True))]


@pytest.fixture(scope="module")
def busy(k3_vision_container, lib_path, tmp_path_factory):
    yield from busy_server(k3_vision_container, lib_path, tmp_path_factory.mktemp("busy-images"),
                           "tokens   serve's own", "--vision")


@pytest.mark.parametrize("path, case, stream", PARAMS)
def test_an_image_refusal_is_a_400_at_once(busy, path, case, stream):
    srv, long = busy
    sent = time.monotonic()
    data = json.dumps({**body(path, case), **({"stream": True} if stream else {})}).encode()
    outcome = exchange(srv.port, path, data, timeout=60)
    took = time.monotonic() - sent
    assert outcome.status == 400 and outcome.problem is None, outcome.raw[:600]
    head, _, rest = outcome.raw.partition(b"\r\n\r\n")
    assert b"text/event-stream" not in head
    error = json.loads(rest)["error"]
    if case == "overflow":   # counted with its images' positions, and its words
        counted = re.search(r"the prompt is (\d+) tokens", error["message"])
        assert counted and int(counted.group(1)) > OVERFLOW * 256, error
    elif case == "too many pixels":
        assert "decodes at most 16777216 pixels" in error["message"], error
    else:
        assert "cannot be decoded" in error["message"], error
    assert took < BOUND, f"{took:.1f} s"
    assert not long.ended.is_set(), "the long prefill ended first: no proof"


def test_count_tokens_counts_images_without_the_engine(busy):
    srv, long = busy
    one = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(FULL).decode()}}]}]}
    sent = time.monotonic()
    outcome = exchange(srv.port, COUNT, json.dumps(one).encode(), timeout=60)
    took = time.monotonic() - sent
    assert outcome.status == 200 and outcome.problem is None, outcome.raw[:600]
    assert json.loads(outcome.raw.partition(b"\r\n\r\n")[2])["input_tokens"] > 256
    assert took < BOUND and not long.ended.is_set()


def test_the_banner_says_who_counts_images(busy):
    srv, _ = busy
    line = next(line for line in srv.banner if line.startswith("images"))
    assert "positions figured by serve before the queue (the reference engine's rule)" in line
