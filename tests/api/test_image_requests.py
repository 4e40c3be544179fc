"""Image parts in chat requests: staged, measured, removed; refused with one reason."""
from __future__ import annotations

import base64
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import pytest

from scripted import (IMAGE_POSITIONS, ScriptedEngine, ScriptedLibrary, assert_error, call,
                      data_url, engine, image_message, scripted_service, server, serving,
                      tiny_png, xtml_answer)
from image_files import truncated_png
from serve import WasteError
from serve.service.images import LOCAL_REFUSED
from serve.service.image_positions import PROBE_SIZES

CHAT = "/v1/chat/completions"

# ---- images -----------------------------------------------------------------

@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Point tempfile at an empty directory so staged images can be counted."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_data_url_image_is_staged_and_removed(engine, private_tmp):
    library = ScriptedLibrary(image_size=(640, 480))
    staged = []
    engine.image_add = lambda path: (staged.append((path, os.stat(path).st_mode & 0o777)), 4)[1]
    with serving(scripted_service(engine, library, vision=True)) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": image_message(data_url(tiny_png()))})
    assert resp.status == 200, resp.body
    ((path, mode),) = staged
    assert mode == 0o600 and os.path.dirname(path) == str(private_tmp)
    assert list(private_tmp.iterdir()) == []
    markup = [s.text for s in engine.segments if s.markup]
    assert "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>" in markup
    pad = engine.specials["<|media_pad|>"]
    assert engine.prompts[0].count(pad) == 4  # expanded by image_expand


@pytest.mark.parametrize("form", ["string", "url object"])
def test_the_release_image_part_is_staged_like_image_url(engine, private_tmp, form):
    library = ScriptedLibrary(image_size=(640, 480))
    url = data_url(tiny_png())
    image = url if form == "string" else {"url": url}
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "and"},
             {"type": "image_url", "image_url": {"url": url}}]
    with serving(scripted_service(engine, library, vision=True)) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": parts}]})
        assert resp.status == 200, resp.body
        assert len(engine.images_added) == 2 and list(private_tmp.iterdir()) == []
        block = "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>"
        assert [s.text for s in engine.segments if s.markup].count(block) == 2
        parts[0]["image"] = "https://example.com/cat.png" if form == "string" else {"url": 5}
        assert_error(call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": parts}]}),
                     400, param="messages[0].content[0]")
    assert len(engine.prompts) == 1


def test_bad_images_are_refused_and_cleaned(engine, private_tmp, tmp_path_factory):
    local = tmp_path_factory.mktemp("img") / "x.png"
    local.write_bytes(tiny_png())
    with serving(scripted_service(engine, vision=True)) as srv:
        cases = [("http://169.254.169.254/latest", "not fetched"),
                 ("https://example.com/cat.png", "not fetched"),
                 (str(local), "allow-local-images DIR"),
                 (f"file://{local}", "allow-local-images DIR"),
                 ("data:image/png;base64,@@notbase64@@", "base64"),
                 (data_url(b"GIF89a not a png"), "could not be read"),
                 ("data:text/html;base64,PGI+", "data")]
        for url, why in cases:
            err = assert_error(call(srv.port, "POST", CHAT, {"messages": image_message(url)}), 400,
                               param="messages[0].content[1]")
            assert why in err["message"], (url, err)
    assert list(private_tmp.iterdir()) == [] and engine.prompts == []


def test_local_images_with_the_flag(engine, tmp_path):
    local = tmp_path / "x.png"
    local.write_bytes(tiny_png())
    (tmp_path / "link.png").symlink_to(local)
    with serving(scripted_service(engine, vision=True, allow_local_images=str(tmp_path))) as srv:
        for url in (str(local), f"file://{local}", "x.png", "link.png"):
            assert call(srv.port, "POST", CHAT, {"messages": image_message(url)}).status == 200, url
    assert engine.images_added == [str(local)] * 4  # symlinks resolved
    assert local.exists()  # the client's own file is never removed


