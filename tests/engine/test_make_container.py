"""tools/make_container.py: the files it writes match engine/FORMAT.md."""
from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zlib
from array import array
from pathlib import Path

import pytest

from conftest import ROOT

from tools import make_container as mc

TOOL = ROOT / "tools" / "make_container.py"
PAGE = 4096


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                          capture_output=True, text=True)


def manifest(container: Path) -> dict:
    return json.loads((container / "manifest.json").read_text())


def all_files(container: Path) -> dict[str, bytes]:
    return {str(p.relative_to(container)): p.read_bytes()
            for p in sorted(container.rglob("*")) if p.is_file()}


def trunk_floats(m: dict) -> int:
    """The trunk's f32 count, from FORMAT.md's tensor list."""
    h, v = m["hidden"], m["vocab_size"]
    total = v * h + h + v * h  # tok_embed, final_norm, lm_head
    for layer in range(m["n_layers"]):
        total += 2 * h + 4 * h * h  # norms, wq wk wv wo
        if layer < m["n_dense_layers"]:
            total += 3 * m["dense_ffn"] * h
        else:
            total += m["n_experts"] * h
            if m["shared_expert"]:
                total += 3 * m["expert_ffn"] * h
    return total


def expert_payload_bytes(m: dict) -> int:
    n = 3 * m["expert_ffn"] * m["hidden"]
    if m["expert_quant"] == "f32":
        return 4 * n
    group = int(m["expert_quant"][3:])
    return n + 4 * (n // group)


# ------------------------------------------------------------------ layout --

@pytest.fixture(scope="module")
def f32_container(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("f32") / "f32.waste"
    assert run_tool(out, "--quant", "f32").returncode == 0
    return out


@pytest.fixture(params=["q8g32", "f32"])
def any_quant(request, k3_container, f32_container) -> Path:
    return k3_container if request.param == "q8g32" else f32_container


def test_manifest_shapes(k3_container):
    m = manifest(k3_container)
    assert m["format"] == "waste-ref" and m["version"] == 1 and m["arch"] == "ref-moe"
    assert (m["hidden"], m["n_layers"], m["n_dense_layers"], m["n_heads"], m["head_dim"]) == \
        (64, 4, 1, 4, 16)
    assert (m["dense_ffn"], m["n_experts"], m["top_k"], m["expert_ffn"]) == (128, 16, 2, 96)
    assert m["shared_expert"] is True and m["expert_quant"] == "q8g32"
    assert m["n_heads"] * m["head_dim"] == m["hidden"]


def test_trunk_size_is_exact(any_quant):
    m = manifest(any_quant)
    assert (any_quant / "trunk.bin").stat().st_size == 4 * trunk_floats(m)


def test_banks_follow_the_record_layout(any_quant):
    m = manifest(any_quant)
    payload_bytes = expert_payload_bytes(m)
    stride = -(-(64 + payload_bytes) // PAGE) * PAGE
    banks = sorted((any_quant / "experts").iterdir())
    assert [b.name for b in banks] == [f"layer-{l:03d}.bank"
                                       for l in range(m["n_dense_layers"], m["n_layers"])]
    for layer, bank in zip(range(m["n_dense_layers"], m["n_layers"]), banks):
        data = bank.read_bytes()
        assert len(data) == PAGE + m["n_experts"] * stride
        header = struct.unpack_from("<4s7I", data)
        group = 0 if m["expert_quant"] == "f32" else 32
        assert header == (b"WBNK", 1, layer, m["n_experts"], stride, payload_bytes, group, 0)
        assert data[32:PAGE] == bytes(PAGE - 32)
        for expert in range(m["n_experts"]):
            rec = data[PAGE + expert * stride:PAGE + (expert + 1) * stride]
            magic, r_layer, r_expert, r_bytes, crc = struct.unpack_from("<4s4I", rec)
            assert (magic, r_layer, r_expert, r_bytes) == (b"WEXP", layer, expert, payload_bytes)
            assert rec[20:64] == bytes(44)
            payload = rec[64:64 + payload_bytes]
            assert zlib.crc32(payload) == crc
            assert rec[64 + payload_bytes:] == bytes(stride - 64 - payload_bytes)


def test_q8_payload_dequantises_to_plausible_weights(k3_container):
    m = manifest(k3_container)
    data = (k3_container / "experts" / "layer-001.bank").read_bytes()
    rows, cols = m["expert_ffn"], m["hidden"]
    n = rows * cols
    payload = data[PAGE + 64:PAGE + 64 + expert_payload_bytes(m)]
    codes = struct.unpack_from(f"<{n}b", payload)
    scales = array("f", payload[n:n + 4 * (n // 32)])
    assert max(codes) == 127 or min(codes) == -127  # every group spans the int8 range
    assert all(s > 0 for s in scales)
    weights = [c * scales[i // 32] for i, c in enumerate(codes)]
    bound = (3.0 / cols) ** 0.5
    assert all(abs(w) <= bound * 1.001 for w in weights)
    assert 0.3 < (sum(w * w for w in weights) / n) ** 0.5 * cols ** 0.5 < 1.5


def test_special_tokens_have_zero_lm_head_rows(k3_container):
    m = manifest(k3_container)
    h, v = m["hidden"], m["vocab_size"]
    trunk = (k3_container / "trunk.bin").read_bytes()
    head = array("f", trunk[len(trunk) - 4 * v * h:])
    specials = {s["id"] for s in json.loads((k3_container / "specials.json").read_text())}
    for tok in range(v):
        row = head[tok * h:(tok + 1) * h]
        assert (max(map(abs, row)) == 0.0) == (tok in specials)


# --------------------------------------------------------------- tokenizer --

def test_tokenizer_model_ranks(k3_container):
    lines = (k3_container / "tokenizer.model").read_text().splitlines()
    tokens = [base64.b64decode(line.split()[0]) for line in lines]
    assert [int(line.split()[1]) for line in lines] == list(range(len(lines)))
    assert tokens[:256] == [bytes([b]) for b in range(256)]
    assert len(set(tokens)) == len(tokens)
    assert 1000 <= len(tokens) <= 1500
    assert all(len(t) >= 2 for t in tokens[256:])
    assert not mc.FORBIDDEN_TOKENS & set(tokens)


def test_training_is_fast_and_reproducible():
    assert mc.train_bpe(mc.CORPUS, 600) == mc.train_bpe(mc.CORPUS, 600)
    assert mc.train_bpe(mc.CORPUS, 600) == mc.train_bpe(mc.CORPUS, mc.BPE_VOCAB)[:600]


FLAVOUR_SPECIALS = {
    "k3": ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
           "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
           "<|kimi_image_placeholder|>"],
    "kimi-linear": ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                    "<|im_system|>", "<|im_middle|>"],
    "plain": ["<|endoftext|>"],
}


@pytest.fixture(params=sorted(FLAVOUR_SPECIALS))
def flavoured(request, k3_container, kimi_linear_container, plain_container):
    return request.param, {"k3": k3_container, "kimi-linear": kimi_linear_container,
                           "plain": plain_container}[request.param]


def test_flavour_specials(flavoured):
    flavour, container = flavoured
    m = manifest(container)
    n_ranks = len((container / "tokenizer.model").read_text().splitlines())
    specials = json.loads((container / "specials.json").read_text())
    assert [s["text"] for s in specials] == FLAVOUR_SPECIALS[flavour]
    assert [s["id"] for s in specials] == list(range(n_ranks, n_ranks + len(specials)))
    assert m["vocab_size"] == n_ranks + len(specials)
    assert m["flavour"] == flavour
    texts = {s["text"] for s in specials}
    assert m["bos_token"] in texts and m["eos_token"] in texts
    if flavour == "plain":
        assert m["bos_token"] == m["eos_token"] == "<|endoftext|>"
    else:
        assert (m["bos_token"], m["eos_token"]) == ("[BOS]", "[EOS]")
    assert m.get("media_pad_token") == ("<|media_pad|>" if flavour == "k3" else None)


def test_chat_json_only_for_kimi_linear(flavoured):
    flavour, container = flavoured
    chat = container / "chat.json"
    if flavour != "kimi-linear":
        assert not chat.exists()
        return
    assert json.loads(chat.read_text()) == {
        "system": ["<|im_system|>system<|im_middle|>", "<|im_end|>"],
        "user": ["<|im_user|>user<|im_middle|>", "<|im_end|>"],
        "assistant": ["<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"],
        "open": "<|im_assistant|>assistant<|im_middle|>",
    }


# ------------------------------------------------------------------ vision --

def test_vision_files(k3_vision_container, k3_container):
    v = json.loads((k3_vision_container / "vision.json").read_text())
    assert v == {"patch_size": 8, "merge": 2, "vision_hidden": 32, "max_tokens": 256}
    h = manifest(k3_vision_container)["hidden"]
    vh, p, mg = v["vision_hidden"], v["patch_size"], v["merge"]
    floats = vh * 3 * p * p + vh + vh + h * vh * mg * mg + h
    assert (k3_vision_container / "vision.bin").stat().st_size == 4 * floats
    assert not (k3_container / "vision.json").exists()
    assert not (k3_container / "vision.bin").exists()
    # The tower is added on top: everything else is the same container.
    with_vision = all_files(k3_vision_container)
    assert {k: b for k, b in with_vision.items() if not k.startswith("vision.")} == \
        all_files(k3_container)


# ----------------------------------------------------------- determinism --

def test_same_arguments_same_bytes(tmp_path, k3_vision_container):
    again = tmp_path / "again.waste"
    assert run_tool(again, "--vision").returncode == 0
    assert all_files(again) == all_files(k3_vision_container)


def test_seed_changes_weights_only(tmp_path, k3_container):
    other = tmp_path / "seed1.waste"
    assert run_tool(other, "--seed", "1").returncode == 0
    a, b = all_files(k3_container), all_files(other)
    assert a.keys() == b.keys()
    for name in ("manifest.json", "tokenizer.model", "specials.json"):
        assert a[name] == b[name]
    assert a["trunk.bin"] != b["trunk.bin"]


# ----------------------------------------------------- writing the directory --

def test_refuses_a_non_empty_directory_without_force(tmp_path):
    out = tmp_path / "out.waste"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_tool(out)
    assert result.returncode == 2 and "--force" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run_tool(out, "--force").returncode == 0
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.waste"]


def test_fills_an_existing_empty_directory(tmp_path):
    out = tmp_path / "empty.waste"
    out.mkdir()
    result = run_tool(out, "--flavour", "plain")
    assert result.returncode == 0 and result.stdout.count("\n") == 1
    assert manifest(out)["flavour"] == "plain"


@pytest.mark.parametrize("args", [["--flavour", "k4"], ["--quant", "q4"], ["--seed", "x"], []])
def test_bad_arguments(tmp_path, args):
    result = run_tool(*args) if not args else run_tool(tmp_path / "x.waste", *args)
    assert result.returncode == 2 and "usage:" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_bank(path, *args):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mc, "write_bank", broken_bank)
    with pytest.raises(OSError, match="disk full"):
        mc.main([str(tmp_path / "out.waste")])
    assert list(tmp_path.iterdir()) == []
