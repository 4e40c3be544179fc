"""Unicode classes as `re` character-class bodies: what \\p{L}, \\p{N}, \\p{Han} and \\s
would match, for the split patterns (Python's `re` has no \\p{..}).

Letters and numbers are general categories L* and N* from this Python's
unicodedata, as the reference engine's tables are (tools/gen_unicode.py, which
names the Unicode version it read); White_Space is the Unicode property (not
str.isspace, which also takes U+001C..U+001F), and Han is the script, whose
ranges unicodedata does not give. Built once, on first use (about half a second).
"""
from __future__ import annotations

import functools
import unicodedata

Ranges = tuple[tuple[int, int], ...]

WHITE_SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                       (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                       (0x3000, 0x3000))

# Script=Han (Unicode's Scripts.txt).
HAN: Ranges = ((0x2E80, 0x2E99), (0x2E9B, 0x2EF3), (0x2F00, 0x2FD5), (0x3005, 0x3005),
               (0x3007, 0x3007), (0x3021, 0x3029), (0x3038, 0x303B), (0x3400, 0x4DBF),
               (0x4E00, 0x9FFF), (0xF900, 0xFA6D), (0xFA70, 0xFAD9), (0x16FE2, 0x16FE3),
               (0x16FF0, 0x16FF1), (0x20000, 0x2A6DF), (0x2A700, 0x2B739), (0x2B740, 0x2B81D),
               (0x2B820, 0x2CEA1), (0x2CEB0, 0x2EBE0), (0x2F800, 0x2FA1D), (0x30000, 0x3134A),
               (0x31350, 0x323AF))


@functools.lru_cache(maxsize=1)
def _categories() -> dict[str, Ranges]:
    """Every general category's code point ranges, from one pass over Unicode."""
    found: dict[str, list[list[int]]] = {}
    for cp in range(0x110000):
        runs = found.setdefault(unicodedata.category(chr(cp)), [])
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    return {name: tuple((a, b) for a, b in runs) for name, runs in found.items()}


def category(*names: str) -> Ranges:
    """The ranges of the general categories whose names start with any of `names`."""
    cats = _categories()
    return tuple(sorted(r for cat, runs in cats.items() if cat.startswith(names) for r in runs))


def minus(ranges: Ranges, taken: Ranges) -> Ranges:
    """`ranges` without the code points in `taken`."""
    out = []
    for lo, hi in ranges:
        for tlo, thi in taken:
            if thi < lo or tlo > hi:
                continue
            if tlo > lo:
                out.append((lo, tlo - 1))
            lo = thi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def body(ranges: Ranges) -> str:
    """The inside of a `re` character class matching `ranges`."""
    return "".join(_escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}" for lo, hi in ranges)


def _escape(cp: int) -> str:
    return f"\\U{cp:08x}"
