"""WARP's pre-tokenizer (next_piece in WARP's src/tokenizer.c), as a compiled `re` pattern.

WARP does not run the Kimi family's tiktoken pattern: it scans bytes with
classes of its own, and its pieces differ from tiktoken's on ordinary text.
- Han: U+4E00-9FFF, 3400-4DBF, F900-FAFF, 20000-2FA1F only.
- Letters: ASCII letters and a few fixed blocks (U+00C0-024F, so with the
  multiplication and division signs; combining marks; Greek; Cyrillic; Hebrew
  and Arabic, so Arabic-Indic digits are letters; kana; Hangul syllables; Latin
  Extended Additional); no case, so "HelloWorld" is one piece. Everything else
  (Devanagari, Thai, emoji, U+3000, other digits) is punctuation, and a run of
  punctuation takes Han with it.
- Digits: ASCII only, at most three to a piece.
- White space: space, \\t \\n \\v \\f \\r and U+00A0 only.
- The rule "a white-space run followed by more text gives back its last char"
  counts bytes: a run ending in U+00A0 gives back only that character's second
  byte (0xA0), which WARP then reads as a white-space character of its own, and
  a lone U+00A0 before anything but a letter is two pieces, b"\\xc2" b"\\xa0".
  To split those bytes with a `str` pattern, each U+00A0 is written as two
  code units, NUL then U+00A0 (text never holds a NUL: the engine's C
  strings end there), so that one unit is one byte wherever white space is
  counted; `piece_bytes` turns the units back into WARP's bytes.
- Contractions ('s 't 're 've 'm 'll 'd) after a letter run: ASCII case only.
"""
from __future__ import annotations

import re

HAN = "\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\U00020000-\U0002fa1f"
LETTERS = ("A-Za-z\u00c0-\u024f\u0300-\u036f\u0370-\u03ff\u0400-\u052f\u0590-\u06ff"
           "\u3040-\u30ff\uac00-\ud7af\u1e00-\u1eff")
NBSP = "\u00a0"
HALF = "\x00"                     # the first byte of a U+00A0, as a code unit of its own
SPACE = f" \\t\\n\\v\\f\\r{HALF}{NBSP}"
SUFFIX = "(?:'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))?"

# The alternatives in WARP's order; together they match every code unit.
PATTERN = re.compile("|".join([
    f"[{HAN}]+",
    f"(?:{HALF}{NBSP}|[^\\r\\n{HALF}{LETTERS}0-9])?[{LETTERS}]+{SUFFIX}",
    "[0-9]{1,3}",
    f" ?[^{SPACE}{LETTERS}0-9]+[\\r\\n]*",
    f"[{SPACE}]*[\\r\\n]",                 # white space up to its last line break
    f"[{SPACE}]+(?=[{SPACE}][^{SPACE}])",  # a run before text: all but its last byte
    f"[{SPACE}]+",
]))


def units(text: str) -> str:
    """The text as the pattern reads it: each U+00A0 as its two bytes' units."""
    return text.replace(NBSP, HALF + NBSP) if NBSP in text else text


def piece_bytes(piece: str) -> bytes:
    """A piece of `units(text)` as the bytes WARP merges."""
    if HALF not in piece and not piece.startswith(NBSP):
        return piece.encode("utf-8")
    head = b""
    if piece.startswith(NBSP):   # 0xA0 alone: the run before it kept the 0xC2
        head, piece = b"\xa0", piece[1:]
    whole = piece.encode("utf-8").replace(b"\x00\xc2\xa0", b"\xc2\xa0")
    return head + whole.replace(b"\x00", b"\xc2")   # a run's last unit, given back
