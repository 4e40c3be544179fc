"""Image headers, decoders and the vision tower (engine/image.c, imgbuf.c, png.c,
gif.c, jpeg.c, vision.c).

The image code is internal to libwaste (hidden symbols), so these tests build
it into a small shared object of their own and call wimg_* / wvision_*
through ctypes.  Every test image is written here in Python (PNG and GIF
encoders below) except the JPEGs, which are embedded: see JPEG_FIXTURES.
Hostile files are decoded in a child process with a timeout, so a crash or
hang fails a test instead of killing pytest.
"""
from __future__ import annotations

import base64
import ctypes
import json
import math
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Optional, Sequence

import pytest

from conftest import ROOT
from image_files import (
    CHANNELS, JPEG_H, JPEG_W, PNG_SIGNATURE, encode_gif, encode_png, expected_rgb, ihdr, jpeg_expected,
    jpeg_fixture, jpeg_resized, png_chunk, png_scanlines, random_pixels, riff_webp, small_gif,
    small_png, webp_vp8, webp_vp8l, webp_vp8x)

ENGINE = ROOT / "engine"
# The image code and what it links against inside the engine.
SOURCES = ["image.c", "imgbuf.c", "png.c", "gif.c", "jpeg.c", "vision.c", "json.c", "ops.c", "simd.c",
           "pool.c", "sys.c", "detail.c"]

OK, E_IO, E_FORMAT, E_OOM, E_ARG, E_UNSUPPORTED = 0, -1, -2, -4, -5, -6
WIMG_MAX_SIDE = 32768
WIMG_DECODE_MAX_PIXELS = 16 * 1024 * 1024
WIMG_MAX_FILE_BYTES = 64 * 1024 * 1024


class Wimg(ctypes.Structure):
    _fields_ = [("w", ctypes.c_int), ("h", ctypes.c_int), ("rgb", ctypes.POINTER(ctypes.c_uint8))]


@pytest.fixture(scope="session")
def imglib(tmp_path_factory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("imglib") / "libwimg.so"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-std=c11", "-O1", "-g", "-D_GNU_SOURCE", "-fPIC", "-shared", "-I", str(ENGINE),
           "-o", str(out), *[str(ENGINE / s) for s in SOURCES], "-lz", "-lm", "-lpthread"]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    status = ctypes.c_int
    err = [ctypes.c_char_p, ctypes.c_size_t]
    lib.wimg_dimensions.restype = status
    lib.wimg_dimensions.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                                    ctypes.POINTER(ctypes.c_int), *err]
    lib.wimg_decode.restype = status
    lib.wimg_decode.argtypes = [ctypes.c_char_p, ctypes.POINTER(Wimg), *err]
    lib.wimg_free.restype = None
    lib.wimg_free.argtypes = [ctypes.POINTER(Wimg)]
    lib.wvision_load.restype = status
    lib.wvision_load.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p), *err]
    lib.wvision_plan.restype = status
    lib.wvision_plan.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), *err]
    lib.wvision_encode.restype = status
    lib.wvision_encode.argtypes = [ctypes.c_void_p, ctypes.POINTER(Wimg),
                                   ctypes.POINTER(ctypes.POINTER(ctypes.c_float)),
                                   ctypes.POINTER(ctypes.c_size_t), *err]
    lib.wvision_free.restype = None
    lib.wvision_free.argtypes = [ctypes.c_void_p]
    lib.path = out
    return lib


def dimensions(lib, path: Path) -> tuple[int, Optional[tuple[int, int]], str]:
    w, h, err = ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(256)
    st = lib.wimg_dimensions(os.fsencode(path), ctypes.byref(w), ctypes.byref(h), err, 256)
    return st, ((w.value, h.value) if st == OK else None), err.value.decode()


def decode(lib, path: Path) -> tuple[int, Optional[tuple[int, int, bytes]], str]:
    img, err = Wimg(), ctypes.create_string_buffer(256)
    st = lib.wimg_decode(os.fsencode(path), ctypes.byref(img), err, 256)
    if st != OK:
        return st, None, err.value.decode()
    try:
        return st, (img.w, img.h, ctypes.string_at(img.rgb, img.w * img.h * 3)), ""
    finally:
        lib.wimg_free(ctypes.byref(img))


