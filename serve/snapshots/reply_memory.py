"""The token ids the model generated for each reply, keyed by how the reply renders.

A client sends a reply back as text. Re-tokenizing that text seldom gives the
ids the model sampled (a character split across tokens, a rare merge), so the
next prompt would part from the state saved after generation just past where
the reply began. Remembering the ids lets the history use them instead.

Entries are keyed by a digest of the reply rendered as an assistant history
message (the segments the chat format writes for it), not by any wire field:
every dialect that renders the same internal message finds the same entry.
Each reply belongs to its namespace (serve/snapshots/scope.py: its sender's key
and cache_salt), which the digest begins with: another owner sending the same
text back finds nothing, neither its ids nor its reasoning.
The memory belongs to one process and is bounded in bytes, least recently
used first out. With a shared tier (--shared-cache) each reply is also
published there, a file per rendering (serve/snapshots/shared_dir.py), and a
reply this process does not remember is looked for there: the next turn on
another host then tokenizes the reply as the host that wrote it did, and
restores the snapshot that host published after it. (A reply whose client
dropped its reasoning is found in this process's memory only.)
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from serve.core.segment import Segment
from serve.snapshots.keys import ID_BYTES, ids_of, raw_ids
from serve.snapshots.shared_dir import Rejected, SharedDir

DEFAULT_CAPACITY = 64 << 20   # about 16M remembered ids


@dataclass(frozen=True)
class Remembered:
    ids: array            # the generation prompt's ids, then every generated id ('i' array)
    reasoning: str        # what the reply said in its think channel, for --keep-reasoning
    dropped: Optional[tuple[bytes, bytes]] = None   # its place in the index without reasoning

    @property
    def size(self) -> int:
        return self.ids.itemsize * len(self.ids) + len(self.reasoning.encode("utf-8", "replace"))


def digest(rendered: Sequence[Segment], namespace: str = "") -> bytes:
    """A digest of rendered segments, in `namespace`, in which text and markup can never be
    confused."""
    h = hashlib.sha256()
    if namespace:
        name = namespace.encode("utf-8", "surrogatepass")
        h.update(b"N" + len(name).to_bytes(8, "little") + name)
    for segment in rendered:
        data = segment.text.encode("utf-8", "surrogatepass")
        h.update(b"M" if segment.markup else b"T")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class ReplyMemory:
    """Bounded LRU of replies: rendered reply -> the ids that produced it. Thread-safe."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY, shared: Optional[SharedDir] = None):
        if capacity_bytes <= 0:
            raise ValueError("reply memory capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self._by_rendering: "OrderedDict[bytes, Remembered]" = OrderedDict()
        # Replies with reasoning, by their rendering without it, then by the conversation
        # before them (--keep-reasoning).
        self._without_reasoning: dict[bytes, dict[bytes, bytes]] = {}
        self.used_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_rendering)

    def remember(self, rendered: Sequence[Segment], ids: Sequence[int], reasoning: str = "",
                 without_reasoning: Optional[tuple[Sequence[Segment], Sequence[Segment]]] = None,
                 namespace: str = "") -> None:
        """Keep `ids` for a reply that renders as `rendered`, in `namespace`.

        `without_reasoning`: for a reply with reasoning, (the conversation
        before it, the reply rendered without its reasoning), which is what a
        client that drops reasoning sends back. The conversation is part of the
        key because replies often differ in reasoning alone (an empty answer
        cut in the think channel, the same tool call twice).
        """
        dropped = None
        if without_reasoning is not None:
            context, stripped = without_reasoning
            dropped = (digest(stripped, namespace), digest(context, namespace))
        entry = Remembered(array("i", ids), reasoning, dropped)
        if entry.size > self.capacity_bytes:
            return
        key = digest(rendered, namespace)
        self._keep(key, entry)
        if self.shared is not None:
            body = raw_ids(entry.ids) + reasoning.encode("utf-8", "surrogatepass")
            self.shared.publish(key.hex(), "reply", {"n_ids": len(entry.ids)}, [body], len(body))

    def _keep(self, key: bytes, entry: Remembered) -> None:
        dropped = entry.dropped
        with self._lock:
            self._forget(key)
            self._by_rendering[key] = entry
            self.used_bytes += entry.size
            if dropped is not None:
                self._without_reasoning.setdefault(dropped[0], {})[dropped[1]] = key
            while self.used_bytes > self.capacity_bytes:
                self._forget(next(iter(self._by_rendering)))

    def _forget(self, key: bytes) -> None:
        entry = self._by_rendering.pop(key, None)
        if entry is None:
            return
        self.used_bytes -= entry.size
        if entry.dropped is not None:
            stripped, context = entry.dropped
            contexts = self._without_reasoning.get(stripped, {})
            if contexts.get(context) == key:
                del contexts[context]
                if not contexts:
                    del self._without_reasoning[stripped]

    def recall(self, rendered: Sequence[Segment], namespace: str = "") -> Optional[Remembered]:
        """The reply that renders exactly as `rendered`, if remembered in `namespace` (here,
        or published by a host of the team)."""
        key = digest(rendered, namespace)
        with self._lock:
            entry = self._by_rendering.get(key)
            if entry is not None:
                self._by_rendering.move_to_end(key)
                return entry
        return self._fetch(key) if self.shared is not None else None

    def _fetch(self, key: bytes) -> Optional[Remembered]:
        """A reply a host of the team published, checked."""
        assert self.shared is not None
        found = self.shared.read_whole(key.hex(), listed=False)
        if found is None:
            return None
        header, body = found
        n = header.get("n_ids")
        try:
            if not isinstance(n, int) or not 0 <= n * ID_BYTES <= len(body):
                raise ValueError("no id count")
            entry = Remembered(array("i", ids_of(body[:n * ID_BYTES])),
                               body[n * ID_BYTES:].decode("utf-8", "surrogatepass"))
        except ValueError:   # UnicodeDecodeError too
            self.shared.reject(key.hex(), Rejected("damaged", f"{key.hex()} is not a reply"))
            return None
        if entry.size <= self.capacity_bytes:
            self._keep(key, entry)
        return entry

    def recall_without_reasoning(self, rendered: Sequence[Segment],
                                  context: Callable[[], Sequence[Segment]], namespace: str = ""
                                  ) -> Optional[Remembered]:
        """The reply with reasoning that renders as `rendered` once the reasoning is dropped,
        in the conversation `context()` renders (called only when some reply could match),
        remembered in `namespace`."""
        with self._lock:
            contexts = self._without_reasoning.get(digest(rendered, namespace))
        if not contexts:
            return None
        before = digest(context(), namespace)
        with self._lock:
            key = contexts.get(before)
            entry = self._by_rendering.get(key) if key is not None else None
            if key is not None and entry is not None:
                self._by_rendering.move_to_end(key)
            return entry
