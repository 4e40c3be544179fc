"""The chat page served at GET /: one HTML file, and the Content-Security-Policy it is sent with.

The page's script and style are inline, and the policy allows exactly those
two blocks by their SHA-256: a script that reached the page any other way
(injected markup, a modified copy, another origin) does not run.  Trusted
Types with no policy makes the browser refuse every HTML-string sink
(innerHTML and friends), so the page can only build its DOM from text nodes.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import re
from pathlib import Path

PAGE_PATH = Path(__file__).resolve().parent.parent / "static" / "chat.html"
CONTENT_TYPE = "text/html; charset=utf-8"


def inline_block(html: str, tag: str) -> str:
    """The text of the one <tag> element in the page (its hash goes into the policy)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    if len(blocks) != 1:
        raise ValueError(f"{PAGE_PATH} must hold exactly one <{tag}> block, found {len(blocks)}")
    return blocks[0]


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@functools.lru_cache(maxsize=1)
def chat_page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy header value, read once."""
    html = PAGE_PATH.read_text(encoding="utf-8")
    policy = "; ".join([
        "default-src 'none'",
        f"script-src {_sha256(inline_block(html, 'script'))}",
        f"style-src {_sha256(inline_block(html, 'style'))}",
        "img-src 'self' data:",       # attached images are previewed from their data: URLs
        "connect-src 'self'",         # the API, on this server only
        "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'",
        "require-trusted-types-for 'script'", "trusted-types 'none'",
    ])
    return html.encode(), policy
