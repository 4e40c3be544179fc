"""ctypes binding to libwaste: every struct and function of engine/waste.h.

The structs below mirror the header by position; one field out of place
would silently shift every field after it, which is why tests compare each
offset against the C compiler's.

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

from serve.engine.types import (EngineConfig, GenParams, GenResult, MemPlan, ModelInfo, Stats,
                                TokenCallback, TokenInfo, UnencodableText, WasteError)

# ------------------------------------------------------------ errors


class LibraryNotFound(Exception):
    """No usable libwaste: names every path tried and why each failed."""


# ------------------------------------------------------------ status codes

WASTE_OK = 0
WASTE_E_IO = -1
WASTE_E_FORMAT = -2
WASTE_E_RAM_BUDGET = -3
WASTE_E_OOM = -4
WASTE_E_ARG = -5
WASTE_E_UNSUPPORTED = -6
WASTE_E_CANCELLED = -7
WASTE_E_BUSY = -8

STATUS_NAMES = {
    WASTE_OK: "WASTE_OK",
    WASTE_E_IO: "WASTE_E_IO",
    WASTE_E_FORMAT: "WASTE_E_FORMAT",
    WASTE_E_RAM_BUDGET: "WASTE_E_RAM_BUDGET",
    WASTE_E_OOM: "WASTE_E_OOM",
    WASTE_E_ARG: "WASTE_E_ARG",
    WASTE_E_UNSUPPORTED: "WASTE_E_UNSUPPORTED",
    WASTE_E_CANCELLED: "WASTE_E_CANCELLED",
    WASTE_E_BUSY: "WASTE_E_BUSY",
}

CACHE_POLICIES = {"lfru": 0, "lru": 1}

# The engine versions this binding speaks to: ABI 1 is engine 0.6.x.
VERSION_RANGE = range(600, 700)

# ------------------------------------------------------- struct mirrors

_u32, _u64, _i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32
_int, _float, _double = ctypes.c_int, ctypes.c_float, ctypes.c_double
_str, _size = ctypes.c_char_p, ctypes.c_size_t


class MemPlanStruct(ctypes.Structure):
    _fields_ = [(f.name, _u64) for f in fields(MemPlan)]


class CfgStruct(ctypes.Structure):
    _fields_ = [
        ("ram_budget_bytes", _u64),
        ("ctx_tokens", _u32),
        ("n_threads", _int),
        ("cpu_list", _str),
        ("cache_policy", _int),
        ("use_direct_io", _int),
        ("vision", _int),
        ("verify_records", _int),
        ("usage_path", _str),
        ("exclusive_open", _int),
    ]


class GenParamsStruct(ctypes.Structure):
    _fields_ = [
        ("temperature", _float),
        ("top_p", _float),
        ("top_k", _int),
        ("seed", _u64),
        ("max_tokens", _u32),
        ("grammar", _str),
        ("stop_tokens", ctypes.POINTER(_i32)),
        ("n_stop", _size),
    ]


class TokenInfoStruct(ctypes.Structure):
    _fields_ = [
        ("token_index", _u32),
        ("token", _i32),
        ("logprob", _float),
        ("experts_hit", _u32),
        ("experts_missed", _u32),
        ("bytes_read", _u64),
        ("ms_total", _double),
        ("ms_io", _double),
    ]


class ModelInfoStruct(ctypes.Structure):
    _fields_ = [
        ("n_layers", _u32),
        ("n_experts", _u32),
        ("top_k", _u32),
        ("hidden", _u32),
        ("ctx_max", _u32),
        ("params_total", _u64),
        ("params_active", _u64),
        ("arch", _str),
        ("quant_summary", _str),
    ]


class StatsStruct(ctypes.Structure):
    _fields_ = [
        ("tokens_generated", _u64),
        ("experts_hit", _u64),
        ("experts_missed", _u64),
        ("bytes_read", _u64),
        ("sec_total", _double),
        ("sec_io", _double),
        ("direct_io", _int),
    ]


# The C typedef name of each mirror, for the layout test.
C_STRUCTS = {
    "waste_memplan": MemPlanStruct,
    "waste_cfg": CfgStruct,
    "waste_gen_params": GenParamsStruct,
    "waste_token_info": TokenInfoStruct,
    "waste_model_info": ModelInfoStruct,
    "waste_stats": StatsStruct,
}

# ------------------------------------------------------ function table

_ctx = ctypes.c_void_p          # waste_ctx * (opaque)
_ids = ctypes.POINTER(_i32)
_size_out = ctypes.POINTER(_size)

TOKEN_CALLBACK = ctypes.CFUNCTYPE(_int, ctypes.POINTER(TokenInfoStruct), ctypes.c_void_p,
                                  ctypes.c_void_p)

# name -> (restype, argtypes), in header order.
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "waste_strerror": (_str, [_int]),
    "waste_version": (_str, []),
    "waste_version_number": (_int, []),
    "waste_build_info": (_str, []),
    "waste_cfg_init": (None, [ctypes.POINTER(CfgStruct)]),
    "waste_gen_params_init": (None, [ctypes.POINTER(GenParamsStruct)]),
    "waste_plan_memory": (_int, [_str, _u32, ctypes.POINTER(MemPlanStruct)]),
    "waste_open": (_int, [_str, ctypes.POINTER(CfgStruct), ctypes.POINTER(_ctx)]),
    "waste_close": (None, [_ctx]),
    "waste_memory_used": (_int, [_ctx, ctypes.POINTER(MemPlanStruct)]),
    "waste_error_detail": (_str, [_ctx]),
    "waste_physical_ram": (_u64, []),
    "waste_usable_ram": (_u64, []),
    "waste_tokenize": (_int, [_ctx, _str, _int, _ids, _size, _size_out]),
    "waste_tokenize_markup": (_int, [_ctx, _str, _int, _ids, _size, _size_out]),
    "waste_detokenize": (_int, [_ctx, _ids, _size, ctypes.c_char_p, _size, _size_out]),
    "waste_image_dimensions": (_int, [_str, ctypes.POINTER(_int), ctypes.POINTER(_int)]),
    "waste_image_add": (_int, [_ctx, _str, _size_out]),
    "waste_image_expand": (_int, [_ctx, _ids, _size, _ids, _size, _size_out]),
    "waste_image_clear": (None, [_ctx]),
    "waste_generate": (_int, [_ctx, _ids, _size, ctypes.POINTER(GenParamsStruct),
                              TOKEN_CALLBACK, ctypes.c_void_p]),
    "waste_eval": (_int, [_ctx, _ids, _size, ctypes.POINTER(ctypes.POINTER(_float)),
                          _size_out]),
    "waste_state_save": (_int, [_ctx, _str]),
    "waste_state_load": (_int, [_ctx, _str]),
    "waste_state_reset": (None, [_ctx]),
    "waste_model_get_info": (_int, [_ctx, ctypes.POINTER(ModelInfoStruct)]),
    "waste_get_stats": (_int, [_ctx, ctypes.POINTER(StatsStruct)]),
    "waste_save_usage": (_int, [_ctx]),
}


def _text(raw: Optional[bytes]) -> Optional[str]:
    return None if raw is None else raw.decode("utf-8", "replace")


def _c_text(text: str) -> bytes:
    """UTF-8 for a `const char *`; a NUL would silently cut the string short."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" decodes to a str no encoder accepts
        raise UnencodableText("text contains a lone surrogate, which is not UTF-8") from None
    if b"\0" in data:
        raise UnencodableText("text contains a NUL character, which a C string cannot carry")
    return data


