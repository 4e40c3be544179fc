"""The texts tools/warp_oracle.py has WARP's tokenizer split and encode: every character
class WARP's scanner tells apart, the borders of its ranges, mixed scripts, emoji,
white-space runs (U+00A0 before words, punctuation, digits and the end), code,
contractions, random Unicode, pieces past WARP's 1024-byte merge window, and markup
with special tokens' texts (whole, cut short, overlapping). Deterministic for a seed.
"""
from __future__ import annotations

import random
import unicodedata

SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
            "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
            "<|kimi_image_placeholder|>", "<|im_end|>", "<|im_user|>",
            "<|media_pad|>x",            # a special that another one starts
            "<｜begin▁of▁sentence｜>"]   # non-ASCII text

# Each class WARP's scanner knows, and what lies just outside its ranges.
ASCII_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPACES = " \t\n\r\f\v\u00a0"
NOT_WARP_SPACES = "\u3000\u2003\u2002\u2009\u202f\u0085\u1680\u2028\u205f\x1c\x1f"
PUNCT = "'\".,;:!?-_()[]{}<>/@#$%^&*+=~`|\\\x01\x7f"
LETTERS = ("éèêçñüößÆØÅ×÷\u00c0\u024f\u0300\u0301\u036fΑλφαΓειάПриветмирЁ\u052f"
           "שלוםمرحبا\u06ff١٢٣ひらがなカタカナ\u3040\u30ff한국어\uac00\ud7afẞỹ\u1e00\u1eff")
HAN = "你好世界中文漢字\u4e00\u9fff\u3400\u4dbf\uf900\ufaff\U00020000\U0002fa1f𪚲"
NEAR_RANGES = ("\u00bf\u0250\u02ff\u0370\u0530\u058f\u0700\u303f\u3100\uabff\ud7b0\u1dff"
               "\u1f00\u4dc0\u3300\ufb00\U0001ffff\U0002fa20\U00030000")
OTHER = ("नमस्तेสวัสดีქართულიՀայերենሰላም४२๑１２３²³½Ⅻ𝐀𝐁ﬁ〇々〆、。「」（），！"
         "🙂🚀🌍❤️✨👨‍👩‍👧🇫🇷\u200d\u200c\ufe0f")
DIGITS = "0123456789"
WORDS = ["HelloWorld", "getHTTPResponse", "don't", "IT'S", "we'll", "they'VE", "I'm", "she'D",
         "it'ſ", "straße'S", "ΔΣ'm", "'s", "'ll", "'", "''", "naïve", "12345", "3.14159",
         "x", "the", "你好", "，", "!", "def", "f(x):", "return", "{'a': [1, 22]}", "#",
         "\u00a0", "\u00a0\u00a0", "  ", "\n", "\r\n", "\t", "\u3000", "١٢٣٤", "४२", "🙂"]
CODE = ["def f(x):\n    return {'a': [1, 22, 333, 4444]}  # comment\n\n\tif x != 0:\n\t\tpass\n",
        "for (int i = 0; i < n; i++) {\n\tsum += a[i] * 3.14f;\n}\n",
        "SELECT name, COUNT(*) FROM users WHERE id > 100 GROUP BY name;\r\n",
        "<div class=\"x\">Hello&nbsp;world</div>\n  <!-- c -->\n",
        "    \n    \n\n  x = y  \n"]
ALPHABET = ASCII_LETTERS + SPACES + NOT_WARP_SPACES + PUNCT + LETTERS + HAN + NEAR_RANGES \
    + OTHER + DIGITS * 2


def any_character(rng: random.Random) -> str:
    """An assigned code point but NUL, from any plane in use."""
    while True:
        c = chr(rng.choice((rng.randrange(0x30000), rng.randrange(0x10000), rng.randrange(0x800))))
        if c != "\0" and unicodedata.category(c) not in ("Cn", "Cs"):
            return c


def mixed(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))


def worded(rng: random.Random) -> str:
    gaps = [" ", " ", " ", "", "  ", "\u00a0", " \u00a0", "\u00a0 ", "\t", "\n", "\u3000", "\n\u00a0"]
    out = []
    for _ in range(rng.randint(1, 14)):
        out.append(rng.choice(WORDS) if rng.random() < 0.8 else rng.choice(CODE))
        out.append(rng.choice(gaps))
    return "".join(out)


def spaced(rng: random.Random) -> str:
    """Single characters of every class between runs of white space."""
    singles = ASCII_LETTERS[:6] + LETTERS[:12] + HAN[:4] + PUNCT[:6] + DIGITS[:3] + OTHER[:6]
    out = []
    for _ in range(rng.randint(1, 10)):
        out.append("".join(rng.choice(SPACES + "\u00a0\u00a0  " + NOT_WARP_SPACES[:3])
                           for _ in range(rng.randint(0, 5))))
        out.append(rng.choice(singles))
    if rng.random() < 0.5:
        out.append(rng.choice(SPACES + "\u00a0"))
    return "".join(out)


def unicode_soup(rng: random.Random) -> str:
    return "".join(any_character(rng) for _ in range(rng.randint(1, 40)))


def long_pieces() -> list[str]:
    """Pieces past 1024 bytes, whose seams fall between and inside characters."""
    out = []
    for n in (1023, 1024, 1025, 2049, 3100):
        out.append("abc" * (n // 3) + "abc"[:n % 3])       # period 3: tokens span the seam
        out.append("a" * (n - 1) + "é" + "abc" * 20)        # a 2-byte letter across byte 1024
    out += ["é" * 513, "é" * 600 + "x" * 7, "한" * 342, "한" * 700, "你" * 342, "你" * 500 + "!",
            "Приветмир" * 70, "supercalifragilisticexpialidocious" * 40,
            "🙂" * 300, "!?" * 700, "，世界" * 200, "-" * 1500 + "\n\n",
            " " * 1500 + "x", "\u00a0" * 700 + "x", " \u00a0" * 400 + "!", "\n" * 1100 + "y",
            "\t" * 1030, "x\u00a0" * 600, "1" * 2000, ("ab" * 600 + " ") * 3,
            "a" * 1023 + "你好" + "b" * 300, "'" + "s" * 1100 + "'ll"]
    return out


def plain_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    makers = [mixed] * 4 + [worded] * 3 + [spaced] * 2 + [unicode_soup] * 2
    texts = [rng.choice(makers)(rng) for _ in range(n)]
    return texts + long_pieces() + CODE + WORDS + ["", " ", "\u00a0", "\u00a0!", "a\u00a0", "\r\n"]


def markup_texts(seed: int, texts: list[str], n: int) -> list[str]:
    """Texts with special tokens' texts (or the start of one) in random places."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = rng.choice(texts)[:200]
        parts = []
        for _ in range(rng.randint(1, 5)):
            cut = rng.randint(0, len(text))
            parts.append(text[:cut])
            special = rng.choice(SPECIALS)
            parts.append(special if rng.random() < 0.8 else special[:rng.randint(1, len(special))])
            text = text[cut:]
        out.append("".join(parts) + text)
    out += ["".join(SPECIALS), "<|media_pad|>x<|media_pad|>", "<<|open|>|>", "[[BOS]EOS]",
            " \u00a0<|sep|>\u00a0x", "你好<|sep|>，世界"]
    return out
