"""The libwaste C ABI, exercised through ctypes against real containers.

The ctypes mirror of waste.h at the top is also what test_container_fuzz.py
uses in its subprocesses.
"""
from __future__ import annotations

import contextlib
import ctypes as C
import json
import math
import os
import re
import shutil
import random
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from conftest import ROOT, make_container
from gguf_writer import tiny_llama
from state_layout import rewrite


OK, E_IO, E_FORMAT, E_RAM_BUDGET, E_OOM, E_ARG, E_UNSUPPORTED, E_CANCELLED, E_BUSY = (
    0, -1, -2, -3, -4, -5, -6, -7, -8)
PAGE = 4096
RECORD_HEADER = 64
CTX = 256  # small contexts keep every test quick


# --------------------------------------------------------------- ctypes mirror

class MemPlan(C.Structure):
    _fields_ = [(name, C.c_uint64) for name in (
        "trunk_bytes", "state_bytes", "scratch_bytes", "min_expert_cache", "floor_bytes",
        "recommended_bytes", "vision_bytes", "working_set_bytes")]


class Cfg(C.Structure):
    _fields_ = [("ram_budget_bytes", C.c_uint64), ("ctx_tokens", C.c_uint32),
                ("n_threads", C.c_int), ("cpu_list", C.c_char_p), ("cache_policy", C.c_int),
                ("use_direct_io", C.c_int), ("vision", C.c_int), ("verify_records", C.c_int),
                ("usage_path", C.c_char_p), ("exclusive_open", C.c_int)]


class GenParams(C.Structure):
    _fields_ = [("temperature", C.c_float), ("top_p", C.c_float), ("top_k", C.c_int),
                ("seed", C.c_uint64), ("max_tokens", C.c_uint32), ("grammar", C.c_char_p),
                ("stop_tokens", C.POINTER(C.c_int32)), ("n_stop", C.c_size_t)]


class TokenInfo(C.Structure):
    _fields_ = [("token_index", C.c_uint32), ("token", C.c_int32), ("logprob", C.c_float),
                ("experts_hit", C.c_uint32), ("experts_missed", C.c_uint32),
                ("bytes_read", C.c_uint64), ("ms_total", C.c_double), ("ms_io", C.c_double)]


class ModelInfo(C.Structure):
    _fields_ = [("n_layers", C.c_uint32), ("n_experts", C.c_uint32), ("top_k", C.c_uint32),
                ("hidden", C.c_uint32), ("ctx_max", C.c_uint32), ("params_total", C.c_uint64),
                ("params_active", C.c_uint64), ("arch", C.c_char_p), ("quant_summary", C.c_char_p)]


class Stats(C.Structure):
    _fields_ = [("tokens_generated", C.c_uint64), ("experts_hit", C.c_uint64),
                ("experts_missed", C.c_uint64), ("bytes_read", C.c_uint64),
                ("sec_total", C.c_double), ("sec_io", C.c_double), ("direct_io", C.c_int)]


TOKEN_CB = C.CFUNCTYPE(C.c_int, C.POINTER(TokenInfo), C.c_char_p, C.c_void_p)

_P = C.c_void_p
_I32P = C.POINTER(C.c_int32)
_SIZEP = C.POINTER(C.c_size_t)
PROTOTYPES = {
    "waste_strerror": (C.c_char_p, [C.c_int]),
    "waste_version": (C.c_char_p, []),
    "waste_version_number": (C.c_int, []),
    "waste_build_info": (C.c_char_p, []),
    "waste_cfg_init": (None, [C.POINTER(Cfg)]),
    "waste_gen_params_init": (None, [C.POINTER(GenParams)]),
    "waste_plan_memory": (C.c_int, [C.c_char_p, C.c_uint32, C.POINTER(MemPlan)]),
    "waste_open": (C.c_int, [C.c_char_p, C.POINTER(Cfg), C.POINTER(_P)]),
    "waste_close": (None, [_P]),
    "waste_memory_used": (C.c_int, [_P, C.POINTER(MemPlan)]),
    "waste_error_detail": (C.c_char_p, [_P]),
    "waste_physical_ram": (C.c_uint64, []),
    "waste_usable_ram": (C.c_uint64, []),
    "waste_tokenize": (C.c_int, [_P, C.c_char_p, C.c_int, _I32P, C.c_size_t, _SIZEP]),
    "waste_tokenize_markup": (C.c_int, [_P, C.c_char_p, C.c_int, _I32P, C.c_size_t, _SIZEP]),
    "waste_detokenize": (C.c_int, [_P, _I32P, C.c_size_t, C.c_char_p, C.c_size_t, _SIZEP]),
    "waste_image_dimensions": (C.c_int, [C.c_char_p, C.POINTER(C.c_int), C.POINTER(C.c_int)]),
    "waste_image_add": (C.c_int, [_P, C.c_char_p, _SIZEP]),
    "waste_image_expand": (C.c_int, [_P, _I32P, C.c_size_t, _I32P, C.c_size_t, _SIZEP]),
    "waste_image_clear": (None, [_P]),
    "waste_generate": (C.c_int, [_P, _I32P, C.c_size_t, C.POINTER(GenParams), TOKEN_CB, _P]),
    "waste_eval": (C.c_int, [_P, _I32P, C.c_size_t, C.POINTER(C.POINTER(C.c_float)), _SIZEP]),
    "waste_state_save": (C.c_int, [_P, C.c_char_p]),
    "waste_state_load": (C.c_int, [_P, C.c_char_p]),
    "waste_state_reset": (None, [_P]),
    "waste_model_get_info": (C.c_int, [_P, C.POINTER(ModelInfo)]),
    "waste_get_stats": (C.c_int, [_P, C.POINTER(Stats)]),
    "waste_save_usage": (C.c_int, [_P]),
}


def load_library(path: Path) -> C.CDLL:
    lib = C.CDLL(str(path))
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def make_cfg(lib: C.CDLL, **fields) -> Cfg:
    cfg = Cfg()
    lib.waste_cfg_init(C.byref(cfg))
    for key, value in fields.items():
        setattr(cfg, key, value.encode() if isinstance(value, str) else value)
    return cfg


def try_open(lib: C.CDLL, path: Path, **fields) -> tuple[int, C.c_void_p, str | None]:
    """(status, ctx, detail) of one waste_open; the caller closes ctx."""
    ctx = C.c_void_p()
    status = lib.waste_open(str(path).encode(), C.byref(make_cfg(lib, **fields)), C.byref(ctx))
    detail = lib.waste_error_detail(None)
    return status, ctx, detail.decode() if detail else None


@contextlib.contextmanager
def opened(lib: C.CDLL, path: Path, **fields) -> Iterator[C.c_void_p]:
    fields.setdefault("ctx_tokens", CTX)
    status, ctx, detail = try_open(lib, path, **fields)
    assert status == OK, detail
    try:
        yield ctx
    finally:
        lib.waste_close(ctx)


def detail_of(lib: C.CDLL, ctx) -> str | None:
    text = lib.waste_error_detail(ctx)
    return text.decode() if text is not None else None


def ints(values: Sequence[int]):
    return (C.c_int32 * max(1, len(values)))(*values)


def tokenize(lib: C.CDLL, ctx, text: str, markup: bool = False, bos: bool = False) -> list[int]:
    fn = lib.waste_tokenize_markup if markup else lib.waste_tokenize
    buf, n = (C.c_int32 * 4096)(), C.c_size_t()
    assert fn(ctx, text.encode(), int(bos), buf, 4096, C.byref(n)) == OK
    return list(buf[:n.value])


def evaluate(lib: C.CDLL, ctx, tokens: Sequence[int]) -> list[float]:
    logits, vocab = C.POINTER(C.c_float)(), C.c_size_t()
    status = lib.waste_eval(ctx, ints(tokens), len(tokens), C.byref(logits), C.byref(vocab))
    assert status == OK, detail_of(lib, ctx)
    return logits[:vocab.value]


