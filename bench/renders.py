#!/usr/bin/env python3
"""How often one chat request renders and tokenizes its conversation, with reply memory on.

    .venv/bin/python bench/renders.py [CONTAINER] [--turns 0 1 3 6] [--lib PATH]

A chat with a system message and one tool grows turn by turn (greedy
12-token replies, each remembered, then settled as in idle time); for the
request that has N assistant turns in its history this counts the chat
format's renders (of any list of messages), the tokenizer's calls and the
characters they tokenize, settling included. The figures do not depend on
the machine: they are counts.
"""
from __future__ import annotations

import argparse
import collections
import tempfile

from common import DEMO, Quiet
from serve import (Engine, EngineConfig, PrefixCache, ReplyMemory, Service, ServiceOptions,
                   load_library, parse_chat_request, resolve_chat_format)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--turns", type=int, nargs="+", default=[0, 1, 3, 6])
    ap.add_argument("--lib", default=None)
    args = ap.parse_args()
    lib = load_library(args.lib)
    print("assistant turns  renders  tokenizer calls  characters tokenized")
    for turns in args.turns:
        with Engine(lib, args.container, EngineConfig()) as engine, \
                tempfile.TemporaryDirectory() as cache_dir:
            counts: collections.Counter = collections.Counter()
            fmt = resolve_chat_format(engine, args.container)
            render, tokenize = fmt.render, engine.tokenize_segments

            def counted_render(*a, **kw):
                counts["renders"] += 1
                return render(*a, **kw)

            def counted_tokenize(segments):
                segments = list(segments)
                counts["calls"] += 1
                counts["chars"] += sum(len(s.text) for s in segments)
                return tokenize(segments)

            fmt.render, engine.tokenize_segments = counted_render, counted_tokenize
            cache = PrefixCache(256 << 20, parent_dir=cache_dir)
            service = Service(engine, lib, fmt, ServiceOptions(
                model_id="bench", reply_memory=ReplyMemory(), prefix_cache=cache, thinking=False))
            messages = [{"role": "system", "content": "You are terse."}]
            for turn in range(turns + 1):
                messages.append({"role": "user", "content": f"Question number {turn}?"})
                counts.clear()
                reply = service.chat(parse_chat_request({"messages": messages, "max_tokens": 12,
                                                         "temperature": 0, "tools": TOOLS}), Quiet())
                service.settle()
                messages.append(reply.message)
            service.close()
            cache.close()
            print(f"{turns:15d}  {counts['renders']:7d}  {counts['calls']:15d}  {counts['chars']:20d}")


if __name__ == "__main__":
    main()
