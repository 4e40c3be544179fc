"""The ctypes binding (serve/engine/binding.py) against the real reference engine."""
from __future__ import annotations

import base64
import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from cache_calls import lookup
from serve.engine import abi, binding as eng
from serve.engine.binding import (Engine, EngineConfig, GenParams, LibraryNotFound, WasteError,
                          load_library)
from serve.core.segment import Segment

PROMPT_TEXT = "The lighthouse keeper climbed the stairs"


def compile_shared(tmp_path: Path, source: str) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "stub.c").write_text(source)
    out = tmp_path / "libstub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(tmp_path / "stub.c")],
                   check=True, capture_output=True)
    return out


def stub_library_source(version_number: int, omit: tuple[str, ...] = ()) -> str:
    """A library exporting libwaste's names (as do-nothing stubs) with a chosen version."""
    lines = [f"int waste_version_number(void) {{ return {version_number}; }}"]
    lines += [f"void {name}(void) {{}}" for name in abi.SIGNATURES
              if name != "waste_version_number" and name not in omit]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def engine(k3_engine):
    return k3_engine


@pytest.fixture
def fresh(engine):
    """The shared k3 engine with an empty conversation."""
    engine.reset()
    return engine


def manifest(container: Path) -> dict:
    return json.loads((container / "manifest.json").read_text())


def greedy(engine: Engine, prompt: list[int], max_tokens: int = 12, **kw) -> list[int]:
    seen: list[int] = []
    engine.generate(prompt, GenParams(max_tokens=max_tokens, **kw),
                    lambda info, piece: seen.append(info.token))
    return seen

# ------------------------------------------------------------ ABI layout


def test_struct_layouts_match_the_c_header(tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    prints = []
    for c_name, mirror in abi.C_STRUCTS.items():
        prints.append(f'printf("{c_name} sizeof %zu\\n", sizeof({c_name}));')
        for field, _ in mirror._fields_:
            prints.append(f'printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    source = ('#include <stdio.h>\n#include <stddef.h>\n#include "waste.h"\n'
              "int main(void) {\n" + "\n".join(prints) + "\nreturn 0;\n}\n")
    (tmp_path / "layout.c").write_text(source)
    subprocess.run([cc, "-std=c11", "-I", str(ROOT / "engine"), "-o", str(tmp_path / "layout"),
                    str(tmp_path / "layout.c")], check=True, capture_output=True)
    output = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                            text=True).stdout
    from_c = {tuple(line.split()[:2]): int(line.split()[2]) for line in output.splitlines()}
    from_ctypes = {}
    for c_name, mirror in abi.C_STRUCTS.items():
        from_ctypes[(c_name, "sizeof")] = ctypes.sizeof(mirror)
        for field, _ in mirror._fields_:
            from_ctypes[(c_name, field)] = getattr(mirror, field).offset
    assert from_ctypes == from_c


def test_every_header_function_has_a_signature():
    header = (ROOT / "engine" / "waste.h").read_text()
    declared = set(re.findall(r"\b(waste_\w+)\s*\(", header))
    assert declared == set(abi.SIGNATURES)

# ------------------------------------------------------ library discovery


def test_explicit_library_wins_over_the_environment(lib_path, tmp_path, monkeypatch):
    monkeypatch.setenv("WASTE_LIB", str(tmp_path / "elsewhere.so"))
    lib = load_library(str(lib_path))
    assert lib.path == lib_path and lib.rejected == []
    assert lib.version_number() in range(600, 700)
    assert lib.version().startswith("0.6.")
    assert lib.build_info()


def test_environment_is_tried_before_the_default(lib_path, tmp_path, monkeypatch):
    copy = tmp_path / "libcopy.so"
    shutil.copy(lib_path, copy)
    monkeypatch.setenv("WASTE_LIB", str(copy))
    assert load_library().path == copy


def test_unusable_candidates_are_skipped_and_remembered(lib_path, tmp_path, monkeypatch):
    not_a_library = tmp_path / "libwaste.txt"
    not_a_library.write_text("plain text\n")
    monkeypatch.setenv("WASTE_LIB", str(not_a_library))
    monkeypatch.setattr(eng, "default_library_path", lambda: lib_path)
    lib = load_library(str(tmp_path / "missing.so"))
    assert lib.path == lib_path
    assert [r.split(" ")[0] for r in lib.rejected] == [str(tmp_path / "missing.so"),
                                                      str(not_a_library)]


