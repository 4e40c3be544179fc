"""The engine's types, without the binding: what serve passes to an engine and gets back.

serve/engine/api.py's `EngineApi` speaks in these; serve/engine/binding.py fills them
from libwaste's structs, and a second binding (or the tests' scripted engine) would too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


class WasteError(Exception):
    """An engine call failed: status code, its name, strerror and detail."""

    def __init__(self, status: int, name: str, message: str, detail: Optional[str], call: str):
        self.status = status      # e.g. -1
        self.name = name          # e.g. "WASTE_E_IO"
        self.message = message    # waste_strerror(status)
        self.detail = detail      # waste_error_detail(...) or None
        self.call = call          # e.g. "waste_open"
        super().__init__(f"{call}: {name}: {message}" + (f" ({detail})" if detail else ""))


class UnencodableText(ValueError):
    """Text a `const char *` cannot carry: a NUL character, or a lone surrogate (not UTF-8)."""


@dataclass
class EngineConfig:
    budget: int = 0                 # ram_budget_bytes
    ctx: int = 0                    # ctx_tokens
    threads: int = 0
    cpus: Optional[str] = None      # cpu_list
    cache_policy: str = "lfru"      # "lfru" | "lru"
    direct_io: bool = True
    vision: bool = False
    verify: bool = False
    usage_path: Optional[str] = None
    exclusive_open: bool = False


@dataclass
class GenParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 256
    stop_tokens: Sequence[int] = ()


@dataclass
class TokenInfo:
    token_index: int
    token: int
    logprob: float
    experts_hit: int
    experts_missed: int
    bytes_read: int
    ms_total: float
    ms_io: float


@dataclass
class GenResult:
    n_tokens: int                  # tokens handed to the callback
    cancelled: bool                # the callback asked to stop
    context_full: bool             # ended because the context filled
    detail: Optional[str]          # waste_error_detail after the call


@dataclass
class MemPlan:
    trunk_bytes: int
    state_bytes: int
    scratch_bytes: int
    min_expert_cache: int
    floor_bytes: int
    recommended_bytes: int
    vision_bytes: int
    working_set_bytes: int


@dataclass
class ModelInfo:
    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    ctx_max: int
    params_total: int
    params_active: int
    arch: str
    quant_summary: str


@dataclass
class Stats:
    tokens_generated: int
    experts_hit: int
    experts_missed: int
    bytes_read: int
    sec_total: float
    sec_io: float
    direct_io: bool


# on_token(info, piece_bytes) -> True to stop; an exception also stops and is re-raised.
TokenCallback = Callable[[TokenInfo, bytes], Optional[bool]]
