#!/usr/bin/env python3
"""An agent's tool loop at a scaled K3 clock, its client timing out once a turn: positions evaluated
against the positions the conversation holds.

    .venv/bin/python bench/slow_agent.py [CONTAINER] [--lib PATH] [--delay-ms 10] [--turns 4]
        [--timeout-at 0.3] [--result-sentences 30] [--ctx N] [--serve-from DIR]

The same tool loop is replayed twice, on two servers started alike: once by a
client that waits, once by a client that gives up partway through each
turn's prefill, as Codex or Claude Code do on K3 when a stream stays silent
too long: it streams the request, closes the connection once the prefill of
what the turn added is --timeout-at through (by the server's `: prefill n/m`
comments), and sends the same request again at once, not streamed. Each reply
is a tool call (forced by tool_choice, so that the random demo model makes
one); it goes back into the conversation with a tool result of about 33
positions a sentence (as the user's turn when max_tokens cut the reply before
its call). Greedy decoding: both clients see the same replies.

The servers run the reference engine slowed by WASTE_DELAY_MS (K3 prefills a
position in about 2128 ms; the default 10 is K3 scaled down 213 times). After
each turn, once the server is idle, its /metrics counter
serve_engine_evaluated_tokens_total says how many positions the engine
evaluated. A server that evaluates no position twice evaluates as much for the
client that gives up as for the one that waits, and both about the positions
the conversation holds (a reply cut by max_tokens is closed in idle time, which
adds a few). --serve-from runs another checkout's serve (its own libwaste.so)
instead; it must count the same metric.
"""
from __future__ import annotations

import argparse
import http.client
import json
import time
import urllib.request
from pathlib import Path
from typing import Optional

from common import DEMO, ROOT, machine, server

# What the snapshot policy measured and chose (docs/snapshots.md), as /metrics says it.
POLICY = ("prefill_seconds_per_token", "snapshot_save_seconds", "snapshot_load_seconds",
          "snapshot_bytes", "snapshot_spacing_tokens", "snapshot_break_even_tokens")
SENTENCE = "The harbour master kept a ledger of every ship that passed the breakwater. "
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"enum": ["README.md", "main.py", "notes.txt"]}},
                   "required": ["path"], "additionalProperties": False}}}]
SYSTEM = ("You are a coding agent working in /home/user/project. Use the tools to read files before "
          "you answer. " + "Keep changes small and explain each of them. " * 40)


def request(messages: list[dict], calls: bool) -> dict:
    tools = {"tools": TOOLS, "tool_choice": "required"} if calls else {}
    return {"model": "agent", "messages": messages, **tools, "max_tokens": 48, "temperature": 0,
            "reasoning_effort": "none"}


def hang_up_during_prefill(port: int, body: dict, held: int, fraction: float) -> tuple[int, int]:
    """Stream `body` and close the connection once the prefill of what follows the first `held`
    positions is `fraction` through; (positions prefilled when it left, of the prompt's total),
    or (0, 0) when the prompt needed no prefill progress (one chunk)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    pending = b""
    try:
        while chunk := resp.read1(1 << 16):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if line.startswith(b": prefill "):
                    done, total = map(int, line[10:].split(b"/"))
                    if done >= held + fraction * (total - held):
                        return done, total
                elif line.startswith(b"data: ") and b'"choices"' in line and b'"delta"' in line \
                        and (b'"tool_calls"' in line or b'"content": "' in line) and b'"content": ""' not in line:
                    return 0, 0   # the reply began: the prefill was over before the client gave up
        return 0, 0
    finally:
        conn.close()   # the hang-up


def complete(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        return json.loads(resp.read())


def metric(port: int, name: str) -> Optional[float]:
    """A sample without labels from /metrics, or None."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def wait_idle(port: int) -> None:
    """Until the server's idle-time work (a prefill finished for nobody, settling) is over."""
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as resp:
            if json.loads(resp.read())["idle"]:
                return
        time.sleep(0.2)


