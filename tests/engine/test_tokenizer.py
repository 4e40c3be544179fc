"""The engine's tokenizer (engine/tokenizer.c) and JSON reader (engine/json.c).

Both are compiled on their own into a small shared object and called through
ctypes, which reaches what the ABI hides (malformed files, the JSON tree).
The tokenizer is checked differentially against the pure-Python reference
encoder in tools/make_container.py, which implements the same FORMAT.md rules,
both directly and through libwaste's waste_tokenize* / waste_detokenize.
"""
from __future__ import annotations

import base64
import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from hypothesis import given, settings, strategies as st

from tools import make_container as mc

WASTE_OK, WASTE_E_IO, WASTE_E_FORMAT, WASTE_E_ARG = 0, -1, -2, -5


# ------------------------------------------------------------------ binding --

class JsonValue(ctypes.Structure):
    pass


JsonValue._fields_ = [
    ("type", ctypes.c_int), ("key", ctypes.c_char_p), ("number", ctypes.c_double),
    ("str", ctypes.POINTER(ctypes.c_char)), ("len", ctypes.c_size_t),
    ("items", ctypes.POINTER(JsonValue)),
]
JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT = range(6)


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    """tokenizer.c + json.c (and the error formatter) alone, as a shared object."""
    out = tmp_path_factory.mktemp("tokso") / "libtok.so"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-O1", "-g",
                    "-D_GNU_SOURCE", "-fPIC", "-shared", "-o", str(out),
                    str(ROOT / "engine" / "tokenizer.c"), str(ROOT / "engine" / "json.c"),
                    str(ROOT / "engine" / "detail.c"), str(ROOT / "engine" / "unicode.c")],
                   check=True, capture_output=True)
    so = ctypes.CDLL(str(out))
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32
    so.wtok_load.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.POINTER(vp),
                             ctypes.c_char_p, sz]
    so.wtok_free.argtypes = [vp]
    so.wtok_encode.argtypes = [vp, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, i32,
                               ctypes.POINTER(i32), sz, ctypes.POINTER(sz)]
    so.wtok_piece.argtypes = [vp, i32, ctypes.POINTER(sz)]
    so.wtok_piece.restype = ctypes.POINTER(ctypes.c_uint8)
    so.wtok_special_id.argtypes = [vp, ctypes.c_char_p]
    so.wtok_special_id.restype = i32
    so.wtok_is_special.argtypes = [vp, i32]
    so.json_parse.argtypes = [ctypes.c_char_p, sz, ctypes.c_char_p, sz]
    so.json_parse.restype = ctypes.POINTER(JsonValue)
    so.json_free.argtypes = [ctypes.POINTER(JsonValue)]
    return so


