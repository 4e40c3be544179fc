"""The tokenizer the engine's smollm tokenization is compared against:
Hugging Face's `tokenizers` built from a vocabulary and merge list
(Digits individual + ByteLevel), and the random strings to compare on."""
from __future__ import annotations

import random
import unicodedata

import pytest


def hf_tokenizer(tokens: list[str], merges: list[str]):
    tk = pytest.importorskip("tokenizers")
    model = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                          merges=[tuple(m.split(" ")) for m in merges], unk_token="<|endoftext|>")
    tokenizer = tk.Tokenizer(model)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tokenizer


def any_character(rng: random.Random) -> str:
    """A random assigned code point but NUL (this Python's Unicode), from any plane in use."""
    while True:
        c = chr(rng.choice((rng.randrange(0x30000), rng.randrange(0x10000))))
        if c != "\0" and unicodedata.category(c) not in ("Cn", "Cs"):  # C strings end at NUL
            return c


def random_texts(rng: random.Random, n: int) -> list[str]:
    """Strings from a mix of scripts, digits, punctuation, emoji and whitespace runs."""
    alphabet = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                " \t\n\r  \u00a0\u3000'\".,;:!?-_()[]{}<>/@#$%^&*+=~`|\\"
                "éèêçñüößÆØÅ" "Привет" "Γειά" "مرحبا" "你好世界" "日本語カタカナ" "한국어" "नमस्ते"
                "١٢٣" "½²Ⅻ" "🙂🚀🌍❤️✨" "\x04\U00040000")
    out = []
    for _ in range(n):
        k = rng.randint(0, 40)
        text = "".join(rng.choice(alphabet) for _ in range(k))
        for word in ("'s", "'ll", " the", "don't", "  x", "\n\n", "12345"):
            if rng.random() < 0.1:
                text += word
        while rng.random() < 0.3:
            text += any_character(rng)
        out.append(text)
    return out
