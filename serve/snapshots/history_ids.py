"""Tokenize a rendered conversation, giving remembered replies the ids the model produced.

The prompt's text never changes: an assistant message is used only when it
renders to exactly the segments of a remembered reply, and its ids are laid
over those segments under two rules that keep the prompt's structure.
- A markup segment takes remembered ids only where they are exactly that
  segment's own markup tokenization.
- A run of text segments takes remembered ordinary (non-special) ids whose
  text, decoded as the client saw it (UTF-8 with errors replaced), is a prefix
  of the run's text; each id must end on a whole character, and the decoder
  is flushed only where the reply parser flushed it (at a special id, or at
  the end of the reply).
The first place the ids stop matching (the reply was cut by max_tokens or a
stop string, or the model wrote structure the renderer writes otherwise) ends
the overlay: from there on the message is tokenized as usual.
"""
from __future__ import annotations

import codecs
from typing import Sequence

from serve.engine.api import EngineApi
from serve.core.segment import Segment


def find(segments: Sequence[Segment], run: Sequence[Segment], start: int) -> int:
    """Where `run` occurs in `segments` at or after `start`, or -1."""
    n = len(run)
    for at in range(start, len(segments) - n + 1):
        if segments[at] == run[0] and list(segments[at:at + n]) == list(run):
            return at
    return -1


def tokenize_history(engine: EngineApi, segments: Sequence[Segment],
                     replies: Sequence[tuple[Sequence[Segment], Sequence[int]]],
                     cuts: Sequence[int] = ()) -> tuple[list[int], dict[int, int]]:
    """engine.tokenize_segments(segments), except inside the remembered replies; and, for
    each segment count in `cuts`, how many ids the segments before it make.

    `replies` are (rendered message, remembered ids) in conversation order. A cut
    inside a remembered reply has no position (a reply is laid over as a whole).
    """
    ids: list[int] = []
    positions: dict[int, int] = {}
    pending = sorted(set(cuts))
    at = 0

    def plain(upto: int) -> None:
        """Tokenize segments[at:upto] as they are, noting the cuts on the way."""
        nonlocal at
        while pending and pending[0] <= upto:
            cut = pending.pop(0)
            if cut >= at:
                ids.extend(engine.tokenize_segments(segments[at:cut]))
                positions[cut] = len(ids)
                at = cut
        ids.extend(engine.tokenize_segments(segments[at:upto]))
        at = upto

    for rendered, remembered in replies:
        start = find(segments, rendered, at) if rendered else -1
        if start < 0:
            continue
        plain(start)
        ids.extend(overlay(engine, rendered, remembered))
        at = start + len(rendered)
    plain(len(segments))
    return ids, positions


def overlay(engine: EngineApi, rendered: Sequence[Segment], remembered: Sequence[int]) -> list[int]:
    """The ids of one rendered message: remembered ones as far as they match, then tokenized."""
    specials = frozenset(engine.specials.values())
    out: list[int] = []
    pos = i = 0
    while i < len(rendered) and pos < len(remembered):
        if rendered[i].markup:
            want = engine.tokenize_segments([rendered[i]])
            k = _common_prefix(want, remembered, pos)
            if k < len(want) and pos + k < len(remembered):
                break                       # the reply wrote other structure here
            out += want
            pos += k
            i += 1
            continue
        end = i
        while end < len(rendered) and not rendered[end].markup:
            end += 1
        text = "".join(s.text for s in rendered[i:end])
        stop = pos
        while stop < len(remembered) and remembered[stop] not in specials:
            stop += 1
        n, chars = _text_prefix(engine, remembered[pos:stop], text)
        out += remembered[pos:pos + n]
        pos += n
        if chars < len(text):
            out += _rest_of_run(engine, rendered[i:end], chars)
            i = end
            break
        i = end
        if pos < stop:
            break                           # the reply said more text than the message holds
    return out + engine.tokenize_segments(rendered[i:])


def _common_prefix(want: Sequence[int], have: Sequence[int], pos: int) -> int:
    k = 0
    while k < len(want) and pos + k < len(have) and want[k] == have[pos + k]:
        k += 1
    return k


def _text_prefix(engine: EngineApi, ids: Sequence[int], text: str) -> tuple[int, int]:
    """(n, chars): the most leading `ids` whose decoded text is text[:chars], whole characters only."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    best = (0, 0)
    chars = 0
    for n, token in enumerate(ids, start=1):
        piece = decoder.decode(engine.detokenize([token]), final=n == len(ids))
        if text[chars:chars + len(piece)] != piece:
            break
        chars += len(piece)
        if not decoder.getstate()[0]:  # no bytes held back: the id ends on a character boundary
            best = (n, chars)
    return best


def _rest_of_run(engine: EngineApi, run: Sequence[Segment], chars: int) -> list[int]:
    """Tokenize a text run from character `chars` on, keeping its segments apart."""
    rest: list[Segment] = []
    for segment in run:
        if chars >= len(segment.text):
            chars -= len(segment.text)
            continue
        rest.append(Segment(segment.text[chars:], False))
        chars = 0
    return engine.tokenize_segments(rest)
