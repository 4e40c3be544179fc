"""A container's tokenizer files, read without the engine.

The formats (engine/FORMAT.md; WARP's docs/FORMAT.md):
- `tokenizer.model` (WARP also reads `tiktoken.model`): "<base64 bytes> <rank>" per line,
  the rank being the id;
- `specials.json`: [{"id": int, "text": str}, ...], the markup tokens;
- `tokenizer.merges` (optional, GGUF conversions): "<left id> <right id>" per line,
  highest priority first: merges go by this list, not by the result's rank;
- `manifest.json`: the pre-tokenizer ("pretokenizer": "smollm", or the reference
  engine's default) and `unk_token`, what a byte with no token of its own encodes as.
A container that is not the reference engine's ("format": "waste-ref") is WARP's,
whose manifest names no pre-tokenizer: WARP splits text with a scanner of its own
(serve/tokenizer/warp_split.py), close to but not the Kimi family's tiktoken
pattern, so such a container has two candidates, "warp" then "kimi", and the
start-up probe (serve/tokenizer/tokenizer_choice.py) keeps the first equal to the engine.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from serve.tokenizer.split import NAMES

RANK_FILES = ("tokenizer.model", "tiktoken.model")
WARP_CANDIDATES = ("warp", "kimi")   # WARP's scanner, then the tiktoken pattern it follows


class VocabularyError(ValueError):
    """The tokenizer files cannot be read as any format serve knows."""


@dataclass(frozen=True)
class Vocabulary:
    ranks: dict[bytes, int]                       # a BPE token's bytes -> its id
    specials: dict[str, int]                      # a markup token's text -> its id
    pretokenizers: tuple[str, ...]                # the candidates, in order (split.NAMES)
    merges: Optional[dict[tuple[int, int], int]]  # (left id, right id) -> priority; None: by rank
    byte_ids: tuple[int, ...]                     # each byte's id on its own (unk_token if none)


def load(container: str | Path) -> Vocabulary:
    root = Path(container)
    manifest = _json(root / "manifest.json")
    if not isinstance(manifest, dict):
        raise VocabularyError("manifest.json is not a JSON object")
    ranks = _ranks(root)
    specials = _specials(root / "specials.json")
    byte_ids = _byte_ids(ranks, specials, manifest.get("unk_token"))
    merges = _merges(root / "tokenizer.merges", ranks)
    return Vocabulary(ranks, specials, _pretokenizers(manifest), merges, byte_ids)


def _pretokenizers(manifest: dict) -> tuple[str, ...]:
    name = manifest.get("pretokenizer")
    if name is None:
        return ("default",) if manifest.get("format") == "waste-ref" else WARP_CANDIDATES
    if name not in NAMES:
        raise VocabularyError(f"pre-tokenizer {name!r} is not one serve knows")
    return (str(name),)


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise VocabularyError(f"{path.name}: {e}") from None


def _ranks(root: Path) -> dict[bytes, int]:
    for name in RANK_FILES:
        path = root / name
        if path.is_file():
            break
    else:
        raise VocabularyError("no tokenizer.model (or tiktoken.model)")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
            except (IndexError, ValueError, binascii.Error):
                raise VocabularyError(f"{name} line {lineno}: expected \"<base64> <rank>\"") from None
            if ranks.setdefault(token, rank) != rank:
                raise VocabularyError(f"{name} line {lineno}: the same bytes have two ranks")
    return ranks


def _specials(path: Path) -> dict[str, int]:
    entries = _json(path)
    try:
        if not isinstance(entries, list):
            raise TypeError("not a list")
        return {str(e["text"]): int(e["id"]) for e in entries}
    except (TypeError, KeyError, ValueError):
        raise VocabularyError("specials.json is not a list of {\"id\", \"text\"}") from None


def _byte_ids(ranks: dict[bytes, int], specials: dict[str, int], unk: object) -> tuple[int, ...]:
    unk_id = specials.get(unk) if isinstance(unk, str) and unk else None
    ids = []
    for b in range(256):
        found = ranks.get(bytes([b]), unk_id)
        if found is None:
            raise VocabularyError(f"no token for the byte 0x{b:02x} and no unk_token")
        ids.append(found)
    return tuple(ids)


def _merges(path: Path, ranks: dict[bytes, int]) -> Optional[dict[tuple[int, int], int]]:
    if not path.is_file():
        return None
    merges: dict[tuple[int, int], int] = {}
    with open(path, "rb") as f:
        for priority, line in enumerate(f):
            try:
                left, right = (int(field) for field in line.split())
            except ValueError:
                raise VocabularyError(f"tokenizer.merges line {priority + 1}: expected "
                                      "\"<left id> <right id>\"") from None
            merges.setdefault((left, right), priority)
    return merges
