"""serve's pixel check before the queue (serve/service/image_check.py) against the reference
engine's waste_image_add.

The differential test damages good PNG, JPEG and GIF files (cut short at many offsets,
bytes flipped) and, for every damaged file, requires that the check refusing it means
the engine refuses it too: the check never refuses what the engine would have taken.
It reports how many of the engine's refusals the check catches before the queue.
"""
from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from image_files import (CHANNELS, JPEG_FIXTURES, PNG_SIGNATURE, corrupt_zlib_png, encode_gif,
                         encode_png, gif_without_lzw, ihdr, jpeg_fixture, jpeg_without_scan,
                         png_chunk, png_of_rows, random_pixels, small_gif, truncated_png, webp_vp8)
from serve.engine.binding import Engine, EngineConfig
from serve.engine.types import WasteError
from serve.service.image_check import MAX_PIXELS, Undecodable, check_pixels


def good_images() -> dict[str, bytes]:
    rng = random.Random(29)
    return {
        "png rgb": encode_png(random_pixels(rng, 21, 9, 3, 256), idat_parts=3),
        "png interlaced grey 4-bit": encode_png(random_pixels(rng, 13, 11, 1, 16), 4, 0, True),
        "png palette": encode_png(random_pixels(rng, 10, 6, 1, 4), 2, 3,
                                  palette=[(9, 8, 7), (1, 2, 3), (4, 5, 6), (7, 7, 7)]),
        "png rgba 16-bit": encode_png(random_pixels(rng, 6, 5, CHANNELS[6], 65536), 16, 6),
        **{f"jpeg {name}": jpeg_fixture(name) for name in JPEG_FIXTURES if name != "progressive"},
        "gif": small_gif(rng),
        "gif interlaced, local table": encode_gif(
            11, 9, [rng.randrange(3) for _ in range(99)], [(1, 2, 3), (4, 5, 6), (7, 8, 9)],
            interlace=True, local=True),
    }


def damaged(good: dict[str, bytes]) -> list[tuple[str, bytes]]:
    """Each image cut short at ~24 offsets and with ~24 single bytes changed."""
    rng = random.Random(2029)
    out = []
    for name, data in good.items():
        cuts = sorted({*rng.sample(range(1, len(data)), min(20, len(data) - 1)),
                       len(data) - 1, len(data) - 2, len(data) - 5, len(data) // 2})
        out += [(f"{name} cut at {cut}", data[:cut]) for cut in cuts]
        for _ in range(24):
            at = rng.randrange(len(data))
            flipped = bytearray(data)
            flipped[at] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else 0xFF
            out.append((f"{name} byte {at} changed", bytes(flipped)))
    return out


def refusal(data: bytes) -> str:
    try:
        check_pixels(data)
    except Undecodable as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def vision_engine(lib, k3_vision_container):
    with Engine(lib, k3_vision_container, EngineConfig(vision=True)) as engine:
        yield engine


def engine_refusal(engine, path: Path, data: bytes) -> str:
    path.write_bytes(data)
    try:
        engine.image_add(str(path))
    except WasteError as e:
        return str(e) or "refused"
    finally:
        engine.image_clear()
    return ""


def test_good_images_pass_and_the_engine_takes_them(vision_engine, tmp_path):
    for name, data in good_images().items():
        assert refusal(data) == "", name
        assert engine_refusal(vision_engine, tmp_path / "good", data) == "", name


def test_the_check_refuses_only_what_the_engine_refuses(lib, vision_engine, tmp_path, capsys):
    corpus = damaged(good_images())
    assert len(corpus) > 300
    engine_refused = by_header = by_pixels = 0
    path = tmp_path / "damaged"
    for name, data in corpus:
        ours = refusal(data)
        theirs = engine_refusal(vision_engine, path, data)
        assert not ours or theirs, f"{name}: the check refused ({ours}) what the engine takes"
        if theirs:
            engine_refused += 1
            try:   # before the check, serve reads the header with the engine's own reader
                lib.image_dimensions(str(path))
            except WasteError:
                by_header += 1
                continue
            by_pixels += bool(ours)
    with capsys.disabled():
        print(f"\ndamaged images: {len(corpus)}; the engine refuses {engine_refused}; serve "
              f"refuses {by_header + by_pixels} of them before the queue ({by_header} by the "
              f"header, {by_pixels} by the pixel check)")
    # What the check cannot see: CRCs (stb_image does not check them), bit errors in a
    # JPEG's entropy data, an LZW stream cut short. The cut files it sees almost all.
    assert by_header + by_pixels >= engine_refused // 2


@pytest.mark.parametrize("name, data, reason", [
    ("truncated png", truncated_png, "truncated"),
    ("corrupt zlib", corrupt_zlib_png, "corrupt"),
    ("jpeg with no scan", jpeg_without_scan, "ends before its scan"),
    ("gif with no image data", gif_without_lzw, "no LZW data"),
    ("png filter 5", lambda: png_of_rows(b"\x05" + bytes(3)), "filter type 5"),
    ("png rows short", lambda: png_of_rows(b"\x00" + bytes(2)), "before its last row"),
    ("png rows long", lambda: png_of_rows(b"\x00" + bytes(4)), "larger than"),
])
def test_what_the_check_refuses_the_engine_refuses(vision_engine, tmp_path, name, data, reason):
    image = data()
    assert reason in refusal(image), name
    assert engine_refusal(vision_engine, tmp_path / "bad", image), name


def test_webp_is_refused_at_the_edge(vision_engine, tmp_path):
    data = webp_vp8(16, 16)
    assert "WebP" in refusal(data)
    assert "WebP" in engine_refusal(vision_engine, tmp_path / "w.webp", data)


def test_a_bomb_is_refused_by_its_header_before_inflating():
    huge = PNG_SIGNATURE + ihdr(16384, 16384) + png_chunk(b"IDAT", b"x") + png_chunk(b"IEND", b"")
    assert "at most" in refusal(huge)
    assert 16384 * 16384 > MAX_PIXELS


def test_a_stream_longer_than_its_rows_stops_inflating_at_once(monkeypatch):
    """A small PNG declaring 4x4 whose data inflates to 256 MB: refused once the output
    passes the rows, having inflated at most one step past them."""
    stream = zlib.compressobj(9)
    data = stream.compress(b"") + b"".join(stream.compress(bytes(1 << 20)) for _ in range(256))
    data += stream.flush()
    bomb = PNG_SIGNATURE + ihdr(4, 4) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")
    assert len(bomb) < 1 << 20
    produced: list[int] = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, wbits: int):
            self.inner = real(wbits)

        def decompress(self, piece, limit):
            out = self.inner.decompress(piece, limit)
            produced.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)
    monkeypatch.setattr(zlib, "decompressobj", Counting)
    assert "larger than its 4x4 header" in refusal(bomb)
    assert sum(produced) <= 2 << 20


