#!/usr/bin/env python3
"""Tokens per second of the off-engine tokenizer (serve/tokenizer/) against waste_tokenize.

    .venv/bin/python bench/tokenizer.py [--tokens 60000] [--splits warp,kimi,kimi-python] [CONTAINER ...]

Per container (default: build/demo.waste, and build/smollm2.waste when it is
there): a prompt of about --tokens tokens, three kinds of text (English-like
prose from a fixed word list, mixed scripts with emoji and digits, and source
code with indentation, and gibberish: random words of letters, digits and CJK, where
almost no piece repeats, the worst case for the memo), tokenized by waste_tokenize and by serve's Python
tokenizer, cold (a fresh tokenizer: every piece merged) and warm (the same text
again: pieces from the memo); best of three runs each. The ids are compared.

Then, on a container with a rank file (not a merge list), the same texts through
each of --splits, the pre-tokenizers serve tries on a WARP container: "warp"
(WARP's scanner), "kimi" (the Kimi pattern, through tiktoken when it is
installed) and "kimi-python" (the same pattern in stdlib `re`). The reference
engine splits like none of them, so those rows have no engine column. Last, the
same on the 20,000-token vocabulary of tests/fixtures/warp_tokenizer.json.gz
(WARP's own output on it is what the "warp" rows are tested against), texts
sized by the "warp" tokenizer's count.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from common import DEMO, ROOT, machine
from serve import BpeTokenizer, Engine, EngineConfig, load_library, load_vocabulary as load
from tools.warp_oracle import fixture_tokens, read_fixture, write_vocabulary

WORDS = ("the of and to in is was for that with as on by at from his her it an were are which "
         "this be or have had not but one all their they there been has when who will more no "
         "would can she if out so up said what about into than them only other new some could "
         "time these two may then first any like now my such make over our even most after "
         "model token server prompt engine expert context request stream reply snapshot").split()
SCRIPTS = ("Привет мир", "Γειά σου", "مرحبا بالعالم", "你好世界", "日本語のテキスト", "한국어 문장",
           "नमस्ते दुनिया", "🙂🚀🌍", "1234567", "  \t", "\n\n", "éèêçñüöß", "a\u00a0b \u00a0")
CODE = ("def handler(request):\n    if request.path == '/v1/models':\n        return 200, {}\n",
        "    for i in range(10):\n        total += values[i] * 3.14159\n",
        "class Engine:\n    \"\"\"Docstring.\"\"\"\n    def __init__(self, n: int) -> None:\n")

GIBBERISH = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,é你"


def text_of(kind: str, rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        if kind == "prose":
            piece = " ".join(rng.choice(WORDS) for _ in range(12)) + ". "
        elif kind == "scripts":
            piece = " ".join(rng.choice(SCRIPTS) for _ in range(6)) + " "
        elif kind == "code":
            piece = rng.choice(CODE)
        else:
            piece = "".join(rng.choice(GIBBERISH) for _ in range(rng.randint(1, 12))) + " "
        parts.append(piece)
        size += len(piece)
    return "".join(parts)


def best(run, repeat: int = 3) -> tuple[float, list[int]]:
    times, out = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return min(times), out


def split_tokenizer(vocab, name: str) -> Callable[[], BpeTokenizer]:
    if name == "kimi-python":
        return lambda: BpeTokenizer(vocab, "kimi", use_tiktoken=False)
    return lambda: BpeTokenizer(vocab, name)


def row(container: str, split: str, kind: str, engine_s: Optional[float],
        fresh: Callable[[], BpeTokenizer], text: str, expected: Optional[list[int]]) -> None:
    cold_s, got = best(lambda: fresh().tokenize(text))
    warm = fresh()
    warm.tokenize(text)
    warm_s, _ = best(lambda: warm.tokenize(text))
    n = len(got)
    engine = f"{n / engine_s:,.0f}" if engine_s else "-"
    equal = "-" if expected is None else "yes" if got == expected else "NO"
    print(f"{container:<14} {split:<16} {kind:<9} {n:>7} {engine:>13} {n / cold_s:>12,.0f} "
          f"{n / warm_s:>12,.0f} {cold_s * 1000:>8.0f} {equal:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("containers", nargs="*", type=Path)
    parser.add_argument("--tokens", type=int, default=60000)
    parser.add_argument("--lib", default=str(ROOT / "libwaste.so"))
    parser.add_argument("--splits", default="warp,kimi,kimi-python",
                        help="pre-tokenizers to time as well, on a rank-file container")
    args = parser.parse_args()
    containers = args.containers or [p for p in (DEMO, ROOT / "build" / "smollm2.waste")
                                     if p.exists()]
    lib = load_library(args.lib)
    print(machine())
    print(f"{'container':<14} {'split':<16} {'text':<9} {'tokens':>7} {'engine tok/s':>13} "
          f"{'python cold':>12} {'python warm':>12} {'cold ms':>8} {'equal':>6}")
    for container in containers:
        vocab = load(container)
        splits = [s for s in args.splits.split(",") if s] if vocab.merges is None else []
        with Engine(lib, container, EngineConfig()) as engine:
            for kind in ("prose", "scripts", "code", "gibberish"):
                rng = random.Random(7)
                text = text_of(kind, rng, 1000)
                ratio = len(text) / len(engine.tokenize(text))   # characters per token
                text = text_of(kind, rng, int(args.tokens * ratio))
                engine_s, expected = best(lambda: engine.tokenize(text))
                row(container.name, "container's", kind, engine_s,
                    lambda: BpeTokenizer(vocab), text, expected)
                for split in splits:
                    splits_row(container.name, vocab, split, kind, text)
    with tempfile.TemporaryDirectory() as tmp:
        fixture = read_fixture()
        write_vocabulary(Path(tmp), fixture_tokens(fixture), fixture["specials"])
        Path(tmp, "manifest.json").write_text('{"format_version": 0}')   # WARP's
        vocab = load(tmp)
    for kind in ("prose", "scripts", "code", "gibberish"):
        rng = random.Random(7)
        text = text_of(kind, rng, 1000)
        ratio = len(text) / len(BpeTokenizer(vocab, "warp").tokenize(text))
        text = text_of(kind, rng, int(args.tokens * ratio))
        for split in [s for s in args.splits.split(",") if s]:
            splits_row("fixture vocab", vocab, split, kind, text)


def splits_row(container: str, vocab, split: str, kind: str, text: str) -> None:
    fresh = split_tokenizer(vocab, split)
    label = f"{split} ({fresh().backend})" if split == "kimi" else split
    row(container, label, kind, None, fresh, text, None)


if __name__ == "__main__":
    main()
