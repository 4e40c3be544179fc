"""How many positions an image takes once expanded, from its size and the container's
vision.json: known before the request waits for the engine, so a prompt that cannot fit
with its images is refused at once, and count_tokens counts images without the engine.

Each engine has its own rule, and a container is read by one engine only, so serve
uses the rule of the engine its container is for (the manifest's "format", as the
tokenizer does):

- the reference engine ("format": "waste-ref"; engine/FORMAT.md, engine/vision.c):
  U = patch_size * merge, s = min(1, sqrt(max_tokens * U*U / (W*H))), each side
  floor(side * s / U) blocks of U, at least one; a thin image whose blocks exceed
  max_tokens has its long side cut to floor(max_tokens / short side's blocks);
- WARP (any other container; its src/image.c and src/waste.c): a grid of 14-pixel
  patches, scale = min(1, sqrt(max_patches / (W*H / 196))), each side
  (int)(side * scale / 14 + 0.5) patches, at least 2, made even, then 2 patches off
  the longer side until the grid fits max_patches (vision.json, 1024 when absent);
  the tower merges 2x2 patches into one position. WARP queues at most 32 images.

Each rule also says how many images a request may queue and how many pixels the
engine decodes (the reference engine 16 Mpixels, WARP 64), refused before the
queue too while serve's figure holds.

Both compute in IEEE doubles in the order written here, as Python's floats do, so
the figure is the engine's exactly. Serve still checks it against the engine: at
start, on a few small images encoded while the engine is idle (probe(), the banner's
images line), and then against the count waste_image_add returns for every image.
The first that differs (an engine built with another rule) turns serve's figure off
for the life of the process, saying so in the log, and from then on images count one
position each before the queue (a bound never above the engine's) and count_tokens
asks the engine; the engine's own count after waste_image_add stays the last word on
fitting the context.
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, TypeGuard

from serve.engine.api import EngineApi
from serve.engine.types import WasteError

WARP_PATCH = 14          # src/image.c's PATCH: WARP's vision.json must say 14
WARP_MAX_IMAGES = 32     # src/model.h's WASTE_MAX_IMAGES: waste_image_add refuses the 33rd
# Encoded at start to check the figure: small (a few positions on any tower, cheap on K3's),
# and sizes the two rules count differently.
PROBE_SIZES = ((70, 42), (30, 200), (3, 3))


class Grid(Protocol):
    """An engine's rule for an image's positions."""

    @property
    def engine(self) -> str: ...                 # whose rule, for the log

    @property
    def max_images(self) -> Optional[int]: ...   # images one request may queue; None: no limit

    @property
    def max_pixels(self) -> int: ...             # the largest image it decodes, in pixels

    def positions(self, width: int, height: int) -> int: ...


@dataclass(frozen=True)
class ReferenceGrid:
    """The reference engine's rule (engine/FORMAT.md, "vision.json and vision.bin")."""
    patch: int
    merge: int
    max_tokens: int
    engine: str = "the reference engine"
    max_images: Optional[int] = None   # its queue holds a context's worth of positions, no count
    max_pixels: int = 16 * 1024 * 1024   # engine/imgbuf.h's WIMG_DECODE_MAX_PIXELS

    def positions(self, width: int, height: int) -> int:
        u = self.patch * self.merge
        s = min(1.0, math.sqrt(self.max_tokens * u * u / (width * height)))
        gx = max(1, math.floor(width * s / u))
        gy = max(1, math.floor(height * s / u))
        if gx * gy > self.max_tokens:   # a thin image: its long side is cut
            if gx > gy:
                gx = self.max_tokens // gy
            else:
                gy = self.max_tokens // gx
        return gx * gy


