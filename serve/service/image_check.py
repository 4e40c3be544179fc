"""Whether an image's pixels can be decoded, checked with the standard library before the
request waits for the engine (docs/images.md).

The engines decode an image only in waste_image_add, which needs the engine's context,
so the queue; the ABI has no context-free decode. This walks each format's structure
(and inflates a PNG's data) and refuses only what the engines refuse: the reference
engine (engine/png.c, gif.c, jpeg.c) always, and WARP (stb_image) too except where
stb_image makes an image out of nothing (a JPEG with no scan, a GIF with no LZW data)
or would inflate a bomb into memory (a PNG stream longer than its header's rows).
Whatever the engines would accept that this cannot tell (bit errors in a JPEG's entropy
data, an LZW stream cut short) is still the engine's to find, after the queue.
"""
from __future__ import annotations

import struct
import zlib
from typing import Optional

MAX_PIXELS = 64 * 1024 * 1024   # both engines refuse more (imgbuf.h, WARP's model.h)
INFLATE_STEP = 1 << 16           # input fed to inflate at a time: bounds each unconsumed tail
OUTPUT_STEP = 1 << 20            # output taken from inflate at a time, looked at and dropped


class Undecodable(ValueError):
    """Why an image's pixels cannot be decoded."""


def check_pixels(data: bytes) -> None:
    """Raise Undecodable when no engine could decode `data`; formats this does not know
    (the header check has refused them, or the engine decodes them) pass."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        check_png(data)
    elif data.startswith((b"GIF87a", b"GIF89a")):
        check_gif(data)
    elif data.startswith(b"\xff\xd8\xff"):
        check_jpeg(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise Undecodable("WebP images are decoded by neither engine (the reference engine "
                          "nor WARP's stb_image); send PNG, JPEG or GIF")


def check_size(kind: str, width: int, height: int) -> None:
    if width * height > MAX_PIXELS:
        raise Undecodable(f"{kind} image is {width}x{height}; at most {MAX_PIXELS} pixels "
                          "are decoded")


# -------------------------------------------------------------------------- PNG

CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}          # by colour type
DEPTHS = (1, 2, 4, 8, 16)   # any with any colour type but a 16-bit palette, as stb_image reads them
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2))


def check_png(data: bytes) -> None:
    """Chunks in bounds up to IEND, a valid IHDR first, a palette before the image data of
    a palette image, and the image data inflating to exactly its rows, each with a known
    filter type. CRCs and the zlib checksum are not checked: stb_image does not."""
    pos, rows, palette = 8, None, False
    view = memoryview(data)
    while True:
        if len(data) - pos < 8:
            raise Undecodable("PNG is truncated (no IEND chunk)")
        length, kind = struct.unpack_from(">I4s", data, pos)
        body = pos + 8
        if kind == b"IEND" and rows is not None:
            rows.finish()
            return
        if length > len(data) - body - 4:
            raise Undecodable(f"PNG is truncated: chunk {kind.decode('latin-1')!r} runs past "
                              "the end")
        if pos == 8:
            if kind == b"CgBI":   # Apple's variant: stb_image decodes it, the reference does not
                return
            if kind != b"IHDR" or length != 13:
                raise Undecodable("PNG does not start with a 13-byte IHDR chunk")
            rows = PngRows(*struct.unpack_from(">IIBBBBB", data, body))
        elif kind == b"PLTE":
            palette = True
        elif kind == b"IDAT":
            assert rows is not None
            if rows.ctype == 3 and not palette and not rows.started:
                raise Undecodable("PNG palette image has no PLTE chunk before its image data")
            rows.feed(view[body:body + length])
        elif not kind[0] & 0x20:   # an upper-case first letter: critical, cannot be skipped
            raise Undecodable(f"PNG has unknown critical chunk {kind.decode('latin-1')!r}")
        pos = body + length + 4


class PngRows:
    """A PNG's image data, inflated a step at a time and dropped once looked at: where each
    row's filter byte falls, and that the stream ends with the last row, no sooner or later."""

    def __init__(self, width: int, height: int, depth: int, ctype: int, compression: int,
                 filtering: int, interlace: int):
        if ctype not in CHANNELS or depth not in DEPTHS or (ctype, depth) == (3, 16):
            raise Undecodable(f"PNG colour type {ctype} with bit depth {depth} is invalid")
        if width == 0 or height == 0:
            raise Undecodable(f"PNG declares an empty image ({width}x{height})")
        if compression or filtering or interlace > 1:
            raise Undecodable(f"PNG compression {compression}, filter {filtering} or interlace "
                              f"{interlace} is unknown")
        check_size("PNG", width, height)   # before anything is inflated: a bomb stops here
        self.ctype = ctype
        self.width, self.height = width, height
        passes = ADAM7 if interlace else ((0, 0, 1, 1),)
        # (rows, bytes a row with its filter byte) of each pass that has pixels
        self.passes = [(-(-(height - y0) // dy), (-(-(width - x0) // dx) * CHANNELS[ctype] * depth
                                                   + 7) // 8 + 1)
                       for x0, y0, dx, dy in passes if width > x0 and height > y0]
        self.need = sum(n * size for n, size in self.passes)
        self.produced = 0
        self.started = False
        self._head = b""            # the zlib header's two bytes, which may straddle IDATs
        self._z: Optional[zlib._Decompress] = None
        self._pass = self._row = 0
        self._next_filter = 0       # offset in the raw data of the next row's filter byte

    def feed(self, chunk: memoryview) -> None:
        self.started = True
        if self._z is None:
            take = 2 - len(self._head)
            self._head += bytes(chunk[:take])
            chunk = chunk[take:]
            if len(self._head) < 2:
                return
            self._z = zlib.decompressobj(-15)   # raw deflate: the zlib checksum goes unchecked
            cmf, flg = self._head
            if (cmf * 256 + flg) % 31 or flg & 0x20 or cmf & 15 != 8:
                raise Undecodable("PNG image data is not a zlib stream")
        z = self._z
        for at in range(0, len(chunk), INFLATE_STEP):
            piece: bytes | memoryview = chunk[at:at + INFLATE_STEP]
            while piece and not z.eof:
                try:
                    out = z.decompress(piece, OUTPUT_STEP)
                except zlib.error as e:
                    raise Undecodable(f"PNG image data is corrupt ({e})") from None
                self._look(out)
                piece = z.unconsumed_tail

    def _look(self, out: bytes) -> None:
        start = self.produced
        self.produced += len(out)
        if self.produced > self.need:
            raise Undecodable(f"PNG image data is larger than its {self.width}x{self.height} "
                              "header declares")
        while self._next_filter < self.produced:
            kind = out[self._next_filter - start]
            if kind > 4:
                raise Undecodable(f"PNG row uses unknown filter type {kind}")
            rows, size = self.passes[self._pass]
            self._next_filter += size
            self._row += 1
            if self._row == rows:
                self._pass, self._row = self._pass + 1, 0

    def finish(self) -> None:
        """At IEND: every row inflated, and the stream ended."""
        if self._z is None:
            raise Undecodable("PNG has no image data (no IDAT chunk)")
        if self.produced < self.need:
            raise Undecodable(f"PNG image data ends before its last row ({self.produced} of "
                              f"{self.need} bytes)")
        if not self._z.eof:
            raise Undecodable("PNG image data does not end (the zlib stream is cut short)")


# -------------------------------------------------------------------------- GIF

def check_gif(data: bytes) -> None:
    """Screen, colour tables and extensions in bounds, an image descriptor with a colour
    table, and LZW data after it."""
    if len(data) < 13:
        raise Undecodable("GIF is truncated before its screen descriptor")
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    check_size("GIF", width, height)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    table = bool(flags & 0x80)
    while True:
        if pos >= len(data):
            raise Undecodable("GIF is truncated before its first image")
        block = data[pos]
        if block == 0x2C:
            break
        if block == 0x3B:
            raise Undecodable("GIF has no image")
        if block != 0x21:
            raise Undecodable(f"GIF has unknown block 0x{block:02x}")
        pos = skip_sub_blocks(data, pos + 2)
    if len(data) - pos < 10:
        raise Undecodable("GIF image descriptor is truncated")
    local = data[pos + 9]
    pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
    if not table and not local & 0x80:
        raise Undecodable("GIF image has no colour table")
    if pos >= len(data):
        raise Undecodable("GIF is truncated before its image data")
    if data[pos] > 12:
        raise Undecodable(f"GIF LZW minimum code size {data[pos]} is invalid")
    if pos + 1 >= len(data) or data[pos + 1] == 0:
        raise Undecodable("GIF image has no LZW data")


def skip_sub_blocks(data: bytes, pos: int) -> int:
    """The position after a chain of sub-blocks starting at `pos`."""
    while pos < len(data):
        length = data[pos]
        pos += 1 + length
        if length == 0:
            return pos
    raise Undecodable("GIF extension block is truncated")


# ------------------------------------------------------------------------- JPEG

def check_jpeg(data: bytes) -> None:
    """Segments in bounds up to the first scan, a frame header of a kind an engine decodes
    (baseline, extended or progressive Huffman), quantisation and Huffman tables, the scan,
    and entropy-coded data after it. The entropy data itself is not decoded: stb_image
    accepts it cut short."""
    pos, components, tables = 2, b"", set()
    while True:
        if len(data) - pos < 2:
            raise Undecodable("JPEG is truncated before its scan")
        if data[pos] != 0xFF:
            raise Undecodable(f"JPEG has 0x{data[pos]:02x} where a marker should be "
                              f"(offset {pos})")
        marker = data[pos + 1]
        if marker == 0xFF:          # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            pos += 2
            continue
        if marker == 0xD9:
            raise Undecodable("JPEG ends before its scan")
        if len(data) - pos < 4:
            raise Undecodable("JPEG is truncated in a segment header")
        length = struct.unpack_from(">H", data, pos + 2)[0]
        if length < 2 or length - 2 > len(data) - pos - 4:
            raise Undecodable(f"JPEG segment 0x{marker:02x} runs past the end of the file")
        segment = data[pos + 4:pos + 2 + length]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8):
            components = check_frame(marker, segment)
        elif marker == 0xDB:
            check_quantisation(segment)
            tables.add("quantisation")
        elif marker == 0xC4:
            check_huffman(segment)
            tables.add("Huffman")
        elif marker == 0xDA:
            break
        pos += 2 + length
    if not components:
        raise Undecodable("JPEG scan comes before its frame header")
    for kind in ("quantisation", "Huffman"):
        if kind not in tables:
            raise Undecodable(f"JPEG has no {kind} table before its scan")
    check_scan(segment, components)
    entropy = pos + 2 + length
    if entropy >= len(data) or (data[entropy] == 0xFF and data[entropy + 1:entropy + 2] != b"\0"):
        raise Undecodable("JPEG scan has no entropy-coded data")