def replay(port: int, turns: int, result_sentences: int, fraction: float, calls: bool) -> list[tuple]:
    """Per turn: (prompt, where the client gave up or None, cached at the retry, reply tokens,
    positions evaluated); `fraction` 0 is a client that never gives up; without `calls` the
    replies are text, and each tool result comes back as the user's turn."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Why does the build fail? Read what you need."}]
    held = evaluated = 0
    rows = []
    for turn in range(1, turns + 1):
        body = request(messages, calls)
        left = hang_up_during_prefill(port, body, held, fraction) if fraction else None
        reply = complete(port, body)   # the retry, at once
        wait_idle(port)
        usage = reply["usage"]
        now = metric(port, "serve_engine_evaluated_tokens_total")
        if now is None:
            raise SystemExit("the server does not count serve_engine_evaluated_tokens_total")
        rows.append((usage["prompt_tokens"], left, usage["prompt_tokens_details"]["cached_tokens"],
                     usage["completion_tokens"], now - evaluated))
        evaluated, held = now, usage["prompt_tokens"] + usage["completion_tokens"]
        message = reply["choices"][0]["message"]
        made = message.get("tool_calls") or []
        result = f"(turn {turn}) " + SENTENCE * result_sentences
        # Each call gets the result (a conversation going on past an unanswered call is a
        # 400); text replies, or one cut by max_tokens before its call: the user's turn.
        messages += [message, *([{"role": "tool", "tool_call_id": call["id"], "content": result}
                                 for call in made] or [{"role": "user", "content": result}])]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--delay-ms", type=float, default=10.0, help="WASTE_DELAY_MS (K3: 2128)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--timeout-at", type=float, default=0.3,
                    help="the share of each turn's new prefill after which the client gives up")
    ap.add_argument("--result-sentences", type=int, default=30, help="each tool result's length")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--replies", choices=("tool-calls", "text"), default="tool-calls",
                    help="tool calls forced by tool_choice, or text answers")
    ap.add_argument("--serve-from", type=Path, default=ROOT, help="the checkout whose serve runs")
    args = ap.parse_args()
    print(f"slow agent — {machine()}; WASTE_DELAY_MS={args.delay_ms:g}, serve from {args.serve_from}")
    flags = ("--ctx", str(args.ctx), *(("--lib", args.lib) if args.lib else ()))
    runs = []
    for fraction in (0.0, args.timeout_at):
        with server(Path(args.container), *flags, env={"WASTE_DELAY_MS": f"{args.delay_ms:g}"},
                    root=args.serve_from) as port:
            runs.append(replay(port, args.turns, args.result_sentences, fraction,
                               args.replies == "tool-calls"))
            policy = {name: metric(port, f"serve_{name}") for name in POLICY}
    waits, gives_up = runs
    print(f"evaluated: by a client that waits | by one that gives up at {args.timeout_at:.0%} of "
          "each turn's new prefill and retries")
    print(f"{'turn':>4} {'prompt':>7} {'reply':>5} {'evaluated':>9} | {'gave up at':>11} "
          f"{'retry cached':>12} {'evaluated':>9} {'again':>5}")
    for turn, (w, g) in enumerate(zip(waits, gives_up), 1):
        left = f"{g[1][0]}/{g[1][1]}" if g[1] and g[1][1] else "-"
        print(f"{turn:>4} {w[0]:>7} {w[3]:>5} {w[4]:>9.0f} | {left:>11} {g[2]:>12} {g[4]:>9.0f} "
              f"{g[4] - w[4]:>5.0f}")
    conversation = waits[-1][0] + waits[-1][3]
    waited, gave_up = sum(r[4] for r in waits), sum(r[4] for r in gives_up)
    hang_ups = sum(1 for r in gives_up if r[1] and r[1][1])
    print(f"positions in the conversation {conversation}; evaluated {waited:.0f} for the client that "
          f"waits, {gave_up:.0f} for the one that gave up {hang_ups} times: "
          f"{(gave_up - waited) / max(1, hang_ups):.0f} positions evaluated again per hang-up")
    if policy["prefill_seconds_per_token"] is not None:
        print(f"snapshot policy: a position {policy['prefill_seconds_per_token'] * 1e3:.3g} ms, a save "
              f"{policy['snapshot_save_seconds'] * 1e3:.3g} ms, a load "
              f"{policy['snapshot_load_seconds'] * 1e3:.3g} ms ({policy['snapshot_bytes'] / 1e6:.3g} MB): "
              f"a progress snapshot every {policy['snapshot_spacing_tokens']:.0f} positions of prefill, "
              f"a checkpoint when it spares more than {policy['snapshot_break_even_tokens']:.0f}")


if __name__ == "__main__":
    main()
