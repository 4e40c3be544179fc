"""What serve needs of an engine: the calls the ctypes binding (serve/engine/binding.py) makes into
libwaste, as a Protocol that the tests' scripted engine meets as well."""
from __future__ import annotations

import array
import os
from typing import Callable, Optional, Protocol, Sequence

from serve.engine.types import GenParams, GenResult, ModelInfo, Stats, TokenInfo


class EngineApi(Protocol):
    info: ModelInfo
    specials: dict[str, int]   # special token text -> id
    longest_token: int         # bytes of the vocabulary's longest ordinary token
    evaluated: int             # positions evaluated so far (eval, generate), restores not included

    def tokenize(self, text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> bytes: ...

    def token_id(self, text: str) -> Optional[int]: ...

    def image_add(self, path: str | os.PathLike) -> int: ...

    def image_expand(self, ids: Sequence[int]) -> list[int]: ...

    def image_clear(self) -> None: ...

    def generate(self, prompt: Sequence[int], params: GenParams,
                 on_token: Callable[[TokenInfo, bytes], Optional[bool]]) -> GenResult: ...

    def eval(self, tokens: Sequence[int]) -> array.array: ...

    def reset(self) -> None: ...

    def save_state(self, path: str | os.PathLike) -> None: ...

    def load_state(self, path: str | os.PathLike) -> None: ...

    def stats(self) -> Stats: ...


class ImageProbe(Protocol):
    """The library call that measures an image before it is queued (waste_image_dimensions)."""

    def image_dimensions(self, path: str | os.PathLike) -> tuple[int, int]: ...