def test_no_usable_library_lists_every_path_on_one_line(tmp_path, monkeypatch):
    not_a_library = tmp_path / "libwaste.txt"
    not_a_library.write_text("plain text\n")
    monkeypatch.setenv("WASTE_LIB", str(not_a_library))
    monkeypatch.setattr(eng, "default_library_path", lambda: tmp_path / "libwaste-absent.so")
    with pytest.raises(LibraryNotFound) as caught:
        load_library(str(tmp_path / "missing.so"))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{tmp_path / 'missing.so'} (--lib): no such file" in message
    assert f"{not_a_library} ($WASTE_LIB): " in message
    assert f"{tmp_path / 'libwaste-absent.so'} (default): no such file" in message
    assert message.index("missing.so") < message.index("libwaste.txt") < message.index("absent")


def test_a_library_with_the_wrong_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WASTE_LIB", raising=False)
    monkeypatch.setattr(eng, "default_library_path", lambda: tmp_path / "libwaste-absent.so")
    stub = compile_shared(tmp_path, stub_library_source(500))
    with pytest.raises(LibraryNotFound, match=r"libstub\.so \(--lib\): engine version_number 500 "
                                              r"is outside 600\.\.699"):
        load_library(str(stub))


def test_a_library_missing_symbols_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WASTE_LIB", raising=False)
    monkeypatch.setattr(eng, "default_library_path", lambda: tmp_path / "libwaste-absent.so")
    stub = compile_shared(tmp_path, stub_library_source(608, omit=("waste_eval",)))
    with pytest.raises(LibraryNotFound, match=r"missing waste_eval"):
        load_library(str(stub))

def test_another_library_is_never_asked_for_a_detail_without_a_ctx(tmp_path, monkeypatch):
    # The ABI does not promise waste_error_detail(NULL) is safe; this stub
    # crashes on it, as a library that dereferences its argument would.
    monkeypatch.delenv("WASTE_LIB", raising=False)
    source = "\n".join([
        "#include <stddef.h>",
        "int waste_version_number(void) { return 608; }",
        'const char *waste_build_info(void) { return "another engine"; }',
        'const char *waste_strerror(int s) { return "file missing"; }',
        "void waste_cfg_init(void *cfg) {}",
        "int waste_open(const char *p, const void *c, void **out) { *out = NULL; return -1; }",
        "const char *waste_error_detail(const int *ctx) { return ctx[0] ? \"x\" : NULL; }",
        *[f"void {name}(void) {{}}" for name in abi.SIGNATURES if name not in (
            "waste_version_number", "waste_build_info", "waste_strerror", "waste_cfg_init",
            "waste_open", "waste_error_detail")]])
    stub = load_library(str(compile_shared(tmp_path, source)))
    assert not stub.detail_without_ctx
    with pytest.raises(WasteError) as caught:
        Engine(stub, tmp_path / "model.waste", EngineConfig())
    assert (caught.value.name, caught.value.message, caught.value.detail) == (
        "WASTE_E_IO", "file missing", None)


def test_the_reference_engine_explains_a_failed_open(lib):
    assert lib.detail_without_ctx


# ------------------------------------------------------------------ opening


def test_open_failure_carries_the_engine_detail(lib, tmp_path):
    with pytest.raises(WasteError) as caught:
        Engine(lib, tmp_path / "no-such.waste", EngineConfig())
    error = caught.value
    assert (error.status, error.name, error.call) == (abi.WASTE_E_IO, "WASTE_E_IO", "waste_open")
    assert error.message == lib.strerror(abi.WASTE_E_IO)
    assert error.detail


