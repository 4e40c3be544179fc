#!/usr/bin/env python3
"""What translating an agent's request costs, next to rendering and tokenizing it.

    .venv/bin/python bench/dialects.py [CONTAINER] [--repeat N]

A Claude Code request (24 tools, ~64 KB of schemas) and a Codex request
(9 tools, ~19 KB), as tests/agents.py builds them, each five turns deep:
the edge translation (request JSON -> the internal chat request) against
the render and tokenize every chat request pays.  Prints a small table.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

from common import ROOT, container_args, machine
from serve import (ChatRequest, Engine, EngineConfig, ResponsesExchange, ResponseStore,
                   build_chat_segments, load_library, parse_anthropic_request)

sys.path.insert(0, str(ROOT / "tests"))
from agents import (claude_code_first_message, claude_code_request, codex_first_input,  # noqa: E402
                    codex_request)


def claude_code_session(turns: int) -> dict:
    messages = [claude_code_first_message("Tidy up the README.")]
    for n in range(turns):
        messages += [{"role": "assistant", "content": [
                         {"type": "text", "text": f"Reading part {n}."},
                         {"type": "tool_use", "id": f"toolu_{n}", "name": "Tool3",
                          "input": {"option_0": f"src/part{n}.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": f"toolu_{n}",
                          "content": "def f():\n    return 1\n" * 40}]}]
    return claude_code_request(messages)


def codex_session(turns: int) -> dict:
    items = codex_first_input("List the files.")
    for n in range(turns):
        items += [{"type": "function_call", "call_id": f"call_{n}", "name": "shell",
                   "arguments": '{"option_0": "ls"}'},
                  {"type": "function_call_output", "call_id": f"call_{n}", "output": "README.md\n" * 40}]
    return codex_request(items)


def translations() -> dict[str, Callable[[], ChatRequest]]:
    store = ResponseStore()
    claude_code, codex = claude_code_session(5), codex_session(5)   # built once, outside the timing
    return {"claude code": lambda: parse_anthropic_request(claude_code).request,
            "codex": lambda: ResponsesExchange(codex, store, "k3").request}


def main() -> None:
    args = container_args(__doc__)

    engine = Engine(load_library(args.lib), args.container, EngineConfig())
    print(f"agent requests, five turns deep, median of {args.repeat} — {machine()}")
    print(f"{'request':<12} {'translate ms':>13} {'render ms':>10} {'tokenize ms':>12} {'tokens':>7}")
    for name, translate in translations().items():
        timings: list[tuple[float, float, float]] = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            req = translate()
            t1 = time.perf_counter()
            segments = build_chat_segments(req.messages, req.tools, thinking=True,
                                           thinking_effort=req.thinking_effort)
            t2 = time.perf_counter()
            ids = engine.tokenize_segments(segments)
            t3 = time.perf_counter()
            timings.append((t1 - t0, t2 - t1, t3 - t2))
        translate_ms, render_ms, tokenize_ms = (statistics.median(t[i] for t in timings) * 1e3
                                                for i in range(3))
        print(f"{name:<12} {translate_ms:>13.2f} {render_ms:>10.2f} {tokenize_ms:>12.2f} {len(ids):>7}")
    engine.close()


if __name__ == "__main__":
    main()
