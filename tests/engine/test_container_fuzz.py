"""Malformed containers: every damage must give a clean, specific failure.

Each open runs in a child process with a timeout, so a crash or a hang in
the engine fails one test instead of taking the test runner down.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from test_abi import E_FORMAT, E_IO, OK

TESTS = Path(__file__).resolve().parent

# The child: open (and plan) the container, print the outcome as JSON.
CHILD = """
import ctypes, json, os, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]   # test_abi, and the conftest it reads
from test_abi import MemPlan, load_library, try_open
lib = load_library(sys.argv[2])
status, ctx, detail = try_open(lib, sys.argv[3], ctx_tokens=64, vision=int(sys.argv[4]))
if status == 0:
    lib.waste_close(ctx)
plan = MemPlan()
plan_status = lib.waste_plan_memory(sys.argv[3].encode(), 64, ctypes.byref(plan))
print(json.dumps({"status": status, "detail": detail, "plan": plan_status}))
"""


def open_in_child(lib_path: Path, container: Path, vision: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), str(lib_path), str(container),
                           str(int(vision))], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


# ------------------------------------------------------------------ mutations

def edit_manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        m = json.loads((root / "manifest.json").read_text())
        change(m)
        (root / "manifest.json").write_text(json.dumps(m))
    return mutate


def set_key(key: str, value) -> Callable[[Path], None]:
    return edit_manifest(lambda m: m.__setitem__(key, value))


def drop_key(key: str) -> Callable[[Path], None]:
    return edit_manifest(lambda m: m.pop(key))


def write_file(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda root: (root / name).write_bytes(data)


def remove(name: str) -> Callable[[Path], None]:
    return lambda root: (root / name).unlink()


def resize(name: str, delta: int) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        data = (root / name).read_bytes()
        (root / name).write_bytes(data[:delta] if delta < 0 else data + bytes(delta))
    return mutate


def truncate_to(name: str, size: int) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        (root / name).write_bytes((root / name).read_bytes()[:size])
    return mutate


BANK = "experts/layer-002.bank"


def bank_field(offset: int, value: bytes) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        data = bytearray((root / BANK).read_bytes())
        data[offset:offset + len(value)] = value
        (root / BANK).write_bytes(bytes(data))
    return mutate


def edit_specials(change: Callable[[list], object]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        items = json.loads((root / "specials.json").read_text())
        (root / "specials.json").write_text(json.dumps(change(items)))
    return mutate


def many_specials_one_repeated(n: int) -> Callable[[Path], None]:
    """n extra specials (vocab_size grown to hold them), the last repeating a text:
    a duplicate check that compares every pair of specials would hang on it."""
    def mutate(root: Path) -> None:
        items = json.loads((root / "specials.json").read_text())
        first = max(s["id"] for s in items) + 1
        items += [{"id": first + i, "text": f"<|s{i}|>"} for i in range(n)]
        items.append({"id": first + n, "text": "<|s0|>"})
        (root / "specials.json").write_text(json.dumps(items))
        edit_manifest(lambda m: m.__setitem__("vocab_size", first + n + 1))(root)
    return mutate


TEXT_CASES = {
    # manifest.json
    "manifest truncated": (truncate_to("manifest.json", 100), E_FORMAT),
    "manifest not json": (write_file("manifest.json", b"hello, I am not JSON"), E_FORMAT),
    "manifest empty": (write_file("manifest.json", b""), E_FORMAT),
    "manifest is a list": (write_file("manifest.json", b"[1, 2, 3]"), E_FORMAT),
    "manifest missing": (remove("manifest.json"), E_IO),
    "hidden is a string": (set_key("hidden", "64"), E_FORMAT),
    "n_layers is fractional": (set_key("n_layers", 4.5), E_FORMAT),
    "shared_expert is a number": (set_key("shared_expert", 1), E_FORMAT),
    "expert_quant is a number": (set_key("expert_quant", 8), E_FORMAT),
    "bos_token is a number": (set_key("bos_token", 5), E_FORMAT),
    "wrong format": (set_key("format", "gguf"), E_FORMAT),
    "wrong version": (set_key("version", 2), E_FORMAT),
    **{f"missing {k}": (drop_key(k), E_FORMAT) for k in (
        "format", "version", "arch", "vocab_size", "hidden", "n_layers", "n_dense_layers",
        "n_heads", "head_dim", "dense_ffn", "n_experts", "top_k", "expert_ffn",
        "shared_expert", "rope_theta", "norm_eps", "expert_quant", "bos_token", "eos_token")},
    "hidden 2^31": (set_key("hidden", 2 ** 31), E_FORMAT),
    "hidden 2^16 with matching heads": (edit_manifest(lambda m: m.update(
        hidden=2 ** 16, n_heads=2 ** 12, head_dim=16)), E_FORMAT),
    "zero layers": (set_key("n_layers", 0), E_FORMAT),
    "more dense layers than layers": (set_key("n_dense_layers", 9), E_FORMAT),
    "no MoE layer": (set_key("n_dense_layers", 4), E_FORMAT),
    "top_k above n_experts": (set_key("top_k", 17), E_FORMAT),
    "zero experts": (set_key("n_experts", 0), E_FORMAT),
    "vocab 2^30": (set_key("vocab_size", 2 ** 30), E_FORMAT),
    "heads do not make hidden": (set_key("n_heads", 3), E_FORMAT),
    "expert_ffn 2^30": (set_key("expert_ffn", 2 ** 30), E_FORMAT),
    "negative rope_theta": (set_key("rope_theta", -1.0), E_FORMAT),
    "quant group does not divide": (set_key("expert_quant", "q8g7"), E_FORMAT),
    "unknown quant": (set_key("expert_quant", "q4k"), E_FORMAT),
    "f32 claimed for q8 banks": (set_key("expert_quant", "f32"), E_FORMAT),
    "more experts than banked": (set_key("n_experts", 32), E_FORMAT),
    "eos names no special": (set_key("eos_token", "<|nope|>"), E_FORMAT),
    "media pad names no special": (set_key("media_pad_token", "<|nope|>"), E_FORMAT),
    "vocab smaller than tokenizer": (set_key("vocab_size", 1000), E_FORMAT),
    # trunk.bin
    "trunk truncated": (resize("trunk.bin", -4), E_FORMAT),
    "trunk extended": (resize("trunk.bin", 4), E_FORMAT),
    "trunk missing": (remove("trunk.bin"), E_IO),
    # banks
    "bank wrong magic": (bank_field(0, b"XBNK"), E_FORMAT),
    "bank wrong version": (bank_field(4, struct.pack("<I", 9)), E_FORMAT),
    "bank wrong layer": (bank_field(8, struct.pack("<I", 1)), E_FORMAT),
    "bank wrong expert count": (bank_field(12, struct.pack("<I", 15)), E_FORMAT),
    "bank wrong stride": (bank_field(16, struct.pack("<I", 4096)), E_FORMAT),
    "bank wrong payload size": (bank_field(20, struct.pack("<I", 100)), E_FORMAT),
    "bank wrong quant group": (bank_field(24, struct.pack("<I", 16)), E_FORMAT),
    "bank truncated": (resize(BANK, -4096), E_FORMAT),
    "bank header only": (truncate_to(BANK, 4096), E_FORMAT),
    "bank shorter than a header": (write_file(BANK, b"WBNK"), E_FORMAT),
    "bank extended": (resize(BANK, 4096), E_FORMAT),
    "bank missing": (remove(BANK), E_IO),
    # tokenizer.model and specials.json
    "tokenizer garbage": (write_file("tokenizer.model", b"\x00\xff garbage\nnot base64 at all\n"),
                          E_FORMAT),
    "tokenizer empty": (write_file("tokenizer.model", b""), E_FORMAT),
    "tokenizer missing": (remove("tokenizer.model"), E_IO),
    "specials not a list": (write_file("specials.json", b'{"id": 1}'), E_FORMAT),
    "specials not json": (write_file("specials.json", b"[{"), E_FORMAT),
    "special id out of range": (edit_specials(lambda s: s + [{"id": 99999, "text": "<|x|>"}]),
                                E_FORMAT),
    "special id duplicated": (edit_specials(lambda s: s + [{"id": s[0]["id"], "text": "<|x|>"}]),
                              E_FORMAT),
    "special without text": (edit_specials(lambda s: s + [{"id": s[-1]["id"] + 1}]), E_FORMAT),
    "bos special missing": (edit_specials(lambda s: [x for x in s if x["text"] != "[BOS]"]),
                            E_FORMAT),
    "specials missing": (remove("specials.json"), E_IO),
    "many specials, one repeated": (many_specials_one_repeated(400_000), E_FORMAT),
    "an id nothing defines": (edit_specials(lambda s: s[:-1]), E_FORMAT),
}

def edit_vision(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        v = json.loads((root / "vision.json").read_text())
        change(v)
        (root / "vision.json").write_text(json.dumps(v))
    return mutate


def vision_json_with_many_members(n: int) -> Callable[[Path], None]:
    """vision.json padded with n unknown members and ending in a repeated one: a
    duplicate check that compares every pair of names would hang on it."""
    def mutate(root: Path) -> None:
        text = (root / "vision.json").read_text().rstrip().rstrip("}")
        filler = "".join(f', "k{i}": 0' for i in range(n))
        (root / "vision.json").write_text(text + filler + ', "merge": 2}')
    return mutate


VISION_CASES = {
    "vision.json with a repeated member among many": (vision_json_with_many_members(500_000),
                                                      E_FORMAT),
    "vision.json not json": (write_file("vision.json", b"{patch"), E_FORMAT),
    "vision.json zero patch": (edit_vision(lambda v: v.update(patch_size=0)), E_FORMAT),
    "vision.json missing key": (edit_vision(lambda v: v.pop("merge")), E_FORMAT),
    "vision.json absurd tokens": (edit_vision(lambda v: v.update(max_tokens=2 ** 40)), E_FORMAT),
    "vision.bin truncated": (resize("vision.bin", -4), E_FORMAT),
    "vision.bin extended": (resize("vision.bin", 4), E_FORMAT),
    "vision.bin missing": (remove("vision.bin"), E_IO),
}


def damaged_copy(src: Path, dst: Path, mutate: Callable[[Path], None]) -> Path:
    shutil.copytree(src, dst)
    mutate(dst)
    return dst


def test_the_pristine_container_opens(lib_path, k3_vision_container):
    assert open_in_child(lib_path, k3_vision_container, vision=True)["status"] == OK


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_damaged_container_is_refused(lib_path, k3_container, tmp_path, case):
    mutate, expected = TEXT_CASES[case]
    result = open_in_child(lib_path, damaged_copy(k3_container, tmp_path / "c.waste", mutate))
    assert result["status"] == expected, result
    assert result["detail"], result


@pytest.mark.parametrize("case", list(VISION_CASES))
def test_damaged_vision_tower_is_refused(lib_path, k3_vision_container, tmp_path, case):
    mutate, expected = VISION_CASES[case]
    root = damaged_copy(k3_vision_container, tmp_path / "c.waste", mutate)
    result = open_in_child(lib_path, root, vision=True)
    assert result["status"] == expected, result
    assert result["detail"], result


def test_damaged_tower_does_not_block_text_only_open(lib_path, k3_vision_container, tmp_path):
    mutate = VISION_CASES["vision.json not json"][0]
    root = damaged_copy(k3_vision_container, tmp_path / "c.waste", mutate)
    result = open_in_child(lib_path, root, vision=False)
    assert result["status"] == OK, result
    assert result["plan"] == E_FORMAT  # the plan still describes the tower, and cannot