@dataclass(frozen=True)
class WarpGrid:
    """WARP's rule (its src/image.c waste_image_load, src/waste.c waste_image_add)."""
    max_patches: int
    engine: str = "WARP"
    max_images: Optional[int] = WARP_MAX_IMAGES
    max_pixels: int = 64 * 1024 * 1024   # src/model.h's WASTE_MAX_SOURCE_PIXELS

    def positions(self, width: int, height: int) -> int:
        scale = min(1.0, math.sqrt(self.max_patches / (width * height / (WARP_PATCH * WARP_PATCH))))
        gw = max(2, int(width * scale / WARP_PATCH + 0.5)) & ~1
        gh = max(2, int(height * scale / WARP_PATCH + 0.5)) & ~1
        while gw * gh > self.max_patches and (gw > 2 or gh > 2):
            if gw >= gh and gw > 2:
                gw -= 2
            else:
                gh -= 2
        return (gw // 2) * (gh // 2)


def read_grid(container: str) -> Optional[Grid]:
    """The rule for `container`'s images, from manifest.json and vision.json; None when
    either is missing or malformed (the engine, which opened it, then counts alone)."""
    try:
        with open(os.path.join(container, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        with open(os.path.join(container, "vision.json"), encoding="utf-8") as f:
            vision = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(vision, dict):
        return None
    if manifest.get("format") == "waste-ref":
        values = [vision.get(key) for key in ("patch_size", "merge", "max_tokens")]
        numbers = [v for v in values if positive_int(v)]
        if len(numbers) != 3:
            return None
        patch, merge, most = numbers
        return ReferenceGrid(patch, merge, most)
    if vision.get("patch_size", WARP_PATCH) != WARP_PATCH:
        return None
    max_patches = vision.get("max_patches", 1024)
    return WarpGrid(max_patches) if positive_int(max_patches) and max_patches >= 4 else None


def positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class ImagePositions:
    """Serve's figure for an image's positions, for as long as the engine agrees with it."""

    def __init__(self, grid: Optional[Grid], log: Optional[Callable[[str], None]] = None):
        self.grid = grid
        self.differed: Optional[str] = None   # what the engine counted otherwise, once it did
        self._log = log

    @property
    def _rule(self) -> Optional[Grid]:
        """The grid, while serve's figure holds; None once the engine differed."""
        return None if self.differed is not None else self.grid

    @property
    def max_images(self) -> Optional[int]:
        """Images one request may carry, as the engine's rule says; None: no limit known."""
        return None if self._rule is None else self._rule.max_images

    @property
    def max_pixels(self) -> Optional[int]:
        """The largest image the engine decodes, as its rule says; None: not known."""
        return None if self._rule is None else self._rule.max_pixels

    def figure(self, width: int, height: int) -> Optional[int]:
        """The positions a width x height image takes; None when serve does not count them."""
        return None if self._rule is None else self._rule.positions(width, height)

    def probe(self, engine: EngineApi) -> None:
        """At start, with the engine idle: encode PROBE_SIZES and compare the counts."""
        if self.grid is None:
            return
        for w, h in PROBE_SIZES:
            fd, path = tempfile.mkstemp(prefix="serve-probe-", suffix=".png")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(grey_png(w, h))
                figure = self.figure(w, h)
                self.observe((w, h), figure, engine.image_add(path))
            except WasteError as e:
                self.differed = f"a {w}x{h} probe image could not be encoded ({e})"
            finally:
                engine.image_clear()
                os.unlink(path)
            if self.differed is not None:
                return

    def describe(self) -> str:
        """The banner's images line."""
        if self.grid is None:
            return "positions counted on the engine (no rule for this container's vision.json)"
        if self.differed is not None:
            return f"positions counted on the engine: {self.differed}"
        return (f"positions figured by serve before the queue ({self.grid.engine}'s rule), equal "
                f"to the engine's on the probe")

    def observe(self, size: tuple[int, int], figure: Optional[int], counted: int) -> None:
        """The engine's count for an image serve figured at `figure`: a difference turns
        serve's figures off from now on."""
        if figure is None or figure == counted or self.differed is not None:
            return
        self.differed = (f"the engine counted {counted} positions for a {size[0]}x{size[1]} "
                         f"image where serve's figure ({self.grid.engine if self.grid else '?'}'s "
                         f"rule) was {figure}")
        if self._log is not None:
            self._log(f"images: {self.differed}; image positions are counted on the engine "
                      "from now on")


def grey_png(width: int, height: int) -> bytes:
    """A flat grey PNG, for the probe."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    rows = zlib.compress((b"\0" + b"\x80" * width) * height)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows)
            + chunk(b"IEND", b""))
