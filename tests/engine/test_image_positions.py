"""Serve's figure for an image's positions (serve/service/image_positions.py) equals what
the reference engine's waste_image_add counts, for a spread of sizes and aspect ratios,
tiny to the largest the engine decodes, under several vision.json max_tokens; WARP's
rule, checked against figures worked out by hand from its src/image.c; and a rule that is
not the engine's is caught by the start-up probe, after which the engine counts.
"""
from __future__ import annotations

import base64
import json
import random
import shutil
from pathlib import Path

import pytest

from image_files import flat_png
from scripted import real_service
from serve import parse_chat_request
from serve.engine.binding import Engine, EngineConfig
from serve.service.image_positions import (ImagePositions, ReferenceGrid, WarpGrid, read_grid)

SIZES = [(1, 1), (1, 2), (2, 1), (15, 15), (16, 16), (17, 33), (31, 16), (32, 32), (70, 42),
         (42, 70), (200, 30), (30, 200), (255, 257), (256, 256), (257, 255), (640, 480),
         (1920, 1080), (1080, 1920), (4096, 1), (1, 4096), (32768, 1), (1, 32768), (32768, 3),
         (3000, 5), (4096, 4096), (4000, 3000), (2, 8000), (999, 1001)]


def sizes() -> list[tuple[int, int]]:
    rng = random.Random(29)
    spread = [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(30)]
    return SIZES + spread


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[tuple[tuple[int, int], Path]]:
    folder = tmp_path_factory.mktemp("sizes")
    made = []
    for w, h in sizes():
        path = folder / f"{w}x{h}.png"
        path.write_bytes(flat_png(w, h))
        made.append(((w, h), path))
    return made


def container_with(k3_vision_container: Path, tmp: Path, max_tokens: int) -> Path:
    """The vision container with another max_tokens (vision.bin does not depend on it)."""
    out = tmp / f"max{max_tokens}.waste"
    shutil.copytree(k3_vision_container, out)
    vision = json.loads((out / "vision.json").read_text())
    (out / "vision.json").write_text(json.dumps({**vision, "max_tokens": max_tokens}))
    return out


@pytest.mark.parametrize("max_tokens", [256, 1, 7, 1024])
def test_the_figure_is_the_reference_engines_count(lib, k3_vision_container, tmp_path, images,
                                                   max_tokens):
    container = (k3_vision_container if max_tokens == 256
                 else container_with(k3_vision_container, tmp_path, max_tokens))
    grid = read_grid(str(container))
    assert grid == ReferenceGrid(8, 2, max_tokens)
    positions = ImagePositions(grid)
    with Engine(lib, container, EngineConfig(vision=True)) as engine:
        for (w, h), path in images:
            assert lib.image_dimensions(str(path)) == (w, h)
            counted = engine.image_add(str(path))
            engine.image_clear()
            figure = positions.figure(w, h)
            assert figure == counted, (w, h, figure, counted)
            positions.observe((w, h), figure, counted)
    assert positions.differed is None


def test_a_difference_turns_the_figure_off_and_says_so():
    said: list[str] = []
    positions = ImagePositions(ReferenceGrid(8, 2, 256), said.append)
    figure = positions.figure(70, 42)
    assert figure == 8
    positions.observe((70, 42), figure, 8)
    assert positions.figure(70, 42) == 8 and not said
    positions.observe((70, 42), figure, 9)
    assert positions.figure(70, 42) is None and positions.figure(1, 1) is None
    assert len(said) == 1 and "counted 9 positions for a 70x42 image" in said[0]
    assert "counted on the engine" in said[0]


# WARP: a grid of 14-pixel patches, rounded to nearest, even, at least 2 a side, shrunk
# two patches off the longer side until it fits max_patches; 2x2 patches a position.
@pytest.mark.parametrize("size, max_patches, positions", [
    ((28, 28), 1024, 1),         # 2x2 patches
    ((1, 1), 1024, 1),           # at least 2x2
    ((70, 42), 1024, 2),         # 5 -> 4, 3 -> 2 patches: 2x1
    ((30, 200), 1024, 7),        # 2.1 -> 2, 14.3 -> 14: 1x7
    ((48, 48), 1024, 1),         # 3.43 + 0.5 -> 3 -> 2
    ((49, 49), 1024, 4),         # 3.5 + 0.5 -> 4
    ((448, 448), 1024, 256),     # exactly 32x32 patches, unscaled
    ((1920, 1080), 1024, 252),   # scale 0.311: 42.7 + 0.5 -> 43 -> 42, 24.0 -> 24: 21x12
    ((10000, 10), 1024, 256),    # thin, unscaled: 714x2 patches, cut to 512x2: 256x1
    ((896, 896), 64, 16),        # scaled to 8x8 patches
])
def test_warp_rule(size, max_patches, positions):
    assert WarpGrid(max_patches).positions(*size) == positions


def test_warp_containers_are_read_as_warp(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "warp", "config": {}}))
    (tmp_path / "vision.json").write_text(json.dumps({"patch_size": 14, "max_patches": 4096}))
    assert read_grid(str(tmp_path)) == WarpGrid(4096)
    (tmp_path / "vision.json").write_text(json.dumps({"vt_hidden_size": 1024}))
    assert read_grid(str(tmp_path)) == WarpGrid(1024)
    (tmp_path / "vision.json").write_text(json.dumps({"patch_size": 16}))
    assert read_grid(str(tmp_path)) is None       # WARP refuses such a tower
    (tmp_path / "vision.json").write_text("{not json")
    assert read_grid(str(tmp_path)) is None


def test_reference_containers_need_the_three_keys(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "waste-ref"}))
    (tmp_path / "vision.json").write_text(json.dumps({"patch_size": 8, "merge": 2}))
    assert read_grid(str(tmp_path)) is None
    assert read_grid(str(tmp_path / "missing")) is None


def counting(lib_path, container, grid, body: dict) -> tuple[int, str]:
    """count_chat of `body` by a service on the real engine with `grid` as serve's rule,
    and the banner's images line."""
    with real_service(lib_path, container, vision=True, image_grid=grid) as service:
        return service.count_chat(parse_chat_request(body), lambda: False), \
            service.positions.describe()


def image_body(*sizes: tuple[int, int]) -> dict:
    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(flat_png(w, h)).decode()}}
        for w, h in sizes]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


def test_the_probe_finds_a_rule_that_is_not_the_engines(lib_path, k3_vision_container):
    body = image_body((640, 480), (30, 200))
    right, said = counting(lib_path, k3_vision_container, read_grid(str(k3_vision_container)), body)
    assert said.startswith("positions figured by serve before the queue (the reference engine")
    wrong, said = counting(lib_path, k3_vision_container, WarpGrid(1024), body)
    assert said.startswith("positions counted on the engine: the engine counted")
    assert wrong == right      # counted on the engine, not by the wrong rule
    assert WarpGrid(1024).positions(640, 480) != ReferenceGrid(8, 2, 256).positions(640, 480)
