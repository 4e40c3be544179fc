"""GGUF -> container conversion and the engine's llama path, on tiny generated GGUFs.

The engine's logits are compared with a numpy forward pass of the GGUF itself
(tests/gguf_reference.py), and its tokenizer with Hugging Face's `tokenizers`
built from the same vocabulary and merges.
"""
from __future__ import annotations

import base64
import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import ROOT
from gguf_reference import Reference
from gguf_writer import MISSING_BYTES, SPECIALS, tiny_llama, vocabulary
from tokenizer_reference import hf_tokenizer, random_texts
from test_container_fuzz import E_FORMAT, damaged_copy, drop_key, open_in_child, set_key
from serve.formats.format_choice import resolve_chat_format
from serve.formats.template.format import TemplateFormat
from serve.engine.binding import Engine, EngineConfig

# Activations are quantised to int16 per block of 32: logits stay within
# this fraction of their spread (max - min) of the float reference.
LOGIT_TOLERANCE = 2e-3
PROMPTS = [[1, 40, 41, 42], [3, 200, 100, 5, 9, 250, 17, 17, 17, 300], [2]]


def convert(gguf: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), str(out),
                           "--from-gguf", str(gguf)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(gguf, container) of the default tiny model: Q4_1 blocks, Q8_0 tied embeddings."""
    d = tmp_path_factory.mktemp("tiny")
    gguf = tiny_llama(d / "tiny.gguf")
    assert convert(gguf, d / "tiny.waste").returncode == 0
    return gguf, d / "tiny.waste"


@pytest.fixture(scope="module")
def tiny_engine(lib, tiny):
    with Engine(lib, tiny[1], EngineConfig(threads=1, ctx=64)) as engine:
        yield engine


def engine_logits(engine: Engine, ids: list[int]) -> np.ndarray:
    engine.reset()
    return np.array(engine.eval(ids))


def assert_logits_close(engine: Engine, gguf: Path) -> None:
    ref = Reference(gguf)
    for ids in PROMPTS:
        want = ref.logits(ids)[-1]
        got = engine_logits(engine, ids)
        spread = float(want.max() - want.min())
        assert np.abs(got - want).max() < LOGIT_TOLERANCE * spread, ids

# ------------------------------------------------------------------ conversion


def test_manifest_describes_the_gguf(tiny):
    manifest = json.loads((tiny[1] / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("arch", "hidden", "n_layers", "n_heads", "n_kv_heads",
                                     "head_dim", "n_experts", "top_k", "expert_ffn",
                                     "n_dense_layers", "rope_style", "pretokenizer",
                                     "expert_quant", "weight_quant", "embed_quant",
                                     "tied_embeddings", "bos_token", "eos_token", "unk_token")} == {
        "arch": "llama", "hidden": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "head_dim": 16, "n_experts": 1, "top_k": 1, "expert_ffn": 96, "n_dense_layers": 0,
        "rope_style": "adjacent", "pretokenizer": "smollm", "expert_quant": "q4_1",
        "weight_quant": "q4_1", "embed_quant": "q8g32", "tied_embeddings": True,
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    assert manifest["vocab_size"] == len(vocabulary()[0])


def test_every_ffn_is_its_layers_only_expert_on_disk(tiny):
    for layer in range(2):
        bank = (tiny[1] / "experts" / f"layer-{layer:03d}.bank").read_bytes()
        magic, version, index, n_experts, stride, payload, group, kind = struct.unpack_from(
            "<4s7I", bank)
        assert (magic, index, n_experts, group, kind) == (b"WBNK", layer, 1, 32, 1)
        # three 96x64 q4_1 matrices: nibbles plus an f32 scale and minimum per 32
        assert payload == 3 * (96 * 64 // 2 + 8 * 96 * 64 // 32)
        assert len(bank) == 4096 + stride


def test_tokenizer_files_keep_ids_and_merge_priorities(tiny):
    tokens, _, merges = vocabulary()
    lines = (tiny[1] / "tokenizer.model").read_text().splitlines()
    assert len(lines) == len(tokens) - len(SPECIALS)
    assert int(lines[0].split()[1]) == len(SPECIALS)
    pairs = (tiny[1] / "tokenizer.merges").read_text().splitlines()
    assert len(pairs) == len(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    left, right = merges[0].split(" ")
    assert pairs[0] == f"{ids[left]} {ids[right]}"
    specials = json.loads((tiny[1] / "specials.json").read_text())
    assert specials == [{"id": i, "text": t} for i, t in enumerate(SPECIALS)]


def test_chat_json_is_chatml_with_the_templates_default_system(tiny, tiny_engine):
    chat = resolve_chat_format(tiny_engine, tiny[1])
    assert isinstance(chat, TemplateFormat)
    assert chat.stop_tokens == [2]
    text = "".join(s.text for s in chat.render([{"role": "user", "content": "Hi"}], thinking=False).segments)
    assert text == ("<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


REFUSED = {
    "architecture": ({"arch": "gpt2"}, "architecture 'gpt2' is not supported"),
    "tensor type": ({"block_type": "Q4_0"}, "Q4_0 is not supported"),
    "tokenizer": ({"overrides": {"tokenizer.ggml.model": "llama"}}, "tokenizer 'llama'"),
    "pre-tokenizer": ({"overrides": {"tokenizer.ggml.pre": "qwen2"}}, "pre-tokenizer 'qwen2'"),
    "bad merge": ({"overrides": {"tokenizer.ggml.merges": ["x zz"]}}, "merge 0 ('x zz')"),
}


@pytest.mark.parametrize("kwargs, message", REFUSED.values(), ids=REFUSED.keys())
def test_unsupported_gguf_is_refused_by_name_and_leaves_nothing(tmp_path, kwargs, message):
    gguf = tiny_llama(tmp_path / "bad.gguf", **kwargs)
    done = convert(gguf, tmp_path / "out.waste")
    assert done.returncode == 1
    assert message in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(60))
    done = convert(tmp_path / "x.gguf", tmp_path / "out.waste")
    assert done.returncode == 1 and "not a GGUF file" in done.stderr

# ---------------------------------------------------------------------- logits


def test_logits_match_the_numpy_reference(tiny, tiny_engine):
    assert_logits_close(tiny_engine, tiny[0])


@pytest.mark.parametrize("block_type, embed_type, tied", [("F16", "F32", False),
                                                          ("Q8_0", "Q4_1", False),
                                                          ("F32", "F16", True)])
def test_other_weight_types_convert_exactly(lib, tmp_path, block_type, embed_type, tied):
    gguf = tiny_llama(tmp_path / "t.gguf", block_type=block_type, embed_type=embed_type, tied=tied)
    assert convert(gguf, tmp_path / "t.waste").returncode == 0
    with Engine(lib, tmp_path / "t.waste", EngineConfig(threads=1, ctx=64)) as engine:
        assert_logits_close(engine, gguf)


def test_a_small_budget_streams_ffns_through_the_expert_cache(lib, tiny, tiny_engine):
    want = engine_logits(tiny_engine, PROMPTS[1])
    plan = lib.plan_memory(tiny[1], 64)
    with Engine(lib, tiny[1], EngineConfig(threads=1, ctx=64, budget=plan.floor_bytes)) as small:
        got = engine_logits(small, PROMPTS[1])
        batched = small.stats()
        small.reset()
        for token in PROMPTS[1]:
            alone = np.array(small.eval([token]))
        stats = small.stats()
    assert np.array_equal(got, want) and np.array_equal(alone, want)
    # one record fits, two layers alternate: the prompt as one batch reads each
    # layer's FFN once for all its positions; one position at a time reads both
    # FFNs for every position
    assert (batched.experts_hit, batched.experts_missed) == (0, 2)
    assert (stats.experts_hit, stats.experts_missed) == (0, 2 + 2 * len(PROMPTS[1]))
    assert stats.bytes_read == stats.experts_missed * plan.min_expert_cache

# ------------------------------------------------------------------- tokenizer


def test_tokenization_equals_hugging_face_tokenizers(tiny_engine):
    tokens, _, merges = vocabulary()
    reference = hf_tokenizer(tokens, merges)
    texts = random_texts(random.Random(7), 3000) + ["the quick brown fox", "café 12 naïve",
                                                    "a  b\t\tc \n\n d", "x" * 500]
    for text in texts:
        assert tiny_engine.tokenize(text) == reference.encode(text, add_special_tokens=False).ids, text


def test_bytes_the_vocabulary_lacks_encode_as_the_unknown_token(tiny_engine):
    for byte in MISSING_BYTES:
        text = bytes([byte]).decode("latin-1") if byte < 0x80 else "\U00040000"
        assert 0 in tiny_engine.tokenize(text)

# ------------------------------------------------------------- damaged llama


def byte_id(container: Path, raw: bytes) -> int:
    for line in (container / "tokenizer.model").read_text().splitlines():
        text, rank = line.split()
        if base64.b64decode(text) == raw:
            return int(rank)
    raise KeyError(raw)


def edit_merges(change: Callable[[Path, list[str]], list[str]]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        lines = (root / "tokenizer.merges").read_text().splitlines()
        (root / "tokenizer.merges").write_text("".join(f"{x}\n" for x in change(root, lines)))
    return mutate


def first_bank_quant_kind(kind: int) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        bank = root / "experts" / "layer-000.bank"
        data = bytearray(bank.read_bytes())
        data[28:32] = struct.pack("<I", kind)
        bank.write_bytes(bytes(data))
    return mutate


LLAMA_DAMAGE = {
    "kv heads do not divide heads": (set_key("n_kv_heads", 3), "must divide n_heads"),
    "more kv heads than heads": (set_key("n_kv_heads", 5), '"n_kv_heads" must be an integer'),
    "rope style": (set_key("rope_style", "halves"), '"rope_style" must be "adjacent"'),
    "pre-tokenizer": (set_key("pretokenizer", "qwen2"), '"pretokenizer" must be "default" or "smollm"'),
    "weight quant": (set_key("weight_quant", "q4_0"), '"weight_quant" must be'),
    "embed quant group": (set_key("embed_quant", "q8g7"), '"embed_quant" must be'),
    "tied is a string": (set_key("tied_embeddings", "yes"), '"tied_embeddings" must be true or false'),
    "two experts": (set_key("n_experts", 2), 'arch "llama" has one expert per layer'),
    "shared expert": (set_key("shared_expert", True), 'arch "llama" has one expert per layer'),
    "untied, no lm_head stored": (set_key("tied_embeddings", False), "trunk.bin"),
    "f32 claimed for q4_1 banks": (set_key("expert_quant", "f32"), "layer-000.bank"),
    "bank quant kind": (first_bank_quant_kind(0), "header quant_kind is 0"),
    "unk names no special": (set_key("unk_token", "<|nope|>"), 'unk_token "<|nope|>"'),
    "no unk for missing bytes": (drop_key("unk_token"), "no rank for the single byte 0x04"),
    "merge line malformed": (edit_merges(lambda root, lines: ["1 2 3"] + lines),
                             "tokenizer.merges line 1: expected"),
    "merge of a special": (edit_merges(lambda root, lines: ["0 40"] + lines),
                           "tokenizer.merges line 1: expected"),
    "merge that makes no token": (
        edit_merges(lambda root, lines: [f"{byte_id(root, b'Q')} {byte_id(root, b'Z')}"] + lines),
        "do not merge into a token"),
    "merge repeated": (edit_merges(lambda root, lines: lines + lines[:1]), "repeats a merge"),
}


@pytest.mark.parametrize("case", list(LLAMA_DAMAGE))
def test_damaged_llama_container_is_refused_by_name(lib_path, tiny, tmp_path, case):
    mutate, detail = LLAMA_DAMAGE[case]
    result = open_in_child(lib_path, damaged_copy(tiny[1], tmp_path / "c.waste", mutate))
    assert result["status"] == E_FORMAT, result
    assert detail in result["detail"], result
