"""A server whose engine is busy: `python3 -m serve` on the reference engine at a scaled
clock (WASTE_DELAY_MS), one streamed request prefilling a long prompt while a test sends
others. For the tests that prove what is answered without waiting for the engine
(tests/server/test_refused_at_once.py, tests/server/test_answered_while_busy.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import pytest

from served import Served, serve
from slow_clock import LongPrefill

DELAY_MS = 15
LONG_ITEMS = 215     # ~3,600 tokens in each dialect's rendering: ~54 s of prefill at DELAY_MS
CTX = 4096
BOUND = 8.0          # s: an answer within it came while the prefill ran, for all its noise


def busy_server(container: Path, lib_path: Path, work: Path, tokens: str, *flags: str,
                api_key: Optional[str] = None) -> Iterator[tuple[Served, LongPrefill]]:
    """(the server, its long prefill), the prefill holding the engine; `tokens` begins the
    banner's tokens line, saying which tokenizer the server chose; `api_key`, the server's."""
    if api_key is not None:
        flags += ("--api-key", api_key)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(container, lib_path, work, "--ctx", str(CTX), "--no-prefix-cache",
                   "--no-finish-abandoned", *flags) as srv:
            assert any(line.startswith(tokens) for line in srv.banner), srv.banner
            long = LongPrefill(srv.port, LONG_ITEMS, () if api_key is None else
                               (f"Authorization: Bearer {api_key}",))
            try:
                assert long.holding.wait(60), long.raw
                yield srv, long
            finally:
                long.close()
