"""serve's "warp" pre-tokenizer and ids against WARP's own tokenizer, recorded.

tests/fixtures/warp_tokenizer.json.gz is WARP's src/tokenizer.c, compiled unchanged,
run on ~2,800 texts (tools/warp_oracle.py, tools/warp_corpus.py; docs/tokenizer.md):
its pieces (next_piece) and ids (waste_tok_encode, as content and as markup) over a
20,000-token vocabulary of its own. Every piece and every id must be equal.
"""
from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import given, settings, strategies as st

from serve.tokenizer.bpe import Merger
from serve.tokenizer.encoder import BpeTokenizer
from serve.tokenizer.split import splitter
from serve.tokenizer.vocabulary import Vocabulary
from tools.warp_oracle import fixture_ranks, read_fixture


@lru_cache(maxsize=1)
def fixture() -> dict:
    return read_fixture()


def fixture_vocabulary() -> Vocabulary:
    ranks = fixture_ranks(fixture())
    specials = {s["text"]: s["id"] for s in fixture()["specials"]}
    return Vocabulary(ranks, specials, ("warp",), None, tuple(ranks[bytes([b])] for b in range(256)))


def warp_pieces(text: str) -> list[bytes]:
    split = splitter("warp")
    return [split.piece_bytes(p) for p in split.pattern.findall(split.units(text))]


def test_the_fixture_covers_what_warp_does_differently():
    """The corpus reaches the byte-level U+00A0 split, pieces past the merge window, and
    markup; a fixture that lost them would test nothing of it."""
    cases = fixture()["cases"]
    assert len(cases) > 2500
    pieces = [(c["text"].encode("utf-8"), c["pieces"]) for c in cases]
    starts = [data[sum(lens[:i]):][:1] for data, lens in pieces for i in range(len(lens))]
    assert starts.count(b"\xa0") > 20
    assert sum(1 for _, lens in pieces if max(lens, default=0) > 1024) > 20
    assert sum(1 for c in cases if "markup_ids" in c) > 400


def test_pieces_are_warps_byte_for_byte():
    wrong = []
    for case in fixture()["cases"]:
        data, at, want = case["text"].encode("utf-8"), 0, []
        for size in case["pieces"]:
            want.append(data[at:at + size])
            at += size
        if warp_pieces(case["text"]) != want:
            wrong.append(case["text"])
    assert not wrong, f"{len(wrong)} texts split unlike WARP, e.g. {wrong[:3]}"


def test_ids_are_warps_as_content_and_as_markup():
    tokenizer = BpeTokenizer(fixture_vocabulary())
    assert tokenizer.pretokenizer == "warp" and tokenizer.backend == "python"
    wrong = []
    for case in fixture()["cases"]:
        if tokenizer.tokenize(case["text"]) != case["ids"]:
            wrong.append(("content", case["text"]))
        if "markup_ids" in case and tokenizer.tokenize_markup(case["text"]) != case["markup_ids"]:
            wrong.append(("markup", case["text"]))
    assert not wrong, f"{len(wrong)} ids unlike WARP's, e.g. {wrong[:3]}"


def test_the_merge_window_changes_ids_the_fixture_holds():
    """Merged whole, some long pieces' ids differ from WARP's: the fixture's ids test the
    1024-byte windows, not only the split."""
    merger = Merger(fixture_vocabulary())
    long_texts = [c for c in fixture()["cases"] if max(c["pieces"], default=0) > 1024]
    whole = [c for c in long_texts
             if [i for piece in warp_pieces(c["text"]) for i in merger.encode(piece)] != c["ids"]]
    assert len(whole) > 5


@pytest.mark.parametrize("text, pieces", [
    ("HelloWorld it's", [b"HelloWorld", b" it's"]),              # no case split
    ("a \u00a0b", [b"a", b" \xc2", b"\xa0b"]),                   # the run gives back one byte
    ("x\u00a0!", [b"x", b"\xc2", b"\xa0", b"!"]),                # a lone U+00A0, halved
    ("\u00a0word", [b"\xc2\xa0word"]),
    ("\u00a0\u00a0", [b"\xc2\xa0\xc2\xa0"]),                      # at the end: whole
    ("你好，世界！", ["你好".encode(), "，世界！".encode()]),      # punctuation takes Han
    ("\u3000x", ["\u3000x".encode()]),                           # U+3000 is not white space
    ("١٢٣ ४२", ["١٢٣".encode(), " ४२".encode()]),                # Arabic digits are letters
    ("it'ſ IT'S", [b"it", "'ſ".encode(), b" IT'S"]),             # contractions: ASCII case
    ("1234", [b"123", b"4"]),
])
def test_warps_rules(text, pieces):
    assert warp_pieces(text) == pieces


@settings(max_examples=300)
@given(text=st.text(st.one_of(st.sampled_from(" \t\n\r\u00a0\u3000'sS"),
                              st.characters(exclude_categories=("Cs",), exclude_characters="\0")),
                    max_size=60))
def test_pieces_cover_the_text_byte_for_byte(text):
    """Whatever the text, the pieces are its UTF-8 bytes cut, none empty (the halves of a
    U+00A0 included): nothing is lost or doubled between the units and the bytes."""
    pieces = warp_pieces(text)
    assert b"".join(pieces) == text.encode("utf-8") and all(pieces)