@pytest.fixture
def write(tmp_path):
    """write(data, name) -> a file under the test's tmp dir (removed by pytest)."""
    counter = iter(range(1 << 30))

    def _write(data: bytes, name: Optional[str] = None) -> Path:
        path = tmp_path / (name or f"img{next(counter)}")
        path.write_bytes(data)
        return path
    return _write


# -------------------------------------------------------------- dimensions --

def test_dimensions_of_every_format(imglib, write):
    rng = random.Random(3)
    cases = [
        (encode_png(random_pixels(rng, 7, 3, 3, 256)), (7, 3)),
        (encode_gif(9, 4, [0] * 36, [(1, 2, 3), (4, 5, 6)]), (9, 4)),
        (encode_gif(2, 2, [1] * 4, [(1, 2, 3), (4, 5, 6)], screen=(300, 200)), (300, 200)),
        (jpeg_fixture("444"), (JPEG_W, JPEG_H)),
        (jpeg_fixture("progressive"), (JPEG_W, JPEG_H)),
        (webp_vp8(640, 480), (640, 480)),
        (webp_vp8l(1, 16384), (1, 16384)),
        (webp_vp8x(5000, 3), (5000, 3)),
    ]
    for data, size in cases:
        st, dims, err = dimensions(imglib, write(data))
        assert (st, dims) == (OK, size), err


def test_jpeg_dimensions_skip_segments_by_length(imglib, write):
    """APPn segments (here a 60 KB one holding a fake SOF byte pattern) are skipped whole."""
    jpeg = jpeg_fixture("444")
    decoy = b"\xff\xc0\x00\x11\x08\x00\x07\x00\x07" * 100
    app = b"\xff\xe1" + struct.pack(">H", 2 + 60000) + (decoy + bytes(60000))[:60000]
    st, dims, err = dimensions(imglib, write(jpeg[:2] + app + b"\xff\xff" + jpeg[2:]))
    assert (st, dims) == (OK, (JPEG_W, JPEG_H)), err


@pytest.mark.parametrize("data, reason", [
    (PNG_SIGNATURE + ihdr(0, 10), "empty"),
    (PNG_SIGNATURE + ihdr(65535, 65535), "at most"),
    (PNG_SIGNATURE + ihdr(40000, 2), "at most"),
    (PNG_SIGNATURE + ihdr(0xFFFFFFFF, 1), "at most"),
    (b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0), "at most"),
    (b"GIF87a" + struct.pack("<HHBBB", 0, 5, 0, 0, 0), "empty"),
    (jpeg_resized(65535, 65535), "at most"),
    (jpeg_resized(16, 0), "empty"),
    (webp_vp8x(1 << 24, 1 << 24), "at most"),
    (PNG_SIGNATURE + ihdr(10, 10)[:10], "truncated"),
    (b"GIF89a\x01", "truncated"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated"),
    (b"\xff\xd8\xff\xda\x00\x08", "no frame header"),
    (riff_webp(b"VP8 ", b"\x10\x02"), "truncated"),
    (riff_webp(b"ALPH", bytes(16)), "not VP8"),
    (b"BM" + bytes(60), "not a PNG"),
    (b"", "empty"),
])
def test_dimensions_refuse_bad_headers(imglib, write, data, reason):
    st, dims, err = dimensions(imglib, write(data))
    assert st == E_FORMAT and reason in err


def test_unreadable_paths_are_io_errors(imglib, tmp_path):
    for path in (tmp_path / "missing.png", tmp_path):
        assert dimensions(imglib, path)[0] == E_IO
        assert decode(imglib, path)[0] == E_IO


# --------------------------------------------------------------------- PNG --

PNG_TYPES = [(0, 1), (0, 2), (0, 4), (0, 8), (0, 16), (2, 8), (2, 16), (3, 1), (3, 2), (3, 4),
             (3, 8), (4, 8), (4, 16), (6, 8), (6, 16)]