class Tokenizer:
    """A loaded wtok, with Python-friendly calls."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p):
        self.lib, self.handle = lib, handle

    def encode(self, text: str, markup: bool = False, bos: int = -1) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 2
        buf = (ctypes.c_int32 * cap)()
        n = ctypes.c_size_t()
        st = self.lib.wtok_encode(self.handle, data, int(markup), int(bos >= 0), bos, buf, cap,
                                  ctypes.byref(n))
        assert st == WASTE_OK
        return buf[:n.value]

    def piece(self, tok: int) -> bytes | None:
        n = ctypes.c_size_t()
        p = self.lib.wtok_piece(self.handle, tok, ctypes.byref(n))
        return ctypes.string_at(p, n.value) if p else None


def load(lib: ctypes.CDLL, directory: Path, vocab: int) -> tuple[int, ctypes.c_void_p, str]:
    handle = ctypes.c_void_p()
    err = ctypes.create_string_buffer(256)
    st = lib.wtok_load(str(directory).encode(), vocab, ctypes.byref(handle), err, len(err))
    return st, handle, err.value.decode()


@pytest.fixture(scope="module")
def k3(lib, k3_container):
    vocab = json.loads((k3_container / "manifest.json").read_text())["vocab_size"]
    st, handle, err = load(lib, k3_container, vocab)
    assert st == WASTE_OK, err
    yield Tokenizer(lib, handle)
    lib.wtok_free(handle)


@pytest.fixture(scope="module")
def ranks(k3_container) -> dict[bytes, int]:
    return mc.load_ranks(k3_container / "tokenizer.model")


@pytest.fixture(scope="module")
def specials(k3_container) -> dict[str, int]:
    return {s["text"]: s["id"] for s in json.loads((k3_container / "specials.json").read_text())}


# -------------------------------------------------------- differential tests --

FRAGMENTS = ["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>", "<|media_pad|>", "[BOS]",
             "message", " role", "=\"", "user", "café", "日本語", "🙂", "  ", "\n\n", "\t",
             " 12345", "Second", " part.", "<|", "|>", "x" * 40]
texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=120),
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(" abc1é\n", max_size=6)),
             max_size=10).map("".join),
)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_plain_encoding_matches_the_reference(k3, ranks, text):
    ids = k3.encode(text)
    assert ids == mc.encode(text, ranks)
    assert b"".join(k3.piece(i) for i in ids) == text.encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(texts)
def test_markup_encoding_matches_the_reference(k3, ranks, specials, text):
    assert k3.encode(text, markup=True) == mc.encode_markup(text, ranks, specials)


def test_plain_never_yields_a_special_but_markup_does(k3, specials, lib):
    text = "".join(f"a {s} b" for s in specials)
    plain, marked = k3.encode(text), k3.encode(text, markup=True)
    assert not any(lib.wtok_is_special(k3.handle, i) for i in plain)
    assert [i for i in marked if lib.wtok_is_special(k3.handle, i)] == list(specials.values())
    # Away from the specials the two agree: only the special spans differ.
    for s, sid in specials.items():
        assert k3.encode(s, markup=True) == [sid]
        spelled = k3.encode(s)
        assert len(spelled) >= 2
        assert b"".join(k3.piece(i) for i in spelled) == s.encode()


@pytest.mark.parametrize("text", ["message", " role", "=\"", "user", "<|open|>"])
def test_markup_words_are_several_ordinary_tokens(k3, lib, text):
    ids = k3.encode(text)
    assert len(ids) >= 2
    assert not any(lib.wtok_is_special(k3.handle, i) for i in ids)


def test_encoding_segments_apart_differs_from_joined(k3):
    first, second = "First part. ", "Second part."
    apart = k3.encode(first) + k3.encode(second)
    joined = k3.encode(first + second)
    assert apart != joined
    assert k3.piece(joined[len(k3.encode("First part."))]).startswith(b" S")


def test_pretokenizer_rules(k3, ranks):
    # Digits go in runs of at most three; a run of spaces leaves its last ' '
    # to the next word; a lone newline is its own pre-token.
    assert mc.pretokenize(b"x 12345") == [b"x", b" 123", b"45"]
    assert mc.pretokenize(b"a   b") == [b"a", b"  ", b" b"]
    assert mc.pretokenize(b"a\n b\t\tc ") == [b"a", b"\n", b" b", b"\t\t", b"c", b" "]
    assert mc.pretokenize("é!?".encode()) == ["é".encode(), b"!?"]
    for text in ["x 12345", "a   b", "a\n b\t\tc ", "é!? ..."]:
        assert k3.encode(text) == mc.encode(text, ranks)


def test_longest_special_wins(lib, k3_container, tmp_path):
    shutil.copy(k3_container / "tokenizer.model", tmp_path / "tokenizer.model")
    n_ranks = len(mc.load_ranks(tmp_path / "tokenizer.model"))
    (tmp_path / "specials.json").write_text(json.dumps(
        [{"id": n_ranks, "text": "<|a|>"}, {"id": n_ranks + 1, "text": "<|a|>b"}]))
    st, handle, err = load(lib, tmp_path, n_ranks + 2)
    assert st == WASTE_OK, err
    tok = Tokenizer(lib, handle)
    try:
        assert tok.encode("<|a|>b<|a|>", markup=True) == [n_ranks + 1, n_ranks]
        assert lib.wtok_special_id(handle, b"<|a|>b") == n_ranks + 1
        assert lib.wtok_special_id(handle, b"<|b|>") == -1
    finally:
        lib.wtok_free(handle)


def test_long_pretoken_matches_reference(k3, ranks):
    text = ("thequickbrownfoxjumpsoverthelazydog" * 30)[:1000]
    assert k3.encode(text) == mc.encode(text, ranks)


def test_huge_pretoken_is_fully_merged(k3, ranks):
    # One 52 KB pre-token: too long for the quadratic reference, so check the
    # end state instead: it spells the text and no adjacent pair is a token.
    text = "thequickbrownfoxjumpsoverthelazydog" * 1500
    pieces = [k3.piece(i) for i in k3.encode(text)]
    assert b"".join(pieces) == text.encode()
    assert not any(a + b in ranks for a, b in zip(pieces, pieces[1:]))


def test_bos_and_short_buffer(k3, specials):
    bos = specials["[BOS]"]
    ids = k3.encode("hello there")
    assert k3.encode("hello there", bos=bos) == [bos] + ids
    out = (ctypes.c_int32 * 2)()
    n = ctypes.c_size_t()
    st = k3.lib.wtok_encode(k3.handle, b"hello there", 0, 1, bos, out, 2, ctypes.byref(n))
    assert st == WASTE_E_ARG and n.value == len(ids) + 1
    assert list(out) == [bos, ids[0]]
    st = k3.lib.wtok_encode(k3.handle, b"hello there", 0, 0, -1, None, 0, ctypes.byref(n))
    assert st == WASTE_E_ARG and n.value == len(ids)


def test_pieces_and_specials(k3, specials, ranks, lib):
    assert k3.piece(ranks[b"A"]) == b"A"
    assert k3.piece(specials["<|open|>"]) == b"<|open|>"
    assert lib.wtok_is_special(k3.handle, specials["<|open|>"])
    assert not lib.wtok_is_special(k3.handle, ranks[b"A"])
    assert k3.piece(-1) is None and k3.piece(len(ranks) + len(specials)) is None
    assert lib.wtok_special_id(k3.handle, b"<|sep|>") == specials["<|sep|>"]


# ------------------------------------------------------------ malformed files --

MODEL_DAMAGE = {
    "bad base64": lambda lines: ["QQ=A 65"] + [l for l in lines if not l.endswith(" 65")],
    "bad rank": lambda lines: lines[:-1] + [lines[-1].split()[0] + " 12x"],
    "expected": lambda lines: lines + ["justonefield"],
    "duplicate rank": lambda lines: lines + [base64.b64encode(b"zzzq").decode() + " 300"],
    "two ranks": lambda lines: lines + [lines[300].split()[0] + " " + str(len(lines))],
    "vocab_size": lambda lines: lines + [base64.b64encode(b"qqqz").decode() + " 99999"],
    "single byte": lambda lines: [l for l in lines if not l.endswith(" 65")],
    "neither a rank": lambda lines: [l for l in lines if not l.endswith(" 300")],
}


@pytest.mark.parametrize("reason", sorted(MODEL_DAMAGE))
def test_malformed_tokenizer_model_is_a_format_error(lib, k3_container, tmp_path, reason):
    lines = (k3_container / "tokenizer.model").read_text().splitlines()
    (tmp_path / "tokenizer.model").write_text("\n".join(MODEL_DAMAGE[reason](lines)) + "\n")
    shutil.copy(k3_container / "specials.json", tmp_path / "specials.json")
    vocab = json.loads((k3_container / "manifest.json").read_text())["vocab_size"]
    st, handle, err = load(lib, tmp_path, vocab)
    assert (st, handle.value) == (WASTE_E_FORMAT, None)
    assert reason in err


SPECIALS_DAMAGE = {
    "not a JSON array": '{"id": 1300, "text": "<|x|>"}',
    "json:": '[{"id": 1300, "text": "<|x|>"},]',
    "\"id\"": '[{"text": "<|x|>"}]',
    "\"text\"": '[{"id": 1285}]',
    "already taken": '[{"id": 65, "text": "<|x|>"}]',
    "below vocab_size": '[{"id": 99999, "text": "<|x|>"}]',
    "listed twice": '[{"id": 1285, "text": "<|x|>"}, {"id": 1286, "text": "<|x|>"}]',
    "integer": '[{"id": 1285.5, "text": "<|x|>"}]',
}


@pytest.mark.parametrize("reason", sorted(SPECIALS_DAMAGE))
def test_malformed_specials_are_a_format_error(lib, k3_container, tmp_path, reason):
    shutil.copy(k3_container / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "specials.json").write_text(SPECIALS_DAMAGE[reason])
    st, handle, err = load(lib, tmp_path, 1300)
    assert (st, handle.value) == (WASTE_E_FORMAT, None)
    assert reason in err


def test_missing_files_are_io_errors(lib, k3_container, tmp_path):
    st, _, err = load(lib, tmp_path, 1300)
    assert st == WASTE_E_IO and "tokenizer.model" in err
    shutil.copy(k3_container / "tokenizer.model", tmp_path / "tokenizer.model")
    st, _, err = load(lib, tmp_path, 1300)
    assert st == WASTE_E_IO and "specials.json" in err


# --------------------------------------------------------------- JSON reader --

def to_python(v: JsonValue):
    if v.type == JSON_NULL:
        return None
    if v.type == JSON_BOOL:
        return bool(v.number)
    if v.type == JSON_NUMBER:
        return v.number
    if v.type == JSON_STRING:
        return ctypes.string_at(v.str, v.len).decode("utf-8")
    items = [v.items[i] for i in range(v.len)]
    if v.type == JSON_ARRAY:
        return [to_python(i) for i in items]
    return {i.key.decode("utf-8"): to_python(i) for i in items}


def parse(lib, text: str):
    """(python value, None) or (None, error text)."""
    data = text.encode("utf-8")
    err = ctypes.create_string_buffer(200)
    root = lib.json_parse(data, len(data), err, len(err))
    if not root:
        return None, err.value.decode()
    try:
        return to_python(root.contents), None
    finally:
        lib.json_free(root)


def normalise(value):
    """JSON numbers come back as doubles."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return {k: normalise(v) for k, v in value.items()}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",),
                                            blacklist_characters="\0"), max_size=8),
                      inner, max_size=5),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(json_values, st.booleans())
