"""The pre-tokenizers: text -> the pieces BPE merges within, as compiled `re` patterns.

Each pattern's alternatives are tried in order at each position, as the
engines' hand-written matchers do (engine/tokenizer.c; WARP's src/tokenizer.c),
and together they match every character, so `finditer` covers the text.
- default: the reference engine's (FORMAT.md): an optional ' ' then letters
  (ASCII, or any character past U+007F: its UTF-8 bytes are all >= 0x80), then 1-3
  ASCII digits, then other bytes; a run of spaces gives its last ' ' to the word after.
- smollm: every number character alone; GPT-2's pattern between them (a white-space
  run ending at a number is kept whole: the engine's piece ends there).
- kimi: the Kimi family's tiktoken pattern (Kimi K2's tokenization_kimi.py).
- warp: WARP's hand-written scanner (serve/tokenizer/warp_split.py), which is not
  that pattern; its engine also merges a piece over 1024 bytes in windows.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Optional

from serve.tokenizer import warp_split
from serve.tokenizer.unicode_classes import HAN, WHITE_SPACE, body, category, minus

NAMES = ("default", "smollm", "kimi", "warp")

ASCII_SPACE = r" \t\n\r\v\f"
DEFAULT = re.compile(
    rf" ?[A-Za-z\u0080-\U0010ffff]+| ?[0-9]{{1,3}}"
    rf"| ?[^{ASCII_SPACE}A-Za-z0-9\u0080-\U0010ffff]+"
    rf"|[{ASCII_SPACE}]+?(?= [^{ASCII_SPACE}])|[{ASCII_SPACE}]+")

CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"

# The Kimi pattern as tiktoken (Rust's fancy-regex) takes it.
KIMI_TIKTOKEN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


@dataclass(frozen=True)
class Splitter:
    """A pre-tokenizer: `pattern.findall(units(text))` are the pieces, `piece_bytes` what
    each one merges as, in windows of at most `window` bytes (None: whole)."""
    pattern: re.Pattern[str]
    units: Callable[[str], str] = str
    piece_bytes: Callable[[str], bytes] = str.encode
    window: Optional[int] = None


WARP_WINDOW = 1024   # WARP's encode_piece: its merge loop is quadratic in a window


def splitter(name: str) -> Splitter:
    if name == "warp":
        return Splitter(warp_split.PATTERN, warp_split.units, warp_split.piece_bytes, WARP_WINDOW)
    return Splitter(pattern(name))


@functools.lru_cache(maxsize=None)
def pattern(name: str) -> re.Pattern[str]:
    if name == "default":
        return DEFAULT
    if name == "smollm":
        return _smollm()
    if name == "kimi":
        return _kimi()
    raise ValueError(f"no pre-tokenizer {name!r}")


def _smollm() -> re.Pattern[str]:
    letters, numbers, space = body(category("L")), body(category("N")), body(WHITE_SPACE)
    return re.compile(
        f"[{numbers}]|{CONTRACTIONS}| ?[{letters}]+| ?[^{space}{letters}{numbers}]+"
        f"|[{space}]+(?![^{space}{numbers}])|[{space}]+")


def _kimi() -> re.Pattern[str]:
    letters, numbers, space = body(category("L")), body(category("N")), body(WHITE_SPACE)
    han = body(HAN)
    upper = body(minus(category("Lu", "Lt", "Lm", "Lo", "M"), HAN))
    lower = body(minus(category("Ll", "Lm", "Lo", "M"), HAN))
    suffix = f"(?i:{CONTRACTIONS})?"
    return re.compile("|".join([
        f"[{han}]+",
        f"[^\\r\\n{letters}{numbers}]?[{upper}]*[{lower}]+{suffix}",
        f"[^\\r\\n{letters}{numbers}]?[{upper}]+[{lower}]*{suffix}",
        f"[{numbers}]{{1,3}}",
        f" ?[^{space}{letters}{numbers}]+[\\r\\n]*",
        f"[{space}]*[\\r\\n]+",
        f"[{space}]+(?![^{space}])",
        f"[{space}]+",
    ]))