@pytest.mark.parametrize("interlace", [False, True], ids=["progressive-rows", "adam7"])
@pytest.mark.parametrize("ctype, depth", PNG_TYPES)
def test_png_decodes_every_colour_type_and_depth(imglib, write, ctype, depth, interlace):
    rng = random.Random(ctype * 100 + depth * 2 + interlace)
    for w, h in [(1, 1), (13, 7), (3, 17)]:
        palette = None
        if ctype == 3:
            palette = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(1 << depth)]
        top = len(palette) if palette else 1 << depth
        pixels = random_pixels(rng, w, h, CHANNELS[ctype], top)
        data = encode_png(pixels, depth, ctype, interlace, palette, idat_parts=3)
        st, img, err = decode(imglib, write(data))
        assert st == OK, err
        assert img == (w, h, expected_rgb(pixels, depth, ctype, palette))


def test_png_palette_index_out_of_range(imglib, write):
    data = encode_png([[(0,), (5,)]], 8, 3, palette=[(1, 2, 3), (4, 5, 6)])
    st, _, err = decode(imglib, write(data))
    assert st == E_FORMAT and "palette index 5" in err


def test_png_zlib_bomb_stops_at_the_declared_size(imglib, write):
    """20 MB of zeros squeezed into 20 KB of IDAT behind a 4x4 header."""
    bomb = zlib.compress(bytes(20_000_000), 9)
    data = PNG_SIGNATURE + ihdr(4, 4, 8, 0) + png_chunk(b"IDAT", bomb) + png_chunk(b"IEND", b"")
    st, _, err = decode(imglib, write(data))
    assert st == E_FORMAT and "larger than" in err


def idat_iend(data: bytes) -> bytes:
    return png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: d[:33] + b"\xff\xff\xff\xff" + d[37:], "past the end"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "CRC"),
    (lambda d: d[:8] + png_chunk(b"tIME", bytes(7)) + d[8:], "start with IHDR"),
    (lambda d: d[:33] + idat_iend(zlib.compress(b"\0\1\2")), "ends before"),
    (lambda d: d[:33] + idat_iend(b"not zlib at all"), "corrupt"),
    (lambda d: d[:33] + idat_iend(zlib.compress(b"\x07" + bytes(15))), "filter type 7"),
    (lambda d: d[:33] + png_chunk(b"IEND", b""), "missing"),
    (lambda d: d[:-12], "no IEND"),
])
def test_png_malformed(imglib, write, mutate, reason):
    data = encode_png([[(1, 2, 3)] * 5])  # 5x1 RGB: IHDR ends at byte 33
    st, _, err = decode(imglib, write(mutate(data)))
    assert st == E_FORMAT and reason in err, err


def test_png_invalid_depth_for_colour_type(imglib, write):
    data = PNG_SIGNATURE + ihdr(1, 1, 4, 2) + png_chunk(b"IDAT", zlib.compress(b"\0\0\0"))
    st, _, err = decode(imglib, write(data + png_chunk(b"IEND", b"")))
    assert st == E_FORMAT and "bit depth 4" in err


def test_decode_refuses_images_beyond_the_decode_bound(imglib, write):
    """8192x4096 passes the header limits but not the decoder's; nothing is allocated."""
    data = PNG_SIGNATURE + ihdr(8192, 4096) + png_chunk(b"IDAT", zlib.compress(b"\0" * 100))
    path = write(data + png_chunk(b"IEND", b""))
    assert dimensions(imglib, path)[:2] == (OK, (8192, 4096))
    st, _, err = decode(imglib, path)
    assert st == E_FORMAT and "decodes at most" in err


# --------------------------------------------------------------------- GIF --

