"""ctypes binding to libwaste: the library, and an engine (one waste_ctx) as EngineApi.

It calls through serve/engine/abi.py, the mirror of engine/waste.h, and speaks
serve/engine/types.py's types to the rest of serve.

Thread safety: a waste_ctx is not thread-safe and this binding takes no
lock. The server reaches an engine only through serve/engine/queue.py, which
hands it to one request (or one piece of idle-time work) at a time.
"""
from __future__ import annotations

import array
import base64
import ctypes
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from serve.engine import abi
from serve.engine.types import (EngineConfig, GenParams, GenResult, MemPlan, ModelInfo, Stats,
                                TokenCallback, TokenInfo, UnencodableText, WasteError)

# ------------------------------------------------------------ errors


class LibraryNotFound(Exception):
    """No usable libwaste: names every path tried and why each failed."""


# ------------------------------------------------------ library loading


def default_library_path() -> Path:
    """libwaste beside the `serve` package's directory: the checkout's root, where `make`
    builds the reference engine (a pip-installed serve is told of it with --lib or $WASTE_LIB)."""
    names = {"darwin": "libwaste.dylib", "win32": "libwaste.dll"}
    return Path(__file__).resolve().parents[2] / names.get(sys.platform, "libwaste.so")


def _candidates(explicit: Optional[str]) -> list[tuple[str, Path]]:
    """(origin, path) pairs in the order they are tried."""
    found = []
    if explicit:
        found.append(("--lib", Path(explicit)))
    env = os.environ.get("WASTE_LIB")
    if env:
        found.append(("$WASTE_LIB", Path(env)))
    found.append(("default", default_library_path()))
    return found


def _one_line(text: str) -> str:
    return " ".join(text.split())


def load_library(explicit: Optional[str] = None) -> "Library":
    """The first usable libwaste of: `explicit` (--lib), $WASTE_LIB, the repo root.

    Every rejected candidate is kept in `Library.rejected` so a caller can
    warn that, say, its --lib was skipped; if none is usable the single
    LibraryNotFound lists them all on one line.
    """
    rejected: list[str] = []
    for origin, path in _candidates(explicit):
        try:
            return Library(path, rejected)
        except OSError as exc:
            rejected.append(f"{path} ({origin}): {_one_line(str(exc))}")
    raise LibraryNotFound("no usable libwaste; tried " + "; ".join(rejected)
                          + "; build the reference engine with `make` in a serve checkout, or name "
                            "a libwaste with --lib or $WASTE_LIB")


# How the reference engine's waste_build_info() begins.
REFERENCE_BUILD = "waste reference engine"


class Library:
    """A loaded, version-checked libwaste with every signature declared."""

    def __init__(self, path: Path, rejected: Sequence[str] = ()):
        if not path.exists():
            raise OSError("no such file")
        if not path.is_file():
            raise OSError("not a file")
        dll = ctypes.CDLL(str(path))   # OSError when not a loadable library
        missing = [name for name in abi.SIGNATURES if not hasattr(dll, name)]
        if missing:
            raise OSError(f"not libwaste ABI 1: missing {', '.join(missing)}")
        for name, (restype, argtypes) in abi.SIGNATURES.items():
            func = getattr(dll, name)
            func.restype = restype
            func.argtypes = argtypes
        number = dll.waste_version_number()
        if number not in abi.VERSION_RANGE:
            raise OSError(f"engine version_number {number} is outside "
                          f"{abi.VERSION_RANGE.start}..{abi.VERSION_RANGE.stop - 1}")
        self.dll = dll
        self.path = path
        self.rejected = list(rejected)
        # waste_error_detail(NULL) -- the reason an open, plan or image header
        # failed -- is documented by the reference engine only; the ABI does not
        # promise that another libwaste accepts NULL there, so it is not asked.
        self.detail_without_ctx = (abi.text(dll.waste_build_info()) or "").startswith(REFERENCE_BUILD)

    # -- errors

    def strerror(self, status: int) -> str:
        return abi.text(self.dll.waste_strerror(status)) or ""

    def error_detail(self, ctx: Optional[int] = None) -> Optional[str]:
        """waste_error_detail: for a ctx, or (None) this thread's last open/plan,
        where the library supports that."""
        if ctx is None and not self.detail_without_ctx:
            return None
        return abi.text(self.dll.waste_error_detail(ctx))

    def error(self, status: int, call: str, ctx: Optional[int] = None) -> WasteError:
        name = abi.STATUS_NAMES.get(status, f"status {status}")
        return WasteError(status, name, self.strerror(status), self.error_detail(ctx), call)

    def check(self, status: int, call: str, ctx: Optional[int] = None) -> None:
        if status != abi.WASTE_OK:
            raise self.error(status, call, ctx)

    # -- version and host facts

    def version(self) -> str:
        return abi.text(self.dll.waste_version()) or ""

    def version_number(self) -> int:
        return self.dll.waste_version_number()

    def build_info(self) -> str:
        return abi.text(self.dll.waste_build_info()) or ""

    def physical_ram(self) -> int:
        return self.dll.waste_physical_ram()

    def usable_ram(self) -> int:
        return self.dll.waste_usable_ram()

    # -- planning that needs no open model

    def plan_memory(self, model_path: str | os.PathLike, ctx: int = 0) -> MemPlan:
        plan = abi.MemPlanStruct()
        self.check(self.dll.waste_plan_memory(os.fsencode(model_path), abi.c_int(ctx, abi.U32, "ctx"),
                                              ctypes.byref(plan)),
                   "waste_plan_memory")
        return abi.from_struct(MemPlan, plan)

    def image_dimensions(self, path: str | os.PathLike) -> tuple[int, int]:
        w, h = abi.INT(), abi.INT()
        self.check(self.dll.waste_image_dimensions(os.fsencode(path), ctypes.byref(w),
                                                   ctypes.byref(h)),
                   "waste_image_dimensions")
        return w.value, h.value