def test_the_iend_crc_may_be_missing():
    """stb_image stops at IEND's type: a file cut inside its CRC still decodes there."""
    good = encode_png(random_pixels(random.Random(1), 3, 3, 3, 256))
    assert refusal(good[:-2]) == ""


def bad_crc(png: bytes) -> bytes:
    at = png.index(b"IDAT")
    length = int.from_bytes(png[at - 4:at], "big")
    crc = at + 4 + length
    return png[:crc] + bytes(b ^ 0xFF for b in png[crc:crc + 4]) + png[crc + 4:]


def lzw_cut(gif: bytes) -> bytes:
    """The first data sub-block cut to one byte, the chain ended there."""
    at = gif.rindex(b"\x2c") + 10 + 1        # past the descriptor and the min code size
    return gif[:at] + b"\x01" + gif[at + 1:at + 2] + b"\x00\x3b"


@pytest.mark.parametrize("name, data", [
    ("progressive jpeg (WARP decodes it)", lambda: jpeg_fixture("progressive")),
    ("png failing a CRC (stb_image does not check)", lambda: bad_crc(good_images()["png rgb"])),
    ("jpeg cut inside its scan (stb_image fills it)",
     lambda: jpeg_fixture("444")[:-40] + b"\xff\xd9"),
    ("gif whose LZW stream stops early (stb_image keeps what it has)",
     lambda: lzw_cut(good_images()["gif"])),
])
def test_what_only_the_reference_engine_refuses_is_left_to_it(vision_engine, tmp_path, name, data):
    image = data()
    assert refusal(image) == "", name
    assert engine_refusal(vision_engine, tmp_path / "x", image), name



def test_apples_png_variant_is_left_to_the_engine():
    good = encode_png(random_pixels(random.Random(2), 3, 3, 3, 256))
    assert refusal(good[:8] + png_chunk(b"CgBI", b"\x50\x00\x20\x02") + good[8:]) == ""


GOOD = list(good_images().values())


@settings(max_examples=300, database=None)
@given(which=st.integers(0, len(GOOD) - 1), at=st.integers(0, 1 << 16), cut=st.integers(0, 1 << 16),
       junk=st.binary(max_size=12))
def test_the_check_raises_nothing_but_its_refusal(which, at, cut, junk):
    """Whatever a client sends, the check answers or refuses: never another exception (a 500)."""
    good = GOOD[which]
    at %= len(good) + 1
    data = (good[:at] + junk + good[at + len(junk):])[:max(1, cut % (len(good) + 13))]
    try:
        check_pixels(data)
    except Undecodable:
        pass