@pytest.mark.parametrize("interlace", [False, True])
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_gif_decodes_first_frame(imglib, write, interlace, local):
    rng = random.Random(7 + interlace + 2 * local)
    for w, h, colours in [(1, 1, 2), (11, 9, 4), (37, 21, 16), (80, 80, 256)]:
        palette = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(colours)]
        # Runs and noise, so the LZW table both grows long strings and fills up.
        indices = [(x // 5 + y) % colours if y % 2 else rng.randrange(colours)
                   for y in range(h) for x in range(w)]
        data = encode_gif(w, h, indices, palette, interlace=interlace, local=local)
        data = data[:-1] + encode_gif(2, 2, [0] * 4, palette)[13:]  # a second frame, ignored
        st, img, err = decode(imglib, write(data))
        assert st == OK, err
        assert img == (w, h, b"".join(bytes(palette[i]) for i in indices))


def test_gif_frame_is_placed_on_a_background_canvas(imglib, write):
    palette = [(10, 20, 30), (200, 100, 50), (0, 255, 0)]
    indices = [1, 2, 1, 2, 1, 2]
    data = encode_gif(3, 2, indices, palette, screen=(5, 4), offset=(3, 1), background=0)
    st, img, err = decode(imglib, write(data))
    assert st == OK, err
    expected = bytearray(bytes(palette[0]) * 20)
    for y in range(2):
        for x in range(3):
            if 3 + x < 5:  # the frame sticks out of the screen on the right: clipped
                i = ((1 + y) * 5 + 3 + x) * 3
                expected[i:i + 3] = bytes(palette[indices[y * 3 + x]])
    assert img == (5, 4, bytes(expected))


def test_gif_palette_index_out_of_range(imglib, write):
    # Two colours still use 2-bit LZW literals, so index 3 can be coded.
    data = encode_gif(2, 1, [0, 3], [(1, 1, 1), (2, 2, 2)])
    st, _, err = decode(imglib, write(data))
    assert st == E_FORMAT and "palette index 3 of 2" in err, err


def test_gif_without_image_or_data(imglib, write):
    screen = b"GIF89a" + struct.pack("<HHBBB", 2, 2, 0x80, 0, 0) + bytes(6)
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 2, 2, 0)
    for data, reason in [(screen + b"\x3b", "no image"),
                         (screen + b"\x2c" + bytes(9) + b"\x02\x00", "empty"),
                         (screen + frame + b"\x02\x00", "ends after")]:
        st, _, err = decode(imglib, write(data))
        assert st == E_FORMAT and reason in err, err


# -------------------------------------------------------------------- JPEG --

@pytest.mark.parametrize("name", ["444", "422", "420_restart", "gray"])
def test_jpeg_baseline_decodes_close_to_the_source(imglib, write, name):
    st, img, err = decode(imglib, write(jpeg_fixture(name)))
    assert st == OK, err
    w, h, rgb = img
    assert (w, h) == (JPEG_W, JPEG_H)
    diffs = [abs(a - b) for a, b in zip(rgb, jpeg_expected(name == "gray"))]
    assert max(diffs) <= 4  # quality 95 on flat 16x16 blocks is nearly lossless


def test_jpeg_progressive_is_unsupported(imglib, write):
    st, _, err = decode(imglib, write(jpeg_fixture("progressive")))
    assert st == E_UNSUPPORTED and "progressive" in err


def test_webp_decode_is_unsupported(imglib, write):
    st, _, err = decode(imglib, write(webp_vp8(16, 16)))
    assert st == E_UNSUPPORTED and "WebP" in err


# ----------------------------------------------------------------- hostile --

# Decodes each file given on stdin (a JSON list of base64 strings) and prints
# [dimensions status, decode status, width, height] per file.  Runs in a child
# process: a crash or a hang fails the calling test, not the whole session.
HOSTILE_RUNNER = r"""
import base64, ctypes, json, os, sys, tempfile
class Wimg(ctypes.Structure):
    _fields_ = [("w", ctypes.c_int), ("h", ctypes.c_int), ("rgb", ctypes.POINTER(ctypes.c_uint8))]
lib = ctypes.CDLL(sys.argv[1])
lib.wimg_free.argtypes = [ctypes.POINTER(Wimg)]
results = []
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "img").encode()
    err = ctypes.create_string_buffer(256)
    for blob in json.load(sys.stdin):
        with open(path, "wb") as f:
            f.write(base64.b64decode(blob))
        w, h, img = ctypes.c_int(), ctypes.c_int(), Wimg()
        dim = lib.wimg_dimensions(path, ctypes.byref(w), ctypes.byref(h), err, 256)
        dec = lib.wimg_decode(path, ctypes.byref(img), err, 256)
        rgb = ""
        if dec == 0:
            rgb = base64.b64encode(ctypes.string_at(img.rgb, img.w * img.h * 3)).decode()
            results.append([dim, dec, img.w, img.h, rgb])
            lib.wimg_free(ctypes.byref(img))
        else:
            results.append([dim, dec, 0, 0, ""])
json.dump(results, sys.stdout)
"""