def gen_params(lib: C.CDLL, stop: Sequence[int] = (), **fields) -> GenParams:
    params = GenParams()
    lib.waste_gen_params_init(C.byref(params))
    for key, value in fields.items():
        setattr(params, key, value)
    if stop:
        params._stop = ints(stop)  # keep the array alive with the struct
        params.stop_tokens, params.n_stop = params._stop, len(stop)
    return params


def generate(lib: C.CDLL, ctx, prompt: Sequence[int], stop_after: int | None = None,
             stop: Sequence[int] = (), **fields) -> tuple[int, list[dict]]:
    """(status, one dict per callback); stop_after makes the callback ask to stop."""
    seen: list[dict] = []

    def on_token(info, piece, _user):
        i = info.contents
        seen.append({"index": i.token_index, "token": i.token, "logprob": i.logprob,
                     "hit": i.experts_hit, "missed": i.experts_missed, "bytes": i.bytes_read,
                     "ms": i.ms_total, "piece": piece})
        return int(stop_after is not None and len(seen) >= stop_after)

    params = gen_params(lib, stop, **fields)
    status = lib.waste_generate(ctx, ints(prompt), len(prompt), C.byref(params),
                                TOKEN_CB(on_token), None)
    return status, seen


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def specials(path: Path) -> dict[str, int]:
    return {s["text"]: s["id"] for s in json.loads((path / "specials.json").read_text())}


def plan_of(lib: C.CDLL, path: Path, ctx_tokens: int = CTX) -> MemPlan:
    plan = MemPlan()
    status = lib.waste_plan_memory(str(path).encode(), ctx_tokens, C.byref(plan))
    assert status == OK, lib.waste_error_detail(None)
    return plan