def _c_int(value: int, ctype: type, name: str) -> int:
    """`value`, checked to fit `ctype`: ctypes would silently wrap it (2**32 + 1 -> 1)."""
    if ctype(value).value != value:
        raise ValueError(f"{name} {value} does not fit the engine's {ctype.__name__}")
    return value


def _int_array(values: Sequence[int], size: Optional[int] = None) -> ctypes.Array:
    buf = (_i32 * max(1, len(values) if size is None else size))()
    buf[:len(values)] = list(values)
    return buf


def _from_struct(cls, struct: ctypes.Structure):
    """Build a dataclass from a struct mirror whose field names match it."""
    values = {}
    for f in fields(cls):
        value = getattr(struct, f.name)
        if value is None or isinstance(value, bytes):   # a `const char *` field
            value = _text(value) or ""
        values[f.name] = value
    return cls(**values)

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
        missing = [name for name in SIGNATURES if not hasattr(dll, name)]
        if missing:
            raise OSError(f"not libwaste ABI 1: missing {', '.join(missing)}")
        for name, (restype, argtypes) in SIGNATURES.items():
            func = getattr(dll, name)
            func.restype = restype
            func.argtypes = argtypes
        number = dll.waste_version_number()
        if number not in VERSION_RANGE:
            raise OSError(f"engine version_number {number} is outside "
                          f"{VERSION_RANGE.start}..{VERSION_RANGE.stop - 1}")
        self.dll = dll
        self.path = path
        self.rejected = list(rejected)
        # waste_error_detail(NULL) -- the reason an open, plan or image header
        # failed -- is documented by the reference engine only; the ABI does not
        # promise that another libwaste accepts NULL there, so it is not asked.
        self.detail_without_ctx = (_text(dll.waste_build_info()) or "").startswith(REFERENCE_BUILD)

    # -- errors

    def strerror(self, status: int) -> str:
        return _text(self.dll.waste_strerror(status)) or ""

    def error_detail(self, ctx: Optional[int] = None) -> Optional[str]:
        """waste_error_detail: for a ctx, or (None) this thread's last open/plan,
        where the library supports that."""
        if ctx is None and not self.detail_without_ctx:
            return None
        return _text(self.dll.waste_error_detail(ctx))

    def error(self, status: int, call: str, ctx: Optional[int] = None) -> WasteError:
        name = STATUS_NAMES.get(status, f"status {status}")
        return WasteError(status, name, self.strerror(status), self.error_detail(ctx), call)

    def check(self, status: int, call: str, ctx: Optional[int] = None) -> None:
        if status != WASTE_OK:
            raise self.error(status, call, ctx)

    # -- version and host facts

    def version(self) -> str:
        return _text(self.dll.waste_version()) or ""

    def version_number(self) -> int:
        return self.dll.waste_version_number()

    def build_info(self) -> str:
        return _text(self.dll.waste_build_info()) or ""

    def physical_ram(self) -> int:
        return self.dll.waste_physical_ram()

    def usable_ram(self) -> int:
        return self.dll.waste_usable_ram()

    # -- planning that needs no open model

    def plan_memory(self, model_path: str | os.PathLike, ctx: int = 0) -> MemPlan:
        plan = MemPlanStruct()
        self.check(self.dll.waste_plan_memory(os.fsencode(model_path), _c_int(ctx, _u32, "ctx"),
                                              ctypes.byref(plan)),
                   "waste_plan_memory")
        return _from_struct(MemPlan, plan)

    def image_dimensions(self, path: str | os.PathLike) -> tuple[int, int]:
        w, h = _int(), _int()
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
        handle = _ctx()
        status = self._dll.waste_open(os.fsencode(model_path), ctypes.byref(self._cfg),
                                      ctypes.byref(handle))
        if status != WASTE_OK:
            raise lib.error(status, "waste_open")
        self._handle: Optional[int] = handle.value
        info = ModelInfoStruct()
        try:
            self._check(self._dll.waste_model_get_info(self._handle, ctypes.byref(info)),
                        "waste_model_get_info")
        except WasteError:
            self.close()
            raise
        self.info: ModelInfo = _from_struct(ModelInfo, info)
        # Positions evaluated into the state (waste_eval's tokens, waste_generate's prompt and
        # generated tokens): what serve asked the engine to compute, restores not included.
        self.evaluated = 0
        self.specials: dict[str, int] = read_specials(model_path)
        self.longest_token: int = read_longest_token(model_path, self.specials)

    def _make_cfg(self, cfg: EngineConfig) -> CfgStruct:
        if cfg.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {sorted(CACHE_POLICIES)}")
        c = CfgStruct()
        self._dll.waste_cfg_init(ctypes.byref(c))
        c.ram_budget_bytes = _c_int(cfg.budget, _u64, "budget")
        c.ctx_tokens = _c_int(cfg.ctx, _u32, "ctx")
        c.n_threads = _c_int(cfg.threads, _int, "threads")
        c.cpu_list = _c_text(cfg.cpus) if cfg.cpus is not None else None
        c.cache_policy = CACHE_POLICIES[cfg.cache_policy]
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
            out, n = (_i32 * cap)(), _size(0)
            status = fill(out, cap, n)
            if status == WASTE_E_ARG and n.value > cap:
                cap = n.value
                continue
            self._check(status, call)
            return out[:n.value]

    # -- tokenizer

    def tokenize(self, text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]:
        """Text -> ids. markup=True recognises special tokens: only for text we wrote."""
        data = _c_text(text)
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
        tokens = _int_array(ids)
        cap = 8 * len(ids) + 1
        while True:
            out, n = ctypes.create_string_buffer(cap), _size(0)
            status = self._dll.waste_detokenize(self.handle, tokens, len(ids), out, cap,
                                                ctypes.byref(n))
            if status == WASTE_E_ARG and n.value + 1 > cap:
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
        n = _size(0)
        self._check(self._dll.waste_image_add(self.handle, os.fsencode(path), ctypes.byref(n)),
                    "waste_image_add")
        return n.value

    def image_expand(self, ids: Sequence[int]) -> list[int]:
        tokens = _int_array(ids)
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
        c_params = GenParamsStruct()
        self._dll.waste_gen_params_init(ctypes.byref(c_params))
        c_params.temperature = params.temperature
        c_params.top_p = params.top_p
        c_params.top_k = _c_int(params.top_k, _int, "top_k")
        c_params.seed = _c_int(params.seed, _u64, "seed")
        c_params.max_tokens = _c_int(params.max_tokens, _u32, "max_tokens")
        stops = _int_array(params.stop_tokens)
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

        callback = TOKEN_CALLBACK(trampoline)  # referenced until the call returns
        tokens = _int_array(prompt)
        status = self._dll.waste_generate(self.handle, tokens, len(prompt),
                                          ctypes.byref(c_params), callback, None)
        detail = self.lib.error_detail(self.handle)
        if count or status == WASTE_OK:
            self.evaluated += len(prompt) + count
        if raised:
            self.reset()
            raise raised[0]
        if status == WASTE_E_CANCELLED:
            self.reset()
            return GenResult(n_tokens=count, cancelled=True, context_full=False, detail=detail)
        if status != WASTE_OK:
            error = self.lib.error(status, "waste_generate", self.handle)
            self.reset()
            raise error
        return GenResult(n_tokens=count, cancelled=False, context_full=detail is not None,
                         detail=detail)

    def eval(self, tokens: Sequence[int]) -> array.array:
        """Append tokens without sampling; the last position's logits as array('f').

        A copy: the engine's buffer is only valid until the next call.
        """
        logits = ctypes.POINTER(_float)()
        vocab = _size(0)
        self._check(self._dll.waste_eval(self.handle, _int_array(tokens), len(tokens),
                                         ctypes.byref(logits), ctypes.byref(vocab)),
                    "waste_eval")
        self.evaluated += len(tokens)
        return array.array("f", ctypes.string_at(logits, vocab.value * ctypes.sizeof(_float)))

    # -- conversation state

    def reset(self) -> None:
        self._dll.waste_state_reset(self.handle)

    def save_state(self, path: str | os.PathLike) -> None:
        self._check(self._dll.waste_state_save(self.handle, os.fsencode(path)), "waste_state_save")

    def load_state(self, path: str | os.PathLike) -> None:
        self._check(self._dll.waste_state_load(self.handle, os.fsencode(path)), "waste_state_load")

    # -- introspection

    def stats(self) -> Stats:
        out = StatsStruct()
        self._check(self._dll.waste_get_stats(self.handle, ctypes.byref(out)), "waste_get_stats")
        stats = _from_struct(Stats, out)
        stats.direct_io = bool(stats.direct_io)
        return stats

    def memory_used(self) -> MemPlan:
        out = MemPlanStruct()
        self._check(self._dll.waste_memory_used(self.handle, ctypes.byref(out)),
                    "waste_memory_used")
        return _from_struct(MemPlan, out)

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
