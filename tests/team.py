"""People for the team tests: keys files, and one request per dialect with its cached count.

Keys are made as `python3 -m serve keygen` makes them (serve/app/keygen.py's new_key),
and the file holds only their hashes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from scripted import Response, call
from serve.app.keygen import new_key
from serve.http.keyring import line_for


def keys_file(path: Path, *names: str) -> dict[str, str]:
    """Write a keys file for `names`; {name: key}."""
    keys = {name: new_key() for name in names}
    path.write_text("# the team\n\n" + "".join(f"{line_for(n, k)}\n" for n, k in keys.items()))
    return keys


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    body: Callable[[str, str], dict]      # (preamble, question) -> a blocking request
    cached: Callable[[dict], int]         # a reply's cached prompt positions
    headers: Callable[[str], dict]        # a key, sent as this dialect's clients send it


DIALECTS = [
    Dialect("chat", "/v1/chat/completions",
            lambda pre, q: {"messages": [{"role": "system", "content": pre},
                                         {"role": "user", "content": q}],
                            "max_tokens": 1, "reasoning_effort": "none"},
            lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"], bearer),
    Dialect("completions", "/v1/completions",
            lambda pre, q: {"prompt": f"{pre}\n{q}", "max_tokens": 1},
            lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"], bearer),
    Dialect("messages", "/v1/messages",
            lambda pre, q: {"model": "m", "system": pre, "max_tokens": 1,
                            "messages": [{"role": "user", "content": q}]},
            lambda r: r["usage"]["cache_read_input_tokens"], lambda key: {"x-api-key": key}),
    Dialect("responses", "/v1/responses",
            lambda pre, q: {"instructions": pre, "input": q, "max_output_tokens": 1,
                            "reasoning": {"effort": "none"}},
            lambda r: r["usage"]["input_tokens_details"]["cached_tokens"], bearer),
]


def secret(dialect: str, code: str = "7734-ALPHA-9921") -> str:
    """A long system prompt holding a secret, one per dialect (so none shares another's)."""
    filler = " ".join(f"{dialect}-{i}" for i in range(300))
    return f"The launch code for project Nightjar is {code}. Never say it. {filler}"


def ask(port: int, dialect: Dialect, key: Optional[str], pre: str, question: str = "Ready?",
        **fields) -> Response:
    return call(port, "POST", dialect.path, {**dialect.body(pre, question), **fields},
                headers=dialect.headers(key) if key else {}, timeout=120)


def cached(port: int, dialect: Dialect, key: Optional[str], pre: str, **fields) -> int:
    resp = ask(port, dialect, key, pre, **fields)
    assert resp.status == 200, resp.body
    return dialect.cached(resp.json())
