"""The ctypes mirror of engine/waste.h: status codes, structs and the function table.

The structs mirror the header by position; one field out of place would
silently shift every field after it, which is why tests compare each offset
against the C compiler's. serve/engine/binding.py calls through these.
"""
from __future__ import annotations

import ctypes
from dataclasses import fields
from typing import Optional, Sequence

from serve.engine.types import (EngineConfig, GenParams, MemPlan, ModelInfo, Stats, TokenInfo,
                                UnencodableText)

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

U32, U64, I32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32
INT, FLOAT, DOUBLE = ctypes.c_int, ctypes.c_float, ctypes.c_double
STR, SIZE = ctypes.c_char_p, ctypes.c_size_t


class MemPlanStruct(ctypes.Structure):
    _fields_ = [(f.name, U64) for f in fields(MemPlan)]


class CfgStruct(ctypes.Structure):
    _fields_ = [
        ("ram_budget_bytes", U64),
        ("ctx_tokens", U32),
        ("n_threads", INT),
        ("cpu_list", STR),
        ("cache_policy", INT),
        ("use_direct_io", INT),
        ("vision", INT),
        ("verify_records", INT),
        ("usage_path", STR),
        ("exclusive_open", INT),
    ]


class GenParamsStruct(ctypes.Structure):
    _fields_ = [
        ("temperature", FLOAT),
        ("top_p", FLOAT),
        ("top_k", INT),
        ("seed", U64),
        ("max_tokens", U32),
        ("grammar", STR),
        ("stop_tokens", ctypes.POINTER(I32)),
        ("n_stop", SIZE),
    ]


class TokenInfoStruct(ctypes.Structure):
    _fields_ = [
        ("token_index", U32),
        ("token", I32),
        ("logprob", FLOAT),
        ("experts_hit", U32),
        ("experts_missed", U32),
        ("bytes_read", U64),
        ("ms_total", DOUBLE),
        ("ms_io", DOUBLE),
    ]


class ModelInfoStruct(ctypes.Structure):
    _fields_ = [
        ("n_layers", U32),
        ("n_experts", U32),
        ("top_k", U32),
        ("hidden", U32),
        ("ctx_max", U32),
        ("params_total", U64),
        ("params_active", U64),
        ("arch", STR),
        ("quant_summary", STR),
    ]


class StatsStruct(ctypes.Structure):
    _fields_ = [
        ("tokens_generated", U64),
        ("experts_hit", U64),
        ("experts_missed", U64),
        ("bytes_read", U64),
        ("sec_total", DOUBLE),
        ("sec_io", DOUBLE),
        ("direct_io", INT),
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

CTX = ctypes.c_void_p          # waste_ctx * (opaque)
IDS = ctypes.POINTER(I32)
SIZE_OUT = ctypes.POINTER(SIZE)

TOKEN_CALLBACK = ctypes.CFUNCTYPE(INT, ctypes.POINTER(TokenInfoStruct), ctypes.c_void_p,
                                  ctypes.c_void_p)

# name -> (restype, argtypes), in header order.
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "waste_strerror": (STR, [INT]),
    "waste_version": (STR, []),
    "waste_version_number": (INT, []),
    "waste_build_info": (STR, []),
    "waste_cfg_init": (None, [ctypes.POINTER(CfgStruct)]),
    "waste_gen_params_init": (None, [ctypes.POINTER(GenParamsStruct)]),
    "waste_plan_memory": (INT, [STR, U32, ctypes.POINTER(MemPlanStruct)]),
    "waste_open": (INT, [STR, ctypes.POINTER(CfgStruct), ctypes.POINTER(CTX)]),
    "waste_close": (None, [CTX]),
    "waste_memory_used": (INT, [CTX, ctypes.POINTER(MemPlanStruct)]),
    "waste_error_detail": (STR, [CTX]),
    "waste_physical_ram": (U64, []),
    "waste_usable_ram": (U64, []),
    "waste_tokenize": (INT, [CTX, STR, INT, IDS, SIZE, SIZE_OUT]),
    "waste_tokenize_markup": (INT, [CTX, STR, INT, IDS, SIZE, SIZE_OUT]),
    "waste_detokenize": (INT, [CTX, IDS, SIZE, ctypes.c_char_p, SIZE, SIZE_OUT]),
    "waste_image_dimensions": (INT, [STR, ctypes.POINTER(INT), ctypes.POINTER(INT)]),
    "waste_image_add": (INT, [CTX, STR, SIZE_OUT]),
    "waste_image_expand": (INT, [CTX, IDS, SIZE, IDS, SIZE, SIZE_OUT]),
    "waste_image_clear": (None, [CTX]),
    "waste_generate": (INT, [CTX, IDS, SIZE, ctypes.POINTER(GenParamsStruct),
                              TOKEN_CALLBACK, ctypes.c_void_p]),
    "waste_eval": (INT, [CTX, IDS, SIZE, ctypes.POINTER(ctypes.POINTER(FLOAT)),
                          SIZE_OUT]),
    "waste_state_save": (INT, [CTX, STR]),
    "waste_state_load": (INT, [CTX, STR]),
    "waste_state_reset": (None, [CTX]),
    "waste_model_get_info": (INT, [CTX, ctypes.POINTER(ModelInfoStruct)]),
    "waste_get_stats": (INT, [CTX, ctypes.POINTER(StatsStruct)]),
    "waste_save_usage": (INT, [CTX]),
}


def text(raw: Optional[bytes]) -> Optional[str]:
    return None if raw is None else raw.decode("utf-8", "replace")


def c_text(text: str) -> bytes:
    """UTF-8 for a `const char *`; a NUL would silently cut the string short."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" decodes to a str no encoder accepts
        raise UnencodableText("text contains a lone surrogate, which is not UTF-8") from None
    if b"\0" in data:
        raise UnencodableText("text contains a NUL character, which a C string cannot carry")
    return data


def c_int(value: int, ctype: type, name: str) -> int:
    """`value`, checked to fit `ctype`: ctypes would silently wrap it (2**32 + 1 -> 1)."""
    if ctype(value).value != value:
        raise ValueError(f"{name} {value} does not fit the engine's {ctype.__name__}")
    return value


def int_array(values: Sequence[int], size: Optional[int] = None) -> ctypes.Array:
    buf = (I32 * max(1, len(values) if size is None else size))()
    buf[:len(values)] = list(values)
    return buf


def from_struct(cls, struct: ctypes.Structure):
    """Build a dataclass from a struct mirror whose field names match it."""
    values = {}
    for f in fields(cls):
        value = getattr(struct, f.name)
        if value is None or isinstance(value, bytes):   # a `const char *` field
            value = text(value) or ""
        values[f.name] = value
    return cls(**values)
