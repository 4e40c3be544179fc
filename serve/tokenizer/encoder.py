"""The off-engine tokenizer: a container's BPE in Python, callable from any thread.

Markup text is first cut at every special token's text (the longest one at
the earliest place, as both engines do), plain text is split into pieces by
the container's pre-tokenizer (serve/tokenizer/split.py), and each piece is
merged (serve/tokenizer/bpe.py). Pieces repeat (words, indentation), so their
ids are kept in a bounded memo.

The pre-tokenizer is the container's, or for a WARP container one of the
candidates serve/tokenizer/tokenizer_choice.py tries ("warp", then "kimi"). With the
optional `tiktoken` package, the "kimi" candidate's plain text goes through
tiktoken instead: it is the library the Kimi releases tokenize with, reads
exactly their rank file, and is several times faster. The reference
engine's formats stay in Python: tiktoken's split is a Rust regex (the default
pre-tokenizer's rule for a run of spaces and smollm's number split are not
that pattern's rules), and it has no merge-list BPE.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

from serve.engine.abi import c_text
from serve.tokenizer import split
from serve.tokenizer.bpe import Merger
from serve.tokenizer.vocabulary import Vocabulary

MEMO_PIECES = 1 << 16


class BpeTokenizer:
    def __init__(self, vocab: Vocabulary, pretokenizer: Optional[str] = None,
                 use_tiktoken: bool = True):
        self.vocab = vocab
        self.pretokenizer = pretokenizer or vocab.pretokenizers[0]
        self.specials = vocab.specials
        self._pieces = {i: piece for piece, i in vocab.ranks.items()}
        self._pieces.update((i, text.encode("utf-8")) for text, i in vocab.specials.items())
        self._merger = Merger(vocab)
        self._memo: dict[str, list[int]] = {}
        ordered = sorted(vocab.specials, key=len, reverse=True)   # the longest wins
        self._specials: Optional[re.Pattern[str]] = (
            re.compile("|".join(map(re.escape, ordered))) if ordered else None)
        library = _tiktoken(vocab, self.pretokenizer) if use_tiktoken else None
        self._plain: Callable[[str], list[int]] = self._python
        self.backend = "python"
        if library is not None:
            self._plain, self.backend = library.encode_ordinary, "tiktoken"
        else:   # built only when used: the Unicode classes take half a second
            self._splitter = split.splitter(self.pretokenizer)

    def tokenize(self, text: str) -> list[int]:
        c_text(text)   # what the engine cannot take (NUL, a lone surrogate) is refused alike
        return self._plain(text)

    def tokenize_markup(self, text: str) -> list[int]:
        c_text(text)
        if self._specials is None:
            return self._plain(text)
        ids: list[int] = []
        at = 0
        for match in self._specials.finditer(text):
            if match.start() > at:
                ids.extend(self._plain(text[at:match.start()]))
            ids.append(self.vocab.specials[match.group()])
            at = match.end()
        if at < len(text):
            ids.extend(self._plain(text[at:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> bytes:
        try:
            return b"".join(self._pieces[i] for i in ids)
        except KeyError as e:
            raise ValueError(f"no token has the id {e.args[0]}") from None

    def _python(self, text: str) -> list[int]:
        memo, ids, splitter = self._memo, [], self._splitter
        for piece in splitter.pattern.findall(splitter.units(text)):
            found = memo.get(piece)
            if found is None:
                data = splitter.piece_bytes(piece)
                found = (self._merger.encode(data) if splitter.window is None
                         else self._merger.encode_windows(data, splitter.window))
                if len(memo) >= MEMO_PIECES:
                    memo.clear()
                memo[piece] = found
            ids.extend(found)
        return ids


def _tiktoken(vocab: Vocabulary, pretokenizer: str) -> Any:
    """tiktoken's encoder for the Kimi family's pattern, when the package is installed."""
    if pretokenizer != "kimi" or vocab.merges is not None:
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken.Encoding("serve", pat_str=split.KIMI_TIKTOKEN, mergeable_ranks=vocab.ranks,
                             special_tokens={})