def check_frame(marker: int, frame: bytes) -> bytes:
    """The frame's component ids, once its header is one an engine decodes."""
    if marker not in (0xC0, 0xC1, 0xC2):
        raise Undecodable(f"JPEG frame type SOF{marker - 0xC0} (lossless, hierarchical or "
                          "arithmetic-coded) is decoded by neither engine")
    if len(frame) < 6:
        raise Undecodable("JPEG frame header is truncated")
    precision, height, width, components = struct.unpack_from(">BHHB", frame)
    if precision != 8:
        raise Undecodable(f"{precision}-bit JPEG is decoded by neither engine")
    check_size("JPEG", width, height)
    if components not in (1, 3, 4):
        raise Undecodable(f"JPEG has {components} components")
    if len(frame) < 6 + 3 * components:
        raise Undecodable("JPEG frame header is truncated")
    for i in range(components):
        sampling, table = frame[7 + 3 * i], frame[8 + 3 * i]
        if not 1 <= sampling >> 4 <= 4 or not 1 <= sampling & 15 <= 4 or table > 3:
            raise Undecodable(f"JPEG component {i} has invalid sampling or table")
    return bytes(frame[6 + 3 * i] for i in range(components))


def check_quantisation(segment: bytes) -> None:
    at = 0
    while at < len(segment):
        precision, table = segment[at] >> 4, segment[at] & 15
        if precision > 1 or table > 3 or len(segment) - at - 1 < (128 if precision else 64):
            raise Undecodable("JPEG quantisation table is malformed")
        at += 1 + (128 if precision else 64)