def test_json_parses_what_python_writes(lib, value, ascii_only):
    value_text = json.dumps(value, ensure_ascii=ascii_only, indent=1 if ascii_only else None)
    parsed, err = parse(lib, value_text)
    assert err is None
    assert parsed == normalise(value)


@pytest.mark.parametrize("text,reason", [
    ("[1, 2,]", "unexpected"), ('{"a": 1,}', "member name"), ('{"a": 1, "a": 2}', "duplicate"),
    ("[1] x", "trailing"), ('"\\ud800"', "surrogate"), ('"a\nb"', "control"),
    ("01", "trailing"), ("1.", "fraction"), ("-", "number"), ("[", "end of input"),
    ('"abc', "unterminated"), ("tru", "unexpected"), ("'a'", "unexpected"), ("", "end of input"),
    ('"\\x"', "escape"), ("1e999", "range"),
])
def test_json_rejects_malformed_text(lib, text, reason):
    parsed, err = parse(lib, text)
    assert parsed is None and reason in err


def test_json_depth_limit(lib):
    assert parse(lib, "[" * 64 + "]" * 64) == (normalise(json.loads("[" * 64 + "]" * 64)), None)
    parsed, err = parse(lib, "[" * 65 + "]" * 65)
    assert parsed is None and "deeper" in err
    parsed, err = parse(lib, "[" * 100000)  # no stack overflow on hostile input
    assert parsed is None and "deeper" in err