def run_hostile(lib, files: Sequence[bytes]) -> list:
    blobs = json.dumps([base64.b64encode(f).decode() for f in files])
    proc = subprocess.run([sys.executable, "-c", HOSTILE_RUNNER, str(lib.path)], input=blobs,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"decoder crashed (status {proc.returncode}): {proc.stderr[-2000:]}"
    return [(dim, dec, w, h, base64.b64decode(rgb)) for dim, dec, w, h, rgb in json.loads(proc.stdout)]


def valid_files() -> dict[str, bytes]:
    rng = random.Random(11)
    return {
        "png": small_png(rng),
        "png-adam7-palette": encode_png(random_pixels(rng, 9, 9, 1, 4), 2, 3, True,
                                        [(9, 9, 9), (1, 2, 3), (200, 0, 0), (0, 0, 200)]),
        "gif": small_gif(rng),
        "jpeg": jpeg_fixture("420_restart"),
    }


@pytest.mark.parametrize("kind", list(valid_files()))
def test_every_truncation_fails_cleanly_or_decodes_the_same(imglib, kind):
    data = valid_files()[kind]
    results = run_hostile(imglib, [data[:i] for i in range(len(data) + 1)])
    full = results[-1]
    assert full[1] == OK
    for cut, (dim, dec, w, h, rgb) in enumerate(results[:-1]):
        assert dim in (OK, E_FORMAT) and dec in (OK, E_FORMAT), f"prefix {cut}: {dim}, {dec}"
        if dec == OK:  # only trailing bytes the decoder never needs may be missing
            assert (w, h, rgb) == full[2:], f"prefix {cut} decoded differently"
            assert cut >= len(data) - 16
    if kind.startswith("png"):  # a PNG without its IEND is never accepted
        assert all(r[1] == E_FORMAT for r in results[:-1])


@pytest.mark.parametrize("kind", list(valid_files()))
def test_random_byte_flips_never_crash(imglib, kind):
    data = valid_files()[kind]
    rng = random.Random(kind)
    mutants = []
    for _ in range(300):
        m = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            m[rng.randrange(len(m))] = rng.randrange(256)
        mutants.append(bytes(m))
    for dim, dec, w, h, rgb in run_hostile(imglib, mutants):
        assert dim in (OK, E_FORMAT) and dec in (OK, E_FORMAT, E_UNSUPPORTED)
        if dec == OK:
            assert 0 < w <= WIMG_MAX_SIDE and 0 < h <= WIMG_MAX_SIDE and len(rgb) == w * h * 3


def test_corrupt_png_image_data_behind_valid_crcs(imglib):
    """Flips inside IDAT with the CRC fixed up, so inflate and the unfilter see them."""
    rng = random.Random(5)
    pixels = random_pixels(rng, 12, 10, 4, 256)
    data = zlib.compress(png_scanlines(pixels, 8, 6, True))
    head = PNG_SIGNATURE + ihdr(12, 10, 8, 6, 1)
    mutants = []
    for _ in range(300):
        m = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            m[rng.randrange(len(m))] = rng.randrange(256)
        mutants.append(head + png_chunk(b"IDAT", bytes(m)) + png_chunk(b"IEND", b""))
    results = run_hostile(imglib, mutants)
    assert {dec for _, dec, *_ in results} <= {OK, E_FORMAT}
    assert any(dec == E_FORMAT for _, dec, *_ in results)


def test_named_hostile_files(imglib):
    """Each must come back with exactly the expected status, in a child process."""
    one_pixel = encode_png([[(1, 2, 3)]])
    cases = [
        (b"", E_FORMAT, E_FORMAT),
        (PNG_SIGNATURE + ihdr(65535, 65535) + png_chunk(b"IDAT", b"") + png_chunk(b"IEND", b""),
         E_FORMAT, E_FORMAT),
        (PNG_SIGNATURE + ihdr(4, 4, 8, 0) + png_chunk(b"IDAT", zlib.compress(bytes(20_000_000), 9))
         + png_chunk(b"IEND", b""), OK, E_FORMAT),
        (one_pixel[:33] + b"\xff\xff\xff\xff" + one_pixel[37:], OK, E_FORMAT),
        (encode_png([[(0,), (9,)]], 8, 3, palette=[(1, 2, 3)]), OK, E_FORMAT),
        (encode_gif(2, 1, [0, 3], [(1, 1, 1), (2, 2, 2)]), OK, E_FORMAT),
        (b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0), E_FORMAT, E_FORMAT),
        (b"GIF89a" + struct.pack("<HHBBB", 4, 4, 0x87, 0, 0) + bytes(20), OK, E_FORMAT),
        (jpeg_resized(65535, 65535), E_FORMAT, E_FORMAT),
        (jpeg_resized(4096, 8192), OK, E_FORMAT),  # over the decode bound
        (jpeg_fixture("444")[:-200], OK, E_FORMAT),
        (webp_vp8l(4000, 4000), OK, E_UNSUPPORTED),
    ]
    results = run_hostile(imglib, [c[0] for c in cases])
    assert [(r[0], r[1]) for r in results] == [(c[1], c[2]) for c in cases]