def check_huffman(segment: bytes) -> None:
    """Each table's class and id, and code lengths that fit their bits (a canonical code)."""
    at = 0
    while at < len(segment):
        if len(segment) - at < 17 or segment[at] >> 4 > 1 or segment[at] & 15 > 3:
            raise Undecodable("JPEG Huffman table is malformed")
        code = total = 0
        for bits, count in enumerate(segment[at + 1:at + 17], start=1):
            code += count
            total += count
            if code > 1 << bits:
                raise Undecodable("JPEG Huffman code lengths overflow")
            code <<= 1
        if total > 256 or total > len(segment) - at - 17:
            raise Undecodable("JPEG Huffman table is truncated")
        at += 17 + total


def check_scan(header: bytes, components: bytes) -> None:
    """The scan names 1-4 of the frame's components, each with table ids 0-3."""
    count = header[0] if header else 0
    if not 1 <= count <= 4 or len(header) < 4 + 2 * count:
        raise Undecodable("JPEG scan header is malformed")
    for i in range(count):
        if header[1 + 2 * i] not in components:
            raise Undecodable(f"JPEG scan names component {header[1 + 2 * i]}, not in its frame")
        if header[2 + 2 * i] >> 4 > 3 or header[2 + 2 * i] & 15 > 3:
            raise Undecodable("JPEG scan uses a Huffman table id above 3")
