"""At start: is the off-engine tokenizer equal to the engine's? It is used only if so.

The probe is text of every kind a prompt holds (scripts, emoji, digits, runs of
white space, code, contractions), tokenized as content and, with every special
token's text between its parts, as markup; every id must be equal, and the
ids must decode to the same bytes. A container with more than one candidate
pre-tokenizer (WARP's: "warp", then "kimi") tries them in order and keeps the
first that is equal; the probe holds every case where they split differently,
so a wrong one cannot pass. If none is, tokenizing goes to the engine, between
its calls, and the banner says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from serve.engine.api import EngineApi
from serve.tokenizer.encoder import BpeTokenizer
from serve.tokenizer.vocabulary import VocabularyError, load

PROBE = (
    "Hello, world! It's 2026: we'll see 1234567 tokens (3.14159), ½ ² Ⅻ ١٢٣ ४२.",
    "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم. नमस्ते दुनिया. สวัสดีชาวโลก.",
    "你好，世界！日本語のテキスト、カタカナとひらがな。한국어 문장입니다. 𠀋𪚲",
    "emoji 🙂🚀🌍 ❤️ 👨‍👩‍👧‍👦 🇫🇷 ✨ and combining: é e\u0301 n\u0303 Å",
    "   leading spaces\t\ttabs\n\n\nnewlines\r\n crlf  \u00a0nbsp\u3000ideographic   \n  ",
    "def f(x):\n    return {'a': [1, 22, 333, 4444]}  # comment\n\n\tif x != 0:\n\t\tpass\n",
    "I'M HERE, YOU'RE THERE, THEY'VE GONE, she'd said; DON'T'S CAN'T 'll 've",
    "x" * 300 + " " + "9" * 40 + " " + "-" * 80 + "\n" * 30,
    # Where WARP's scanner and the Kimi pattern differ (serve/tokenizer/warp_split.py):
    "HelloWorld getHTTPResponse XMLHttpRequest ÉCOLEétudiant ПриветМир ΑλφαΒήτα",
    "١٢٣ ४२ ๑๒ １２３ ²³ ½ Ⅻ x١٢٣ ქართული-Հայերեն, ሰላም! ᏣᎳᎩ ꯃꯤ ᠮᠣᠩᠭᠣᠯ 𝐀𝐁𝐂 ﬁne",
    "a\u00a0word x\u00a0! y  \u00a0z \u00a0\u00a0( \t\u00a0q 5\u00a09 \u00a0\n\u00a0"
    "\u3000全角\u3000 \u2003em\u2002en\u2009thin\u202fnarrow\u00a0",
    "你好，世界！「引用」（括号）。中文,English;混合 漢字ひらがな 〇々〆 ⺀⼀ 𪚲!",
    "it'ſ IT'ſ don'T WE'LL straße'S ÇA'S naïve'd Δ'm ǅ'll",
    "supercalifragilisticexpialidocious" * 40 + " " + "é" * 600 + " " + "你" * 400 + " "
    + "!?" * 600 + " " + "\u00a0" * 700 + "\n",
)


@dataclass(frozen=True)
class Choice:
    tokenizer: Optional[BpeTokenizer]   # None: tokenize on the engine, between its calls
    bos: tuple[int, ...]                # what add_bos puts before a completion's prompt
    note: str                           # the banner's line


def choose(engine: EngineApi, container: str | Path, enabled: bool = True) -> Choice:
    bos = engine_bos(engine)
    if not enabled:
        return Choice(None, bos, "on the engine, between its calls (--engine-tokenizer)")
    try:
        vocab = load(container)
    except (VocabularyError, OSError) as e:
        return Choice(None, bos, f"on the engine, between its calls: serve cannot read it ({e})")
    engine_ids = EngineAnswers(engine)
    differ: list[tuple[str, str]] = []   # (candidate, where it differs)
    for name in vocab.pretokenizers:
        tokenizer = BpeTokenizer(vocab, name)
        where = difference(tokenizer, engine, engine_ids)
        if where is None:
            passed = "".join(f" ({other} differs: {at})" for other, at in differ)
            return Choice(tokenizer, bos, f"serve's own ({name} pre-tokenizer, {tokenizer.backend}), "
                                          f"equal to the engine's on the probe{passed}")
        differ.append((name, where))
    named = [f"{name}: {at}" if len(differ) > 1 else at for name, at in differ]
    return Choice(None, bos, f"on the engine, between its calls: serve's own differs "
                             f"({'; '.join(named)})")


class EngineAnswers:
    """The engine's ids for probe samples, asked once however many candidates are tried."""

    def __init__(self, engine: EngineApi):
        self.engine = engine
        self._ids: dict[tuple[str, bool], list[int]] = {}

    def __call__(self, text: str, markup: bool) -> list[int]:
        key = (text, markup)
        if key not in self._ids:
            self._ids[key] = self.engine.tokenize(text, markup=markup)
        return self._ids[key]


def difference(tokenizer: BpeTokenizer, engine: EngineApi,
               engine_ids: Optional[EngineAnswers] = None) -> Optional[str]:
    """Where the two tokenizers first differ on the probe, or None."""
    asked = engine_ids or EngineAnswers(engine)
    specials = sorted(engine.specials)
    for i, text in enumerate(PROBE):
        marked = text + "".join(f"{special} {text[:7]}" for special in specials)
        for markup, sample in ((False, text), (False, marked), (True, marked)):
            want = asked(sample, markup)
            got = tokenizer.tokenize_markup(sample) if markup else tokenizer.tokenize(sample)
            if got != want:
                return f"probe {i + 1}{' as markup' if markup else ''}"
            if tokenizer.detokenize(want) != engine.detokenize(want):
                return f"probe {i + 1}, decoded"
    return None


def engine_bos(engine: EngineApi) -> tuple[int, ...]:
    """The ids waste_tokenize's add_bos puts in front (none when the container has no BOS)."""
    plain = engine.tokenize(PROBE[0])
    with_bos = engine.tokenize(PROBE[0], add_bos=True)
    return tuple(with_bos[:len(with_bos) - len(plain)])