# ------------------------------------------------------------ vision tower --

def model_hidden(container: Path) -> int:
    return json.loads((container / "manifest.json").read_text())["hidden"]


def resized_grid(cfg: dict, w: int, h: int) -> tuple[int, int]:
    """FORMAT.md's resize rule, in merge blocks per row and per column."""
    u = cfg["patch_size"] * cfg["merge"]
    s = min(1.0, math.sqrt(cfg["max_tokens"] * u * u / (w * h)))
    gx, gy = max(u, math.floor(w * s / u) * u) // u, max(u, math.floor(h * s / u) * u) // u
    if gx * gy > cfg["max_tokens"]:   # a thin image: the long side is cut to fit
        if gx > gy:
            gx = cfg["max_tokens"] // gy
        else:
            gy = cfg["max_tokens"] // gx
    return gx, gy


def load_tower(lib, model: Path, hidden: int) -> tuple[int, ctypes.c_void_p, str]:
    vis, err = ctypes.c_void_p(), ctypes.create_string_buffer(256)
    st = lib.wvision_load(os.fsencode(model), hidden, ctypes.byref(vis), err, 256)
    return st, vis, err.value.decode()


def plan_tower(lib, model: Path, hidden: int) -> tuple[int, int, str]:
    size, err = ctypes.c_uint64(), ctypes.create_string_buffer(256)
    st = lib.wvision_plan(os.fsencode(model), hidden, ctypes.byref(size), err, 256)
    return st, size.value, err.value.decode()


@pytest.fixture
def tower(imglib, k3_vision_container):
    hidden = model_hidden(k3_vision_container)
    st, vis, err = load_tower(imglib, k3_vision_container, hidden)
    assert st == OK, err
    yield vis, hidden
    imglib.wvision_free(vis)


def encode_image(lib, tower, w: int, h: int, rgb: bytes) -> tuple[int, list]:
    """(n_tokens, flat embeddings) from wvision_encode."""
    vis, hidden = tower
    buf = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
    img = Wimg(w, h, ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)))
    out, n, err = ctypes.POINTER(ctypes.c_float)(), ctypes.c_size_t(), ctypes.create_string_buffer(256)
    st = lib.wvision_encode(vis, ctypes.byref(img), ctypes.byref(out), ctypes.byref(n), err, 256)
    assert st == OK, err.value
    try:
        return n.value, out[:n.value * hidden]
    finally:
        libc_free(out)


def libc_free(pointer) -> None:
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    free(ctypes.cast(pointer, ctypes.c_void_p))


def random_rgb(rng: random.Random, w: int, h: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(w * h * 3))


