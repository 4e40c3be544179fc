"""serve's own tokenizer (serve/tokenizer/) against the engine's waste_tokenize and
waste_tokenize_markup, id for id, on every test container and a large corpus.

The corpus: random strings from many scripts, emoji, digits, punctuation and
white-space runs (tests/tokenizer_reference.py), the start-up probe, long
runs, source code, and hypothesis' own text. Markup text carries every special
token's text between its parts. The Kimi family's pattern, which no reference
container uses, is compared with tiktoken's (the library Kimi tokenizes with).
"""
from __future__ import annotations

import base64
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from serve.engine.binding import Engine
from serve.engine.types import EngineConfig, UnencodableText
from serve.tokenizer.tokenizer_choice import PROBE, choose, difference
from serve.tokenizer.encoder import BpeTokenizer
from serve.tokenizer.split import KIMI_TIKTOKEN, pattern
from serve.tokenizer.vocabulary import VocabularyError, load
from tokenizer_reference import any_character, random_texts

CONTAINERS = ["k3_container", "kimi_linear_container", "plain_container", "smollm2"]
HARD = [
    "", " ", "  ", "\n", " \n ", "a" * 5000, " " * 700 + "x", "\t \t  \n\n  y", "9" * 100,
    "x" * 2000 + "é" * 800 + "你" * 500, "🙂" * 300, "'s 'S 'T 'll 'LL 'Ve", " 1 22 333 4444 55555",
    "def f():\n\treturn [1, 2]\n\n\n    # done\n", "\u00a0\u2003\u3000\u2028 \u0085x", "١٢٣٤ ½Ⅻ ²",
    "e\u0301\u0302 a\u0308 \u200d\u200c", "\U00040000 \U0010fffd \x04 \x7f \xf1",
]


@pytest.fixture(scope="module", params=CONTAINERS)
def pair(request, lib):
    """(the container's engine, serve's tokenizer for it)."""
    container = request.getfixturevalue(request.param)
    with Engine(lib, container, EngineConfig()) as engine:
        yield engine, BpeTokenizer(load(container), use_tiktoken=False)