def copy_container(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def record_offset(path: Path, expert: int) -> int:
    stride = struct.unpack_from("<I", (path).read_bytes(), 16)[0]
    return PAGE + expert * stride


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def lib(lib_path) -> C.CDLL:
    return load_library(lib_path)


@pytest.fixture(scope="module")
def prompt(lib, k3_container) -> list[int]:
    with opened(lib, k3_container) as ctx:
        return tokenize(lib, ctx, "The lighthouse keeper climbed the stairs", bos=True)


# ------------------------------------------------------------ layout, version

# LP64 offsets and sizes of every struct in waste.h.
EXPECTED_LAYOUT = {
    MemPlan: (64, {f: 8 * i for i, (f, _) in enumerate(MemPlan._fields_)}),
    Cfg: (56, {"ram_budget_bytes": 0, "ctx_tokens": 8, "n_threads": 12, "cpu_list": 16,
               "cache_policy": 24, "use_direct_io": 28, "vision": 32, "verify_records": 36,
               "usage_path": 40, "exclusive_open": 48}),
    GenParams: (56, {"temperature": 0, "top_p": 4, "top_k": 8, "seed": 16, "max_tokens": 24,
                     "grammar": 32, "stop_tokens": 40, "n_stop": 48}),
    TokenInfo: (48, {"token_index": 0, "token": 4, "logprob": 8, "experts_hit": 12,
                     "experts_missed": 16, "bytes_read": 24, "ms_total": 32, "ms_io": 40}),
    ModelInfo: (56, {"n_layers": 0, "n_experts": 4, "top_k": 8, "hidden": 12, "ctx_max": 16,
                     "params_total": 24, "params_active": 32, "arch": 40, "quant_summary": 48}),
    Stats: (56, {"tokens_generated": 0, "experts_hit": 8, "experts_missed": 16,
                 "bytes_read": 24, "sec_total": 32, "sec_io": 40, "direct_io": 48}),
}
C_NAMES = {MemPlan: "waste_memplan", Cfg: "waste_cfg", GenParams: "waste_gen_params",
           TokenInfo: "waste_token_info", ModelInfo: "waste_model_info", Stats: "waste_stats"}


@pytest.mark.parametrize("struct_type", list(EXPECTED_LAYOUT), ids=lambda t: t.__name__)
def test_ctypes_mirror_matches_lp64_layout(struct_type):
    size, offsets = EXPECTED_LAYOUT[struct_type]
    assert C.sizeof(struct_type) == size
    assert {f: getattr(struct_type, f).offset for f, _ in struct_type._fields_} == offsets


def test_header_layout_matches_compiler(tmp_path):
    """Compile waste.h and compare the C compiler's sizeof/offsetof with the mirror."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if not cc:
        pytest.skip("no C compiler")
    lines = []
    for struct_type, name in C_NAMES.items():
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in struct_type._fields_:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "waste.h"\n'
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    # the compiler is not under test: keep a sanitizer preload (make asan) away from it
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run([cc, "-std=c11", "-I", str(ROOT / "engine"), "-o", str(tmp_path / "layout"),
                    str(src)], check=True, env=env)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True,
                         env=env)
    measured = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines())
    for struct_type, name in C_NAMES.items():
        size, offsets = EXPECTED_LAYOUT[struct_type]
        assert int(measured[name]) == size
        for field, offset in offsets.items():
            assert int(measured[f"{name}.{field}"]) == offset, f"{name}.{field}"


def test_only_the_api_is_exported(lib_path):
    nm = shutil.which("nm")
    if not nm or lib_path.suffix != ".so":
        pytest.skip("needs nm and an ELF library")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib_path)], check=True,
                         capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert exported == set(PROTOTYPES)


def test_version_and_build_info(lib):
    assert lib.waste_version() == b"0.6.2"
    major, minor, patch = map(int, lib.waste_version().split(b"."))
    assert lib.waste_version_number() == major * 10000 + minor * 100 + patch
    info = lib.waste_build_info().decode()
    assert "\n" not in info and "0.6.2" in info and "waste-ref v1" in info


def test_strerror_covers_every_code(lib):
    texts = {code: lib.waste_strerror(code) for code in range(-8, 1)}
    assert all(texts.values())
    assert len(set(texts.values())) == len(texts)  # each code has its own text
    unknown = lib.waste_strerror(-99)
    assert unknown and unknown not in texts.values()


def test_defaults(lib):
    cfg = make_cfg(lib)
    assert (cfg.ram_budget_bytes, cfg.ctx_tokens, cfg.n_threads, cfg.cpu_list) == (0, 0, 0, None)
    assert (cfg.cache_policy, cfg.use_direct_io, cfg.vision, cfg.verify_records) == (0, 1, 0, 0)
    assert (cfg.usage_path, cfg.exclusive_open) == (None, 0)
    p = gen_params(lib)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (0.0, 1.0, 0, 0, 256)
    assert (p.grammar, bool(p.stop_tokens), p.n_stop) == (None, False, 0)


def test_ram_queries(lib):
    physical, usable = lib.waste_physical_ram(), lib.waste_usable_ram()
    assert physical == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < usable <= physical


# ----------------------------------------------------------- planning, budget

def test_plan_memory_adds_up(lib, k3_container):
    m = manifest(k3_container)
    plan = plan_of(lib, k3_container)
    stride = struct.unpack_from("<I", (k3_container / "experts/layer-001.bank").read_bytes(), 16)[0]
    moe_layers = m["n_layers"] - m["n_dense_layers"]
    assert plan.trunk_bytes == (k3_container / "trunk.bin").stat().st_size
    kv_dim = m.get("n_kv_heads", m["n_heads"]) * m["head_dim"]
    assert plan.state_bytes == 2 * m["n_layers"] * CTX * kv_dim * 2   # keys and values, f16
    assert plan.min_expert_cache == stride
    assert plan.floor_bytes == (plan.trunk_bytes + plan.state_bytes + plan.scratch_bytes
                                + plan.min_expert_cache)
    assert plan.recommended_bytes == plan.floor_bytes + moe_layers * m["n_experts"] * stride
    assert plan.working_set_bytes == m["top_k"] * moe_layers * stride
    assert plan.vision_bytes == 0
    assert plan_of(lib, k3_container, 2 * CTX).state_bytes == 2 * plan.state_bytes


def test_plan_memory_reads_no_weights(lib, k3_container, tmp_path):
    copy = copy_container(k3_container, tmp_path / "c.waste")
    (copy / "trunk.bin").unlink()
    assert bytes(plan_of(lib, copy)) == bytes(plan_of(lib, k3_container))


def test_plan_memory_errors(lib, k3_container, tmp_path):
    plan = MemPlan()
    assert lib.waste_plan_memory(str(tmp_path / "none").encode(), 0, C.byref(plan)) == E_IO
    assert "manifest.json" in lib.waste_error_detail(None).decode()
    assert lib.waste_plan_memory(None, 0, C.byref(plan)) == E_ARG
    copy = copy_container(k3_container, tmp_path / "c.waste")
    (copy / "manifest.json").write_text("{")
    assert lib.waste_plan_memory(str(copy).encode(), 0, C.byref(plan)) == E_FORMAT


def test_a_context_above_the_declared_length_is_refused_and_the_default_stays_within(
        lib, k3_container, tmp_path):
    declared = manifest(k3_container)["context_length"]
    assert plan_of(lib, k3_container, declared).state_bytes > 0
    plan = MemPlan()
    assert lib.waste_plan_memory(str(k3_container).encode(), declared + 1, C.byref(plan)) == E_ARG
    assert f"context_length of {declared}" in lib.waste_error_detail(None).decode()
    status, ctx, detail = try_open(lib, k3_container, ctx_tokens=declared + 1)
    assert (status, ctx.value) == (E_ARG, None) and f"context_length of {declared}" in detail
    # A model trained for less than the default 4096 opens at its own length by default.
    short = copy_container(k3_container, tmp_path / "short.waste")
    (short / "manifest.json").write_text(json.dumps({**manifest(k3_container), "context_length": 300}))
    assert plan_of(lib, short, 0).state_bytes == plan_of(lib, short, 300).state_bytes
    with opened(lib, short, ctx_tokens=0) as opened_ctx:
        info = ModelInfo()
        assert lib.waste_model_get_info(opened_ctx, C.byref(info)) == OK and info.ctx_max == 300
    # Without the key nothing is declared: any context plans.
    undeclared = copy_container(k3_container, tmp_path / "any.waste")
    (undeclared / "manifest.json").write_text(json.dumps(
        {k: v for k, v in manifest(k3_container).items() if k != "context_length"}))
    assert plan_of(lib, undeclared, 4 * declared).state_bytes == 4 * plan_of(lib, k3_container,
                                                                             declared).state_bytes
    (short / "manifest.json").write_text(json.dumps({**manifest(k3_container), "context_length": 0}))
    assert lib.waste_plan_memory(str(short).encode(), 0, C.byref(plan)) == E_FORMAT


def test_vision_plan(lib, k3_vision_container):
    assert plan_of(lib, k3_vision_container).vision_bytes > 0


def test_budget_below_floor_is_refused(lib, k3_container, k3_vision_container):
    floor = plan_of(lib, k3_container).floor_bytes
    status, _, detail = try_open(lib, k3_container, ctx_tokens=CTX, ram_budget_bytes=floor - 1)
    assert status == E_RAM_BUDGET
    assert str(floor - 1) in detail and str(floor) in detail
    vplan = plan_of(lib, k3_vision_container)
    status, _, detail = try_open(lib, k3_vision_container, ctx_tokens=CTX, vision=1,
                                 ram_budget_bytes=vplan.floor_bytes)
    assert status == E_RAM_BUDGET
    assert str(vplan.floor_bytes + vplan.vision_bytes) in detail


def test_budget_sizes_the_cache(lib, k3_container):
    plan = plan_of(lib, k3_container)
    stride = plan.min_expert_cache
    total = (plan.recommended_bytes - plan.floor_bytes) // stride  # every record fits
    for budget, records in [(plan.floor_bytes, 1), (plan.floor_bytes + 3 * stride + 5, 4),
                            (plan.recommended_bytes, total), (0, total)]:
        with opened(lib, k3_container, ram_budget_bytes=budget) as ctx:
            used = MemPlan()
            assert lib.waste_memory_used(ctx, C.byref(used)) == OK
            assert used.floor_bytes == plan.floor_bytes
            cache = used.recommended_bytes - (used.floor_bytes - used.min_expert_cache)
            assert cache == records * stride
            assert used.vision_bytes == 0


# ----------------------------------------------------------------- open, info

def test_open_errors(lib, k3_container, tmp_path):
    status, ctx, detail = try_open(lib, tmp_path / "missing.waste")
    assert (status, ctx.value) == (E_IO, None) and "manifest.json" in detail
    status, _, detail = try_open(lib, k3_container, vision=1)
    assert status == E_UNSUPPORTED and "vision" in detail
    assert try_open(lib, k3_container, cache_policy=7)[0] == E_ARG
    assert try_open(lib, k3_container, n_threads=-1)[0] == E_ARG


@pytest.mark.parametrize("cpus", ["", "3-1", "a", "1,,2", "-1", "0-", "0,", "1 2", "99999"])
def test_malformed_cpu_list_is_refused(lib, k3_container, cpus):
    status, _, detail = try_open(lib, k3_container, ctx_tokens=CTX, cpu_list=cpus)
    assert status == E_ARG and "cpu_list" in detail


def test_cpu_list_binds_to_allowed_cpus(lib, k3_container, prompt):
    allowed = sorted(os.sched_getaffinity(0))
    forbidden = next(c for c in range(1024) if c not in allowed)
    status, _, detail = try_open(lib, k3_container, ctx_tokens=CTX, cpu_list=str(forbidden))
    assert status == E_ARG and f"CPU {forbidden}" in detail
    with opened(lib, k3_container) as ctx:
        reference = evaluate(lib, ctx, prompt)
    with opened(lib, k3_container, cpu_list=f"{allowed[0]}-{allowed[-1]}") as ctx:
        assert evaluate(lib, ctx, prompt) == reference
    assert os.sched_getaffinity(0) == set(allowed)  # the caller's mask is given back


def test_thread_count_does_not_change_results(lib, k3_container, prompt):
    results = []
    for threads in (1, 2, 3):
        with opened(lib, k3_container, n_threads=threads) as ctx:
            results.append(evaluate(lib, ctx, prompt))
    assert results[0] == results[1] == results[2]


def test_contexts_prefill_and_decode_at_once(lib, k3_container, gguf_container):
    """Three contexts in one process -- two of one container, one of another -- each with a
    pool of two threads, prefill a batched prompt and decode at the same moment from three
    host threads (ctypes lets go of the GIL): every one finishes with the tokens and
    log-probabilities it gives alone."""
    import threading
    jobs = []
    for path in (k3_container, k3_container, gguf_container):
        rng = random.Random(len(jobs))
        vocab = manifest(path)["vocab_size"]
        jobs.append((path, [rng.randrange(vocab) for _ in range(150)]))

    def answer(path: Path, prompt: list[int], start: threading.Barrier | None = None):
        with opened(lib, path, ctx_tokens=512, n_threads=2) as ctx:
            if start:
                start.wait()
            status, seen = generate(lib, ctx, prompt, max_tokens=40)
        assert status == OK
        return [(t["token"], t["logprob"]) for t in seen]

    alone = [answer(path, prompt) for path, prompt in jobs]
    together: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        together[i] = answer(*jobs[i], start)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert together == alone and all(len(a) == 40 for a in alone)


def test_model_info(lib, k3_container):
    m = manifest(k3_container)
    h, moe = m["hidden"], m["n_layers"] - m["n_dense_layers"]
    trunk = (k3_container / "trunk.bin").stat().st_size // 4
    expert = 3 * h * m["expert_ffn"]
    with opened(lib, k3_container, ctx_tokens=300) as ctx:
        info = ModelInfo()
        assert lib.waste_model_get_info(ctx, C.byref(info)) == OK
        assert (info.n_layers, info.n_experts, info.top_k, info.hidden, info.ctx_max) == (
            m["n_layers"], m["n_experts"], m["top_k"], h, 300)
        assert info.params_total == trunk + moe * m["n_experts"] * expert
        assert info.params_active == trunk - m["vocab_size"] * h + h + moe * m["top_k"] * expert
        assert info.arch == m["arch"].encode()
        assert info.quant_summary == b"experts Q8G32, trunk F32"


def test_exclusive_open(lib, k3_container):
    with opened(lib, k3_container, exclusive_open=1):
        status, ctx, detail = try_open(lib, k3_container, exclusive_open=1)
        assert (status, ctx.value) == (E_BUSY, None) and "manifest.json" in detail
        with opened(lib, k3_container):  # a non-exclusive open does not compete
            pass
    with opened(lib, k3_container, exclusive_open=1):  # released by close
        pass


def test_error_detail_is_per_call(lib, k3_container):
    try_open(lib, k3_container, cpu_list="x")
    assert lib.waste_error_detail(None) is not None
    plan_of(lib, k3_container)
    assert lib.waste_error_detail(None) is None
    with opened(lib, k3_container) as ctx:
        assert lib.waste_eval(ctx, ints([1]), 0, None, None) == E_ARG
        assert detail_of(lib, ctx)
        evaluate(lib, ctx, [1])
        assert detail_of(lib, ctx) is None


# ------------------------------------------------------------------ tokenizer

def test_markup_and_plain_differ_exactly_on_specials(lib, k3_container):
    ids = specials(k3_container)
    with opened(lib, k3_container) as ctx:
        text = "<|open|>message<|sep|>hello there<|close|>"
        markup = tokenize(lib, ctx, text, markup=True)
        assert markup == ([ids["<|open|>"]] + tokenize(lib, ctx, "message") + [ids["<|sep|>"]]
                          + tokenize(lib, ctx, "hello there") + [ids["<|close|>"]])
        plain = tokenize(lib, ctx, text)
        assert not set(plain) & set(ids.values())
        assert tokenize(lib, ctx, "hi", bos=True) == [ids[manifest(k3_container)["bos_token"]]] + \
            tokenize(lib, ctx, "hi")


def test_tokenize_short_buffer(lib, k3_container):
    with opened(lib, k3_container) as ctx:
        full = tokenize(lib, ctx, "The lighthouse keeper")
        buf, n = (C.c_int32 * 1)(), C.c_size_t()
        assert lib.waste_tokenize(ctx, b"The lighthouse keeper", 0, buf, 1, C.byref(n)) == E_ARG
        assert n.value == len(full)


def test_detokenize(lib, k3_container):
    text = "Rivers shape the land slowly. Zürich 🙂"
    with opened(lib, k3_container) as ctx:
        ids = tokenize(lib, ctx, text)
        need = C.c_size_t()
        assert lib.waste_detokenize(ctx, ints(ids), len(ids), None, 0, C.byref(need)) == E_ARG
        assert need.value == len(text.encode())
        short = C.create_string_buffer(need.value)  # no room for the NUL
        assert lib.waste_detokenize(ctx, ints(ids), len(ids), short, need.value, C.byref(need)) == E_ARG
        buf, n = C.create_string_buffer(need.value + 1), C.c_size_t()
        assert lib.waste_detokenize(ctx, ints(ids), len(ids), buf, need.value + 1, C.byref(n)) == OK
        assert buf.value.decode() == text and n.value == len(text.encode())
        vocab = manifest(k3_container)["vocab_size"]
        for bad in (vocab, -1):
            assert lib.waste_detokenize(ctx, ints([bad]), 1, buf, len(buf), C.byref(n)) == E_ARG


# ----------------------------------------------------------------- evaluation

def test_chunked_eval_equals_token_at_a_time(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        whole = evaluate(lib, ctx, prompt)
        lib.waste_state_reset(ctx)
        evaluate(lib, ctx, prompt[:3])
        chunked = evaluate(lib, ctx, prompt[3:])
        lib.waste_state_reset(ctx)
        for token in prompt:
            single = evaluate(lib, ctx, [token])
    assert whole == chunked == single
    assert all(math.isfinite(x) for x in whole)


def random_chunks(rng: random.Random, total: int, largest: int = 700) -> list[int]:
    """Sizes 1..largest adding up to total."""
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, largest), total - sum(sizes)))
    return sizes


def one_at_a_time(lib, ctx, tokens: Sequence[int]) -> list[list[float]]:
    """The logits after each position, evaluating one token per call."""
    return [evaluate(lib, ctx, [token]) for token in tokens]


@pytest.fixture(scope="module")
def gguf_container(tmp_path_factory) -> Path:
    """A llama converted from a GGUF (q4_1 blocks, q8g32 tied embeddings, 2 KV heads for 4)."""
    d = tmp_path_factory.mktemp("gguf")
    converted = subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"),
                                str(d / "tiny.waste"), "--from-gguf", str(tiny_llama(d / "tiny.gguf"))],
                               capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    return d / "tiny.waste"


@pytest.mark.parametrize("name", ["k3", "k3 vision", "kimi-linear", "plain", "gguf"])
def test_batches_of_any_size_equal_one_position_at_a_time(lib, name, request):
    """A prompt cut into random chunks of 1 to 700 (so past one internal batch of 512),
    on random tokens (so the batch's tokens spread over many experts), evaluated with 3
    threads, gives at every chunk's end the bits one position at a time gives on one thread;
    so does one position at a time on 3 threads, whose steps past 256 positions share their
    spans of positions among the threads (engine/attention.c)."""
    container = request.getfixturevalue({"k3": "k3_container", "k3 vision": "k3_vision_container",
                                         "kimi-linear": "kimi_linear_container",
                                         "plain": "plain_container",
                                         "gguf": "gguf_container"}[name])
    rng = random.Random(name)
    vocab = manifest(container)["vocab_size"]
    tokens = [rng.randrange(vocab) for _ in range(1000)]
    with opened(lib, container, ctx_tokens=1024, n_threads=1) as ctx:
        single = one_at_a_time(lib, ctx, tokens)
    for seed in range(2):
        sizes = random_chunks(random.Random(seed), len(tokens))
        assert max(sizes) > 512 or seed == 0
        with opened(lib, container, ctx_tokens=1024, n_threads=3) as ctx:
            at = 0
            for size in sizes:
                logits = evaluate(lib, ctx, tokens[at:at + size])
                at += size
                assert logits == single[at - 1], (sizes, at)
    with opened(lib, container, ctx_tokens=1024, n_threads=3) as ctx:
        assert one_at_a_time(lib, ctx, tokens) == single


KERNEL_CHILD = """
import json, os, sys
sys.path[0:0] = sys.argv[1].split(os.pathsep)
from test_abi import evaluate, load_library, opened
lib, tokens = load_library(sys.argv[2]), json.loads(sys.argv[4])
with opened(lib, sys.argv[3], ctx_tokens=1024) as ctx:
    whole = evaluate(lib, ctx, tokens)
    lib.waste_state_reset(ctx)
    for at in range(0, len(tokens), 97):
        split = evaluate(lib, ctx, tokens[at:at + 97])
print(json.dumps({"whole": whole, "split": split}))
"""


def logits_in_child(lib_path: Path, container: Path, tokens: list[int], plain: bool) -> dict:
    """The logits of tokens in one call and in chunks of 97, in a process of its own (the
    kernel choice is made once per process)."""
    env = {**os.environ, "WASTE_NO_AVX2": "1" if plain else "0"}
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHILD,
                           os.pathsep.join([str(Path(__file__).parent), str(ROOT / "tests")]), str(lib_path),
                           str(container), json.dumps(tokens)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", ["k3", "gguf"])
def test_the_plain_c_kernels_agree_with_the_simd_ones(lib_path, name, request):
    """WASTE_NO_AVX2=1 keeps the kernels on their portable path: it too gives the same bits
    however a prompt is split, and logits within 1e-4 of their spread of the AVX2 path's
    (the two differ by rounding only).  Without AVX2 on the machine both runs are plain."""
    container = request.getfixturevalue({"k3": "k3_container", "gguf": "gguf_container"}[name])
    vocab = manifest(container)["vocab_size"]
    tokens = [random.Random(name).randrange(vocab) for _ in range(600)]
    plain = logits_in_child(lib_path, container, tokens, plain=True)
    simd = logits_in_child(lib_path, container, tokens, plain=False)
    assert plain["whole"] == plain["split"] and simd["whole"] == simd["split"]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if re.search(r"\bavx2\b", flags) and re.search(r"\bfma\b", flags):
        assert plain["whole"] != simd["whole"]   # two paths were taken
    spread = max(simd["whole"]) - min(simd["whole"])
    assert max(abs(a - b) for a, b in zip(plain["whole"], simd["whole"])) < 1e-4 * spread


def test_an_image_in_the_middle_of_a_chunk(lib, k3_vision_container, tmp_path):
    """Image rows enter at their pad positions whichever chunk holds them: chunks that start
    before, inside and after the image give the bits of one position at a time."""
    image = write(tmp_path / "a.png", png_bytes(96, 64, seed=5))
    pad = specials(k3_vision_container)["<|media_pad|>"]
    rng = random.Random(3)
    with opened(lib, k3_vision_container, vision=1, ctx_tokens=512) as ctx:
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(image).encode(), C.byref(n)) == OK
        text = [rng.randrange(1200) for _ in range(60)]
        _, tokens, _ = expand(lib, ctx, text[:25] + [pad] + text[25:])
        assert tokens.count(pad) == n.value > 4
        single = one_at_a_time(lib, ctx, tokens)
        first = tokens.index(pad)
        for cuts in ([first - 3, first + 2, len(tokens)], [first + 1, len(tokens)],
                     [5, first + n.value + 3, len(tokens)], [len(tokens)]):
            lib.waste_state_reset(ctx)
            assert lib.waste_image_add(ctx, str(image).encode(), C.byref(n)) == OK
            at = 0
            for cut in cuts:
                logits = evaluate(lib, ctx, tokens[at:cut])
                at = cut
                assert logits == single[at - 1], (cuts, at)
        lib.waste_state_reset(ctx)
        plain = evaluate(lib, ctx, tokens)   # no image queued: the pads are ordinary tokens
    assert plain != single[-1]


def test_one_record_cache_gives_the_same_logits(lib, k3_container, prompt):
    plan = plan_of(lib, k3_container)
    results = {}
    for name, budget, policy in [("one", plan.floor_bytes, 0), ("all", plan.recommended_bytes, 0),
                                 ("lru", plan.floor_bytes + 2 * plan.min_expert_cache, 1)]:
        with opened(lib, k3_container, ram_budget_bytes=budget, cache_policy=policy) as ctx:
            used = MemPlan()
            lib.waste_memory_used(ctx, C.byref(used))
            results[name] = (evaluate(lib, ctx, prompt), used.recommended_bytes)
            stats = Stats()
            lib.waste_get_stats(ctx, C.byref(stats))
            results[name] += (stats.experts_missed,)
    assert results["one"][0] == results["all"][0] == results["lru"][0]
    assert results["one"][1] < results["lru"][1] < results["all"][1]
    assert results["one"][2] >= results["lru"][2] >= results["all"][2]


def test_q8_experts_approximate_f32_experts(lib, k3_container, prompt, tmp_path):
    """The same weights stored as f32 and as q8g32 give nearly the same logits."""
    f32 = make_container(tmp_path / "f32.waste", "--quant", "f32")
    with opened(lib, f32) as ctx:
        info = ModelInfo()
        lib.waste_model_get_info(ctx, C.byref(info))
        assert info.quant_summary == b"experts F32, trunk F32"
        exact = evaluate(lib, ctx, prompt)
    with opened(lib, k3_container) as ctx:
        quantized = evaluate(lib, ctx, prompt)
    assert exact != quantized
    spread = max(exact) - min(exact)
    assert max(abs(a - b) for a, b in zip(exact, quantized)) < 0.01 * spread


def test_other_flavours_generate(lib, kimi_linear_container, plain_container, prompt):
    for container in (kimi_linear_container, plain_container):
        with opened(lib, container) as ctx:
            status, seen = generate(lib, ctx, tokenize(lib, ctx, "Rivers shape", bos=True),
                                    max_tokens=5)
            assert status == OK and len(seen) == 5


def test_eval_errors_change_nothing(lib, k3_container, prompt):
    vocab = manifest(k3_container)["vocab_size"]
    with opened(lib, k3_container, ctx_tokens=16) as ctx:
        logits = C.POINTER(C.c_float)()
        n = C.c_size_t()
        assert lib.waste_eval(ctx, ints(prompt), 0, C.byref(logits), C.byref(n)) == E_ARG
        assert lib.waste_eval(ctx, ints([vocab]), 1, C.byref(logits), C.byref(n)) == E_ARG
        assert lib.waste_eval(ctx, ints([1] * 17), 17, C.byref(logits), C.byref(n)) == E_ARG
        assert "16" in detail_of(lib, ctx)
        assert evaluate(lib, ctx, [1] * 16)  # exactly the context fits
        assert lib.waste_eval(ctx, ints([1]), 1, C.byref(logits), C.byref(n)) == E_ARG


def read_usage(path: Path, keys: int) -> list[int]:
    """The routing counts of a hotlist file (engine/usage.h: a 20-byte header, then u64s)."""
    return list(struct.unpack_from(f"<{keys}Q", path.read_bytes(), 20))


def test_stats_count_one_fetch_per_expert_and_batch(lib, k3_container, prompt, tmp_path):
    """The hit and miss counters count experts read through the cache.  A batch (here the
    whole prompt) reads each expert its tokens chose once, however many tokens it serves; a
    generated token reads its own top_k per MoE layer.  The hotlist still counts routings:
    top_k per token and MoE layer."""
    m = manifest(k3_container)
    moe, keys = m["n_layers"] - m["n_dense_layers"], (m["n_layers"] - m["n_dense_layers"]) * m["n_experts"]
    per_token = moe * m["top_k"]
    alone, usage = tmp_path / "alone.waste", tmp_path / "usage.waste"
    with opened(lib, k3_container, usage_path=str(alone)) as ctx:
        evaluate(lib, ctx, prompt)
        stats = Stats()
        lib.waste_get_stats(ctx, C.byref(stats))
        assert lib.waste_save_usage(ctx) == OK
    routed = read_usage(alone, keys)
    distinct = sum(1 for count in routed if count)  # the (layer, expert) pairs the prompt chose
    assert sum(routed) == len(prompt) * per_token
    assert stats.experts_hit + stats.experts_missed == distinct < len(prompt) * per_token
    with opened(lib, k3_container, usage_path=str(usage)) as ctx:
        status, seen = generate(lib, ctx, prompt, max_tokens=5)
        assert status == OK and len(seen) == 5
        assert lib.waste_get_stats(ctx, C.byref(stats)) == OK
        assert stats.tokens_generated == 5
        # the first token's counters include its prompt's
        assert seen[0]["hit"] + seen[0]["missed"] == distinct + per_token
        assert all(t["hit"] + t["missed"] == per_token for t in seen[1:])
        assert stats.experts_hit + stats.experts_missed == distinct + 5 * per_token
        assert sum(t["hit"] + t["missed"] for t in seen) == stats.experts_hit + stats.experts_missed
        assert stats.bytes_read == stats.experts_missed * plan_of(lib, k3_container).min_expert_cache
        assert sum(t["bytes"] for t in seen) == stats.bytes_read
        assert stats.direct_io in (0, 1) and stats.sec_total >= stats.sec_io >= 0
        assert lib.waste_save_usage(ctx) == OK
    assert sum(read_usage(usage, keys)) == (len(prompt) + 5) * per_token
    with opened(lib, k3_container, use_direct_io=0) as ctx:
        stats = Stats()
        lib.waste_get_stats(ctx, C.byref(stats))
        assert stats.direct_io == 0  # asked to keep the page cache


def test_delay_knob_slows_each_evaluated_token(lib, k3_container, prompt, monkeypatch):
    """WASTE_DELAY_MS: the reference engine at a slow model's clock, for time-based tests."""
    with opened(lib, k3_container) as ctx:
        plain = evaluate(lib, ctx, prompt)
    monkeypatch.setenv("WASTE_DELAY_MS", "40")
    with opened(lib, k3_container) as ctx:
        started = time.monotonic()
        assert evaluate(lib, ctx, prompt) == plain   # slower, not different
        assert time.monotonic() - started >= 0.04 * len(prompt)
        status, seen = generate(lib, ctx, [prompt[0]], max_tokens=3)
        assert status == OK and len(seen) == 3
        assert all(t["ms"] >= 40 for t in seen)
        stats = Stats()
        lib.waste_get_stats(ctx, C.byref(stats))
        assert stats.sec_total >= 0.04 * (len(prompt) + 4)
    for ignored in ("-5", "nonsense", "1e9"):
        monkeypatch.setenv("WASTE_DELAY_MS", ignored)
        with opened(lib, k3_container) as ctx:
            started = time.monotonic()
            evaluate(lib, ctx, prompt)
            assert time.monotonic() - started < 0.04 * len(prompt)


# ----------------------------------------------------------------- generation

def test_greedy_is_deterministic_and_runs_long(lib, k3_container, prompt):
    with opened(lib, k3_container, ctx_tokens=512) as ctx:
        status, first = generate(lib, ctx, prompt, max_tokens=300)
        assert status == OK and len(first) == 300  # the container never favours EOS
        assert [t["index"] for t in first] == list(range(300))
        lib.waste_state_reset(ctx)
        status, second = generate(lib, ctx, prompt, max_tokens=300)
    assert [t["token"] for t in first] == [t["token"] for t in second]


def test_greedy_picks_argmax_and_reports_logprob(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        logits = evaluate(lib, ctx, prompt)
        lib.waste_state_reset(ctx)
        status, seen = generate(lib, ctx, prompt, max_tokens=1)
    best = max(range(len(logits)), key=lambda i: (logits[i], -i))
    top = max(logits)
    log_sum = top + math.log(sum(math.exp(x - top) for x in logits))
    assert seen[0]["token"] == best
    assert seen[0]["logprob"] == pytest.approx(logits[best] - log_sum, abs=1e-4)
    assert seen[0]["piece"]


def test_each_token_is_in_the_state_before_its_callback(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        status, seen = generate(lib, ctx, prompt, max_tokens=4)
        after = evaluate(lib, ctx, [1])
        lib.waste_state_reset(ctx)
        replay = evaluate(lib, ctx, prompt + [t["token"] for t in seen] + [1])
    assert after == replay


def test_seeded_sampling(lib, k3_container, prompt):
    def run(seed: int, **fields) -> list[int]:
        with opened(lib, k3_container) as ctx:
            status, seen = generate(lib, ctx, prompt, max_tokens=24, seed=seed,
                                    **{"temperature": 1.0, **fields})
            assert status == OK
            return [t["token"] for t in seen]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(3, top_k=1) == run(4, top_k=1) == run(5, temperature=0.0)  # top_k 1 is greedy
    assert run(3, top_p=1e-6) == run(5, temperature=0.0)  # and so is a tiny nucleus


def test_logprob_of_sampled_tokens(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        status, seen = generate(lib, ctx, prompt, max_tokens=3, temperature=1.5, seed=11)
        lib.waste_state_reset(ctx)
        history = list(prompt)
        for t in seen:
            logits = evaluate(lib, ctx, history[-1:] if len(history) > len(prompt) else history)
            top = max(logits)
            log_sum = top + math.log(sum(math.exp(x - top) for x in logits))
            assert t["logprob"] == pytest.approx(logits[t["token"]] - log_sum, abs=1e-4)
            history.append(t["token"])


def test_max_tokens(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        assert len(generate(lib, ctx, prompt, max_tokens=7)[1]) == 7
        lib.waste_state_reset(ctx)
        status, seen = generate(lib, ctx, prompt, max_tokens=0)
        assert (status, seen) == (OK, [])


def test_stop_tokens_are_delivered_then_end(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        _, free_run = generate(lib, ctx, prompt, max_tokens=12)
        tokens = [t["token"] for t in free_run]
        stop = tokens[5]
        lib.waste_state_reset(ctx)
        status, seen = generate(lib, ctx, prompt, max_tokens=12, stop=[-3, stop])
    assert status == OK
    assert [t["token"] for t in seen] == tokens[:tokens.index(stop) + 1]


def test_eos_ends_generation(lib, k3_container, prompt, tmp_path):
    """Give EOS the lm_head row of the greedy token, doubled, so greedy picks EOS."""
    m = manifest(k3_container)
    with opened(lib, k3_container) as ctx:
        logits = evaluate(lib, ctx, prompt)
    best = max(range(len(logits)), key=lambda i: logits[i])
    assert logits[best] > 0
    copy = copy_container(k3_container, tmp_path / "eos.waste")
    trunk = bytearray((copy / "trunk.bin").read_bytes())
    h, eos = m["hidden"], specials(copy)[m["eos_token"]]
    head = len(trunk) - m["vocab_size"] * h * 4
    row = struct.unpack_from(f"<{h}f", trunk, head + best * h * 4)
    struct.pack_into(f"<{h}f", trunk, head + eos * h * 4, *(2 * x for x in row))
    (copy / "trunk.bin").write_bytes(bytes(trunk))
    with opened(lib, copy) as ctx:
        status, seen = generate(lib, ctx, prompt, max_tokens=10)
    assert status == OK
    assert [t["token"] for t in seen] == [eos]
    assert seen[0]["piece"] == m["eos_token"].encode()


def test_cancellation(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        status, seen = generate(lib, ctx, prompt, stop_after=3, max_tokens=10)
        assert status == E_CANCELLED and len(seen) == 3
        assert detail_of(lib, ctx)


def test_prompt_that_does_not_fit(lib, k3_container):
    with opened(lib, k3_container, ctx_tokens=64) as ctx:
        evaluate(lib, ctx, [5] * 30)
        status, seen = generate(lib, ctx, [6] * 34, max_tokens=3)
        assert (status, seen) == (E_ARG, [])
        detail = detail_of(lib, ctx)
        assert "30" in detail and "64" in detail
        after = evaluate(lib, ctx, [7])  # nothing was evaluated
        lib.waste_state_reset(ctx)
        assert evaluate(lib, ctx, [5] * 30 + [7]) == after
        lib.waste_state_reset(ctx)
        evaluate(lib, ctx, [5] * 30)
        status, seen = generate(lib, ctx, [6] * 33, max_tokens=3)  # leaves exactly one position
        assert status == OK and len(seen) == 1
        assert generate(lib, ctx, [], max_tokens=3)[0] == E_ARG


def test_context_filled_mid_answer(lib, k3_container):
    with opened(lib, k3_container, ctx_tokens=64) as ctx:
        status, seen = generate(lib, ctx, [5] * 10, max_tokens=100)
        assert status == OK and len(seen) == 54
        assert "64" in detail_of(lib, ctx)
        lib.waste_state_reset(ctx)
        status, seen = generate(lib, ctx, [5] * 10, max_tokens=5)
        assert status == OK and len(seen) == 5 and detail_of(lib, ctx) is None


def test_tokenizing_inside_the_token_callback(lib, k3_container):
    """serve tokenizes for waiting requests between two generated tokens (waste.h, waste_token_cb):
    the nested calls answer as outside, and the generation and its context-full detail are
    those of a run without them."""
    text = "Hello <|open|> wörld 123 🙂"
    with opened(lib, k3_container, ctx_tokens=64) as ctx:
        want = (tokenize(lib, ctx, text), tokenize(lib, ctx, text, markup=True))
        status, plain = generate(lib, ctx, [5] * 10, max_tokens=100, temperature=1.0, seed=3)
        plain_detail = detail_of(lib, ctx)
        lib.waste_state_reset(ctx)
        got, tokens = [], []

        def on_token(info, piece, _user):
            tokens.append(info.contents.token)
            got.append((tokenize(lib, ctx, text), tokenize(lib, ctx, text, markup=True)))
            out, n = C.create_string_buffer(256), C.c_size_t()
            assert lib.waste_detokenize(ctx, ints(want[0]), len(want[0]), out, 256, C.byref(n)) == OK
            assert out.raw[:n.value] == text.encode()
            return 0

        params = gen_params(lib, max_tokens=100, temperature=1.0, seed=3)
        nested = lib.waste_generate(ctx, ints([5] * 10), 10, C.byref(params), TOKEN_CB(on_token), None)
        nested_detail = detail_of(lib, ctx)
    assert status == nested == OK and len(plain) == 54
    assert tokens == [t["token"] for t in plain]
    assert got == [want] * 54 and want[0] != want[1]
    assert plain_detail is not None and nested_detail == plain_detail


def test_bad_generation_params(lib, k3_container, prompt):
    with opened(lib, k3_container) as ctx:
        for fields in ({"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -2}):
            assert generate(lib, ctx, prompt, **fields)[0] == E_ARG


# ---------------------------------------------------------------------- state

def test_state_save_reset_load_continues_exactly(lib, k3_container, prompt, tmp_path):
    path = tmp_path / "s.state"
    with opened(lib, k3_container) as ctx:
        generate(lib, ctx, prompt, max_tokens=6)
        assert lib.waste_state_save(ctx, str(path).encode()) == OK
        _, expected = generate(lib, ctx, [9], max_tokens=8)
        lib.waste_state_reset(ctx)
        _, fresh = generate(lib, ctx, [9], max_tokens=8)
        lib.waste_state_reset(ctx)
        assert lib.waste_state_load(ctx, str(path).encode()) == OK
        _, resumed = generate(lib, ctx, [9], max_tokens=8)
    assert [t["token"] for t in resumed] == [t["token"] for t in expected]
    assert [t["token"] for t in fresh] != [t["token"] for t in expected]
    assert [p.name for p in tmp_path.iterdir()] == ["s.state"]  # no temp file left


def test_a_save_that_cannot_be_written_fails_cleanly(lib, k3_container, prompt, tmp_path):
    # The destination is a directory: the temporary file is written, the rename
    # over it fails, and nothing may be left behind.
    target = tmp_path / "occupied"
    (target / "inside").mkdir(parents=True)
    with opened(lib, k3_container) as ctx:
        evaluate(lib, ctx, prompt)
        assert lib.waste_state_save(ctx, str(target).encode()) == E_IO
        assert b"occupied" in detail_of(lib, ctx).encode()
        assert lib.waste_state_save(ctx, str(tmp_path / "no" / "dir.state").encode()) == E_IO
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]
    assert [p.name for p in target.iterdir()] == ["inside"]


def test_state_load_rejects_foreign_and_damaged_files(lib, k3_container, plain_container, prompt,
                                                      tmp_path):
    mine, foreign, reseeded = tmp_path / "k3.state", tmp_path / "plain.state", tmp_path / "s.state"
    # same manifest, other weights: the fingerprint covers the trunk too
    sibling = make_container(tmp_path / "seed3.waste", "--seed", "3")
    for container, path in ((plain_container, foreign), (sibling, reseeded)):
        with opened(lib, container) as ctx:
            evaluate(lib, ctx, [1, 2, 3])
            assert lib.waste_state_save(ctx, str(path).encode()) == OK
    with opened(lib, k3_container) as ctx:
        evaluate(lib, ctx, prompt)
        assert lib.waste_state_save(ctx, str(mine).encode()) == OK
        empty = None
        data = mine.read_bytes()
        damaged = tmp_path / "damaged.state"
        truncated = tmp_path / "truncated.state"
        damaged.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        truncated.write_bytes(data[:-9])
        for bad in (foreign, reseeded, damaged, truncated):
            evaluate(lib, ctx, [4])
            assert lib.waste_state_load(ctx, str(bad).encode()) == E_FORMAT, bad.name
            assert detail_of(lib, ctx)
            logits = evaluate(lib, ctx, [4])  # the state was left reset
            lib.waste_state_reset(ctx)
            empty = empty or evaluate(lib, ctx, [4])
            assert logits == empty
        assert lib.waste_state_load(ctx, str(tmp_path / "none").encode()) == E_IO
    with opened(lib, k3_container, ctx_tokens=4) as ctx:
        assert lib.waste_state_load(ctx, str(mine).encode()) == E_ARG


@pytest.mark.parametrize("version", [1, 2])
def test_a_state_of_an_older_layout_is_refused(lib, k3_container, prompt, tmp_path, version):
    """Older state files would be misread by today's cache: version 1 (engine 0.6.0: keys
    position by position) and version 2 (0.6.1: f32, where the cache now holds f16). Each is
    refused as WASTE_E_FORMAT, naming its version, with the state reset."""
    current, old = tmp_path / "v3.state", tmp_path / f"v{version}.state"
    m = manifest(k3_container)
    with opened(lib, k3_container) as ctx:
        evaluate(lib, ctx, prompt)
        assert lib.waste_state_save(ctx, str(current).encode()) == OK
        rewrite(current, old, version, m.get("n_kv_heads", m["n_heads"]))
        assert old.read_bytes() != current.read_bytes()
        assert lib.waste_state_load(ctx, str(old).encode()) == E_FORMAT
        assert f"version {version}" in detail_of(lib, ctx)
        after = evaluate(lib, ctx, [4])
        lib.waste_state_reset(ctx)
        assert after == evaluate(lib, ctx, [4])
        assert lib.waste_state_load(ctx, str(current).encode()) == OK


def test_a_state_file_holds_the_cache_in_f16(lib, k3_container, prompt, tmp_path):
    """Two bytes a cached number: the file is the header, 2 x layers x positions x kv_dim
    halves, and the crc."""
    path, m = tmp_path / "s.state", manifest(k3_container)
    kv_dim = m.get("n_kv_heads", m["n_heads"]) * m["head_dim"]
    with opened(lib, k3_container) as ctx:
        evaluate(lib, ctx, prompt)
        assert lib.waste_state_save(ctx, str(path).encode()) == OK
    assert path.stat().st_size == 24 + 2 * m["n_layers"] * len(prompt) * kv_dim * 2 + 4


# ---------------------------------------------------------------- expert I/O

def corrupt_every_record(container: Path, layer: int, offset_in_record: int) -> None:
    bank = container / "experts" / f"layer-{layer:03d}.bank"
    n_experts = manifest(container)["n_experts"]
    data = bytearray(bank.read_bytes())
    for expert in range(n_experts):
        data[record_offset(bank, expert) + offset_in_record] ^= 0x5A
    bank.write_bytes(bytes(data))


def test_corrupt_payload_is_caught_with_verify(lib, k3_container, prompt, tmp_path, monkeypatch):
    copy = copy_container(k3_container, tmp_path / "bad.waste")
    corrupt_every_record(copy, 2, RECORD_HEADER + 10)
    with opened(lib, copy) as ctx:  # unverified, a payload flip goes unnoticed
        assert generate(lib, ctx, prompt, max_tokens=2)[0] == OK
    with opened(lib, copy, verify_records=1) as ctx:
        status, seen = generate(lib, ctx, prompt, max_tokens=2)
        assert status == E_IO and seen == []
        assert re.search(r"layer 2 expert \d+", detail_of(lib, ctx))
    monkeypatch.setenv("WASTE_VERIFY", "1")
    with opened(lib, copy) as ctx:
        logits, n = C.POINTER(C.c_float)(), C.c_size_t()
        assert lib.waste_eval(ctx, ints(prompt), len(prompt), C.byref(logits), C.byref(n)) == E_IO
        assert re.search(r"layer 2 expert \d+", detail_of(lib, ctx))


def test_corrupt_record_header_is_caught_without_verify(lib, k3_container, prompt, tmp_path):
    copy = copy_container(k3_container, tmp_path / "bad.waste")
    corrupt_every_record(copy, 3, 8)  # the expert index field
    with opened(lib, copy) as ctx:
        status, _ = generate(lib, ctx, prompt, max_tokens=2)
        assert status == E_IO and re.search(r"layer 3 expert \d+", detail_of(lib, ctx))


def test_usage_save_and_warm_start(lib, k3_container, prompt, tmp_path):
    usage = tmp_path / "usage.waste"
    plan = plan_of(lib, k3_container)
    budget = plan.floor_bytes + 11 * plan.min_expert_cache  # 12 of 48 records

    def first_token(path: Path) -> dict:
        with opened(lib, k3_container, ram_budget_bytes=budget, usage_path=str(path)) as ctx:
            status, seen = generate(lib, ctx, prompt[:1], max_tokens=1)
            assert status == OK
            return seen[0]

    cold = first_token(usage)
    with opened(lib, k3_container, ram_budget_bytes=budget, usage_path=str(usage)) as ctx:
        generate(lib, ctx, prompt[:1], max_tokens=40)
        assert lib.waste_save_usage(ctx) == OK
    assert [p.name for p in tmp_path.iterdir()] == ["usage.waste"]  # written atomically
    warm = first_token(usage)
    assert warm["hit"] > cold["hit"] and warm["missed"] < cold["missed"]
    usage.write_bytes(usage.read_bytes()[:-3])  # a damaged hotlist is ignored
    assert first_token(usage)["hit"] == cold["hit"]


def test_default_usage_path_is_in_the_container(lib, k3_container, tmp_path):
    copy = copy_container(k3_container, tmp_path / "c.waste")
    with opened(lib, copy) as ctx:
        evaluate(lib, ctx, [1, 2])
        assert lib.waste_save_usage(ctx) == OK
    assert (copy / "usage.waste").read_bytes()[:4] == b"WUSG"


# --------------------------------------------------------------------- images

def png_bytes(width: int, height: int, seed: int = 1) -> bytes:
    """An 8-bit RGB PNG with a deterministic gradient."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    rows = b"".join(b"\0" + bytes(((x * seed + y * 3 + c * 50) % 256)
                                  for x in range(width) for c in range(3)) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_images_need_the_tower(lib, k3_container, tmp_path):
    image = write(tmp_path / "a.png", png_bytes(32, 32))
    with opened(lib, k3_container) as ctx:
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(image).encode(), C.byref(n)) == E_UNSUPPORTED
        assert detail_of(lib, ctx)


def expand(lib, ctx, tokens: Sequence[int], cap: int = 4096) -> tuple[int, list[int], int]:
    out, n = (C.c_int32 * max(cap, 1))(), C.c_size_t()
    status = lib.waste_image_expand(ctx, ints(tokens), len(tokens), out, cap, C.byref(n))
    return status, list(out[:n.value]) if status == OK else [], n.value


def test_image_add_expand_clear(lib, k3_vision_container, tmp_path):
    pad = specials(k3_vision_container)["<|media_pad|>"]
    image = write(tmp_path / "a.png", png_bytes(32, 32))
    other = write(tmp_path / "b.png", png_bytes(64, 32, seed=5))
    with opened(lib, k3_vision_container, vision=1) as ctx:
        used = MemPlan()
        lib.waste_memory_used(ctx, C.byref(used))
        assert used.vision_bytes == plan_of(lib, k3_vision_container).vision_bytes
        plain = evaluate(lib, ctx, [1, pad, pad, pad, pad, 2])
        lib.waste_state_reset(ctx)
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(image).encode(), C.byref(n)) == OK and n.value == 4
        assert lib.waste_image_add(ctx, str(other).encode(), C.byref(n)) == OK and n.value == 8
        assert expand(lib, ctx, [1, pad, 2, pad]) == (OK, [1] + [pad] * 4 + [2] + [pad] * 8, 14)
        assert expand(lib, ctx, [1, pad, 2, pad], cap=5)[::2] == (E_ARG, 14)
        assert expand(lib, ctx, [pad, pad, pad])[0] == E_ARG
        with_image = evaluate(lib, ctx, [1, pad, pad, pad, pad, 2])
        assert with_image != plain  # the pads took the image's embedding rows
        lib.waste_image_clear(ctx)
        assert expand(lib, ctx, [1, pad])[0] == E_ARG
        assert expand(lib, ctx, [1, 2]) == (OK, [1, 2], 2)
        lib.waste_state_reset(ctx)
        assert evaluate(lib, ctx, [1, pad, pad, pad, pad, 2]) == plain


def test_image_expand_refuses_an_output_that_aliases_its_input(lib, k3_vision_container, tmp_path):
    pad = specials(k3_vision_container)["<|media_pad|>"]
    image = write(tmp_path / "a.png", png_bytes(32, 32))
    with opened(lib, k3_vision_container, vision=1) as ctx:
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(image).encode(), C.byref(n)) == OK
        buf = (C.c_int32 * 16)(1, pad, 2)
        assert lib.waste_image_expand(ctx, buf, 3, buf, 16, C.byref(n)) == E_ARG
        assert "alias" in detail_of(lib, ctx)
        assert list(buf[:3]) == [1, pad, 2]  # the input was not written over
        tail = C.cast(C.byref(buf, 4 * C.sizeof(C.c_int32)), _I32P)  # disjoint: fine
        assert lib.waste_image_expand(ctx, buf, 3, tail, 12, C.byref(n)) == OK
        assert list(buf[4:4 + n.value]) == [1] + [pad] * 4 + [2]


def test_image_queue_is_bounded(lib, k3_vision_container, tmp_path):
    big = write(tmp_path / "big.png", png_bytes(256, 256))
    with opened(lib, k3_vision_container, vision=1, ctx_tokens=64) as ctx:
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(big).encode(), C.byref(n)) == E_ARG
        assert "64" in detail_of(lib, ctx)


def test_image_add_errors(lib, k3_vision_container, tmp_path):
    with opened(lib, k3_vision_container, vision=1) as ctx:
        n = C.c_size_t()
        assert lib.waste_image_add(ctx, str(tmp_path / "none.png").encode(), C.byref(n)) == E_IO
        junk = write(tmp_path / "junk.png", b"not an image at all")
        assert lib.waste_image_add(ctx, str(junk).encode(), C.byref(n)) == E_FORMAT


def image_headers(width: int, height: int) -> dict[str, bytes]:
    """Minimal but well-formed headers of each format the ABI names."""
    jfif = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(
        [1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1])
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (width - 1).to_bytes(3, "little") + \
        (height - 1).to_bytes(3, "little")
    bits = (width - 1) | (height - 1) << 14
    vp8l = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits)
    return {
        "png": png_bytes(width, height),
        "gif": b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b"\x3b",
        "jpeg": b"\xff\xd8" + jfif + sof0 + b"\xff\xd9",
        "webp-vp8x": b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x,
        "webp-vp8l": b"RIFF" + struct.pack("<I", 4 + len(vp8l) + 1) + b"WEBP" + vp8l + b"\0",
    }


@pytest.mark.parametrize("kind", list(image_headers(1, 1)))
def test_image_dimensions(lib, tmp_path, kind):
    w, h = C.c_int(), C.c_int()
    path = write(tmp_path / f"img.{kind}", image_headers(37, 21)[kind])
    assert lib.waste_image_dimensions(str(path).encode(), C.byref(w), C.byref(h)) == OK
    assert (w.value, h.value) == (37, 21)


def test_image_dimensions_errors(lib, tmp_path):
    w, h = C.c_int(-1), C.c_int(-1)
    assert lib.waste_image_dimensions(str(tmp_path / "none").encode(), C.byref(w), C.byref(h)) == E_IO
    assert lib.waste_error_detail(None)
    for data in (b"hello world, not an image", image_headers(5, 5)["png"][:20]):
        path = write(tmp_path / "bad", data)
        assert lib.waste_image_dimensions(str(path).encode(), C.byref(w), C.byref(h)) == E_FORMAT
    assert (w.value, h.value) == (-1, -1)  # untouched on failure