def reference_tower(model: Path, hidden: int, w: int, h: int, rgb: bytes) -> list:
    """The tower in plain Python, with vision.c's documented choices: pixel-centre
    bilinear sampling without requantising, tanh gelu, rmsnorm eps 1e-5."""
    cfg = json.loads((model / "vision.json").read_text())
    p, m, vh = cfg["patch_size"], cfg["merge"], cfg["vision_hidden"]
    raw = (model / "vision.bin").read_bytes()
    weights = struct.unpack(f"<{len(raw) // 4}f", raw)
    sizes = [vh * 3 * p * p, vh, vh, hidden * vh * m * m, hidden]
    parts, at = [], 0
    for n in sizes:
        parts.append(weights[at:at + n])
        at += n
    patch_proj, patch_bias, norm, proj, proj_bias = parts
    gx, gy = resized_grid(cfg, w, h)
    u = p * m
    rw, rh = gx * u, gy * u

    def axis(src: int, dst: int, i: int) -> tuple[int, int, float]:
        s = min(max((i + 0.5) * src / dst - 0.5, 0.0), src - 1)
        lo = int(s)
        return lo, min(lo + 1, src - 1), s - lo

    def pixel(x: int, y: int, c: int) -> float:
        x0, x1, fx = axis(w, rw, x)
        y0, y1, fy = axis(h, rh, y)
        at_ = lambda xx, yy: rgb[(yy * w + xx) * 3 + c]
        top = at_(x0, y0) * (1 - fx) + at_(x1, y0) * fx
        bottom = at_(x0, y1) * (1 - fx) + at_(x1, y1) * fx
        return top * (1 - fy) + bottom * fy

    def dot(a: Sequence[float], b: Sequence[float]) -> float:
        return sum(x * y for x, y in zip(a, b))

    def gelu(v: float) -> float:
        return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    out = []
    for by in range(gy):
        for bx in range(gx):
            merged = []
            for k in range(m * m):
                x0, y0 = bx * u + (k % m) * p, by * u + (k // m) * p
                inp = [pixel(x0 + x, y0 + y, c) / 127.5 - 1
                       for c in range(3) for y in range(p) for x in range(p)]
                feat = [gelu(dot(patch_proj[i * len(inp):(i + 1) * len(inp)], inp) + patch_bias[i])
                        for i in range(vh)]
                scale = 1 / math.sqrt(sum(f * f for f in feat) / vh + 1e-5)
                merged += [f * scale * g for f, g in zip(feat, norm)]
            out += [dot(proj[i * len(merged):(i + 1) * len(merged)], merged) + proj_bias[i]
                    for i in range(hidden)]
    return out


@pytest.mark.parametrize("w, h", [(16, 16), (20, 36), (3, 2)])
def test_vision_matches_a_reference_tower(imglib, tower, k3_vision_container, w, h):
    rgb = random_rgb(random.Random(w * h), w, h)
    n, got = encode_image(imglib, tower, w, h, rgb)
    want = reference_tower(k3_vision_container, tower[1], w, h, rgb)
    assert len(got) == len(want) == n * tower[1]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


@pytest.mark.parametrize("w, h", [(1, 1), (16, 16), (640, 480), (1000, 10), (33, 4000), (300, 301),
                                  (32768, 1), (2, 30000)])
def test_vision_token_count_follows_the_resize_rule(imglib, tower, k3_vision_container, w, h):
    cfg = json.loads((k3_vision_container / "vision.json").read_text())
    gx, gy = resized_grid(cfg, w, h)
    ramp = bytes(i % 251 for i in range(w * h * 3))
    n, embeds = encode_image(imglib, tower, w, h, ramp)
    assert n == gx * gy <= cfg["max_tokens"]
    assert all(math.isfinite(v) for v in embeds)


def test_vision_is_deterministic_and_image_dependent(imglib, tower):
    rng = random.Random(9)
    a, b = random_rgb(rng, 40, 30), random_rgb(rng, 40, 30)
    first = encode_image(imglib, tower, 40, 30, a)
    assert encode_image(imglib, tower, 40, 30, a) == first
    other = encode_image(imglib, tower, 40, 30, b)
    assert other[0] == first[0] and other[1] != first[1]


def test_vision_plan_counts_weights_and_the_decode_bound(imglib, k3_vision_container, k3_container):
    hidden = model_hidden(k3_vision_container)
    st, size, err = plan_tower(imglib, k3_vision_container, hidden)
    assert st == OK, err
    weights = (k3_vision_container / "vision.bin").stat().st_size
    assert size >= weights + WIMG_DECODE_MAX_PIXELS * 3 + WIMG_MAX_FILE_BYTES
    assert plan_tower(imglib, k3_container, hidden)[:2] == (OK, 0)
    assert load_tower(imglib, k3_container, hidden)[0] == E_UNSUPPORTED


@pytest.fixture
def tower_copy(tmp_path, k3_vision_container) -> Path:
    """A directory holding a copy of the container's vision files, to break."""
    for name in ("vision.json", "vision.bin"):
        (tmp_path / name).write_bytes((k3_vision_container / name).read_bytes())
    return tmp_path


@pytest.mark.parametrize("change", [
    {"patch_size": 0}, {"patch_size": 65}, {"merge": 9}, {"vision_hidden": 4097},
    {"max_tokens": 16385}, {"max_tokens": -1}, {"patch_size": "8"}, {"merge": 2.5}, {"merge": None},
])
def test_vision_config_is_validated(imglib, tower_copy, change):
    cfg = json.loads((tower_copy / "vision.json").read_text())
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tower_copy / "vision.json").write_text(json.dumps(cfg))
    hidden = 64
    assert load_tower(imglib, tower_copy, hidden)[0] == E_FORMAT
    assert plan_tower(imglib, tower_copy, hidden)[0] == E_FORMAT