def corpus(n: int) -> list[str]:
    rng = random.Random(29)
    texts = random_texts(rng, n) + list(PROBE) + HARD
    texts += ["".join(any_character(rng) for _ in range(rng.randint(1, 60))) for _ in range(n // 4)]
    return [t for t in texts if "\0" not in t]


def marked(text: str, specials: list[str], rng: random.Random) -> str:
    """`text` cut in places, a special token's text (or part of one) in each cut."""
    out = []
    for part in (text[i:i + 9] for i in range(0, len(text), 9)):
        out.append(part)
        special = rng.choice(specials)
        out.append(special if rng.random() < 0.8 else special[:len(special) // 2])
    return "".join(out)


def test_every_id_is_the_engines_on_the_corpus(pair):
    engine, tokenizer = pair
    rng = random.Random(3)
    specials = sorted(engine.specials)
    for text in corpus(2000):
        assert tokenizer.tokenize(text) == engine.tokenize(text), text
        markup = marked(text, specials, rng)
        assert tokenizer.tokenize(markup) == engine.tokenize(markup), markup
        assert tokenizer.tokenize_markup(markup) == engine.tokenize(markup, markup=True), markup


@settings(max_examples=300)
@given(text=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0"), max_size=80))
def test_every_id_is_the_engines_on_hypothesis_text(pair, text):
    engine, tokenizer = pair
    assert tokenizer.tokenize(text) == engine.tokenize(text)
    markup = text + "".join(sorted(engine.specials)[:3]) + text
    assert tokenizer.tokenize_markup(markup) == engine.tokenize(markup, markup=True)


def test_ids_decode_to_the_engines_bytes(pair):
    engine, tokenizer = pair
    every = list(range(len(tokenizer.vocab.ranks) + len(tokenizer.vocab.specials)))
    assert tokenizer.detokenize(every) == engine.detokenize(every)
    with pytest.raises(ValueError, match="no token has the id"):
        tokenizer.detokenize([len(every) + 5])


def test_text_the_engine_cannot_take_is_refused_alike(pair):
    engine, tokenizer = pair
    for text in ("a\0b", "\ud800"):
        with pytest.raises(UnencodableText):
            engine.tokenize(text)
        with pytest.raises(UnencodableText):
            tokenizer.tokenize(text)
        with pytest.raises(UnencodableText):
            tokenizer.tokenize_markup(text)


def test_the_start_up_check_chooses_serves_own_where_it_is_equal(pair, request):
    engine, _ = pair
    chosen = choose(engine, engine.model_path)
    assert chosen.tokenizer is not None and "equal to the engine's" in chosen.note
    assert list(chosen.bos) + engine.tokenize("hi") == engine.tokenize("hi", add_bos=True)
    off = choose(engine, engine.model_path, enabled=False)
    assert off.tokenizer is None and "--engine-tokenizer" in off.note


def test_a_tokenizer_that_differs_is_not_used(k3_container, lib):
    with Engine(lib, k3_container, EngineConfig()) as engine:
        vocab = load(k3_container)
        wrong = BpeTokenizer(vocab, "smollm")
        assert difference(wrong, engine) is not None
        shuffled = dict(zip(vocab.ranks, reversed(list(vocab.ranks.values()))))
        assert difference(BpeTokenizer(replace(vocab, ranks=shuffled)), engine) is not None


def test_files_serve_cannot_read_leave_tokenizing_to_the_engine(k3_container, lib, tmp_path):
    copy = tmp_path / "c.waste"
    copy.mkdir()
    for path in k3_container.iterdir():
        (copy / path.name).symlink_to(path)
    with Engine(lib, copy, EngineConfig()) as engine:
        (copy / "specials.json").unlink()
        (copy / "specials.json").write_text("{}")
        chosen = choose(engine, copy)
    assert chosen.tokenizer is None and "cannot read it" in chosen.note


ALL_BYTES = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]


@pytest.mark.parametrize("files, problem", [
    ({"tokenizer.model": "!!!! 0"}, "expected"),
    ({"tokenizer.model": "YQ== 0\nYQ== 1"}, "two ranks"),
    ({"tokenizer.model": "YQ=="}, "expected"),
    ({"tokenizer.model": None}, "no tokenizer.model"),
    ({"tokenizer.model": "YQ== 97"}, "no token for the byte 0x00"),
    ({"tokenizer.merges": "97 x"}, "tokenizer.merges line 1"),
    ({"specials.json": '{"a": 1}'}, "specials.json is not a list"),
    ({"specials.json": "[{"}, "specials.json"),
    ({"manifest.json": "[]"}, "not a JSON object"),
    ({"manifest.json": '{"pretokenizer": "llama3"}'}, "'llama3' is not one serve knows"),
])
def test_files_serve_cannot_read_are_named(tmp_path, files, problem):
    written = {"manifest.json": '{"format": "waste-ref"}', "specials.json": "[]",
               "tokenizer.model": "\n".join(ALL_BYTES), **files}
    for name, text in written.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    with pytest.raises(VocabularyError, match=problem):
        load(tmp_path)


def test_a_byte_without_a_token_is_the_unk_token(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "waste-ref", "unk_token": "<unk>"}')
    (tmp_path / "specials.json").write_text('[{"id": 256, "text": "<unk>"}]')
    (tmp_path / "tokenizer.model").write_text("\n".join(ALL_BYTES[1:]))
    assert load(tmp_path).byte_ids[0] == 256


def test_the_kimi_pattern_splits_as_tiktoken_does(k3_container):
    """The stdlib `re` form of the Kimi pattern against tiktoken's Rust regex, through the
    same ranks: any difference is the split's."""
    tiktoken = pytest.importorskip("tiktoken")
    vocab = load(k3_container)
    ours = BpeTokenizer(vocab, "kimi", use_tiktoken=False)
    theirs = tiktoken.Encoding("kimi", pat_str=KIMI_TIKTOKEN, mergeable_ranks=vocab.ranks,
                               special_tokens={})
    assert BpeTokenizer(vocab, "kimi").backend == "tiktoken"
    for text in corpus(2000):
        assert ours.tokenize(text) == theirs.encode_ordinary(text), (text, pattern("kimi").findall(text))