def test_budget_below_the_floor_is_refused(lib, k3_container):
    floor = lib.plan_memory(k3_container, 0).floor_bytes
    with pytest.raises(WasteError) as caught:
        Engine(lib, k3_container, EngineConfig(budget=floor // 2))
    assert caught.value.name == "WASTE_E_RAM_BUDGET" and caught.value.detail


def test_bad_cache_policy_is_a_value_error(lib, k3_container):
    with pytest.raises(ValueError):
        Engine(lib, k3_container, EngineConfig(cache_policy="fifo"))


def test_integers_that_do_not_fit_their_c_type_are_refused(lib, fresh, k3_container):
    # ctypes would silently wrap them: ctx 2**32 + 1 would open a context of 1.
    for cfg in (EngineConfig(ctx=2 ** 32 + 1), EngineConfig(threads=2 ** 31),
                EngineConfig(budget=2 ** 64)):
        with pytest.raises(ValueError, match="does not fit"):
            Engine(lib, k3_container, cfg)
    with pytest.raises(ValueError, match="does not fit"):
        lib.plan_memory(k3_container, 2 ** 32 + 1)
    with pytest.raises(ValueError, match="does not fit"):
        greedy(fresh, fresh.tokenize(PROMPT_TEXT), top_k=2 ** 31)


def test_model_info_and_specials_come_from_the_container(engine, k3_container):
    shape = manifest(k3_container)
    assert (engine.info.n_layers, engine.info.n_experts, engine.info.top_k, engine.info.hidden) == \
        (shape["n_layers"], shape["n_experts"], shape["top_k"], shape["hidden"])
    assert engine.info.ctx_max == 4096 and engine.info.arch
    specials = json.loads((k3_container / "specials.json").read_text())
    assert engine.specials == {s["text"]: s["id"] for s in specials}


def test_plan_and_memory_used_are_consistent(lib, engine, k3_container):
    plan = lib.plan_memory(k3_container, 0)
    assert plan.floor_bytes == (plan.trunk_bytes + plan.state_bytes + plan.scratch_bytes
                                + plan.min_expert_cache)
    assert plan.recommended_bytes >= plan.floor_bytes
    used = engine.memory_used()
    assert used.trunk_bytes == plan.trunk_bytes
    with pytest.raises(WasteError, match="waste_plan_memory"):
        lib.plan_memory(k3_container / "absent", 0)
    assert lib.usable_ram() <= lib.physical_ram() and lib.physical_ram() > 0


def test_close_is_idempotent_and_final(lib, k3_container):
    opened = Engine(lib, k3_container, EngineConfig())
    opened.close()
    opened.close()
    with pytest.raises(RuntimeError):
        opened.tokenize("hello")

# ---------------------------------------------------------------- tokenizer


def test_tokenize_round_trips_and_adds_bos(engine):
    text = "Second, he wrote the weather into a leather notebook. ünïcode ✓"
    ids = engine.tokenize(text)
    assert engine.detokenize(ids) == text.encode()
    assert engine.tokenize(text, add_bos=True) == [engine.specials["[BOS]"]] + ids
    assert engine.tokenize("") == [] and engine.detokenize([]) == b""


def test_markup_is_recognised_only_by_the_markup_entry_point(engine):
    open_id = engine.specials["<|open|>"]
    assert engine.tokenize("<|open|>", markup=True) == [open_id]
    plain = engine.tokenize("<|open|>")
    assert open_id not in plain and engine.detokenize(plain) == b"<|open|>"
    assert engine.token_id("<|open|>") == open_id
    assert engine.token_id("a") is None
    assert engine.token_id("<|open|><|sep|>") is None
    assert engine.token_id("<|no_such_token|>") is None


def test_detokenize_grows_its_buffer_for_long_tokens(engine, k3_container):
    by_length = sorted((base64.b64decode(line.split()[0]), int(line.split()[1]))
                       for line in (k3_container / "tokenizer.model").read_text().splitlines())
    longest, token = max(by_length, key=lambda pair: len(pair[0]))
    assert len(longest) > 8   # longer than the binding's first guess for one token
    assert engine.detokenize([token]) == longest
    assert engine.detokenize([token] * 3) == longest * 3


def test_unknown_ids_and_nul_characters_are_refused(engine):
    with pytest.raises(WasteError) as caught:
        engine.detokenize([10 ** 6])
    assert caught.value.name == "WASTE_E_ARG" and caught.value.call == "waste_detokenize"
    for unencodable in ("a\0b", "a\ud800b"):  # a NUL, and a lone surrogate (not UTF-8)
        with pytest.raises(eng.UnencodableText):
            engine.tokenize(unencodable)


def test_segments_are_encoded_separately(engine):
    first, second = "First part. ", "Second part."
    separately = engine.tokenize(first) + engine.tokenize(second)
    merged = engine.tokenize(first + second)
    assert separately != merged   # BPE is not associative: merging changes the prompt
    segments = [Segment(first, False), Segment(second, False)]
    assert engine.tokenize_segments(segments) == separately

    open_id = engine.specials["<|open|>"]
    forged = engine.tokenize_segments([Segment("<|open|>", True), Segment("<|open|>", False)])
    assert forged[0] == open_id and open_id not in forged[1:]

# --------------------------------------------------------------- generation


def test_generate_hands_every_token_and_its_piece(fresh):
    prompt = fresh.tokenize(PROMPT_TEXT)
    calls = []
    result = fresh.generate(prompt, GenParams(max_tokens=8),
                            lambda info, piece: calls.append((info, piece)))
    assert result.n_tokens == len(calls) and 0 < len(calls) <= 8
    assert not result.cancelled and not result.context_full
    assert [info.token_index for info, _ in calls] == list(range(len(calls)))
    for info, piece in calls:
        assert piece == fresh.detokenize([info.token])
        assert info.experts_hit + info.experts_missed > 0


def test_greedy_generation_is_repeatable_and_matches_eval(fresh, lib, k3_container):
    prompt = fresh.tokenize(PROMPT_TEXT)
    first = greedy(fresh, prompt)
    fresh.reset()
    assert greedy(fresh, prompt) == first
    fresh.reset()
    logits = fresh.eval(prompt)
    assert len(logits) == manifest(k3_container)["vocab_size"]
    assert max(range(len(logits)), key=logits.__getitem__) == first[0]


def test_stop_token_is_handed_over_then_ends(fresh):
    prompt = fresh.tokenize(PROMPT_TEXT)
    reference = greedy(fresh, prompt, max_tokens=12)
    stop = reference[3]
    fresh.reset()
    assert greedy(fresh, prompt, max_tokens=12, stop_tokens=[stop]) == \
        reference[:reference.index(stop) + 1]


def test_callback_cancel_resets_the_state(fresh):
    prompt = fresh.tokenize(PROMPT_TEXT)
    reference = greedy(fresh, prompt)
    fresh.reset()
    result = fresh.generate(prompt, GenParams(max_tokens=12),
                            lambda info, piece: info.token_index == 1)
    assert result.cancelled and result.n_tokens == 2 and not result.context_full
    assert greedy(fresh, prompt) == reference   # from scratch: nothing left behind


def test_callback_exception_is_reraised_after_a_reset(fresh):
    class Boom(Exception):
        pass

    def explode(info, piece):
        if info.token_index == 2:
            raise Boom("from the callback")

    prompt = fresh.tokenize(PROMPT_TEXT)
    reference = greedy(fresh, prompt)
    fresh.reset()
    with pytest.raises(Boom):
        fresh.generate(prompt, GenParams(max_tokens=12), explode)
    assert greedy(fresh, prompt) == reference


def test_engine_errors_reset_and_carry_detail(fresh):
    prompt = fresh.tokenize(PROMPT_TEXT)
    reference = greedy(fresh, prompt)
    fresh.reset()
    fresh.eval(prompt)
    with pytest.raises(WasteError) as caught:
        fresh.generate([], GenParams(), lambda info, piece: None)
    assert caught.value.name == "WASTE_E_ARG" and caught.value.call == "waste_generate"
    assert greedy(fresh, prompt) == reference   # the evaluated prompt was dropped


def test_context_full_is_reported_not_raised(lib, k3_container):
    with Engine(lib, k3_container, EngineConfig(ctx=24)) as small:
        prompt = small.tokenize(PROMPT_TEXT)
        assert len(prompt) < 20
        result = small.generate(prompt, GenParams(max_tokens=100), lambda info, piece: None)
        assert result.context_full and result.detail
        assert 0 < result.n_tokens < 100
        small.reset()
        with pytest.raises(WasteError) as caught:
            small.generate(prompt * 4, GenParams(), lambda info, piece: None)
        assert caught.value.name == "WASTE_E_ARG" and caught.value.detail

# -------------------------------------------------------- state and stats


def test_saved_state_resumes_identically(fresh, tmp_path):
    prompt = fresh.tokenize(PROMPT_TEXT)
    fresh.eval(prompt[:-1])
    fresh.save_state(tmp_path / "conversation.state")
    continued = greedy(fresh, prompt[-1:])
    fresh.reset()
    fresh.load_state(tmp_path / "conversation.state")
    assert greedy(fresh, prompt[-1:]) == continued
    fresh.reset()
    assert greedy(fresh, prompt) == continued


def test_damaged_state_is_refused(fresh, tmp_path):
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"not a state file")
    with pytest.raises(WasteError) as caught:
        fresh.load_state(bad)
    assert caught.value.name == "WASTE_E_FORMAT" and caught.value.call == "waste_state_load"


def test_a_snapshot_of_the_old_state_layout_is_dropped_and_prefilled(fresh, k3_container,
                                                                     snapshot_cache, tmp_path):
    """A persistent prefix snapshot written by engine 0.6.0 (state version 1) is refused by
    the engine as WASTE_E_FORMAT; prefill drops the entry and evaluates the prompt itself."""
    from serve.service.prefill import prefill
    from state_layout import rewrite
    m = manifest(k3_container)
    tokens = fresh.tokenize(PROMPT_TEXT * 4, add_bos=True)
    head = tokens[:20]
    fresh.eval(head)
    fresh.save_state(tmp_path / "v3.state")
    rewrite(tmp_path / "v3.state", tmp_path / "v1.state", 1, m.get("n_kv_heads", m["n_heads"]))
    snapshot_cache.store(head, lambda path: shutil.copyfile(tmp_path / "v1.state", path))
    assert lookup(snapshot_cache, tokens).n_tokens == len(head)
    fresh.reset()
    assert prefill(fresh, tokens, len(tokens) - 1, cache=snapshot_cache).cached == 0
    assert lookup(snapshot_cache, tokens) is None   # the entry is gone
    logits = list(fresh.eval(tokens[-1:]))
    fresh.reset()
    assert logits == list(fresh.eval(tokens))


def test_stats_accumulate(fresh):
    before = fresh.stats()
    result = fresh.generate(fresh.tokenize(PROMPT_TEXT), GenParams(max_tokens=5),
                            lambda info, piece: None)
    after = fresh.stats()
    assert after.tokens_generated - before.tokens_generated == result.n_tokens
    assert after.experts_hit + after.experts_missed > before.experts_hit + before.experts_missed
    assert isinstance(after.direct_io, bool)


def test_usage_is_saved_where_configured(lib, k3_container, tmp_path):
    usage = tmp_path / "usage.waste"
    with Engine(lib, k3_container, EngineConfig(usage_path=str(usage))) as opened:
        greedy(opened, opened.tokenize(PROMPT_TEXT), max_tokens=3)
        opened.save_usage()
    assert usage.stat().st_size > 0

# ------------------------------------------------------------------ images


def write_png(path: Path, width: int, height: int) -> None:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    rows = b"".join(b"\0" + bytes((x * 7 + y) % 256 for x in range(width * 3))
                    for y in range(height))
    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_images_are_measured_queued_and_expanded(lib, k3_vision_container, tmp_path):
    image = tmp_path / "picture.png"
    write_png(image, 40, 24)
    assert lib.image_dimensions(image) == (40, 24)
    with pytest.raises(WasteError) as caught:
        lib.image_dimensions(tmp_path / "absent.png")
    assert caught.value.name == "WASTE_E_IO"
    with Engine(lib, k3_vision_container, EngineConfig(vision=True)) as seeing:
        pad = seeing.specials["<|media_pad|>"]
        positions = seeing.image_add(image)
        assert positions > 0
        assert seeing.image_expand([1, pad, 2]) == [1] + [pad] * positions + [2]
        seeing.image_clear()
        with pytest.raises(WasteError) as caught:
            seeing.image_expand([pad])
        assert caught.value.name == "WASTE_E_ARG"


def test_images_need_a_vision_tower(engine, tmp_path):
    image = tmp_path / "picture.png"
    write_png(image, 16, 16)
    with pytest.raises(WasteError) as caught:
        engine.image_add(image)
    assert caught.value.name == "WASTE_E_UNSUPPORTED"
