"""The key under which identical requests share one job (serve/service/jobs.py).

Two requests are the same question when they name the same endpoint, carry the
same credentials and class header, and their parsed bodies are equal with keys
in any order (Codex resends its body with `client_metadata` reordered). Left
out of the comparison, because they change how a reply is framed and not what
is generated: `stream` and `stream_options` (a client may stream its first try
and block on the retry). The caller also leaves out what a dialect already keeps
out of the prompt (Claude Code's billing header, which changes on every request).
"""
from __future__ import annotations

import hashlib
import json

FRAMING = ("stream", "stream_options")


def job_key(path: str, owner: str, work: str, body: dict) -> str:
    """A digest of everything that makes two requests the same question."""
    kept = {name: value for name, value in body.items() if name not in FRAMING}
    text = json.dumps(kept, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=True)
    digest = hashlib.sha256()
    for part in (path, owner, work, text):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()