def test_local_images_outside_the_directory_get_one_uniform_refusal(engine, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(tiny_png())
    (allowed / "notes.txt").write_text("not an image")
    (allowed / "sub").mkdir()
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    refused = [str(outside / "secret.png"), "../outside/secret.png", "escape.png",
               f"file://{outside}/secret.png", "/proc/self/environ", "/etc/passwd",
               str(allowed / "missing.png"), "notes.txt", "sub", "/"]
    with serving(scripted_service(engine, vision=True, allow_local_images=str(allowed))) as srv:
        messages = {assert_error(call(srv.port, "POST", CHAT, {"messages": image_message(url)}), 400,
                                 param="messages[0].content[1]")["message"] for url in refused}
    assert len(messages) == 1 and engine.images_added == [], messages


def test_pixels_that_do_not_decode_are_refused_before_the_engine(engine, private_tmp,
                                                                 tmp_path_factory):
    """A data URL names its reason; a local file gets the one refusal every path gets."""
    local = tmp_path_factory.mktemp("local")
    (local / "cut.png").write_bytes(truncated_png())
    with serving(scripted_service(engine, vision=True, allow_local_images=str(local))) as srv:
        err = assert_error(call(srv.port, "POST", CHAT,
                                {"messages": image_message(data_url(truncated_png()))}), 400,
                           param="messages[0].content[1]")
        assert err["message"].startswith("image cannot be decoded: PNG is truncated"), err
        err = assert_error(call(srv.port, "POST", CHAT, {"messages": image_message("cut.png")}),
                           400, param="messages[0].content[1]")
        assert err["message"] == LOCAL_REFUSED
    assert engine.images_added == [] and engine.prompts == []
    assert list(private_tmp.iterdir()) == []


def test_images_of_a_failed_request_never_reach_the_next(engine):
    # The ABI does not say that reset drops the image queue: an image queued by a
    # request that then failed must not be consumed by the next request, of any kind. Its
    # text fits (else it is refused before the engine); its image's positions do not.
    body = {"messages": image_message(data_url(tiny_png())), "max_tokens": 1}
    with serving(scripted_service(ScriptedEngine([xtml_answer("ok")]), vision=True)) as srv:
        expanded = call(srv.port, "POST", CHAT, body).json()["usage"]["prompt_tokens"]
    small = ScriptedEngine([xtml_answer("ok")], ctx_max=expanded - 1)
    with serving(scripted_service(small, vision=True)) as srv:
        assert_error(call(srv.port, "POST", CHAT, {"messages": image_message(data_url(tiny_png()))}),
                     400, code="context_length_exceeded")
        assert small.images_added  # it was queued before the prompt was found too long
        assert call(srv.port, "POST", "/v1/completions", {"prompt": "y"}).status == 200
    assert small.images_consumed and not any(small.images_consumed)


def test_images_need_vision(server):
    assert_error(call(server.port, "POST", CHAT, {"messages": image_message(data_url(tiny_png()))}),
                 400, param="messages[0].content[1]")


# ---- serve's figure of images' positions ------------------------------------------

@dataclass(frozen=True)
class StubGrid:
    """A rule that gives the scripted engine's count, but `odd` for one size."""
    odd: dict = field(default_factory=dict)
    max_images: Optional[int] = None
    max_pixels: int = 1 << 30
    engine: str = "a stub"

    def positions(self, width: int, height: int) -> int:
        return self.odd.get((width, height), IMAGE_POSITIONS)


def images_message(count: int) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_url(tiny_png())}}
    return [{"role": "user", "content": [{"type": "text", "text": "what?"}, *[part] * count]}]


def test_count_tokens_with_images_needs_no_engine(engine):
    service = scripted_service(engine, ScriptedLibrary(image_size=(640, 480)), vision=True,
                               image_grid=StubGrid())
    assert engine.calls.count("image_add") == len(PROBE_SIZES)   # the start-up probe
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(tiny_png()).decode()}}
    body = {"model": "m", "messages": [{"role": "user", "content": [block, block]}]}
    with serving(service) as srv:
        with_images = call(srv.port, "POST", "/v1/messages/count_tokens", body).json()
    assert engine.calls.count("image_add") == len(PROBE_SIZES)   # none for the count
    assert with_images["input_tokens"] > 2 * IMAGE_POSITIONS


def test_more_images_than_the_engine_queues_are_refused(engine):
    service = scripted_service(engine, ScriptedLibrary(), vision=True,
                               image_grid=StubGrid(max_images=2))
    with serving(service) as srv:
        assert call(srv.port, "POST", CHAT, {"messages": images_message(2)}).status == 200
        err = assert_error(call(srv.port, "POST", CHAT, {"messages": images_message(3)}), 400,
                           param="messages[0].content[3]")
    assert "at most 2 images" in err["message"]


def test_a_figure_the_engine_does_not_share_is_dropped(engine):
    said: list[str] = []
    service = scripted_service(engine, ScriptedLibrary(image_size=(640, 480)), vision=True,
                               image_grid=StubGrid(odd={(640, 480): 9}, max_images=1),
                               log=said.append)
    assert service.positions.describe().startswith("positions figured by serve")
    with serving(service) as srv:
        assert call(srv.port, "POST", CHAT, {"messages": images_message(1)}).status == 200
        # serve's figure is off now: the engine counts, and its limit is not assumed
        assert call(srv.port, "POST", CHAT, {"messages": images_message(2)}).status == 200
    assert [line for line in said if line.startswith("images:")] == [
        "images: the engine counted 4 positions for a 640x480 image where serve's figure "
        "(a stub's rule) was 9; image positions are counted on the engine from now on"]
    assert service.positions.figure(640, 480) is None
    assert service.positions.describe().startswith("positions counted on the engine")


def test_a_probe_that_fails_leaves_the_counting_to_the_engine(engine):
    def refuse(path: str) -> int:
        raise WasteError(-2, "WASTE_E_FORMAT", "bad image", "no", "waste_image_add")
    engine.image_add = refuse
    service = scripted_service(engine, ScriptedLibrary(), vision=True, image_grid=StubGrid())
    assert "probe image could not be encoded" in service.positions.describe()
