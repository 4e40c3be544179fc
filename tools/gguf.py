"""Read a GGUF file (version 2 or 3): its metadata and its tensors' raw bytes.

Standard library only.  The file is read once; a tensor's data is a
memoryview into it, so nothing is copied until the caller converts it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# ggml tensor types this reader sizes: (name, elements per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
              8: ("Q8_0", 32, 34)}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the contiguous (column) axis
    type_name: str
    data: memoryview

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def cols(self) -> int:
        return self.shape[0]


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError("truncated header")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError("truncated string")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, n = self.take("<I"), self.take("<Q")
            if inner in _SCALARS:
                fmt = _SCALARS[inner]
                size = struct.calcsize(fmt)
                if self.pos + n * size > len(self.buf):
                    raise GGUFError("truncated array")
                values = list(struct.unpack_from("<%d%s" % (n, fmt[1]), self.buf, self.pos))
                self.pos += n * size
                return values
            return [self.value(inner) for _ in range(n)]
        raise GGUFError(f"unknown metadata value type {kind}")


class GGUF:
    """An open GGUF file: .meta (key -> value) and .tensors (name -> Tensor)."""

    def __init__(self, path: Path) -> None:
        buf = memoryview(Path(path).read_bytes())
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} (want 2 or 3)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            infos.append((name, shape, cur.take("<I"), cur.take("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        base = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, Tensor] = {}
        for name, shape, kind, offset in infos:
            if kind not in GGML_TYPES:
                raise GGUFError(f"tensor {name}: ggml type {kind} is not supported "
                                f"(supported: {', '.join(t[0] for t in GGML_TYPES.values())})")
            type_name, per_block, block_bytes = GGML_TYPES[kind]
            count = 1
            for d in shape:
                count *= d
            if shape[0] % per_block:
                raise GGUFError(f"tensor {name}: row of {shape[0]} is not whole {type_name} blocks")
            size = count // per_block * block_bytes
            start = base + offset
            if start + size > len(buf):
                raise GGUFError(f"tensor {name}: data runs past the end of the file")
            self.tensors[name] = Tensor(name, shape, type_name, buf[start:start + size])

