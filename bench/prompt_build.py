#!/usr/bin/env python3
"""Prompt building cost per request: render and tokenize a large agent prompt.

    .venv/bin/python bench/prompt_build.py [CONTAINER] [--repeat N]

A long agent session (50 tools, 200 messages with tool calls and results)
is rendered to XTML segments and tokenized one segment at a time through the
engine, as the server does for every request.  Prints a small table.
"""
from __future__ import annotations

import json
import statistics
import time

from common import container_args, machine
from serve import Engine, EngineConfig, build_chat_segments, load_library


def agent_tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}",
        "description": f"Tool number {i}: fetches record {i} from the inventory service.",
        "parameters": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "string", "description": "Record identifier"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "fields": {"type": "array", "items": {"type": "string"}}}}}} for i in range(n)]


def agent_messages(n: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are an inventory agent."}]
    turn = 0
    while len(messages) < n:
        turn += 1
        messages.append({"role": "user", "content": f"Check record {turn} and summarise it."})
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{turn}", "type": "function", "function": {
                "name": f"tool_{turn % 50}",
                "arguments": json.dumps({"id": f"r{turn}", "limit": 10, "fields": ["name", "qty"]})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}",
                         "content": json.dumps({"id": f"r{turn}", "name": f"widget {turn}", "qty": turn * 3})})
        messages.append({"role": "assistant", "content": f"Record {turn} is widget {turn}, "
                                                         f"with {turn * 3} in stock."})
    return messages[:n]


def main() -> None:
    args = container_args(__doc__)

    engine = Engine(load_library(args.lib), args.container, EngineConfig())
    tools, messages = agent_tools(50), agent_messages(200)
    render_ms, tokenize_ms = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        segments = build_chat_segments(messages, tools)
        t1 = time.perf_counter()
        ids = engine.tokenize_segments(segments)
        t2 = time.perf_counter()
        render_ms.append((t1 - t0) * 1e3)
        tokenize_ms.append((t2 - t1) * 1e3)
    engine.close()
    total = [r + t for r, t in zip(render_ms, tokenize_ms)]
    print(f"prompt building: 50 tools, 200 messages -> {len(segments)} segments, {len(ids)} tokens, "
          f"median of {args.repeat} — {machine()}")
    print(f"{'stage':<10} {'ms':>8}")
    print(f"{'render':<10} {statistics.median(render_ms):>8.2f}")
    print(f"{'tokenize':<10} {statistics.median(tokenize_ms):>8.2f}")
    print(f"{'total':<10} {statistics.median(total):>8.2f}")


if __name__ == "__main__":
    main()