def test_vision_weights_must_match_exactly(imglib, tower_copy, k3_vision_container):
    hidden = model_hidden(k3_vision_container)
    assert load_tower(imglib, tower_copy, hidden + 1)[0] == E_FORMAT  # sized for another width
    weights = tower_copy / "vision.bin"
    weights.write_bytes(weights.read_bytes()[:-4])
    st, _, err = load_tower(imglib, tower_copy, hidden)
    assert st == E_FORMAT and "vision.bin" in err
    weights.unlink()
    assert load_tower(imglib, tower_copy, hidden)[0] == E_IO


# -------------------------------------------------- through libwaste itself --

@pytest.fixture(scope="module")
def waste_lib():
    from conftest import library_path
    from serve.engine.binding import Library
    path = library_path()
    if not path.exists():
        pytest.skip(f"{path} is not built yet")
    try:
        return Library(path)
    except OSError as exc:  # the engine core does not export every ABI symbol yet
        pytest.skip(f"libwaste is not complete yet: {exc}")


def test_waste_image_dimensions(waste_lib, write):
    from serve.engine.binding import WasteError
    rng = random.Random(4)
    assert waste_lib.image_dimensions(write(encode_png(random_pixels(rng, 6, 2, 3, 256)))) == (6, 2)
    assert waste_lib.image_dimensions(write(webp_vp8x(300, 20))) == (300, 20)
    for data, status in [(b"not an image", E_FORMAT), (PNG_SIGNATURE + ihdr(65535, 65535), E_FORMAT)]:
        with pytest.raises(WasteError) as info:
            waste_lib.image_dimensions(write(data))
        assert info.value.status == status


def test_waste_image_add(waste_lib, k3_vision_container, k3_container, write):
    from serve.engine.binding import Engine, EngineConfig, WasteError
    cfg = json.loads((k3_vision_container / "vision.json").read_text())
    rng = random.Random(6)
    with Engine(waste_lib, k3_vision_container, EngineConfig(vision=True)) as engine:
        for w, h in [(20, 36), (300, 200)]:
            gx, gy = resized_grid(cfg, w, h)
            assert engine.image_add(write(encode_png(random_pixels(rng, w, h, 3, 256)))) == gx * gy
        jpeg_positions = math.prod(resized_grid(cfg, JPEG_W, JPEG_H))
        assert engine.image_add(write(jpeg_fixture("444"))) == jpeg_positions
        for data, status in [(jpeg_fixture("progressive"), E_UNSUPPORTED),
                             (small_png(rng)[:-20], E_FORMAT), (b"", E_FORMAT)]:
            with pytest.raises(WasteError) as info:
                engine.image_add(write(data))
            assert info.value.status == status
    with Engine(waste_lib, k3_container, EngineConfig()) as engine:
        with pytest.raises(WasteError) as info:
            engine.image_add(write(small_png(rng)))
        assert info.value.status == E_UNSUPPORTED