def test_json_escapes(lib):
    assert parse(lib, r'"\u00e9\ud83d\ude42\n\"\/"') == ("é🙂\n\"/", None)


# ------------------------------------------------------ through the real ABI --

class Engine:
    """waste_open on a container; tokenize/detokenize through libwaste."""

    def __init__(self, lib_path: Path, container: Path):
        so = ctypes.CDLL(str(lib_path))
        vp, sz, i32p = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int32)
        so.waste_open.argtypes = [ctypes.c_char_p, vp, ctypes.POINTER(vp)]
        so.waste_close.argtypes = [vp]
        so.waste_error_detail.argtypes = [vp]
        so.waste_error_detail.restype = ctypes.c_char_p
        for name in ("waste_tokenize", "waste_tokenize_markup"):
            getattr(so, name).argtypes = [vp, ctypes.c_char_p, ctypes.c_int, i32p, sz,
                                          ctypes.POINTER(sz)]
        so.waste_detokenize.argtypes = [vp, i32p, sz, ctypes.c_char_p, sz, ctypes.POINTER(sz)]
        self.so, self.ctx = so, ctypes.c_void_p()
        self.status = so.waste_open(str(container).encode(), None, ctypes.byref(self.ctx))
        self.detail = (so.waste_error_detail(None) or b"").decode()

    def tokenize(self, text: str, markup: bool = False) -> list[int]:
        data = text.encode("utf-8")
        buf, n = (ctypes.c_int32 * (len(data) + 1))(), ctypes.c_size_t()
        fn = self.so.waste_tokenize_markup if markup else self.so.waste_tokenize
        assert fn(self.ctx, data, 0, buf, len(buf), ctypes.byref(n)) == WASTE_OK
        return buf[:n.value]

    def detokenize(self, ids: list[int]) -> bytes:
        arr, n = (ctypes.c_int32 * len(ids))(*ids), ctypes.c_size_t()
        probe = ctypes.create_string_buffer(1)
        st = self.so.waste_detokenize(self.ctx, arr, len(ids), probe, 1, ctypes.byref(n))
        assert st in (WASTE_OK, WASTE_E_ARG)
        out = ctypes.create_string_buffer(n.value + 1)
        assert self.so.waste_detokenize(self.ctx, arr, len(ids), out, len(out),
                                        ctypes.byref(n)) == WASTE_OK
        return out.raw[:n.value]

    def close(self) -> None:
        self.so.waste_close(self.ctx)


