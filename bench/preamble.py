#!/usr/bin/env python3
"""An agent's preamble across restarts: time to first token and positions prefilled.

    .venv/bin/python bench/preamble.py [CONTAINER] [--lib PATH] [--ctx N]

A Claude-Code-shaped request (24 tools with about 64 KB of JSON schemas, a
system prompt of about 6 KB, a short user turn) is sent to:

1. a cold first start (empty snapshot directory);
2. a restarted server on the same directory, same request;
3. a restarted server, another project (the system prompt's working
   directory differs): only the tools block is shared;
4. a --warm start on an empty directory, warmed with the saved request,
   then asked another question.

Then the cost model's inputs, measured on this engine through the binding:
the prefill rate, and the size, write and load time of a snapshot, over the
preamble's first --cost-positions positions.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import DEMO, Engine, EngineConfig, load_library, machine, server, stream_chat

TYPES = ("string", "integer", "boolean", "number")


def tool(n: int) -> dict:
    """One tool with a schema of about 2.7 KB: 24 of them make about 64 KB."""
    props = {f"option_{n}_{k}": {"type": TYPES[k % 4],
                                 "description": f"Setting {k} of tool {n}: how the call treats "
                                                f"the files it touches, and what it reports back "
                                                f"when setting {k} is left out."}
             for k in range(13)}
    return {"type": "function", "function": {
        "name": f"tool_{n}", "description": f"Tool {n} of the agent. " + "It acts on the project. " * 6,
        "parameters": {"type": "object", "properties": props, "required": [f"option_{n}_0"]}}}


def system_prompt(project: str) -> str:
    """About 6 KB, of which only the working-directory line differs between projects."""
    rules = "".join(f"- Rule {k}: keep changes small, explain them, and run the tests you touch.\n"
                    for k in range(80))
    return f"You are a coding agent.\nWorking directory: {project}\n\n# Rules\n{rules}"


def request(project: str, question: str) -> dict:
    return {"messages": [{"role": "system", "content": system_prompt(project)},
                         {"role": "user", "content": question}],
            "tools": [tool(n) for n in range(24)], "max_tokens": 8, "temperature": 0,
            "reasoning_effort": "none"}


def wait_ready(port: int) -> float:
    """Seconds until /health stops saying "warming"."""
    started = time.perf_counter()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=600) as resp:
                if resp.status == 200:
                    return time.perf_counter() - started
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise
        time.sleep(0.2)


def measure(port: int, body: dict) -> tuple[float, int, int]:
    """(seconds to first token, prompt tokens, tokens prefilled)."""
    reply = stream_chat(port, body, keep_text=False)
    usage = reply.usage
    return reply.first_token_s, usage["prompt_tokens"], \
        usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


def cost_model(lib: str | None, container: str, ctx: int, body: dict, positions: int,
               chunk: int = 512) -> dict:
    """Prefill time of the preamble's first `positions`, and the size, write and load
    time of a snapshot of them, in-process."""
    from serve import resolve_chat_format
    with Engine(load_library(lib), container, EngineConfig(ctx=ctx)) as engine:
        fmt = resolve_chat_format(engine, container)
        ids = engine.tokenize_segments(fmt.render(body["messages"], tools=body["tools"],
                                                  thinking=False, add_generation_prompt=False).segments)
        ids = ids[:positions]
        started = time.perf_counter()
        for pos in range(0, len(ids), chunk):
            engine.eval(ids[pos:pos + chunk])
        prefill_s = time.perf_counter() - started
        with tempfile.TemporaryDirectory(prefix="bench-state-") as scratch:
            path = os.path.join(scratch, "state")
            started = time.perf_counter()
            engine.save_state(path)
            write_s = time.perf_counter() - started
            size = os.path.getsize(path)
            engine.reset()
            started = time.perf_counter()
            engine.load_state(path)
            load_s = time.perf_counter() - started
    return {"positions": len(ids), "prefill_s": prefill_s, "bytes": size, "write_s": write_s,
            "load_s": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--cost-positions", type=int, default=8192)
    ap.add_argument("--parts", default="restarts,warm,cost",
                    help="which of restarts, warm, cost to run (comma-separated)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    flags = ("--ctx", str(args.ctx))
    first = request("/home/dev/alpha", "Why does the build fail?")
    print(f"Claude-Code-shaped preamble: 24 tools, {len(json.dumps(first['tools'])) >> 10} KB of "
          f"schemas, {len(first['messages'][0]['content']) >> 10} KB system prompt — {machine()}")
    print(f"{'case':<32} {'prompt':>7} {'prefilled':>9} {'TTFT s':>8}")
    if "restarts" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-prefix-") as shared:
            cache = ("--prefix-cache-dir", shared)
            with server(args.container, *flags, *cache, lib=args.lib) as port:
                row("cold first start", *measure(port, first))
            with server(args.container, *flags, *cache, lib=args.lib) as port:
                row("restarted server", *measure(port, first))
            with server(args.container, *flags, *cache, lib=args.lib) as port:
                row("restarted, another project",
                    *measure(port, request("/home/dev/beta", "Why does the build fail?")))
    if "warm" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as warm_dir:
            saved = Path(warm_dir) / "request.json"
            saved.write_text(json.dumps(first))
            with server(args.container, *flags, "--prefix-cache-dir",
                        os.path.join(warm_dir, "cache"), "--warm", str(saved), lib=args.lib) as port:
                warmed_s = wait_ready(port)
                row("--warm start, another question",
                    *measure(port, request("/home/dev/alpha", "Add a test for the parser.")))
        print(f"(--warm spent {warmed_s:.2f} s before /health said ok)")
    if "cost" in parts:
        print_cost(cost_model(args.lib, args.container, args.ctx, first, args.cost_positions))


def row(name: str, ttft: float, prompt: int, prefilled: int) -> None:
    print(f"{name:<32} {prompt:>7} {prefilled:>9} {ttft:>8.2f}", flush=True)


def print_cost(cost: dict) -> None:
    rate = cost["positions"] / cost["prefill_s"]
    print(f"cost model: prefill {rate:.0f} positions/s; a snapshot of {cost['positions']} positions "
          f"is {cost['bytes'] / 2**20:.1f} MiB, written in {cost['write_s'] * 1e3:.1f} ms, loaded in "
          f"{cost['load_s'] * 1e3:.1f} ms, against {cost['prefill_s']:.2f} s to prefill it")


if __name__ == "__main__":
    main()
