"""A WARP container's pre-tokenizer candidates ("warp", then "kimi"): the start-up probe
keeps the first equal to the engine's, says which, and falls back to the engine when none is.

The engines here are tokenizers standing in for WARP's waste_tokenize: serve's "warp"
one (equal to WARP's own on the recorded fixture, tests/tokenizer/test_warp_fixture.py)
and the Kimi pattern (tiktoken, or its stdlib form), over the fixture's 20,000-token
vocabulary written as a WARP container.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest

from serve.tokenizer.tokenizer_choice import PROBE, choose, difference
from serve.tokenizer.encoder import BpeTokenizer
from serve.tokenizer.split import pattern
from serve.tokenizer.vocabulary import load
from test_warp_fixture import fixture, warp_pieces
from tools.warp_oracle import fixture_tokens, write_vocabulary


class TokenizerEngine:
    """The tokenizing face of an engine (what choose() asks of it), given by a tokenizer."""

    def __init__(self, tokenizer: BpeTokenizer, bos: int):
        self.tokenizer = tokenizer
        self.specials = tokenizer.specials
        self.bos = bos

    def tokenize(self, text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]:
        ids = self.tokenizer.tokenize_markup(text) if markup else self.tokenizer.tokenize(text)
        return [self.bos] + ids if add_bos else ids

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self.tokenizer.detokenize(ids)


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    """The fixture's vocabulary as a WARP container's tokenizer files (a WARP manifest
    names its format_version, not "format": "waste-ref")."""
    root = tmp_path_factory.mktemp("warp") / "k3.waste"
    root.mkdir()
    write_vocabulary(root, fixture_tokens(fixture()), fixture()["specials"])
    (root / "manifest.json").write_text('{"format_version": 0, "arch": "kimi_k3"}')
    return root


def engine_splitting_with(container: Path, pretokenizer: str) -> TokenizerEngine:
    vocab = load(container)
    return TokenizerEngine(BpeTokenizer(vocab, pretokenizer), bos=min(vocab.specials.values()))


def test_a_warp_container_has_both_candidates_warps_first(container):
    assert load(container).pretokenizers == ("warp", "kimi")


@pytest.mark.parametrize("named", ["warp", "kimi"])
def test_a_manifest_naming_a_pre_tokenizer_has_that_one_alone(container, tmp_path, named):
    for path in container.iterdir():
        (tmp_path / path.name).symlink_to(path)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 0, "pretokenizer": named}))
    assert load(tmp_path).pretokenizers == (named,)
    engine = engine_splitting_with(container, "smollm")
    assert choose(engine, tmp_path).note == ("on the engine, between its calls: serve's own "
                                            "differs (probe 1)")


def test_warps_engine_gets_the_warp_splitter(container):
    chosen = choose(engine_splitting_with(container, "warp"), container)
    assert chosen.tokenizer is not None and chosen.tokenizer.pretokenizer == "warp"
    assert chosen.note == "serve's own (warp pre-tokenizer, python), equal to the engine's on the probe"
    assert chosen.bos == (min(load(container).specials.values()),)


def test_a_tiktoken_like_engine_gets_the_kimi_pattern_after_warps_differs(container):
    chosen = choose(engine_splitting_with(container, "kimi"), container)
    assert chosen.tokenizer is not None and chosen.tokenizer.pretokenizer == "kimi"
    assert chosen.note.startswith("serve's own (kimi pre-tokenizer, ")
    assert chosen.note.endswith("equal to the engine's on the probe (warp differs: probe 1)")


def test_an_engine_like_neither_leaves_tokenizing_to_it(container):
    chosen = choose(engine_splitting_with(container, "smollm"), container)
    assert chosen.tokenizer is None
    assert chosen.note == ("on the engine, between its calls: serve's own differs "
                           "(warp: probe 1; kimi: probe 1)")


def test_the_engine_is_asked_each_probe_once_whatever_the_candidates(container):
    engine = engine_splitting_with(container, "kimi")
    asked: list[tuple[str, bool, bool]] = []
    tokenize = engine.tokenize

    def counting(text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]:
        asked.append((text, markup, add_bos))
        return tokenize(text, markup=markup, add_bos=add_bos)
    engine.tokenize = counting   # type: ignore[method-assign]
    assert choose(engine, container).tokenizer.pretokenizer == "kimi"   # after warp's probe 1
    assert len(asked) == 2 + 3 * len(PROBE)   # engine_bos's two, then each sample once
    assert len(set(asked)) == len(asked) - 1  # (engine_bos's PROBE[0] is the probe's first)


@pytest.mark.parametrize("right, wrong", [("warp", "kimi"), ("kimi", "warp")])
def test_the_probe_finds_each_wrong_candidate(container, right, wrong):
    """Against the other candidate's engine the probe finds a difference, in the split
    of its own texts as well as in the ids (so it does not rest on this vocabulary)."""
    engine = engine_splitting_with(container, right)
    assert difference(BpeTokenizer(load(container), wrong), engine) is not None
    assert difference(BpeTokenizer(load(container), right), engine) is None


WHERE_THEY_DIFFER = ["HelloWorld", "Ⅻ ١٢٣ ४२.", "x١٢٣", "ქართული-Հայերեն, ሰላም!", "y  \u00a0z",
                     "x\u00a0!", "\u3000全角\u3000 \u2003em", "你好，世界", "it'ſ",
                     "supercalifragilisticexpialidocious" * 40]


@pytest.mark.parametrize("case", WHERE_THEY_DIFFER)
def test_the_probe_holds_each_case_where_the_candidates_split_differently(case):
    """Each kind of text WARP's scanner splits unlike the Kimi pattern is in the probe
    (the long piece by its byte windows, the rest by their pieces)."""
    pieces = pattern("kimi").findall(case)
    if len(case.encode()) > 1024:
        assert [p.encode() for p in pieces] == warp_pieces(case)   # one piece, merged in windows
    else:
        assert [p.encode() for p in pieces] != warp_pieces(case)
    assert any(case in text for text in PROBE)
