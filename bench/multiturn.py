#!/usr/bin/env python3
"""Multi-turn chat with and without prefix reuse: per turn, the prompt tokens
prefilled, the tokens reused from a snapshot, and the time to first token.

    .venv/bin/python bench/multiturn.py [CONTAINER] [--lib PATH] [--turns N] [--mode MODE]

Two servers on the same container, one with the prefix cache and one with
--no-prefix-cache, replay the same conversation; each turn resends the whole
history, as chat clients do. Greedy decoding, so both see identical replies.
Modes say what the client sends back and how replies end:
  answer          thinking off; each answer returned as received (the default)
  reasoning       thinking on; content and reasoning_content returned as received
  drop-reasoning  thinking on; the client drops reasoning_content
  keep-reasoning  the same client, the servers started with --keep-reasoning
  stop            thinking off; each answer cut by a stop string
"""
from __future__ import annotations

import argparse
import time

from common import DEMO, machine, server, stream_chat

# A long-ish user turn, so that prefill is a real share of each request.
PARAGRAPH = ("The harbour master kept a ledger of every ship that passed the breakwater: its name, "
             "its flag, the tonnage it declared and the tonnage the pilots guessed. ")

# mode -> (request fields, server flags, whether the client returns reasoning_content)
MODES = {
    "answer": ({"reasoning_effort": "none"}, (), False),
    "reasoning": ({}, (), True),
    "drop-reasoning": ({}, (), False),
    "keep-reasoning": ({}, ("--keep-reasoning",), False),
    "stop": ({"reasoning_effort": "none", "stop": [" 199"]}, (), False),   # the demo model writes it often
}


def user_turn(n: int) -> dict:
    return {"role": "user", "content": f"Turn {n}. " + PARAGRAPH * 6 + "What changed since last time?"}


def replay(port: int, mode: str, turns: int, answer_tokens: int,
           pause: float) -> list[tuple[float, int, int]]:
    """(seconds to first token, prompt tokens, tokens restored from a snapshot) per turn."""
    fields, _, returns_reasoning = MODES[mode]
    messages: list[dict] = []
    rows = []
    for n in range(turns):
        messages.append(user_turn(n))
        reply = stream_chat(port, {"messages": messages, "max_tokens": answer_tokens,
                                   "temperature": 0, **fields})
        usage = reply.usage
        rows.append((reply.first_token_s, usage["prompt_tokens"],
                     usage["prompt_tokens_details"]["cached_tokens"]))
        message = {"role": "assistant", "content": reply.text}
        if returns_reasoning and reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        messages.append(message)
        time.sleep(pause)   # the user reading, or the tool running: the server's idle time
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--mode", choices=sorted(MODES), default="answer")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between a reply and the next turn")
    args = ap.parse_args()
    flags = ("--ctx", "16384", *MODES[args.mode][1])
    runs = []
    for extra in ((), ("--no-prefix-cache",)):
        with server(args.container, *flags, *extra, lib=args.lib) as port:
            runs.append(replay(port, args.mode, args.turns, args.answer_tokens, args.pause))
    warm, cold = runs
    print(f"{args.turns}-turn chat, mode {args.mode}, greedy, {args.answer_tokens}-token answers — "
          f"{machine()}")
    print(f"{'turn':>4} {'prompt':>7} | {'prefilled':>9} {'reused':>7} {'TTFT ms':>8} (cache) | "
          f"{'prefilled':>9} {'TTFT ms':>8} (no cache)")
    for n, ((w_s, w_prompt, w_cached), (c_s, c_prompt, c_cached)) in enumerate(zip(warm, cold), 1):
        print(f"{n:>4} {w_prompt:>7} | {w_prompt - w_cached:>9} {w_cached:>7} {w_s * 1e3:>8.1f}         | "
              f"{c_prompt - c_cached:>9} {c_s * 1e3:>8.1f}")
    total = lambda rows: (sum(p - c for _, p, c in rows), sum(s for s, _, _ in rows))  # noqa: E731
    (wp, ws), (cp, cs) = total(warm), total(cold)
    print(f"{'all':>4} {'':>7} | {wp:>9} {sum(c for _, _, c in warm):>7} {ws * 1e3:>8.1f}         | "
          f"{cp:>9} {cs * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