@pytest.fixture(scope="module")
def engine(lib_path, k3_container):
    eng = Engine(lib_path, k3_container)
    assert eng.status == WASTE_OK, eng.detail
    yield eng
    eng.close()


@settings(max_examples=150, deadline=None)
@given(texts)
def test_abi_tokenizes_like_the_reference(engine, ranks, specials, text):
    plain = engine.tokenize(text)
    assert plain == mc.encode(text, ranks)
    assert engine.tokenize(text, markup=True) == mc.encode_markup(text, ranks, specials)
    assert engine.detokenize(plain) == text.encode("utf-8")


def test_abi_markup_words_and_segment_boundaries(engine, specials):
    for word in ["message", " role", "=\"", "user", "<|open|>"]:
        ids = engine.tokenize(word)
        assert len(ids) >= 2 and not set(ids) & set(specials.values())
    assert engine.tokenize("<|open|>", markup=True) == [specials["<|open|>"]]
    assert engine.tokenize("First part. ") + engine.tokenize("Second part.") != \
        engine.tokenize("First part. Second part.")


def test_abi_kimi_linear_chat_prefix_is_markup(lib_path, kimi_linear_container):
    eng = Engine(lib_path, kimi_linear_container)
    assert eng.status == WASTE_OK, eng.detail
    try:
        chat = json.loads((kimi_linear_container / "chat.json").read_text())
        ids = {s["text"]: s["id"] for s in
               json.loads((kimi_linear_container / "specials.json").read_text())}
        marked = eng.tokenize(chat["open"], markup=True)
        assert marked[0] == ids["<|im_assistant|>"] and marked[-1] == ids["<|im_middle|>"]
        assert eng.detokenize(marked) == chat["open"].encode()
    finally:
        eng.close()


def test_abi_open_rejects_a_broken_tokenizer(lib_path, k3_container, tmp_path):
    broken = tmp_path / "broken.waste"
    shutil.copytree(k3_container, broken)
    (broken / "specials.json").write_text('{"id": 1}')
    eng = Engine(lib_path, broken)
    assert eng.status == WASTE_E_FORMAT and "not a JSON array" in eng.detail
