"""Image files written in Python for the tests: PNG and GIF encoders, the embedded JPEG
fixtures (made once with Pillow, see JPEG_FIXTURES) and WebP headers. Used by the engine's
image tests and serve's own pre-queue image checks."""
from __future__ import annotations

import base64
import random
import struct
import zlib
from typing import Optional, Sequence


# ------------------------------------------------------------ PNG encoder --

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2)]


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def ihdr(w: int, h: int, depth: int = 8, ctype: int = 2, interlace: int = 0) -> bytes:
    return png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, ctype, 0, 0, interlace))


def pack_samples(samples: Sequence[int], depth: int) -> bytes:
    if depth == 16:
        return b"".join(struct.pack(">H", s) for s in samples)
    if depth == 8:
        return bytes(samples)
    per_byte, out = 8 // depth, bytearray()
    for i in range(0, len(samples), per_byte):
        byte = 0
        for j, s in enumerate(samples[i:i + per_byte]):
            byte |= s << (8 - depth * (j + 1))
        out.append(byte)
    return bytes(out)


def paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def filter_row(kind: int, row: bytes, prev: bytes, bpp: int) -> bytes:
    out = bytearray()
    for i, x in enumerate(row):
        a = row[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        predictor = [0, a, b, (a + b) // 2, paeth(a, b, c)][kind]
        out.append((x - predictor) & 0xFF)
    return bytes(out)


def png_scanlines(pixels: list, depth: int, ctype: int, interlace: bool) -> bytes:
    """Filtered image data; the filter type cycles through all five by row."""
    h, w = len(pixels), len(pixels[0])
    bpp = max(1, CHANNELS[ctype] * depth // 8)
    raw, n = bytearray(), 0
    for x0, y0, dx, dy in (ADAM7 if interlace else [(0, 0, 1, 1)]):
        xs, ys = range(x0, w, dx), range(y0, h, dy)
        if not xs or not ys:
            continue
        prev = None
        for y in ys:
            row = pack_samples([s for x in xs for s in pixels[y][x]], depth)
            prev = prev or bytes(len(row))
            kind = n % 5
            n += 1
            raw += bytes([kind]) + filter_row(kind, row, prev, bpp)
            prev = row
    return bytes(raw)


def encode_png(pixels: list, depth: int = 8, ctype: int = 2, interlace: bool = False,
               palette: Optional[list] = None, idat_parts: int = 1) -> bytes:
    """pixels: rows of per-pixel sample tuples (channel count of ctype)."""
    h, w = len(pixels), len(pixels[0])
    data = zlib.compress(png_scanlines(pixels, depth, ctype, interlace))
    out = PNG_SIGNATURE + ihdr(w, h, depth, ctype, int(interlace))
    out += png_chunk(b"tEXt", b"Comment\0written by test_images")
    if palette is not None:
        out += png_chunk(b"PLTE", b"".join(bytes(c) for c in palette))
    step = max(1, -(-len(data) // idat_parts))
    for i in range(0, len(data), step):
        out += png_chunk(b"IDAT", data[i:i + step])
    return out + png_chunk(b"IEND", b"")


def expected_rgb(pixels: list, depth: int, ctype: int, palette: Optional[list]) -> bytes:
    """What the decoder promises: alpha dropped, 16-bit -> high byte, low depths scaled."""
    out = bytearray()
    for row in pixels:
        for px in row:
            if ctype == 3:
                out += bytes(palette[px[0]])
                continue
            samples = [s >> 8 if depth == 16 else s * 255 // ((1 << depth) - 1) for s in px]
            out += bytes(samples[:3]) if ctype in (2, 6) else bytes([samples[0]] * 3)
    return bytes(out)


def random_pixels(rng: random.Random, w: int, h: int, channels: int, top: int) -> list:
    return [[tuple(rng.randrange(top) for _ in range(channels)) for _ in range(w)] for _ in range(h)]


def small_png(rng: random.Random) -> bytes:
    return encode_png(random_pixels(rng, 5, 4, 3, 256))


# ------------------------------------------------------------ GIF encoder --

def lzw_encode(indices: Sequence[int], min_size: int) -> bytes:
    """GIF LZW: variable code width, a clear code when the table fills."""
    clear, eoi = 1 << min_size, (1 << min_size) + 1
    acc = nbits = 0
    out = bytearray()

    def put(code: int, size: int) -> None:
        nonlocal acc, nbits
        acc |= code << nbits
        nbits += size
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8

    size, next_code, table = min_size + 1, eoi + 1, {}
    put(clear, size)
    current = None
    for px in indices:
        if current is None:
            current = px
        elif (current, px) in table:
            current = table[(current, px)]
        else:
            put(current, size)
            if next_code == 4096:
                put(clear, size)
                size, next_code, table = min_size + 1, eoi + 1, {}
            else:
                # The decoder learns each entry one code later, so widen
                # only once the table has outgrown the current width.
                if next_code >= 1 << size and size < 12:
                    size += 1
                table[(current, px)] = next_code
                next_code += 1
            current = px
    put(current, size)
    if next_code < 4096 and next_code >= 1 << size and size < 12:
        size += 1
    put(eoi, size)
    if nbits:
        out.append(acc & 0xFF)
    return bytes(out)


def sub_blocks(data: bytes) -> bytes:
    return b"".join(bytes([len(data[i:i + 255])]) + data[i:i + 255]
                    for i in range(0, len(data), 255)) + b"\0"


def gif_table(palette: list) -> tuple[int, bytes]:
    bits = max(1, (len(palette) - 1).bit_length())
    padded = list(palette) + [(0, 0, 0)] * ((1 << bits) - len(palette))
    return bits, b"".join(bytes(c) for c in padded)


GIF_INTERLACE = [(0, 8), (4, 8), (2, 4), (1, 2)]


def encode_gif(w: int, h: int, indices: Sequence[int], palette: list, *, interlace: bool = False,
               local: bool = False, screen: Optional[tuple[int, int]] = None,
               offset: tuple[int, int] = (0, 0), background: int = 0) -> bytes:
    bits, table = gif_table(palette)
    sw, sh = screen or (w, h)
    out = b"GIF89a" + struct.pack("<HHBBB", sw, sh, 0 if local else 0x80 | (bits - 1), background, 0)
    out += b"" if local else table
    out += b"\x21\xf9\x04\x00\x00\x00\x00\x00"          # graphic control extension
    out += b"\x21\xfe" + sub_blocks(b"a comment to skip")  # comment extension
    flags = (0x40 if interlace else 0) | ((0x80 | (bits - 1)) if local else 0)
    out += b"\x2c" + struct.pack("<HHHHB", offset[0], offset[1], w, h, flags)
    out += table if local else b""
    rows = [y for start, step in GIF_INTERLACE for y in range(start, h, step)] if interlace else range(h)
    stream = [indices[y * w + x] for y in rows for x in range(w)]
    min_size = max(2, bits)
    return out + bytes([min_size]) + sub_blocks(lzw_encode(stream, min_size)) + b"\x3b"


def small_gif(rng: random.Random) -> bytes:
    palette = [(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(4)]
    return encode_gif(6, 5, [rng.randrange(4) for _ in range(30)], palette)


# -------------------------------------------------------------- JPEG data --

# Made once with Pillow 13 (not a runtime or test dependency), in a scratch
# venv outside the repo:  python -m venv /tmp/pil && /tmp/pil/bin/pip install Pillow
# then, for the 40x24 image jpeg_pattern() describes:
#   img = Image.new("RGB", (40, 24)); img.putdata([jpeg_pattern(x, y) for y.. for x..])
#   img.save(buf, "JPEG", quality=95, subsampling=0)                 -> "444"
#   ... subsampling=1                                                 -> "422"
#   ... subsampling=2, restart_marker_blocks=1                        -> "420_restart"
#   img.convert("L").save(buf, "JPEG", quality=95)                    -> "gray"
#   ... progressive=True                                              -> "progressive"
JPEG_COLORS = [(200, 40, 40), (40, 180, 60), (50, 60, 200), (230, 220, 90), (20, 20, 20),
               (250, 250, 250)]
JPEG_W, JPEG_H = 40, 24


def jpeg_pattern(x: int, y: int) -> tuple[int, int, int]:
    """16x16 blocks of flat colour: even 4:2:0 chroma is flat within each."""
    return JPEG_COLORS[(x // 16 + 2 * (y // 16)) % len(JPEG_COLORS)]


JPEG_FIXTURES = {
    "444": (
        "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAIBAQEBAQIBAQECAgICAgQDAgICAgUEBAMEBgUGBgYFBgYGBwkIBgcJ"
        "BwYGCAsICQoKCgoKBggLDAsKDAkKCgr/2wBDAQICAgICAgUDAwUKBwYHCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoK"
        "CgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgr/wAARCAAYACgDAREAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAA"
        "AAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAk"
        "M2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKT"
        "lJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QA"
        "HwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdh"
        "cRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hp"
        "anN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk"
        "5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD5fr8TP9QAoA+kK+bP+c8KAPjOv9sD+sDvK/xzP9gAoA+kK+bP"
        "+c8KAPjOv9sD+sAoAKAP6HK/50z+gAoA/kPr/Qw/Pz//2Q=="
    ),
    "422": (
        "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAIBAQEBAQIBAQECAgICAgQDAgICAgUEBAMEBgUGBgYFBgYGBwkIBgcJ"
        "BwYGCAsICQoKCgoKBggLDAsKDAkKCgr/2wBDAQICAgICAgUDAwUKBwYHCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoK"
        "CgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgr/wAARCAAYACgDASEAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAA"
        "AAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAk"
        "M2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKT"
        "lJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QA"
        "HwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdh"
        "cRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hp"
        "anN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk"
        "5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD5for8TP8AUA+kKK+bP+c8+M6K/wBsD+sDvKK/xzP9gD6Qor5s"
        "/wCc8+M6K/2wP6wCigD+hyiv+dM/oA/kPor/AEMPz8//2Q=="
    ),
    "420_restart": (
        "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAIBAQEBAQIBAQECAgICAgQDAgICAgUEBAMEBgUGBgYFBgYGBwkIBgcJ"
        "BwYGCAsICQoKCgoKBggLDAsKDAkKCgr/2wBDAQICAgICAgUDAwUKBwYHCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoK"
        "CgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgr/wAARCAAYACgDASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAA"
        "AAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAk"
        "M2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKT"
        "lJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QA"
        "HwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdh"
        "cRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hp"
        "anN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk"
        "5ebn6Onq8vP09fb3+Pn6/90ABAAB/9oADAMBAAIRAxEAPwD5fooor8TP9QD/0M+iiiv5vP4PP//R+I6KKK/0gPz8"
        "/9L4jooor/SA/Pz/0/1Aooor/PM/QD//1PxPooooA//Z"
    ),
    "gray": (
        "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAIBAQEBAQIBAQECAgICAgQDAgICAgUEBAMEBgUGBgYFBgYGBwkIBgcJ"
        "BwYGCAsICQoKCgoKBggLDAsKDAkKCgr/wAALCAAYACgBAREA/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcI"
        "CQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcY"
        "GRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKj"
        "pKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/9oACAEBAAA/APl+"
        "ivpCivjOu8or6Qor4zoor+hyiv5D6//Z"
    ),
    "progressive": (
        "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAIBAQEBAQIBAQECAgICAgQDAgICAgUEBAMEBgUGBgYFBgYGBwkIBgcJ"
        "BwYGCAsICQoKCgoKBggLDAsKDAkKCgr/2wBDAQICAgICAgUDAwUKBwYHCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoK"
        "CgoKCgoKCgoKCgoKCgoKCgoKCgoKCgoKCgr/wgARCAAYACgDASIAAhEBAxEB/8QAFgABAQEAAAAAAAAAAAAAAAAA"
        "AAcJ/8QAGQEAAgMBAAAAAAAAAAAAAAAAAAgGBwkF/9oADAMBAAIQAxAAAAGXiEtBSBzc54yHYtgA0OGdNgZDhho/"
        "/8QAFBABAAAAAAAAAAAAAAAAAAAAMP/aAAgBAQABBQJ//8QAFBEBAAAAAAAAAAAAAAAAAAAAIP/aAAgBAwEBPwFf"
        "/8QAFBEBAAAAAAAAAAAAAAAAAAAAIP/aAAgBAgEBPwFf/8QAFBABAAAAAAAAAAAAAAAAAAAAMP/aAAgBAQAGPwJ/"
        "/8QAFBABAAAAAAAAAAAAAAAAAAAAMP/aAAgBAQABPyF//9oADAMBAAIAAwAAABAAAAAAD//EABQRAQAAAAAAAAAA"
        "AAAAAAAAACD/2gAIAQMBAT8QX//EABQRAQAAAAAAAAAAAAAAAAAAACD/2gAIAQIBAT8QX//EABQQAQAAAAAAAAAA"
        "AAAAAAAAADD/2gAIAQEAAT8Qf//Z"
    ),
}


def jpeg_fixture(name: str) -> bytes:
    return base64.b64decode("".join(JPEG_FIXTURES[name]))


def jpeg_resized(w: int, h: int) -> bytes:
    """The 4:4:4 fixture with its frame header claiming w x h."""
    data = jpeg_fixture("444")
    sof = b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", JPEG_H, JPEG_W)
    assert data.count(sof) == 1
    return data.replace(sof, sof[:5] + struct.pack(">HH", h, w))


def jpeg_expected(gray: bool) -> bytes:
    out = bytearray()
    for y in range(JPEG_H):
        for x in range(JPEG_W):
            r, g, b = jpeg_pattern(x, y)
            out += bytes([round(0.299 * r + 0.587 * g + 0.114 * b)] * 3) if gray else bytes((r, g, b))
    return bytes(out)


# --------------------------------------------------------------- WebP data --

def riff_webp(chunk: bytes, payload: bytes) -> bytes:
    body = b"WEBP" + chunk + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_vp8(w: int, h: int) -> bytes:
    frame_tag = b"\x10\x02\x00"  # key frame (bit 0 clear), version 0, shown
    return riff_webp(b"VP8 ", frame_tag + b"\x9d\x01\x2a" + struct.pack("<HH", w, h) + bytes(10))


def webp_vp8l(w: int, h: int) -> bytes:
    return riff_webp(b"VP8L", b"\x2f" + struct.pack("<I", (w - 1) | (h - 1) << 14) + bytes(8))


def webp_vp8x(w: int, h: int) -> bytes:
    size = lambda v: struct.pack("<I", v - 1)[:3]
    return riff_webp(b"VP8X", b"\x00\x00\x00\x00" + size(w) + size(h))


# ------------------------------------------------- damaged, as clients send them --

def png_of_rows(raw: bytes, w: int = 1, h: int = 1) -> bytes:
    """A w x h 8-bit RGB PNG whose image data inflates to `raw` (filter bytes included)."""
    return (PNG_SIGNATURE + ihdr(w, h) + png_chunk(b"IDAT", zlib.compress(raw))
            + png_chunk(b"IEND", b""))


def truncated_png() -> bytes:
    """A 32x32 PNG cut inside its image data: the header still reads."""
    good = encode_png(random_pixels(random.Random(5), 32, 32, 3, 256))
    return good[:len(good) // 2]


def corrupt_zlib_png() -> bytes:
    """A 64x64 grey PNG whose zlib stream's first block has the reserved type."""
    stream = bytearray(zlib.compress(bytes(range(256)) * 64))
    stream[2] |= 0x06    # BTYPE 11
    return PNG_SIGNATURE + ihdr(64, 64, 8, 0) + png_chunk(b"IDAT", bytes(stream)) + \
        png_chunk(b"IEND", b"")


def jpeg_without_scan() -> bytes:
    """The 4:4:4 fixture ending (EOI) where its scan should start."""
    jpeg = jpeg_fixture("444")
    return jpeg[:jpeg.index(b"\xff\xda")] + b"\xff\xd9"


def gif_without_lzw() -> bytes:
    """A 4x4 GIF whose image descriptor is followed by an empty chain of data sub-blocks."""
    gif = encode_gif(4, 4, [0] * 16, [(1, 2, 3), (4, 5, 6)])
    descriptor = gif.rindex(b"\x2c")
    return gif[:descriptor + 10] + b"\x02\x00\x3b"   # min code size, no sub-block, trailer


def flat_png(w: int, h: int) -> bytes:
    """One grey w x h PNG, cheap to write and to decode at any size."""
    rows = zlib.compress((b"\0" + bytes(w)) * h, 1)
    return PNG_SIGNATURE + ihdr(w, h, 8, 0) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")