# ------------------------------------------------------------ the model


def read_specials(model_path: str | os.PathLike) -> dict[str, int]:
    """specials.json as {text: id}; {} when it is missing or malformed."""
    try:
        entries = json.loads((Path(model_path) / "specials.json").read_text("utf-8"))
        return {e["text"]: int(e["id"]) for e in entries
                if isinstance(e["text"], str) and isinstance(e["id"], int)}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def read_longest_token(model_path: str | os.PathLike, specials: Iterable[str]) -> int:
    """Bytes in the vocabulary's longest token (tokenizer.model, and the `specials`
    texts already read from specials.json); 0 if unknown.

    It bounds how few tokens a text can become, so an oversized prompt can be
    refused without tokenizing it.
    """
    longest = max((len(text.encode()) for text in specials), default=0)
    try:
        with open(Path(model_path) / "tokenizer.model", "rb") as f:
            for line in f:
                # base64 of n bytes is 4 * ceil(n / 3) characters: decode only the longest
                encoded = line.split(None, 1)[0] if line.strip() else b""
                if len(encoded) * 3 // 4 > longest:
                    longest = max(longest, len(base64.b64decode(encoded)))
    except (OSError, ValueError):
        return 0
    return longest


class Engine:
    """One open model (a waste_ctx). Not thread-safe: see the module's docstring."""

    def __init__(self, lib: Library, model_path: str | os.PathLike, cfg: EngineConfig):
        self.lib = lib
        self.model_path = str(model_path)
        self._dll = lib.dll
        # Kept for the ctx's lifetime: the engine may hold on to the strings.
        self._cfg = self._make_cfg(cfg)
        handle = abi.CTX()
        status = self._dll.waste_open(os.fsencode(model_path), ctypes.byref(self._cfg),
                                      ctypes.byref(handle))
        if status != abi.WASTE_OK:
            raise lib.error(status, "waste_open")
        self._handle: Optional[int] = handle.value
        info = abi.ModelInfoStruct()
        try:
            self._check(self._dll.waste_model_get_info(self._handle, ctypes.byref(info)),
                        "waste_model_get_info")
        except WasteError:
            self.close()
            raise
        self.info: ModelInfo = abi.from_struct(ModelInfo, info)
        # Positions evaluated into the state (waste_eval's tokens, waste_generate's prompt and
        # generated tokens): what serve asked the engine to compute, restores not included.
        self.evaluated = 0
        self.specials: dict[str, int] = read_specials(model_path)
        self.longest_token: int = read_longest_token(model_path, self.specials)

    def _make_cfg(self, cfg: EngineConfig) -> abi.CfgStruct:
        if cfg.cache_policy not in abi.CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {sorted(abi.CACHE_POLICIES)}")
        c = abi.CfgStruct()
        self._dll.waste_cfg_init(ctypes.byref(c))
        c.ram_budget_bytes = abi.c_int(cfg.budget, abi.U64, "budget")
        c.ctx_tokens = abi.c_int(cfg.ctx, abi.U32, "ctx")
        c.n_threads = abi.c_int(cfg.threads, abi.INT, "threads")
        c.cpu_list = abi.c_text(cfg.cpus) if cfg.cpus is not None else None
        c.cache_policy = abi.CACHE_POLICIES[cfg.cache_policy]
        c.use_direct_io = int(cfg.direct_io)
        c.vision = int(cfg.vision)
        c.verify_records = int(cfg.verify)
        c.usage_path = os.fsencode(cfg.usage_path) if cfg.usage_path is not None else None
        c.exclusive_open = int(cfg.exclusive_open)
        return c

    # -- plumbing

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise RuntimeError("the engine is closed")
        return self._handle

    def _check(self, status: int, call: str) -> None:
        self.lib.check(status, call, self.handle)

    def _grow_ids(self, call: str, fill: Callable[[ctypes.Array, int, ctypes.c_size_t], int],
                  guess: int) -> list[int]:
        """Run an id-producing call, retrying once the engine says how much room it needs."""
        cap = max(1, guess)
        while True:
            out, n = (abi.I32 * cap)(), abi.SIZE(0)
            status = fill(out, cap, n)
            if status == abi.WASTE_E_ARG and n.value > cap:
                cap = n.value
                continue
            self._check(status, call)
            return out[:n.value]

    # -- tokenizer

    def tokenize(self, text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]:
        """Text -> ids. markup=True recognises special tokens: only for text we wrote."""
        data = abi.c_text(text)
        func = self._dll.waste_tokenize_markup if markup else self._dll.waste_tokenize
        call = "waste_tokenize_markup" if markup else "waste_tokenize"
        # A token is at least one byte, so this first guess almost always fits.
        return self._grow_ids(call, lambda out, cap, n: func(self.handle, data, int(add_bos), out,
                                                             cap, ctypes.byref(n)),
                              len(data) + 1)

    def tokenize_segments(self, segments: Iterable) -> list[int]:
        """Encode each Segment on its own, through the entry point its `markup` picks.

        Never concatenate segments into one string: content would then be read
        with markup rules and could forge turn structure. Never merge adjacent
        segments of the same mode either: BPE is not associative, so "A" + "B"
        encoded apart differs from "AB" encoded whole, and the reference
        encoder works one segment at a time.
        """
        ids: list[int] = []
        for segment in segments:
            ids.extend(self.tokenize(segment.text, markup=segment.markup))
        return ids

    def detokenize(self, ids: Sequence[int]) -> bytes:
        """Ids -> raw bytes (not necessarily valid UTF-8 at the edges)."""
        if not ids:
            return b""
        tokens = abi.int_array(ids)
        cap = 8 * len(ids) + 1
        while True:
            out, n = ctypes.create_string_buffer(cap), abi.SIZE(0)
            status = self._dll.waste_detokenize(self.handle, tokens, len(ids), out, cap,
                                                ctypes.byref(n))
            if status == abi.WASTE_E_ARG and n.value + 1 > cap:
                cap = n.value + 1   # the needed count excludes the NUL
                continue
            self._check(status, "waste_detokenize")
            return out.raw[:n.value]

    def token_id(self, text: str) -> Optional[int]:
        """The id of `text` when markup tokenization makes it exactly one special token."""
        ids = self.tokenize(text, markup=True)
        # Plain tokenization never yields a special, so a single markup id that
        # plain encoding does not reproduce is one.
        if len(ids) == 1 and self.tokenize(text) != ids:
            return ids[0]
        return None

    # -- images

    def image_add(self, path: str | os.PathLike) -> int:
        """Encode and queue one image; returns the positions it will take."""
        n = abi.SIZE(0)
        self._check(self._dll.waste_image_add(self.handle, os.fsencode(path), ctypes.byref(n)),
                    "waste_image_add")
        return n.value

    def image_expand(self, ids: Sequence[int]) -> list[int]:
        tokens = abi.int_array(ids)
        return self._grow_ids("waste_image_expand",
                              lambda out, cap, n: self._dll.waste_image_expand(
                                  self.handle, tokens, len(ids), out, cap, ctypes.byref(n)),
                              len(ids))

    def image_clear(self) -> None:
        self._dll.waste_image_clear(self.handle)

    # -- generation

    def generate(self, prompt: Sequence[int], params: GenParams,
                 on_token: TokenCallback) -> GenResult:
        """Append `prompt` to the state and sample, calling on_token for each token.

        on_token returning True cancels (GenResult.cancelled); an exception in
        it cancels and is re-raised here. Whenever generation does not end
        normally (cancelled, callback error, engine error) the state is reset,
        as the ABI requires after a failed waste_generate.
        """
        c_params = abi.GenParamsStruct()
        self._dll.waste_gen_params_init(ctypes.byref(c_params))
        c_params.temperature = params.temperature
        c_params.top_p = params.top_p
        c_params.top_k = abi.c_int(params.top_k, abi.INT, "top_k")
        c_params.seed = abi.c_int(params.seed, abi.U64, "seed")
        c_params.max_tokens = abi.c_int(params.max_tokens, abi.U32, "max_tokens")
        stops = abi.int_array(params.stop_tokens)
        c_params.stop_tokens = stops
        c_params.n_stop = len(params.stop_tokens)

        count = 0
        raised: list[BaseException] = []

        def trampoline(info_ptr, piece_ptr, _user) -> int:
            nonlocal count
            count += 1
            try:
                c = info_ptr.contents  # per token: build TokenInfo directly, no field reflection
                info = TokenInfo(c.token_index, c.token, c.logprob, c.experts_hit, c.experts_missed,
                                 c.bytes_read, c.ms_total, c.ms_io)
                piece = ctypes.string_at(piece_ptr) if piece_ptr else b""
                return 1 if on_token(info, piece) else 0
            except BaseException as exc:  # noqa: BLE001 - must not unwind through C
                raised.append(exc)
                return 1

        callback = abi.TOKEN_CALLBACK(trampoline)  # referenced until the call returns
        tokens = abi.int_array(prompt)
        status = self._dll.waste_generate(self.handle, tokens, len(prompt),
                                          ctypes.byref(c_params), callback, None)
        detail = self.lib.error_detail(self.handle)
        if count or status == abi.WASTE_OK:
            self.evaluated += len(prompt) + count
        if raised:
            self.reset()
            raise raised[0]
        if status == abi.WASTE_E_CANCELLED:
            self.reset()
            return GenResult(n_tokens=count, cancelled=True, context_full=False, detail=detail)
        if status != abi.WASTE_OK:
            error = self.lib.error(status, "waste_generate", self.handle)
            self.reset()
            raise error
        return GenResult(n_tokens=count, cancelled=False, context_full=detail is not None,
                         detail=detail)

    def eval(self, tokens: Sequence[int]) -> array.array:
        """Append tokens without sampling; the last position's logits as array('f').

        A copy: the engine's buffer is only valid until the next call.
        """
        logits = ctypes.POINTER(abi.FLOAT)()
        vocab = abi.SIZE(0)
        self._check(self._dll.waste_eval(self.handle, abi.int_array(tokens), len(tokens),
                                         ctypes.byref(logits), ctypes.byref(vocab)),
                    "waste_eval")
        self.evaluated += len(tokens)
        return array.array("f", ctypes.string_at(logits, vocab.value * ctypes.sizeof(abi.FLOAT)))

    # -- conversation state

    def reset(self) -> None:
        self._dll.waste_state_reset(self.handle)

    def save_state(self, path: str | os.PathLike) -> None:
        self._check(self._dll.waste_state_save(self.handle, os.fsencode(path)), "waste_state_save")

    def load_state(self, path: str | os.PathLike) -> None:
        self._check(self._dll.waste_state_load(self.handle, os.fsencode(path)), "waste_state_load")

    # -- introspection

    def stats(self) -> Stats:
        out = abi.StatsStruct()
        self._check(self._dll.waste_get_stats(self.handle, ctypes.byref(out)), "waste_get_stats")
        stats = abi.from_struct(Stats, out)
        stats.direct_io = bool(stats.direct_io)
        return stats

    def memory_used(self) -> MemPlan:
        out = abi.MemPlanStruct()
        self._check(self._dll.waste_memory_used(self.handle, ctypes.byref(out)),
                    "waste_memory_used")
        return abi.from_struct(MemPlan, out)

    def save_usage(self) -> None:
        self._check(self._dll.waste_save_usage(self.handle), "waste_save_usage")

    # -- lifetime

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._dll.waste_close(handle)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
